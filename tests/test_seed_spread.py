"""``SeedSpread`` (lesson 04): a result over several seeds, its range, and a verdict that names a
difference only when the ranges do not overlap. Oracle for ``chance_apart``: every way to split
the runs into two groups, counted by brute force."""
import itertools
import math

import pytest

from course_lib.train import SeedSpread


def test_median_lowest_highest_and_the_printed_form():
    s = SeedSpread([0.8, 0.7, 0.75])
    assert (s.median, s.lowest, s.highest) == (0.75, 0.7, 0.8)
    assert s.values == (0.8, 0.7, 0.75)
    assert str(s) == "median 0.750 (lowest 0.700, highest 0.800) over 3 seeds"
    assert str(SeedSpread([0.5])) == "median 0.500 (lowest 0.500, highest 0.500) over 1 seed"


def test_a_difference_is_named_only_when_the_ranges_do_not_overlap():
    base = SeedSpread([0.70, 0.72, 0.75])
    assert "is lower than the baseline on every seed" in SeedSpread([0.1, 0.1, 0.6]).verdict(
        "lr 1.2", base, "the baseline")
    assert "is higher than the baseline on every seed" in SeedSpread([0.76, 0.8, 0.9]).verdict(
        "lr 0.5", base, "the baseline")
    for overlapping in ([0.1, 0.71, 0.9], [0.75, 0.8, 0.9], [0.6, 0.70]):
        text = SeedSpread(overlapping).verdict("other", base, "the baseline")
        assert "the ranges overlap" in text and "every seed" not in text, text


@pytest.mark.parametrize("n, m", [(1, 1), (2, 2), (3, 3), (2, 4), (4, 3)])
def test_chance_apart_counts_the_splits_that_leave_the_ranges_apart(n, m):
    runs = range(n + m)                      # n + m distinct results, ranked 0 .. n+m-1
    splits = list(itertools.combinations(runs, n))
    apart = sum(max(a) < min(set(runs) - set(a)) or min(a) > max(set(runs) - set(a))
                for a in splits)
    assert SeedSpread([0.0] * n).chance_apart(SeedSpread([0.0] * m)) == pytest.approx(
        min(1.0, apart / len(splits)))
    assert math.comb(6, 3) == 20 and SeedSpread([1] * 3).chance_apart(SeedSpread([1] * 3)) == 0.1


@pytest.mark.parametrize("bad", [[], [0.5, float("nan")], [float("inf")]])
def test_no_result_or_a_non_finite_one_is_refused(bad):
    with pytest.raises(ValueError, match="at least one finite number"):
        SeedSpread(bad)
