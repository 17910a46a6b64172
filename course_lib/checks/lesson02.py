"""Checkers for the exercises of lesson 02 (replicate and allreduce)."""
from __future__ import annotations

from collections.abc import Callable

from ..devices import devices
from ..distributed.collectives import ring_chunk_bounds
from ._core import ExerciseResult, call_bounded, check_answer, failure, verdict

__all__ = ["check_allreduce_fn", "check_ring_sends", "ring_sends"]

def check_allreduce_fn(fn: Callable | None, *, device_counts: tuple[int, ...] = (1, 2, 4, 8),
                       strict: bool = False) -> ExerciseResult:
    """Exercise 02: ``fn(tensors)`` is an in-place allreduce for each number of devices."""
    from ..parallel.comm import check_allreduce

    name = getattr(fn, "__name__", "allreduce")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for n in device_counts:
        try:
            call_bounded(check_allreduce, fn, devices(n, warn=False))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the check's AssertionError, or fn failing
            return verdict(name, False, f"with {n} device(s): {failure(exc)}", strict)
    return verdict(name, True, f"every tensor holds the sum, for {list(device_counts)} "
                    "devices.", strict)


def ring_sends(numel: int, n: int) -> list[int]:
    """Elements each device sends in ``comm.ring_allreduce`` of ``numel`` elements over n."""
    size = [end - start for start, end in ring_chunk_bounds(numel, n)]
    # step s of 2 (n - 1): device i sends chunk (i - s) mod n to its right neighbour
    return [sum(size[(i - s) % n] for s in range(2 * (n - 1))) for i in range(n)]


def check_ring_sends(sent: list[int] | None, n: int = 4, numel: int = 1000, *,
                     strict: bool = False) -> ExerciseResult:
    """Exercise 02: the elements each of ``n`` devices sends in a ring allreduce of ``numel``."""
    expected = ring_sends(numel, n)
    try:
        sent = None if sent is None else [int(s) for s in sent]
    except (TypeError, ValueError):
        return verdict("ring traffic", False, f"expected a list of {n} integers, got {sent!r}.",
                       strict)
    return check_answer("ring traffic", sent,
                        expected, hint=f"each device sends 2 (n - 1) = {2 * (n - 1)} chunks of "
                        f"about numel / n = {numel / n:g} elements.", strict=strict)
