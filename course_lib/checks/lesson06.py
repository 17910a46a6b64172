"""Checkers for the exercises of lesson 06 (torch.distributed)."""
from __future__ import annotations

from collections.abc import Callable

from ._core import ExerciseResult, check_function
from .lesson02 import ring_sends

__all__ = ["check_elements_sent", "check_tree_rounds", "elements_sent", "tree_rounds"]

def tree_rounds(p: int) -> int:
    """Rounds of ``distributed.tree_broadcast`` for p ranks: its loop, run without sending."""
    step, rounds = 1, 0
    while step < p:
        step, rounds = step * 2, rounds + 1
    return rounds


def check_tree_rounds(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(p)`` is the number of rounds ``tree_broadcast`` needs for p ranks."""
    return check_function("rounds", fn, tree_rounds, [(p,) for p in range(1, 17)] + [(1000,)],
                          hint="the number of ranks holding the data doubles every round.",
                          strict=strict)


def elements_sent(n: int, p: int, rank: int = 0) -> int:
    """Elements rank ``rank`` sends in ``distributed.ring_allreduce`` of n elements over p ranks."""
    return ring_sends(n, p)[rank]  # the same ring schedule and chunking as lesson 02's


def check_elements_sent(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(n, p, rank)`` is what that rank sends in
    ``course_lib.distributed.ring_allreduce``."""
    cases = [(n, p, r) for n, p in [(10, 2), (1000, 4), (7, 3), (2, 4), (10**6, 8)]
             for r in range(p)]
    return check_function("elements_sent", fn, elements_sent, cases,
                          hint="2 (p - 1) steps; in step s the rank sends chunk (rank - s) mod p, "
                          "chunk c has n // p elements, one more for the first n % p chunks "
                          "(ring_chunk_bounds).", strict=strict)
