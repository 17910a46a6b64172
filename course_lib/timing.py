"""Timing that tells the truth: synchronize before reading the clock, warm up, report medians.

PyTorch counterpart: ``torch.utils.benchmark.Timer`` (which also synchronizes CUDA). Lesson 00.
A foundation, below the training loops that time their epochs with it; the benchmarks built on
it are in ``course_lib.bench`` (``python -m course_lib.bench NAME``).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .devices import synchronize

__all__ = ["BenchResult", "Timer", "benchmark"]


class Timer:
    """Wall-clock timer that synchronizes ``device`` before each reading.

    Use as a context manager (``with Timer(dev) as t: ...; t.elapsed``) or with
    ``start()`` / ``stop()``; ``stop`` appends to ``times`` and returns the interval in seconds.

    Args:
        device: the device whose queued work must finish before the clock is read
            (None: every GPU; a no-op on a CPU-only machine).
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.times: list[float] = []
        self._start: float | None = None
        self.elapsed: float = 0.0

    def start(self) -> Timer:
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._start is None:
            raise RuntimeError("Timer.stop() called before Timer.start().")
        synchronize(self.device)
        self.elapsed = time.perf_counter() - self._start
        self.times.append(self.elapsed)
        self._start = None
        return self.elapsed

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def sum(self) -> float:
        """Total of the recorded intervals."""
        return sum(self.times)

    def avg(self) -> float:
        """Mean of the recorded intervals."""
        return sum(self.times) / len(self.times) if self.times else 0.0


@dataclass
class BenchResult:
    """Median and spread of repeated timings, in seconds."""

    median: float
    min: float
    max: float
    iqr: float  # interquartile range: the spread, robust to one noisy run
    times: list[float] = field(repr=False)

    def as_dict(self) -> dict:
        return asdict(self)


def benchmark(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 5,
              device: torch.device | str | None = None) -> BenchResult:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    Args:
        fn: the work to time, called with no arguments.
        warmup: calls before timing (caches, allocator, lazy CUDA initialisation).
        repeat: timed calls; the median is the result.
        device: synchronized before and after each timed call (see ``Timer``).
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}.")
    for _ in range(warmup):
        fn()
    timer = Timer(device)
    for _ in range(repeat):
        with timer:
            fn()
    ts = sorted(timer.times)
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
    return BenchResult(median=statistics.median(ts), min=ts[0], max=ts[-1],
                       iqr=q[2] - q[0], times=timer.times)
