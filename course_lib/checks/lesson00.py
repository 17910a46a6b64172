"""Checkers for the exercises of lesson 00 (setup and devices)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._core import ExerciseResult, call_bounded, failure, verdict

__all__ = ["check_matmul_flops", "check_try_all_gpus"]

#: GPU counts the checker pretends to have: none, one, several.
_FAKE_GPU_COUNTS = (0, 1, 4)


def _with_gpus(k: int, fn: Callable[[], list]) -> list:
    """``fn()`` on a machine that seems to have ``k`` GPUs: ``torch.cuda.device_count`` and
    ``is_available`` (which ``course_lib.devices.num_gpus`` reads) answer as if it had; both
    are restored afterwards."""
    cuda = torch.cuda
    saved = cuda.device_count, cuda.is_available
    cuda.device_count, cuda.is_available = (lambda: k), (lambda: k > 0)
    try:
        return call_bounded(fn)
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
        want = _with_gpus(k, devices.try_all_gpus)
        try:
            got = _with_gpus(k, fn)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the learner's code failed: a verdict
            return verdict(name, False, f"on a machine with {k} GPU(s): {failure(exc)}.", strict)
        try:
            ok = [torch.device(d) for d in got] == want
        except (TypeError, RuntimeError):
            ok = False
        if not ok:
            hint = (" With no GPU the answer is [device('cpu')], not []." if k == 0 else
                    " Ask torch.cuda.device_count() (or num_gpus()) how many GPUs there are.")
            return verdict(name, False, f"on a machine with {k} GPU(s): expected {want}, "
                           f"received {got!r}.{hint}", strict)
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
    from ._core import check_function

    cases = [(2, 2, 2), (3, 5, 7), (64, 1, 9), (1, 300, 4), (128, 64, 32)]
    return check_function("matmul flops", fn, matmul_flops_counted, cases,
                          hint="Each of the n*m outputs is a dot product of length k.",
                          strict=strict)
