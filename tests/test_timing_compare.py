"""``course_lib.timing.compare``: a known-faster variant is found faster, equal variants give "no
difference measurable here", samples are taken interleaved with a rotating start, loops are sized
from the median of several calls, and the interval pairs samples by round."""
import json
import random
import time

import pytest

from course_lib.timing import Comparison, bootstrap_ratio, compare


class FakeClock:
    """A clock that only moves when a variant 'runs': exact, load-free timings for the tests."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def variant(self, name, cost):
        """A variant that records its call and advances the clock by ``cost()`` seconds."""
        def run():
            self.calls.append(name)
            self.now += cost()
        return run


def test_known_faster_variant_is_found_faster_real_clock():
    """Sleeping 2 ms against 6 ms: robust under CPU load (sleeping needs no core)."""
    c = compare({"slow": lambda: time.sleep(0.006), "fast": lambda: time.sleep(0.002)},
                samples=8, min_sample_seconds=0.02, warmup=1, calibration_calls=3)
    r, lo, hi = c.ratio("fast")
    assert hi < 1 and r < 0.8
    assert c.winner == "fast"
    assert c.verdict("fast").startswith("fast is faster than slow")


def test_loop_of_n_against_3n_is_found_faster():
    def loop(n):
        def run():
            s = 0
            for i in range(n):
                s += i
            return s
        return run
    # ten times the work: a difference that survives a loaded machine (at 3x, a burst of load on
    # two cores once put the interval's top at 2.06)
    c = compare({"10n": loop(200_000), "n": loop(20_000)}, samples=10, min_sample_seconds=0.01)
    assert c.ratio("n")[2] < 1 and c.winner == "n"


def _equal(seed):
    clock, rng = FakeClock(), random.Random(seed)
    noisy = lambda: 1e-3 * rng.uniform(0.8, 1.2)  # the same distribution for both
    return compare({"a": clock.variant("a", noisy), "b": clock.variant("b", noisy)},
                   samples=15, min_sample_seconds=0.0, clock=clock)


def test_equal_variants_give_no_difference():
    c = _equal(seed=0)
    r, lo, hi = c.ratio("b")
    assert lo < 1 < hi
    assert c.winner is None
    assert "no difference measurable here" in c.verdict("b")
    # a 95 % interval wrongly names a winner in about 5 % of such comparisons, not more
    false_winners = sum(_equal(seed).winner is not None for seed in range(40))
    assert false_winners <= 6


def test_samples_are_interleaved_with_a_rotating_start():
    clock = FakeClock()
    c = compare({n: clock.variant(n, lambda: 1e-3) for n in "ABC"}, samples=4, warmup=1,
                calibration_calls=3, min_sample_seconds=5e-3, clock=clock)
    # warm-up and calibration first, one variant at a time
    assert clock.calls[:12] == ["A"] * 4 + ["B"] * 4 + ["C"] * 4
    assert c.loops == {"A": 5, "B": 5, "C": 5}  # 5 ms / the 1 ms median
    timed = clock.calls[12:]
    samples = [timed[i] for i in range(0, len(timed), 5)]
    assert all(len(set(timed[i:i + 5])) == 1 for i in range(0, len(timed), 5))  # a loop each
    assert samples == list("ABC" "BCA" "CAB" "ABC") == c.order
    assert c.seconds["A"] == pytest.approx([1e-3] * 4)


def test_loop_is_sized_from_the_median_not_one_call():
    clock = FakeClock()
    costs = iter([1e-3, 1e-3,            # warm-up
                  1.0, 1e-3, 1e-3])      # calibration: one call hit by a hiccup
    c = compare({"a": clock.variant("a", lambda: next(costs, 1e-3)),
                 "b": clock.variant("b", lambda: 1e-3)},
                samples=2, warmup=2, calibration_calls=3, min_sample_seconds=0.01, clock=clock)
    assert c.loops["a"] == 10  # from the median 1 ms, not from the 1 s hiccup


def test_interval_pairs_samples_by_round():
    """Load that drifts over the rounds slows both variants of a round alike: paired by round, b
    is clearly 1.1x a; the same samples unpaired would not tell."""
    clock = FakeClock()
    drift = lambda: 1 + 0.5 * ((len(clock.calls) - 1) // 2)  # grows round after round
    c = compare({"a": clock.variant("a", lambda: 1e-3 * drift()),
                 "b": clock.variant("b", lambda: 1.1e-3 * drift())},
                samples=12, warmup=0, calibration_calls=1, min_sample_seconds=0.0, clock=clock)
    r, lo, hi = c.ratio("b")
    assert 1.0 < lo and r == pytest.approx(1.1, rel=0.1)
    a, b = c.seconds["a"], c.seconds["b"]
    shuffled = b[::-1]  # break the pairing: the interval now straddles 1
    assert bootstrap_ratio(shuffled, a)[1] < 1


def test_to_json_records_everything():
    clock = FakeClock()
    c = compare({"a": clock.variant("a", lambda: 2e-3), "b": clock.variant("b", lambda: 1e-3)},
                samples=3, min_sample_seconds=0.0, clock=clock)
    out = json.loads(json.dumps(c.to_json()))
    assert out["baseline"] == "a" and out["winner"] == "b"  # exact times: no doubt
    v = out["variants"]["b"]
    assert {"median_s", "min_s", "loops", "seconds", "ratio_low", "ratio_high", "verdict"} <= set(v)
    assert v["ratio_to_baseline"] == pytest.approx(0.5)
    assert isinstance(c, Comparison) and "ratio to a" in str(c)


def test_one_variant_is_timed_alone():
    ticks = iter(range(100))
    c = compare({"a": lambda: None}, samples=3, min_sample_seconds=0.0, calibration_calls=1,
                warmup=0, clock=lambda: float(next(ticks)))
    v = c.to_json()["variants"]["a"]
    assert v["seconds"] == [1.0, 1.0, 1.0] and v["ratio_to_baseline"] == 1.0
    assert c.to_json()["winner"] is None


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        compare({})
    with pytest.raises(ValueError, match="baseline"):
        compare({"a": lambda: None, "b": lambda: None}, baseline="c")
    with pytest.raises(ValueError, match="samples >= 2"):
        compare({"a": lambda: None, "b": lambda: None}, samples=1)


def test_time_sample_runs_before_untimed_then_one_loop_and_reduces_the_time_per_call():
    """``time_sample``, the sample loop ``compare`` runs (lesson 10 shows it): ``before`` ends
    before the clock starts, ``loops`` calls under one clock, seconds per call, ``reduce``d."""
    from course_lib.timing import time_sample

    clock = FakeClock()
    work = clock.variant("work", lambda: 0.002)
    seen = []

    def before():                    # a barrier that takes 1 s: it must not be timed
        seen.append(len(clock.calls))
        clock.now += 1.0

    got = time_sample(work, 5, before=before, reduce=lambda t: 10 * t, clock=clock)
    assert seen == [0] and clock.calls == ["work"] * 5
    assert got == pytest.approx(10 * 0.002)
    assert time_sample(work, 4, clock=clock) == pytest.approx(0.002)   # no before, no reduce


def test_compare_times_each_sample_with_time_sample(monkeypatch):
    """``compare`` takes every sample, the calibration's included, from ``time_sample`` with
    its own device, before, reduce and clock."""
    from course_lib import _compare

    calls = []
    real = _compare.time_sample

    def spy(fn, loops, **kw):
        calls.append((loops, sorted(kw)))
        return real(fn, loops, **kw)

    monkeypatch.setattr(_compare, "time_sample", spy)
    clock = FakeClock()
    compare({"a": clock.variant("a", lambda: 0.01), "b": clock.variant("b", lambda: 0.02)},
            samples=3, min_sample_seconds=0.05, warmup=1, calibration_calls=2, clock=clock)
    assert len(calls) == 2 * 2 + 2 * 3                      # calibration calls, then samples
    assert all(kw == ["before", "clock", "device", "reduce"] for _, kw in calls)
    assert [n for n, _ in calls[:2]] == [1, 1] and {n for n, _ in calls[-6:]} == {5, 3}


def test_bootstrap_difference_and_unpaired_ratio():
    """The paired difference sees a shift that drifting load hides from unpaired resampling;
    every interval holds its point estimate; bad input names what was expected."""
    from course_lib.timing import bootstrap_difference, bootstrap_median
    drift = [1.0 + 0.1 * i for i in range(20)]           # load that grows round after round
    a, b = [x + 0.05 for x in drift], drift               # a: always 0.05 s dearer, same round
    d, lo, hi = bootstrap_difference(a, b)
    assert d == pytest.approx(0.05) and lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    r, lo, hi = bootstrap_ratio(a, b, paired=False)      # rounds ignored: the drift dominates
    assert lo < 1 < hi and lo <= r <= hi
    r, lo, hi = bootstrap_ratio(a, b)                     # paired: clearly above 1
    assert 1 < lo <= r <= hi
    m, lo, hi = bootstrap_median(drift)
    assert lo < m < hi and m == pytest.approx(1.95)
    with pytest.raises(ValueError, match="equally long, non-empty lists"):
        bootstrap_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty lists"):
        bootstrap_ratio([], [1.0], paired=False)
