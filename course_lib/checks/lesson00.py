"""Checkers for the exercises of lesson 00 (setup and devices)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ..timing import WorkQueue
from ._core import ExerciseResult, as_numbers, call_or_verdict, check_function, verdict

__all__ = ["check_matmul_flops", "check_time_queued", "check_try_all_gpus"]

#: GPU counts the checker pretends to have: none, one, several.
_FAKE_GPU_COUNTS = (0, 1, 4)


@contextlib.contextmanager
def _gpus(k: int) -> Iterator[None]:
    """Inside, the machine seems to have ``k`` GPUs: ``torch.cuda.device_count`` and
    ``is_available`` (which ``course_lib.devices.num_gpus`` reads) answer as if it had."""
    cuda = torch.cuda
    saved = cuda.device_count, cuda.is_available
    cuda.device_count, cuda.is_available = (lambda: k), (lambda: k > 0)
    try:
        yield
    finally:
        cuda.device_count, cuda.is_available = saved


def check_try_all_gpus(fn: Callable[[], list] | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 00: your ``try_all_gpus`` must return every GPU, or ``[cpu]``; never ``[]``.

    The answer must be right on any machine, not just this one: the checker calls ``fn()`` as if
    the machine had 0, 1 and 4 GPUs (it fakes ``torch.cuda.device_count`` and
    ``torch.cuda.is_available``, and restores them), and compares with
    ``course_lib.devices.try_all_gpus`` under the same pretence.
    """
    from .. import devices

    name = "try_all_gpus"
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for k in _FAKE_GPU_COUNTS:
        where = f"on a machine with {k} GPU(s): "
        with _gpus(k):
            want = devices.try_all_gpus()
            got, failed = call_or_verdict(name, strict, fn, before=where, after=".")
        if failed is not None:
            return failed
        try:
            ok = [torch.device(d) for d in got] == want
        except (TypeError, RuntimeError):
            ok = False
        if not ok:
            hint = (" With no GPU the answer is [device('cpu')], not []." if k == 0 else
                    " Ask torch.cuda.device_count() (or num_gpus()) how many GPUs there are.")
            return verdict(name, False, f"{where}expected {want}, received {got!r}.{hint}",
                           strict)
    return verdict(name, True, f"right with {', '.join(map(str, _FAKE_GPU_COUNTS))} GPUs "
                   "(faked).", strict)


def matmul_flops_counted(n: int, k: int, m: int) -> int:
    """The floating-point operations of one ``(n, k) @ (k, m)`` product, as counted by torch's
    own ``FlopCounterMode`` (a multiply and an add count as two)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        torch.empty(n, k) @ torch.empty(k, m)
    return counter.get_total_flops()


def check_matmul_flops(fn: Callable[[int, int, int], int] | None, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 00: ``fn(n, k, m)`` returns the FLOPs of one ``(n, k) @ (k, m)`` matmul, checked
    against ``FlopCounterMode`` on square and non-square shapes (an answer right only for square
    matrices, such as ``2 * n**3``, fails)."""
    cases = [(2, 2, 2), (3, 5, 7), (64, 1, 9), (1, 300, 4), (128, 64, 32)]
    return check_function("matmul flops", fn, matmul_flops_counted, cases,
                          hint="Each of the n*m outputs is a dot product of length k.",
                          strict=strict)


#: The checker's queued work: it sleeps this long (a kernel of known length).
_WORK_S = 0.1
#: What scheduling may add to one timing (a busy machine's sleep overshoots): under the work
#: itself, so that a timing of two calls fails.
_SLACK_S = 0.08
#: What the first call on a fresh queue costs on top (CUDA's lazy initialisation, in miniature).
_FIRST_CALL_S = 0.25
#: Work already queued when the learner's function is called.
_PENDING_S = 0.25


class _FirstCallQueue(WorkQueue):
    """A ``WorkQueue`` whose first submitted call pays a one-time cost, as a GPU's first kernel
    pays for lazy initialisation; ``submitted`` counts the calls."""

    def __init__(self, first_call_s: float) -> None:
        super().__init__()
        self.first_call_s, self.submitted = first_call_s, 0

    def submit(self, fn: Callable[[], object]) -> None:
        if self.submitted == 0 and self.first_call_s:
            super().submit(lambda: time.sleep(self.first_call_s))
        super().submit(fn)
        self.submitted += 1


def _queued_work() -> None:
    """The work the checker asks you to time: it must run on the queue, not in your thread."""
    if threading.current_thread().name != "work-queue":
        raise RuntimeError("work() was called directly: hand it to the queue with "
                           "queue.submit(work), and time what the queue does")
    time.sleep(_WORK_S)


def _timings(fn: Callable, q: _FirstCallQueue, repeat: int) -> list:
    """The learner's timings, once everything it queued has run."""
    times = fn(q, _queued_work, repeat)
    q.synchronize()
    return times


def check_time_queued(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 00: ``fn(queue, work, repeat)`` returns ``repeat`` timings, in seconds, of one
    ``work`` call run on ``queue`` (a ``WorkQueue``: ``submit`` returns at once).

    The checker's ``work`` sleeps 100 ms; the first call on a fresh queue costs 250 ms more (a
    warm-up must absorb it); in a second case 250 ms of earlier work is already queued when
    ``fn`` is called (the clock must start after it). Every timing must lie between half the
    work's time and the work's time plus 80 ms (two calls in one timing fail).
    """
    name = "time_queued"
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    repeat = 3
    for case, first_call_s, pending_s in (("a fresh queue", _FIRST_CALL_S, 0.0),
                                          ("a queue still busy with earlier work", 0.0,
                                           _PENDING_S)):
        q = _FirstCallQueue(first_call_s)
        try:
            if pending_s:
                q.submit(lambda s=pending_s: time.sleep(s))
            times, failed = call_or_verdict(name, strict, _timings, fn, q, repeat,
                                            before=f"on {case}: ", after=".")
        finally:
            q.close()
        if failed is not None:
            return failed
        times, problem = as_numbers(times, repeat, f"seconds, repeat={repeat}")
        if problem:
            return verdict(name, False, problem, strict)
        shown = ", ".join(f"{t * 1e3:.1f}" for t in times)
        said = (f"on {case} your timings were [{shown}] ms for work that takes "
                f"{_WORK_S * 1e3:.0f} ms: ")
        if min(times) < 0.5 * _WORK_S:
            return verdict(name, False, f"{said}the clock was read while the work was still "
                           "queued. Call queue.synchronize() after submitting and before "
                           "reading the clock.", strict)
        if max(times) > _WORK_S + _SLACK_S:
            first = f"the one-time cost of the queue's first call ({_FIRST_CALL_S * 1e3:.0f} ms)"
            if 2 * _WORK_S <= max(times) < 2 * _WORK_S + _SLACK_S and min(times) >= 2 * _WORK_S:
                why = ("more than one work call each: submit the work once per timing (the "
                       "warm-up apart, untimed)")
            elif pending_s:
                why = (f"{pending_s * 1e3:.0f} ms of work queued before your function was "
                       "called: call queue.synchronize() before starting the clock too")
            elif q.submitted > repeat:   # it warmed up, but started the clock too early
                why = (f"{first}, paid by your warm-up, which was still running when the clock "
                       "started: call queue.synchronize() before starting the clock too")
            else:
                why = (f"{first}: run the work once, untimed, and wait for it, before timing "
                       "(a warm-up)")
            return verdict(name, False, f"{said}they include {why}.", strict)
    return verdict(name, True, f"every timing within the work's {_WORK_S * 1e3:.0f} ms (+ "
                   f"scheduling), on a fresh queue and on a busy one.", strict)
