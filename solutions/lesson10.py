"""Lesson 10, exercises: the alpha-beta time of a ring all-reduce; the alpha-beta fit of a ring
all-reduce; the predicted all-reduce time of a step; the bus bandwidth of one raw row of a
collectives results file (no longer asked by the notebook; its checker is kept).

Checked by ``course_lib.checks.lesson10.check_ring_time``, ``check_alpha_beta_fit``,
``check_predicted_comm`` and ``check_bus_bandwidth``.
"""
from __future__ import annotations

import statistics

import numpy as np

__all__ = ["alpha_beta_fit", "bus_bandwidth", "predicted_comm", "ring_time"]


def ring_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce of ``n_bytes`` over p ranks: ``2 (p - 1)`` steps (a
    reduce-scatter, then an all-gather), each one message of ``n / p`` bytes per rank."""
    return 2 * (p - 1) * (alpha + n_bytes / p * beta)


def alpha_beta_fit(sizes: list[float], times: list[float], p: int) -> tuple[float, float]:
    """Latency (s) and inverse bandwidth (s/byte) of a ring all-reduce over p ranks, from the
    line ``t = a + b n`` fitted on the relative error: ``t_ring = 2 (p - 1) alpha
    + 2 (p - 1) / p n beta``."""
    n, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    b, a = np.polyfit(n, t, 1, w=1 / t)      # residuals weighted by 1 / t: relative errors
    return float(a / (2 * (p - 1))), float(b * p / (2 * (p - 1)))


def predicted_comm(message_bytes: list[float], p: int, alpha: float, beta: float) -> float:
    """Seconds of a step's all-reduces: one ring all-reduce per message, one after another."""
    return sum(ring_time(n, p, alpha, beta) for n in message_bytes)


def bus_bandwidth(row: dict) -> float:
    """GB/s of bus bandwidth of one all-reduce row (``world_size``, ``bytes``, ``seconds``).

    The typical operation's time is the median of the samples (each already seconds per
    operation); algorithm bandwidth = bytes / time; bus bandwidth = algbw * 2 (p - 1) / p.
    """
    p, n = row["world_size"], row["bytes"]
    seconds = statistics.median(row["seconds"])
    algbw = n / seconds                      # bytes per second
    return algbw * 2 * (p - 1) / p / 1e9     # GB/s
