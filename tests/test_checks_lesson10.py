"""The lesson-09 checker: None is "not answered yet", the reference answer passes, realistic wrong
answers fail with the case shown, and the checker's oracle (a walk over the ring's schedule)
agrees with the cost model the notebook fits."""
import math

import pytest

from course_lib.bench import cost_model
from course_lib.checks.lesson10 import check_ring_time, ring_time_by_schedule
from solutions.lesson10 import ring_time


def forgets_the_latency(n_bytes, p, alpha, beta):  # bandwidth term only
    return 2 * (p - 1) / p * n_bytes * beta


def whole_message_per_step(n_bytes, p, alpha, beta):  # sends n, not n / p, in every step
    return 2 * (p - 1) * (alpha + n_bytes * beta)


def one_phase_only(n_bytes, p, alpha, beta):  # reduce-scatter without the all-gather
    return (p - 1) * alpha + (p - 1) / p * n_bytes * beta


def test_not_answered(capsys):
    result = check_ring_time(None)
    assert result.ok is None and "not answered" in capsys.readouterr().out


def test_reference_passes(capsys):
    assert check_ring_time(ring_time, strict=True)
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [forgets_the_latency, whole_message_per_step, one_phase_only])
def test_wrong_answers_fail_with_the_case(wrong, capsys):
    result = check_ring_time(wrong)
    out = capsys.readouterr().out
    assert result.ok is False and "expected" in out and "n_bytes=" in out
    with pytest.raises(AssertionError):
        check_ring_time(wrong, strict=True)


def test_an_exception_is_a_verdict(capsys):
    def broken(n_bytes, p, alpha, beta):
        return n_bytes / (p - p)

    assert check_ring_time(broken).ok is False
    assert "ZeroDivisionError" in capsys.readouterr().out


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("n", [0, 4096, 10**6, 2**26])
def test_oracle_matches_the_cost_model(n, p):
    assert math.isclose(ring_time_by_schedule(n, p, 3e-5, 1e-9),
                        cost_model.ring_time(n, p, 3e-5, 1e-9), rel_tol=1e-12, abs_tol=1e-18)
