"""The lesson 00 and 06 checkers accept the reference answers and reject realistic wrong ones."""
import time

import pytest

from course_lib import checks
from solutions import lesson00


def test_matmul_flops_checker_accepts_reference_and_rejects_square_only_answers():
    assert checks.check_matmul_flops(lesson00.matmul_flops)
    assert not checks.check_matmul_flops(lambda n, k, m: 2 * n**3)     # right for squares only
    assert not checks.check_matmul_flops(lambda n, k, m: n * k * m)    # forgot the adds
    assert not checks.check_matmul_flops(lambda n, k, m: 2 * n * m)    # forgot the length k
    assert checks.check_matmul_flops(None).ok is None                  # open, not failed


def test_try_all_gpus_checker_accepts_reference():
    assert checks.check_try_all_gpus(lesson00.try_all_gpus)
    assert not checks.check_try_all_gpus(lambda: [])                   # d2l 1.0.3 on a CPU
    assert checks.check_try_all_gpus(_open_try_all_gpus).ok is None    # the scaffold as shipped


def _open_try_all_gpus():
    raise NotImplementedError("try_all_gpus")


def _no_sync(queue, work, repeat):          # reads the clock while the work is still queued
    queue.submit(work)
    queue.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        queue.submit(work)
        times.append(time.perf_counter() - start)
    return times


def _no_warmup(queue, work, repeat):        # the first timing pays the first call's cost
    times = []
    for _ in range(repeat):
        queue.synchronize()
        start = time.perf_counter()
        queue.submit(work)
        queue.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _no_sync_at_start(queue, work, repeat):  # earlier queued work runs inside the first timing
    queue.submit(work)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        queue.submit(work)
        queue.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _direct(queue, work, repeat):           # calls the work itself instead of queueing it
    work()
    return [0.02] * repeat


def _two_per_timing(queue, work, repeat):   # each timing covers two calls of the work
    queue.submit(work)
    times = []
    for _ in range(repeat):
        queue.synchronize()
        start = time.perf_counter()
        queue.submit(work)
        queue.submit(work)
        queue.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _open(queue, work, repeat):
    raise NotImplementedError


def test_time_queued_checker_accepts_reference_and_names_each_mistake(capsys):
    assert checks.check_time_queued(lesson00.time_queued)
    for wrong, words in ((_no_sync, "synchronize() after submitting"),
                         (_no_warmup, "warm-up"),
                         (_no_sync_at_start, "before starting the clock"),
                         (_direct, "called directly"),
                         (_two_per_timing, "more than one work call"),
                         (lambda q, w, r: [0.02], "repeat=3")):
        capsys.readouterr()
        result = checks.check_time_queued(wrong)
        assert result.ok is False, wrong
        assert words in result.message, (wrong, result.message)
    assert checks.check_time_queued(None).ok is None                   # open, not failed
    assert checks.check_time_queued(_open).ok is None                  # the scaffold as shipped


def test_work_queue_returns_at_once_and_synchronize_waits():
    from course_lib.timing import Timer, WorkQueue, benchmark

    with WorkQueue() as q:
        start = time.perf_counter()
        q.submit(lambda: time.sleep(0.1))
        queued = time.perf_counter() - start
        q.synchronize()
        done = time.perf_counter() - start
        assert queued < 0.05 <= 0.1 <= done
        order = []
        for i in range(5):
            q.submit(lambda i=i: order.append(i))
        q.synchronize()
        assert order == [0, 1, 2, 3, 4]                                 # in order, like a stream
        with Timer(q) as t:                                             # Timer waits for a queue
            q.submit(lambda: time.sleep(0.03))
        assert t.elapsed >= 0.03
        r = benchmark(lambda: q.submit(lambda: time.sleep(0.01)), warmup=1, repeat=3, device=q)
        assert r.min >= 0.01
        q.submit(lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):   # reported at the next sync
            q.synchronize()
        q.synchronize()                                                 # reported once
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(lambda: None)


def test_lesson06_counting_references_pass_and_off_by_one_answers_fail():
    from solutions import lesson06

    assert checks.check_tree_rounds(lesson06.rounds)
    assert not checks.check_tree_rounds(lambda p: p.bit_length())            # 1 too many at 2^k
    assert checks.check_elements_sent(lesson06.elements_sent)
    assert not checks.check_elements_sent(lambda n, p, rank=0: 2 * (p - 1) * (n // p))  # floor
