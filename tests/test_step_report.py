"""Lesson 10's reading of a ``measure_step_comm`` run (``course_lib.bench.step_report``), on
hand-made runs whose answers are known: steps built as local + the wrapper + the calls, with the
same noise in every variant of a round, so that each paired difference is exact."""
import math
import statistics

import pytest

from course_lib.bench import cost_model, step_report
from course_lib.bench.step_comm import slower_rank_wait
from course_lib.timing import bootstrap_difference

NOISE = [0.0, 0.003, -0.002, 0.001, 0.004, -0.001, 0.002]   # one value per round, s


def _stamped(rounds, calls, backward_end):
    return [[{"begin": 0.0, "calls": calls, "backward_end": backward_end}] * 2
            for _ in range(rounds)]


def _run():
    local = [0.100 + n for n in NOISE]
    step = {"local": local,
            "naive_nosend": [t + 0.004 for t in local], "naive": [t + 0.004 + 0.030 for t in local],
            "bucketed_nosend": [t + 0.003 for t in local],
            "bucketed": [t + 0.003 + 0.010 for t in local]}
    alone = {"naive": [0.020 + n / 10 for n in NOISE], "bucketed": [0.008 + n / 10 for n in NOISE]}
    return {"threads_per_worker": 1, "models": {"lenet": {
        "messages": {"naive": [4096] * 8, "bucketed": [16384, 16384]},
        "step": step, "alone": alone,
        "local_met": [[0.10, 0.12, 0.10], [0.11, 0.10, 0.10]],
        "bucketed_calls": {"step": _stamped(4, [[1.0, 3.0], [4.0, 6.0]], 5.0),
                           "alone": _stamped(4, [[0.0, 1.0], [1.0, 2.0]], None)}}}}


def test_prediction_check_prices_each_message_as_a_ring():
    run, alpha, beta = _run(), 1e-4, 1e-9
    check = step_report.prediction_check(run, alpha, beta, p=3)
    naive = check["lenet", "naive"]
    assert naive["calls"] == 8 and naive["bytes"] == 8 * 4096
    assert math.isclose(naive["predicted"], 8 * cost_model.ring_time(4096, 3, alpha, beta))
    med, lo, hi = naive["alone"]
    assert lo <= med <= hi and med == pytest.approx(0.020 + 0.0001)   # median of the noise: 1 ms/10
    r = naive["ratio"]
    assert r[1] <= r[0] <= r[2] and r[0] == pytest.approx(naive["predicted"] / med)
    assert check["lenet", "naive - bucketed"] == bootstrap_difference(
        run["models"]["lenet"]["alone"]["naive"], run["models"]["lenet"]["alone"]["bucketed"])
    assert check["lenet", "naive - bucketed"][1] > 0   # 12 ms apart in every round
    table = step_report.prediction_table(check)
    assert "lenet    naive:   8" in table and "lenet: naive's calls alone - bucketed's" in table


def test_step_parts_are_the_paired_differences():
    parts = step_report.step_parts(_run())
    for s, wrapper, comm in (("naive", 0.004, 0.030), ("bucketed", 0.003, 0.010)):
        for key, want in (("exposed", wrapper + comm), ("wrapper", wrapper), ("comm", comm)):
            assert parts["lenet", s][key] == pytest.approx((want,) * 3), (s, key)
    assert parts["lenet", "naive - bucketed"] == pytest.approx((0.021,) * 3)
    # meeting every step: mean of the per-step max (0.11, 0.12, 0.10) less the slower mean
    wait, lo, hi = parts["lenet", "wait"]
    assert wait == pytest.approx(0.11 - (0.32 / 3))
    assert wait == slower_rank_wait(_run()["models"]["lenet"]["local_met"])
    assert 0 <= lo <= wait <= hi <= 0.02   # meeting never saves time; at most the 20 ms spread
    mine = step_report.step_parts(_run(), wait=lambda d: 0.5)   # a learner's function is used
    assert mine["lenet", "wait"] == (0.5, 0.5, 0.5)
    table = step_report.parts_table(parts, step_report.prediction_check(_run(), 1e-4, 1e-9))
    assert "34.0 [34.0, 34.0]" in table and "waiting for the slower rank 3.33 [" in table


def test_stamp_summary_reads_the_stamps():
    # calls 1-3 and 4-6, backward ends at 5: lead 4, tail 1, 3 of the calls' 4 s before the end
    s = step_report.stamp_summary(_run(), "lenet")
    assert s["steps"] == 8   # 4 steps x 2 ranks
    assert s["lead"] == (4.0, 4.0, 4.0) and s["tail"] == (1.0, 1.0, 1.0)
    assert s["share"] == (0.75, 0.75, 0.75)
    assert s["in_step"] == (4.0, 4.0, 4.0) and s["alone"] == (2.0, 2.0, 2.0)
    # the step grew by exactly 10 ms over bucketed_nosend in every round: 4 s - 0.01 s hidden
    assert s["hidden"] == pytest.approx((3.99,) * 3)
    # both ranks launch together: after launch the calls run 4 s in the step, 2 s alone
    assert s["after_step"] == (4.0, 4.0, 4.0) and s["after_alone"] == (2.0, 2.0, 2.0)
    assert s["after_extra"] == (2.0, 2.0, 2.0)
    table = step_report.stamp_table({"lenet": s})
    assert "75% of the calls' time" in table and "(2.0x)" in table
    assert "paired difference 2000.0 [2000.0, 2000.0], longer in the step" in table


def test_after_launch_counts_from_the_last_rank_s_launch_and_each_instant_once():
    # call 0 launched at 0 and 2, call 1 at 1 and 3: neither can run before 2 and 3. Rank 0's
    # [2, 5] and [3, 6] overlap (queued calls): 4 s, not 6; rank 1's [2, 5] and [3, 6.5]: 4.5 s
    ranks = [{"calls": [[0.0, 5.0], [1.0, 6.0]]}, {"calls": [[2.0, 5.0], [3.0, 6.5]]}]
    assert step_report.after_launch(ranks) == pytest.approx((4.0 + 4.5) / 2)
    # a result stamped before the other rank's launch (clocks a hair apart) counts nothing
    assert step_report.after_launch([{"calls": [[0.0, 1.0]]}, {"calls": [[2.0, 3.0]]}]) == 0.5
    # three ranks: the latest of three launches
    three = [{"calls": [[0.0, 4.0]]}, {"calls": [[1.0, 4.0]]}, {"calls": [[3.0, 4.0]]}]
    assert step_report.after_launch(three) == pytest.approx(1.0)


def test_hidden_interval_resamples_both_sources():
    # the calls' time varies from step to step and the growth from round to round: the interval
    # holds the point estimate, is wider than either source's alone, and moves with the growth
    calls = [[0.070 + 0.002 * k, 0.071 + 0.002 * k] for k in range(10)]
    nosend = [0.40 + n for n in NOISE * 2]
    step = [t + 0.030 + 0.01 * (i % 3) for i, t in enumerate(nosend)]
    med, lo, hi = step_report._hidden(calls, step, nosend)
    assert lo < med < hi
    assert med == pytest.approx(statistics.median(c for cs in calls for c in cs)
                                - (statistics.median(step) - statistics.median(nosend)))
    grown = step_report._hidden(calls, [t + 0.02 for t in step], nosend)
    assert grown[0] == pytest.approx(med - 0.02) and grown[2] < hi


def test_compare_intervals_needs_the_intervals_apart():
    assert step_report.compare_intervals((1, 0.5, 1.5), (3, 2, 4)) == "lower"
    assert step_report.compare_intervals((3, 2, 4), (1, 0.5, 1.5)) == "higher"
    assert step_report.compare_intervals((1, 0.5, 2.5), (3, 2, 4)) == "not told apart"
    assert step_report.ms((0.0123, 0.011, 0.0145)) == "12.3 [11.0, 14.5]"
    assert step_report.ms((0.00123, 0.0011, 0.00145)) == "1.23 [1.10, 1.45]"
