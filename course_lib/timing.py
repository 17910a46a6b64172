"""Timing that tells the truth: synchronize before reading the clock, warm up, report medians;
compare variants interleaved, with a confidence interval; say when the machine was busy.

- ``Timer`` and ``benchmark``: one piece of work, synchronized, median of several runs.
- ``WorkQueue``: a CUDA stream's behaviour on a CPU (``submit`` returns at once, a thread runs
  the work in order, ``synchronize`` waits), so lesson 00 shows a timer that reads too early.
- ``compare`` (``_compare``, re-exported): variants interleaved (A B C, B C A, ...), each sample
  a loop long enough to rise above the noise, a bootstrap interval on each ratio, a winner
  named only when its interval excludes 1.
- ``keep_freed_memory`` and ``page_faults`` (``_allocator``, re-exported): keep the C
  allocator from handing freed blocks back to the OS, and count the page faults (lesson 12).
- ``wait_for_quiet``: a bounded wait while the machine is busy; its ``LoadStamp`` says so.

PyTorch counterpart: ``torch.utils.benchmark.Timer`` (which also synchronizes CUDA and sizes its
loops by ``blocked_autorange``) and ``torch.utils.benchmark.Compare``. Lessons 00 and 10. Read
more: Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), ch. 13 (percentile
intervals); Chen & Revels, "Robust benchmarking in noisy environments" (2016). A foundation;
the benchmarks built on it are in ``course_lib.bench`` (``python -m course_lib.bench NAME``).
"""
from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ._allocator import keep_freed_memory, page_faults  # noqa: F401 - public here
from ._compare import (  # noqa: F401 - public here
    Comparison,
    bootstrap_difference,
    bootstrap_median,
    bootstrap_ratio,
    compare,
    time_sample,
)
from .devices import cpu_cores, synchronize

__all__ = ["BenchResult", "Comparison", "LoadStamp", "Timer", "WorkQueue", "benchmark",
           "bootstrap_difference", "bootstrap_median", "bootstrap_ratio", "compare",
           "keep_freed_memory", "load_average", "matmul_flops", "page_faults", "time_sample",
           "wait_for_quiet"]


def matmul_flops(n: int, k: int, m: int) -> int:
    """FLOPs of one ``(n, k) @ (k, m)`` product: ``n * m`` dot products of length ``k``, a
    multiply and an add each (the count ``torch.utils.flop_counter.FlopCounterMode`` uses)."""
    return 2 * n * k * m


class WorkQueue:
    """A stand-in for a CUDA stream on a CPU: ``submit`` queues work and returns at once.

    One background thread runs the calls in order, as a GPU runs one stream's kernels;
    ``synchronize`` waits until all submitted so far have run and re-raises an error one raised
    (as CUDA reports a kernel's error at the next synchronizing call). ``close`` (or leaving a
    ``with`` block) stops the thread.
    """

    def __init__(self) -> None:
        self._todo: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="work-queue", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._todo.get()
            try:
                if fn is None:
                    return
                fn()
            except BaseException as exc:  # noqa: B036 - kept for synchronize() to re-raise
                self._error = self._error or exc
            finally:
                self._todo.task_done()

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn()`` to run after everything queued before it; return without waiting."""
        if not self._thread.is_alive():
            raise RuntimeError("WorkQueue.submit: the queue is closed; make a new WorkQueue.")
        self._todo.put(fn)

    def synchronize(self) -> None:
        """Wait until every submitted call has run; re-raise the first error one raised."""
        self._todo.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"WorkQueue: queued work raised {type(error).__name__}: "
                               f"{error}") from error

    def close(self) -> None:
        """Run what is queued, then stop the background thread."""
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Timer:
    """Wall-clock timer that synchronizes ``device`` before each reading.

    Use as a context manager (``with Timer(dev) as t: ...; t.elapsed``) or with ``start()`` /
    ``stop()``; ``stop`` appends to ``times`` and returns the interval in seconds. ``device``:
    whose queued work must finish before the clock is read (None: every GPU, a no-op without
    one), or anything with a ``synchronize()`` method (a ``torch.cuda.Stream``, a ``WorkQueue``).
    """

    def __init__(self, device: torch.device | str | WorkQueue | None = None):
        self.device = device
        self.times: list[float] = []
        self._start: float | None = None
        self.elapsed: float = 0.0

    def _wait(self) -> None:
        if hasattr(self.device, "synchronize"):   # a stream or a WorkQueue
            self.device.synchronize()
        else:
            synchronize(self.device)

    def start(self) -> Timer:
        self._wait()
        self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._start is None:
            raise RuntimeError("Timer.stop() called before Timer.start().")
        self._wait()
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


def benchmark(fn: Callable[[], object], *, warmup: int = 2, repeat: int = 5,
              device: torch.device | str | WorkQueue | None = None) -> BenchResult:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    Args:
        fn: the work to time, called with no arguments.
        warmup: calls before timing (caches, allocator, lazy CUDA initialisation).
        repeat: timed calls; the median is the result.
        device: synchronized before and after each timed call (see ``Timer``): a device, a
            ``torch.cuda.Stream`` or a ``WorkQueue``.
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


# --- is the machine quiet? ----------------------------------------------------------------------

def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


@dataclass
class LoadStamp:
    """What the load was when a measurement started, and whether that makes it a busy run.

    ``load`` and ``load_end``: the 1-minute load average at the start (None: unknown) and at the
    end (``finish()`` sets it); ``cores`` this process may use; ``threshold`` above which the
    machine is busy; ``waited_s`` spent waiting; ``busy``: still above it after waiting.
    """

    load: float | None
    cores: int
    threshold: float
    waited_s: float = 0.0
    busy: bool = False
    load_end: float | None = None

    @property
    def message(self) -> str:
        """One line for the output: quiet, or "taken on a busy machine (load X on N cores)"."""
        if self.load is None:
            return f"load average unknown on this OS ({self.cores} cores): quietness not checked"
        if self.busy:
            return (f"taken on a busy machine (load {self.load:.2f} on {self.cores} cores, "
                    f"above {self.threshold:.2f}): no conclusion should be drawn from it")
        waited = f", after waiting {self.waited_s:.0f} s" if self.waited_s >= 1 else ""
        return f"quiet machine (load {self.load:.2f} on {self.cores} cores{waited})"

    def finish(self) -> LoadStamp:
        """Record the load at the end of the measurement; returns self."""
        avg = load_average()
        self.load_end = avg[0] if avg else None
        return self

    def to_json(self) -> dict:
        return {**asdict(self), "message": self.message}

    def __str__(self) -> str:
        return self.message


def wait_for_quiet(threshold: float | None = None, *, max_wait_s: float = 120.0,
                   poll_s: float = 5.0, verbose: bool = True) -> LoadStamp:
    """Wait (at most ``max_wait_s``) until the 1-minute load average is at most ``threshold``.

    A load above the core count multiplies step times; a measurement taken then is stamped
    busy, and a lesson draws no conclusion from it. After ``max_wait_s`` it runs anyway, stamped.

    Args:
        threshold: the load above which the machine is busy (default: half the cores, at
            least 1: on 2 cores, more than one core's worth of other work).
        max_wait_s: the longest wait, in seconds (0: do not wait, only stamp).
        poll_s: seconds between readings.
        verbose: print a line to stderr when waiting starts (not with ``COURSE_WAIT_SILENT=1``,
            as ``make notebooks`` sets: a stored lesson keeps no progress lines).

    Returns:
        A ``LoadStamp``: put ``stamp.to_json()`` in the results, print ``stamp.message``.
    """
    cores = cpu_cores()
    threshold = max(1.0, cores / 2) if threshold is None else float(threshold)
    if max_wait_s < 0 or poll_s <= 0:
        raise ValueError(f"wait_for_quiet: max_wait_s must be >= 0 and poll_s > 0, got "
                         f"max_wait_s={max_wait_s}, poll_s={poll_s}.")
    start = time.monotonic()
    avg = load_average()
    if avg is None:
        return LoadStamp(None, cores, threshold)
    told = False
    while avg[0] > threshold and time.monotonic() - start < max_wait_s:
        if verbose and not told and os.environ.get("COURSE_WAIT_SILENT") != "1":
            print(f"load {avg[0]:.2f} on {cores} cores is above {threshold:.2f}: waiting up to "
                  f"{max_wait_s:.0f} s for a quiet machine", file=sys.stderr, flush=True)
            told = True
        time.sleep(min(poll_s, max(0.0, max_wait_s - (time.monotonic() - start))))
        avg = load_average()
    return LoadStamp(avg[0], cores, threshold, waited_s=round(time.monotonic() - start, 1),
                     busy=avg[0] > threshold)
