"""The lesson-10 checker: None and a scaffold that raises NotImplementedError are "not answered
yet", the reference answer passes, realistic wrong answers fail with the row shown and the
mistake named, nothing raises on a wrong answer, and the checker's oracle (the ring's schedule,
a median by sorting) agrees with the library's ``cost_model.bus_bandwidth_gbps`` and with the
``busbw_GBps`` column the collectives benchmark stores."""
import math
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.bench import cost_model, step_comm, step_report
from course_lib.checks import check_time_collective
from course_lib.checks.harness import first_failure_in_ranks, verdicts_as_expected
from course_lib.checks.lesson10 import (
    _LOOPS,
    _SAMPLES,
    _STALLED,
    _WARMUP,
    _cases,
    _comm_cases,
    _fit_cases,
    _overlap_cases,
    _ring_cases,
    _tail_cases,
    _time_collective_cases,
    _wait_cases,
    after_backward_by_latest_start,
    check_alpha_beta_fit,
    check_bus_bandwidth,
    check_comm_after_backward,
    check_overlap_of_step,
    check_predicted_comm,
    check_ring_time,
    check_slower_rank_wait,
    comm_by_schedule,
    fit_line,
    link_bytes_by_schedule,
    lstsq_relative_fit,
    median_by_sorting,
    overlap_by_walking,
    planned_sleep,
    ring_time_by_schedule,
    wait_by_clocks,
)
from solutions.lesson10 import (
    alpha_beta_fit,
    bus_bandwidth,
    comm_after_backward,
    overlap_of_step,
    predicted_comm,
    ring_time,
    slower_rank_wait,
    time_collective,
)

RESULTS = Path(__file__).resolve().parent.parent / "results"


def algorithm_bandwidth(row):                       # forgets 2 (p - 1) / p
    return row["bytes"] / statistics.median(row["seconds"]) / 1e9


def from_the_mean(row):
    p = row["world_size"]
    return row["bytes"] / statistics.fmean(row["seconds"]) * 2 * (p - 1) / p / 1e9


def upper_middle(row):                              # sorted(xs)[n // 2]: wrong for even counts
    p, xs = row["world_size"], sorted(row["seconds"])
    return row["bytes"] / xs[len(xs) // 2] * 2 * (p - 1) / p / 1e9


def integer_chunks(row):                            # 2 (p - 1) * (n // p) bytes
    p = row["world_size"]
    return 2 * (p - 1) * (row["bytes"] // p) / statistics.median(row["seconds"]) / 1e9


def bytes_per_second(row):                          # right, but not in GB/s
    return bus_bandwidth(row) * 1e9


WRONG = {algorithm_bandwidth: "algorithm bandwidth", from_the_mean: "mean",
         upper_middle: "even count", integer_chunks: "n // p", bytes_per_second: "1e9"}


def test_not_answered(capsys):
    assert check_bus_bandwidth(None).ok is None
    assert "not answered" in capsys.readouterr().out


def test_a_scaffold_that_raises_not_implemented_is_not_answered(capsys):
    def scaffold(row):
        raise NotImplementedError("bus_bandwidth")

    assert check_bus_bandwidth(scaffold).ok is None
    assert "not answered" in capsys.readouterr().out


def test_reference_passes(capsys):
    assert check_bus_bandwidth(bus_bandwidth, strict=True)
    assert "correct" in capsys.readouterr().out


def test_the_library_passes():
    assert check_bus_bandwidth(cost_model.bus_bandwidth_gbps)


@pytest.mark.parametrize("wrong", list(WRONG), ids=[f.__name__ for f in WRONG])
def test_wrong_answers_fail_with_the_row_and_the_mistake(wrong, capsys):
    result = check_bus_bandwidth(wrong)                  # never raises without strict
    out = capsys.readouterr().out
    assert result.ok is False and "expected" in out and "'world_size':" in out
    assert WRONG[wrong] in out, out
    with pytest.raises(AssertionError):
        check_bus_bandwidth(wrong, strict=True)


def test_an_exception_or_a_non_number_is_a_verdict(capsys):
    def broken(row):
        return row["bandwidth"]

    def text(row):
        return "fast"

    assert check_bus_bandwidth(broken).ok is False
    assert "KeyError" in capsys.readouterr().out
    assert check_bus_bandwidth(text).ok is False
    assert "one number" in capsys.readouterr().out


def test_the_cases_cover_three_ranks_sizes_that_do_not_divide_and_even_counts():
    rows = _cases()
    assert any(r["world_size"] == 3 for r in rows)
    assert any(r["bytes"] % r["world_size"] for r in rows)
    assert any(len(r["seconds"]) % 2 == 0 for r in rows)
    assert any(statistics.fmean(r["seconds"]) > 1.2 * statistics.median(r["seconds"])
               for r in rows)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("n", [1000, 4096, 10**6 + 1, 2**26])
def test_oracle_matches_the_library(n, p):
    seconds = [0.003, 0.001, 0.002, 0.010]
    row = {"world_size": p, "bytes": n, "seconds": seconds}
    want = link_bytes_by_schedule(n, p) / median_by_sorting(seconds) / 1e9
    assert math.isclose(cost_model.bus_bandwidth_gbps(row), want, rel_tol=1e-12)
    assert median_by_sorting(seconds) == statistics.median(seconds)


def test_the_library_reproduces_the_stored_column():
    """Every stored collectives file: busbw_GBps was computed from the median, as the exercise
    asks (the notebook compares the learner's function with that column)."""
    files = sorted(RESULTS.glob("collectives-*.json"))
    assert files
    for path in files:
        for row in cost_model.load_results(path)["results"]:
            assert math.isclose(cost_model.bus_bandwidth_gbps(row), row["busbw_GBps"],
                                rel_tol=1e-9), (path.name, row["op"], row["bytes"])


def _fit(weight, convert=True):
    """A fit with numpy: np.polyfit's w multiplies the residuals (weights ``weight(t)``)."""
    def fit(sizes, times, p):
        t = np.asarray(times)
        b, a = np.polyfit(sizes, t, 1, w=weight(t))
        return (a / (2 * (p - 1)), b * p / (2 * (p - 1))) if convert else (a, b)
    return fit


def _open_fit(sizes, times, p):
    raise NotImplementedError("alpha_beta_fit")


def test_alpha_beta_fit_checker_accepts_the_reference_and_names_the_usual_mistakes(capsys):
    assert check_alpha_beta_fit(alpha_beta_fit)
    assert check_alpha_beta_fit(lambda s, t, p: (lambda m: (m.alpha, m.beta))(
        cost_model.fit_ring(s, t, p)))                                   # the library agrees
    assert check_alpha_beta_fit(None).ok is None
    assert check_alpha_beta_fit(_open_fit).ok is None
    for wrong, words in ((_fit(lambda t: np.ones_like(t)), "unweighted"),
                         (_fit(lambda t: 1 / t ** 2), "np.polyfit squares its weights"),
                         (_fit(lambda t: 1 / t, convert=False), "intercept and slope"),
                         (lambda s, t, p: alpha_beta_fit(s, t, p)[::-1], "return (alpha, beta)"),
                         (lambda s, t, p: alpha_beta_fit(s, t, 2), "p=3"),   # right at 2 only
                         (lambda s, t, p: 1.0, "two numbers"),
                         (lambda s, t, p: 1 / 0, "ZeroDivisionError")):
        capsys.readouterr()
        result = check_alpha_beta_fit(wrong)
        assert result.ok is False, wrong
        assert words in result.message, result.message


def _model_relative_fit(sizes, times, p):
    """Errors relative to the model's time, not the measured one: another objective, wrong."""
    n, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    b, a = np.polyfit(n, t, 1, w=1 / t)
    for _ in range(20):                               # reweight by the current model's time
        b, a = np.polyfit(n, t, 1, w=1 / (a + b * n))
    return a / (2 * (p - 1)), b * p / (2 * (p - 1))


def test_alpha_beta_fit_checker_holds_to_the_stated_objective():
    # the spec names the objective, sum(((model - measured) / measured) ** 2): a fit on another
    # relative error (to the model's time) differs on the noisy cases and fails, with the hint
    result = check_alpha_beta_fit(_model_relative_fit)
    assert result.ok is False
    assert "relative to each measured time" in result.message, result.message
    assert check_alpha_beta_fit(_fit(lambda t: np.ones_like(t))).ok is False   # unweighted


def test_alpha_beta_fit_noisy_cases_separate_the_weighted_from_the_plain_fit():
    noisy = _fit_cases()[3:]                         # the last two carry a pattern of noise
    assert noisy                                     # some cases are not exact lines
    for sizes, times, p in noisy:
        good = alpha_beta_fit(sizes, times, p)
        plain = _fit(lambda t: np.ones_like(t))(sizes, times, p)
        assert not math.isclose(good[0], plain[0], rel_tol=0.05)   # alpha differs by > 5 %


# --- the ring's alpha-beta time ---------------------------------------------------------------

def _ring_open(n, p, alpha, beta):
    raise NotImplementedError("ring_time")


RING_WRONG = {
    "reduce-scatter alone": lambda n, p, a, b: (p - 1) * (a + n / p * b),
    "whole messages": lambda n, p, a, b: 2 * (p - 1) * (a + n * b),
    "alpha paid once": lambda n, p, a, b: a + 2 * (p - 1) / p * n * b,
    "2 p steps": lambda n, p, a, b: 2 * p * (a + n / p * b),
    "integer division": lambda n, p, a, b: 2 * (p - 1) * (a + (n // p) * b),
    "swapped": lambda n, p, a, b: 2 * (p - 1) * (b + n / p * a),
}


def test_ring_time_checker_a_failure_or_a_non_number_is_a_verdict():
    assert "ZeroDivisionError" in check_ring_time(lambda n, p, a, b: 1 / 0).message
    assert "one number" in check_ring_time(lambda n, p, a, b: "fast").message
    # right at 2 ranks only (2 (p - 1) / p = 1 there): the cases at 3 and more catch it
    assert check_ring_time(lambda n, p, a, b: 2 * (p - 1) * a + n * b).ok is False


def test_ring_schedule_oracle_matches_the_library():
    for n, p, a, b in _ring_cases() + [(4096 * 4 ** i, q, 1e-5, 1e-9)
                                      for i in range(8) for q in (2, 3, 16)]:
        assert math.isclose(ring_time_by_schedule(n, p, a, b), cost_model.ring_time(n, p, a, b),
                            rel_tol=1e-12, abs_tol=1e-18)
    assert any(p == 3 for _, p, _, _ in _ring_cases())
    assert any(n % p for n, p, _, _ in _ring_cases() if p > 1)


def test_lstsq_oracle_matches_the_normal_equations_and_the_library():
    for sizes, times, p in _fit_cases():
        a, b = fit_line(sizes, times, [1 / t ** 2 for t in times])
        alpha, beta = lstsq_relative_fit(sizes, times, p)
        assert math.isclose(alpha, a / (2 * (p - 1)), rel_tol=1e-9)
        assert math.isclose(beta, b * p / (2 * (p - 1)), rel_tol=1e-9)
        lib = cost_model.fit_ring(sizes, times, p)
        assert math.isclose(alpha, lib.alpha, rel_tol=1e-9)
        assert math.isclose(beta, lib.beta, rel_tol=1e-9)


# --- a step's predicted all-reduce time ---------------------------------------------------------

def _comm_open(msgs, p, alpha, beta):
    raise NotImplementedError("predicted_comm")


COMM_WRONG = {
    "one all-reduce of all the bytes":
        lambda m, p, a, b: cost_model.ring_time(sum(m), p, a, b) if m else 0.0,
    "alpha paid once per message":
        lambda m, p, a, b: sum(a + 2 * (p - 1) / p * n * b for n in m) if p > 1 else 0.0,
    "the 2-rank formula": lambda m, p, a, b: sum(2 * a + n * b for n in m),
    "the largest message only":
        lambda m, p, a, b: cost_model.ring_time(max(m), p, a, b) if m else 0.0,
    "whole messages in every ring step": lambda m, p, a, b: sum(2 * (p - 1) * (a + n * b)
                                                               for n in m),
}


def test_predicted_comm_checker_a_failure_a_non_number_or_a_mutated_list_is_a_verdict():
    assert "ZeroDivisionError" in check_predicted_comm(lambda m, p, a, b: 1 / 0).message
    assert "one number" in check_predicted_comm(lambda m, p, a, b: "fast").message

    def pops(m, p, a, b):   # empties the caller's list: each call gets its own copy
        total = 0.0
        while m:
            total += cost_model.ring_time(m.pop(), p, a, b)
        return total
    assert check_predicted_comm(pops).ok


def test_comm_oracle_matches_the_library_and_covers_three_ranks():
    for m, p, a, b in _comm_cases():
        assert math.isclose(comm_by_schedule(m, p, a, b), cost_model.predicted_comm(m, p, a, b),
                            rel_tol=1e-12, abs_tol=1e-18)
        assert math.isclose(cost_model.predicted_comm(m, p, a, b),
                            cost_model.predicted_step_time(0.0, m, p, cost_model.AlphaBeta(
                                alpha=a, beta=b, p=p)), rel_tol=1e-12, abs_tol=1e-18)
    assert any(p == 3 for _, p, _, _ in _comm_cases())
    assert any(not m for m, _, _, _ in _comm_cases())


# --- the benchmark loop of a collective (multi-process) ------------------------------------------

def _timing(op, warmup, samples, loops, *, warm=True, barrier=True, reduce="max",
            median=True, per_call=True, extra=0, barrier_inside=False):
    """time_collective with one thing changed (what the wrong answers below get wrong)."""
    for _ in range(warmup if warm else 0):
        op()
    times = []
    for _ in range(samples):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        for i in range(loops + extra):
            if barrier_inside and i:
                dist.barrier()
            op()
        t = torch.tensor([(time.perf_counter() - start) / (loops if per_call else 1)],
                         dtype=torch.float64)
        if reduce == "max":
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        elif reduce == "sum":
            dist.all_reduce(t)                                 # sums: op forgotten
        elif reduce == "to rank 0":
            dist.reduce(t, 0, op=dist.ReduceOp.MAX)            # only rank 0 gets the max
        times.append(t.item())
    return (statistics.median if median else statistics.fmean)(times)


def no_warmup(op, w, s, n):
    return _timing(op, w, s, n, warm=False)


def mean_of_samples(op, w, s, n):
    return _timing(op, w, s, n, median=False)


def own_time(op, w, s, n):
    return _timing(op, w, s, n, reduce=None)


def max_of_medians(op, w, s, n):
    t = torch.tensor([_timing(op, w, s, n, reduce=None)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reduced_to_rank_0(op, w, s, n):
    return _timing(op, w, s, n, reduce="to rank 0")


def summed(op, w, s, n):
    return _timing(op, w, s, n, reduce="sum")


def no_barrier(op, w, s, n):
    return _timing(op, w, s, n, barrier=False)


def barrier_in_the_loop(op, w, s, n):
    return _timing(op, w, s, n, barrier_inside=True)


def per_sample(op, w, s, n):
    return _timing(op, w, s, n, per_call=False)


def one_call_too_many(op, w, s, n):
    return _timing(op, w, s, n, extra=1)


def with_the_library(op, warmup, samples, loops):
    """The course's own sample loop (what measure_collectives gives compare) in the exercise's
    frame: the checker must pass it."""
    from course_lib.distributed.env import _slowest
    from course_lib.timing import time_sample

    for _ in range(warmup):
        op()
    return statistics.median(time_sample(op, loops, before=dist.barrier, reduce=_slowest)
                             for _ in range(samples))


def time_collective_scaffold(op, warmup, samples, loops):
    raise NotImplementedError   # the notebook's scaffold, not yet written


_ROWS = [
    ("the reference", _time_collective_cases, time_collective, {2: None}),
    ("the library", _time_collective_cases, with_the_library, {2: None}),
    ("the scaffold", _time_collective_cases, time_collective_scaffold, {2: "NotImplementedError"}),
    ("no warm-up", _time_collective_cases, no_warmup, {2: "That is no warm-up"}),
    ("mean", _time_collective_cases, mean_of_samples, {2: "the mean of the samples"}),
    # each rank's own time: named as such on a quiet machine; under load the ranks' medians
    # come close and the checker may give only the general reason, which every message holds
    ("own time", _time_collective_cases, own_time, {2: "different numbers on different ranks"}),
    ("max of medians", _time_collective_cases, max_of_medians, {2: "a fast rank's time"}),
    ("reduce", _time_collective_cases, reduced_to_rank_0, {2: "different numbers on different"}),
    ("sum", _time_collective_cases, summed, {2: "the sum over the ranks"}),
    ("no barrier", _time_collective_cases, no_barrier, {2: "no dist.barrier() at all"}),
    ("barrier in the loop", _time_collective_cases, barrier_in_the_loop,
     {2: "between two timed calls"}),
    ("per sample", _time_collective_cases, per_sample, {2: "the time of a whole sample"}),
    ("calls", _time_collective_cases, one_call_too_many, {2: "op was called 22 times"}),
]


def test_time_collective_wrong_answers_get_their_reasons_in_one_launch():
    """Every row in one launch of 2 ranks: the reference passes, each wrong answer is named.
    The stand-in's sleeps make a row last about 0.25 s."""
    found = first_failure_in_ranks(verdicts_as_expected, _ROWS, (2,), (), timeout=120.0,
                                   hang_hint="", hint="")
    assert found is None, found


def test_time_collective_checker_passes_the_reference_at_2_and_3_ranks(capsys):
    assert check_time_collective(time_collective, strict=True)
    assert "[time_collective] correct" in capsys.readouterr().out
    assert check_time_collective(None).ok is None
    assert "not answered yet" in capsys.readouterr().out


def test_time_collective_plan_separates_the_slowest_rank_from_the_others():
    """The stand-in's plan (nominal sleeps): the slowest rank's median per call differs from
    every usual mistake by 25 % or more at 2 and 3 ranks, so that the tolerance holds."""
    for world in (2, 3):
        calls = _WARMUP + _SAMPLES * _LOOPS
        per_rank = [[sum(planned_sleep(_WARMUP + s * _LOOPS + i, r) for i in range(_LOOPS))
                     / _LOOPS for s in range(_SAMPLES)] for r in range(world)]
        by_sample = list(zip(*per_rank))
        want = statistics.median(max(ts) for ts in by_sample)
        usual = [statistics.fmean(max(ts) for ts in by_sample),
                 *(statistics.median(ts) for ts in per_rank),
                 statistics.median(min(ts) for ts in by_sample),
                 statistics.median(sum(ts) for ts in by_sample),
                 statistics.median(sum(ts) / world for ts in by_sample), want * _LOOPS]
        assert all(abs(math.log(u / want)) > math.log(1.25) for u in usual), (world, usual)
        assert min(planned_sleep(k, r) for k in range(calls) for r in range(world)) >= 0.004
        assert any(planned_sleep(_WARMUP + _STALLED * _LOOPS, r) > 0.1 for r in range(world))


# ---- time_all_reduce: the learner's loop on a real all-reduce ---------------------------------

@pytest.mark.parametrize("world_size", [2, 3])
def test_time_all_reduce_runs_a_passing_loop_on_dist_all_reduce(world_size):
    from course_lib.checks import time_all_reduce

    sizes = [4 * 1024, 32 * 1024 * 1024]
    got = time_all_reduce("solutions.lesson10:time_collective", sizes, [20, 1],
                          world_size=world_size, samples=3)
    assert sorted(got) == sizes
    assert all(0 < t < 5 for t in got.values())
    # 8192 times the bytes: gloo on loopback moves a few GB/s at most, so 32 MB takes well over
    # 3 ms where 4 KB takes about one: the loop timed the all-reduce it was given
    assert got[sizes[1]] > 3 * got[sizes[0]]


def test_time_all_reduce_refuses_bad_input_and_says_what_to_do():
    from course_lib.checks import time_all_reduce

    with pytest.raises(ValueError, match="cannot import a function defined in a notebook"):
        time_all_reduce(lambda op, w, s, n: 0.0, [4096], [1])
    with pytest.raises(ValueError, match="one positive loop count per positive size"):
        time_all_reduce("solutions.lesson10:time_collective", [4096, 8192], [1])
    with pytest.raises(RuntimeError, match="could not import your function"):
        time_all_reduce("no_such_module_here:time_collective", [4096], [1], samples=1)


# --- the wait for the slower rank ---------------------------------------------------------------

def _wait_open(durations):
    raise NotImplementedError


WAIT_WRONG = {
    "with nothing taken away": lambda d: statistics.fmean(max(s) for s in zip(*d)),
    "the average rank's mean time": lambda d: statistics.fmean(max(s) for s in zip(*d))
    - statistics.fmean(statistics.fmean(x) for x in d),
    "divide by the number of steps": lambda d: sum(max(s) for s in zip(*d))
    - max(sum(x) for x in d),
    "ranks and steps swapped": lambda d: step_comm.slower_rank_wait([list(c) for c in zip(*d)]),
}


def test_slower_rank_wait_oracle_matches_the_library_on_every_case_and_at_random():
    cases = _wait_cases()
    assert {len(c) for c in cases} >= {2, 3, 4} and any(len(c[0]) > len(c) for c in cases)
    gen = torch.Generator().manual_seed(0)
    for ranks, steps in ((2, 9), (3, 4), (5, 6)):
        cases.append((torch.rand(ranks, steps, generator=gen, dtype=torch.float64) + 0.5).tolist())
    for c in cases:
        assert math.isclose(wait_by_clocks(c), step_comm.slower_rank_wait(c), rel_tol=1e-12,
                            abs_tol=1e-15)
        assert wait_by_clocks(c) >= -1e-15   # meeting often never saves time
    assert wait_by_clocks([[1.0, 1.0], [2.0, 3.0]]) == 0.0   # one rank slower at every step


# --- the three one-number checkers: the reference and the library pass, the mistakes are named ---

def _overlap_open(calls, backward_end):
    raise NotImplementedError


def _share(calls, end):
    return sum(max(0.0, min(e, end) - s) for s, e in calls) / sum(e - s for s, e in calls)


OVERLAP_WRONG = {
    "counted by call": lambda c, end: (sum(s < end for s, _ in c) / len(c),
                                       max(0.0, max(e for _, e in c) - end)),
    "counted wholly before it": lambda c, end: (
        sum(e - s for s, e in c if s < end) / sum(e - s for s, e in c),
        max(0.0, max(e for _, e in c) - end)),
    "counted wholly after it": lambda c, end: (
        sum(e - s for s, e in c if e <= end) / sum(e - s for s, e in c),
        max(0.0, max(e for _, e in c) - end)),
    "from the last call's start": lambda c, end: (_share(c, end),
                                                  max(0.0, max(s for s, _ in c) - end)),
    "a negative tail": lambda c, end: (_share(c, end), max(e for _, e in c) - end),
    "the last call launched": lambda c, end: (_share(c, end), max(0.0, c[-1][1] - end)),
}


def test_overlap_oracle_matches_the_library_on_every_case_and_at_random():
    cases = _overlap_cases()
    gen = torch.Generator().manual_seed(0)
    for k in range(20):   # random steps: 1 to 4 calls, backward's end anywhere among them
        n = 1 + k % 4
        starts = sorted((torch.rand(n, generator=gen) * 10).tolist())
        calls = [(s, s + 0.1 + float(torch.rand(1, generator=gen)) * 5) for s in starts]
        cases.append((calls, float(torch.rand(1, generator=gen)) * 15))
    for calls, end in cases:
        want = overlap_by_walking(calls, end)
        got = step_report.overlap_of_step(calls, end)
        assert all(math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-12) for g, w in zip(got, want))
        assert 0 <= want[0] <= 1 and want[1] >= 0
    assert overlap_by_walking([(2.0, 5.0), (6.0, 9.0)], 8.0) == (5 / 6, 1.0)


def _tail_open(ready, sizes, p, alpha, beta):
    raise NotImplementedError


def _ring(n, p, alpha, beta):
    return 2 * (p - 1) * (alpha + n / p * beta)


def _queued_end(ready, sizes, p, alpha, beta):
    end = float("-inf")
    for r, n in zip(ready, sizes):
        end = max(end, r) + _ring(n, p, alpha, beta)
    return end


TAIL_WRONG = {   # the usual mistake's words in the message -> an answer that makes it
    "beside the one before": lambda r, s, p, a, b: max(
        x + _ring(n, p, a, b) for x, n in zip(r, s)) - max(r),
    "one after another": lambda r, s, p, a, b: sum(_ring(n, p, a, b) for n in s),
    "the last call alone": lambda r, s, p, a, b: _ring(s[-1], p, a, b),
    "counted from backward's start": _queued_end,
    "counted from the last bucket's ready time": lambda r, s, p, a, b:
        _queued_end(r, s, p, a, b) - r[-1],
}


def test_tail_oracle_matches_the_library_on_every_case_and_at_random():
    cases = _tail_cases()
    gen = torch.Generator().manual_seed(0)
    for k in range(30):   # random steps: 1 to 6 buckets, any order of readiness, 1 to 8 ranks
        n = 1 + k % 6
        ready = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.05).tolist()
        sizes = (torch.rand(n, generator=gen, dtype=torch.float64) * 3e7).tolist()
        cases.append((ready, sizes, 1 + k % 8, 1e-5 * (k % 3), 1e-9))
    for ready, sizes, p, alpha, beta in cases:
        want = after_backward_by_latest_start(ready, sizes, p, alpha, beta)
        for got in (step_report.comm_after_backward(ready, sizes, p, alpha, beta),
                    comm_after_backward(ready, sizes, p, alpha, beta)):
            assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), (ready, sizes, p)
        # never less than the last call, never more than every call after backward
        times = [cost_model.ring_time(n, p, alpha, beta) for n in sizes]
        assert times[-1] - 1e-15 <= want <= sum(times) + max(ready) - min(ready) + 1e-15
    # by hand: calls of 1 ms queue behind the first (ready at 1, 1.2, 1.4 ms): 4 - 1.4 ms
    assert math.isclose(after_backward_by_latest_start([1e-3, 1.2e-3, 1.4e-3], [1e6] * 3, 2,
                                                       0.0, 1e-9), 2.6e-3, rel_tol=1e-12)


NUMBER_CHECKERS = {   # name: (checker, reference, the library's, a scaffold, the usual mistakes)
    "ring_time": (check_ring_time, ring_time, cost_model.ring_time, _ring_open, RING_WRONG),
    "predicted_comm": (check_predicted_comm, predicted_comm, cost_model.predicted_comm,
                       _comm_open, COMM_WRONG),
    "slower_rank_wait": (check_slower_rank_wait, slower_rank_wait, step_comm.slower_rank_wait,
                         _wait_open, WAIT_WRONG),
    "overlap_of_step": (check_overlap_of_step, overlap_of_step, step_report.overlap_of_step,
                        _overlap_open, OVERLAP_WRONG),
    "comm_after_backward": (check_comm_after_backward, comm_after_backward,
                            step_report.comm_after_backward, _tail_open, TAIL_WRONG),
}


@pytest.mark.parametrize("name", list(NUMBER_CHECKERS))
def test_checker_accepts_the_reference_and_the_library(name, capsys):
    check, reference, library, scaffold, _ = NUMBER_CHECKERS[name]
    assert check(reference, strict=True)
    assert check(library)
    assert check(None).ok is None
    assert check(scaffold).ok is None
    assert "not answered" in capsys.readouterr().out


@pytest.mark.parametrize("name, why", [(name, why) for name, c in NUMBER_CHECKERS.items()
                                       for why in c[-1]])
def test_checker_names_the_usual_mistakes(name, why):
    check, *_, wrong = NUMBER_CHECKERS[name]
    result = check(wrong[why])
    assert result.ok is False and "expected" in result.message
    assert why in result.message, result.message
    with pytest.raises(AssertionError):
        check(wrong[why], strict=True)
