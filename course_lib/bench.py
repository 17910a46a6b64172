"""Timing that tells the truth: synchronize before reading the clock, warm up, report medians.

PyTorch counterpart: ``torch.utils.benchmark.Timer`` (which also synchronizes CUDA).
Command line: ``python -m course_lib.bench NAME`` runs a registered benchmark and prints JSON
(``python -m course_lib.bench --list`` names them).
"""
from __future__ import annotations

import importlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .devices import synchronize

__all__ = ["BENCHMARKS", "BenchResult", "Timer", "benchmark", "main"]


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


#: name -> "module:function" of a benchmark that takes argv and prints JSON.
BENCHMARKS: dict[str, str] = {
    "dataloader": "course_lib.bench_data:main",
    "allreduce": "course_lib.bench_allreduce:main",
}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]``: ``python -m course_lib.bench NAME``; 0 if it ran."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "--list"}:
        print("usage: python -m course_lib.bench NAME [options]\nbenchmarks: "
              + ", ".join(sorted(BENCHMARKS)))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    module, func = BENCHMARKS[name].split(":")
    return getattr(importlib.import_module(module), func)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
