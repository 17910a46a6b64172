"""Lesson 10, exercise: the bus bandwidth of one raw row of a collectives results file.

Checked by ``course_lib.checks.lesson10.check_bus_bandwidth``.
"""
from __future__ import annotations

import statistics

__all__ = ["bus_bandwidth"]


def bus_bandwidth(row: dict) -> float:
    """GB/s of bus bandwidth of one all-reduce row (``world_size``, ``bytes``, ``seconds``).

    The typical operation's time is the median of the samples (each already seconds per
    operation); algorithm bandwidth = bytes / time; bus bandwidth = algbw * 2 (p - 1) / p.
    """
    p, n = row["world_size"], row["bytes"]
    seconds = statistics.median(row["seconds"])
    algbw = n / seconds                      # bytes per second
    return algbw * 2 * (p - 1) / p / 1e9     # GB/s
