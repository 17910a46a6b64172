"""Lesson 09, exercise: the alpha-beta cost of a ring all-reduce.

Checked by ``course_lib.checks.lesson10.check_ring_time``.
"""
from __future__ import annotations

__all__ = ["ring_time"]


def ring_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds for a ring all-reduce of ``n_bytes`` over ``p`` ranks.

    ``2 (p - 1)`` steps (reduce-scatter, then all-gather), each one message of ``n / p`` bytes
    sent by every rank at once: ``2 (p - 1) alpha + 2 (p - 1) / p * n * beta``.
    """
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta
