"""Checkers for the exercises of lesson 00 (setup and devices)."""
from __future__ import annotations

from collections.abc import Callable

from ._core import ExerciseResult, check_function

__all__ = ["check_try_all_gpus"]

def check_try_all_gpus(fn: Callable[[], list] | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 00: your ``try_all_gpus`` must return every GPU, or ``[cpu]``; never ``[]``."""
    from ..devices import try_all_gpus

    return check_function("try_all_gpus", fn, try_all_gpus, [()],
                          hint="On a CPU-only machine the answer is [device('cpu')], not [].",
                          strict=strict)
