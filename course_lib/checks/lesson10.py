"""Checkers for the exercises of lesson 10 (timing plots and the alpha-beta model).

``check_ring_time`` asks for the alpha-beta cost of a ring all-reduce. Its oracle is not a copy
of the formula: it walks the ring's schedule (``2 (p - 1)`` steps, in each of which every rank
sends one chunk of ``n / p`` bytes at once) and adds ``alpha + bytes * beta`` per step.
The tests check that this walk agrees with ``course_lib.bench.cost_model.ring_time``.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ._core import ExerciseResult, call_bounded, failure, verdict

__all__ = ["check_ring_time", "ring_time_by_schedule"]

_NAME = "ring_time"
_HINT = ("a ring all-reduce is 2 (p - 1) steps (reduce-scatter, then all-gather); in each step "
         "every rank sends one chunk of n / p bytes at the same time, and a message of m bytes "
         "costs alpha + m * beta.")


def ring_time_by_schedule(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce of ``n_bytes`` over p ranks, step by step of its schedule.

    The steps follow one another; within a step all ranks send at once, so a step costs one
    message of the largest chunk. Byte counts are taken as real numbers (n / p), as the
    textbook formula does.
    """
    if p == 1:
        return 0.0
    chunk = n_bytes / p  # every rank's chunk (ring_chunk_bounds: sizes differ by one element)
    return sum(alpha + chunk * beta for _ in range(2 * (p - 1)))


def check_ring_time(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 09: ``fn(n_bytes, p, alpha, beta)`` is the ring all-reduce's alpha-beta cost.

    Compared on several sizes and rank counts, with alphas and betas far apart so that a
    missing or doubled term shows; relative tolerance 1e-6. The first failing case is printed.
    """
    if fn is None:
        return verdict(_NAME, None, "define your function and pass it here.", strict)
    cases = [(n, p, alpha, beta)
             for n, p in [(4096, 2), (2**20, 2), (2**20, 4), (64 * 2**20, 8), (10**6, 3),
                          (0, 4), (2**26, 16)]
             for alpha, beta in [(1e-3, 1e-9), (5e-6, 1 / 50e9)]] + [(2**20, 1, 1e-3, 1e-9)]
    for case in cases:
        want = ring_time_by_schedule(*case)
        try:
            got = float(call_bounded(fn, *case))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
            return verdict(_NAME, False, f"{failure(exc)} on input {case}. {_HINT}", strict)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-15):
            n, p, alpha, beta = case
            return verdict(_NAME, False, f"for n_bytes={n}, p={p}, alpha={alpha:g}, "
                           f"beta={beta:g}: expected {want:.6g} s, got {got:.6g} s. {_HINT}",
                           strict)
    return verdict(_NAME, True, f"matches the ring's schedule on {len(cases)} inputs.", strict)
