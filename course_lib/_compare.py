"""Comparing variants of one piece of work (re-exported by ``course_lib.timing``): ``compare``
interleaves samples timed by ``time_sample``; ``bootstrap_ratio`` (``_difference``,
``_median``) gives intervals; ``Comparison`` names a winner only when the interval excludes 1.
"""
from __future__ import annotations

import functools
import math
import operator
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .devices import synchronize

if TYPE_CHECKING:  # annotations only: timing imports this module
    from .timing import LoadStamp

__all__ = ["Comparison", "bootstrap_difference", "bootstrap_median", "bootstrap_ratio", "compare",
           "time_sample"]


def _quantile(sorted_xs: list[float], q: float) -> float:
    """The q-quantile of sorted values, linear between neighbours."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _percentile_interval(resample: Callable[[random.Random], float], confidence: float,
                         resamples: int, seed: int) -> tuple[float, float]:
    """The middle ``confidence`` of ``resamples`` draws of ``resample(rng)`` (the statistic on a
    resampled data set): the percentile bootstrap interval."""
    rng = random.Random(seed)
    values = sorted(resample(rng) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return _quantile(values, tail), _quantile(values, 1 - tail)


def _paired(op: Callable[[float, float], float], a: list[float], b: list[float], what: str,
            confidence: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """``op(median(a), median(b))`` and its interval, rounds (``a[i]`` with ``b[i]``) resampled
    whole: the same indices serve both lists."""
    if len(a) != len(b) or not a:
        raise ValueError(f"{what} needs two equally long, non-empty lists of samples (one per "
                         f"round), got {len(a)} and {len(b)}.")

    def resample(rng: random.Random) -> float:
        idx = [rng.randrange(len(a)) for _ in a]
        return op(statistics.median(a[i] for i in idx), statistics.median(b[i] for i in idx))
    return (op(statistics.median(a), statistics.median(b)),
            *_percentile_interval(resample, confidence, resamples, seed))


def bootstrap_ratio(a: list[float], b: list[float], *, paired: bool = True,
                    confidence: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """``median(a) / median(b)`` and its percentile bootstrap interval, paired by round.

    ``a[i]`` and ``b[i]`` were taken in the same round (seconds apart), so rounds are resampled
    whole: a load that slows one round slows both of its samples, and the pairing cancels it.
    ``paired=False``: samples of two launches, no rounds in common; each list is resampled on
    its own.

    Returns:
        ``(ratio, low, high)``.
    """
    if paired:
        return _paired(operator.truediv, a, b, "bootstrap_ratio", confidence, resamples, seed)
    if not a or not b:
        raise ValueError(f"bootstrap_ratio needs two non-empty lists of samples, got "
                         f"{len(a)} and {len(b)}.")

    def resample(rng: random.Random) -> float:
        return (statistics.median(rng.choices(a, k=len(a)))
                / statistics.median(rng.choices(b, k=len(b))))
    return (statistics.median(a) / statistics.median(b),
            *_percentile_interval(resample, confidence, resamples, seed))


def bootstrap_difference(a: list[float], b: list[float], *, confidence: float = 0.95,
                         resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``median(a) - median(b)`` and its percentile bootstrap interval, rounds paired (as
    ``bootstrap_ratio``): ``(difference, low, high)``."""
    return _paired(operator.sub, a, b, "bootstrap_difference", confidence, resamples, seed)


def bootstrap_median(xs: list[float], *, confidence: float = 0.95, resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float, float]:
    """``median(xs)`` and its percentile bootstrap interval: ``(median, low, high)``."""
    if not xs:
        raise ValueError("bootstrap_median needs at least one value, got an empty list.")
    return (statistics.median(xs), *_percentile_interval(
        lambda rng: statistics.median(rng.choices(xs, k=len(xs))), confidence, resamples, seed))


def time_sample(fn: Callable[[], object], loops: int, *,
                device: torch.device | str | None = None,
                before: Callable[[], None] | None = None,
                reduce: Callable[[float], float] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """One timed sample: ``loops`` calls of ``fn`` under one clock; the seconds per call.

    ``before`` runs first, untimed (a ``dist.barrier``, so that every rank starts the sample
    together). The device is synchronized before the clock starts (earlier GPU work is not
    counted) and before it stops (the work the loop queued is). ``reduce`` turns this
    process's seconds per call into the one reported (``_slowest``: the largest over the
    ranks, since a collective ends when its slowest rank does).
    """
    if before is not None:
        before()
    synchronize(device)
    start = clock()
    for _ in range(loops):
        fn()
    synchronize(device)
    seconds = (clock() - start) / loops
    return seconds if reduce is None else reduce(seconds)


@dataclass
class Comparison:
    """The result of ``compare``: samples, medians, ratios with intervals, a verdict.

    ``names``: the variants, in the order given, ``baseline`` (the one every ratio divides by)
    among them; ``seconds``: name -> seconds per call, one sample per round (interleaved);
    ``loops``: name -> calls per sample; ``order``: the variants in the order their samples ran;
    ``confidence``: the intervals' level; ``stamp``: the ``wait_for_quiet`` load stamp, or None.
    """

    names: list[str]
    baseline: str
    seconds: dict[str, list[float]]
    loops: dict[str, int]
    order: list[str]
    confidence: float = 0.95
    stamp: LoadStamp | None = None
    _ratios: dict = field(default_factory=dict, repr=False, compare=False)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def min(self, name: str) -> float:
        return min(self.seconds[name])

    def ratio(self, name: str, to: str | None = None) -> tuple[float, float, float]:
        """``median(name) / median(to)`` (default: the baseline), with its interval."""
        key = (name, to or self.baseline)
        if key not in self._ratios:
            self._ratios[key] = bootstrap_ratio(self.seconds[name], self.seconds[key[1]],
                                                confidence=self.confidence)
        return self._ratios[key]

    def verdict(self, name: str, to: str | None = None) -> str:
        """One sentence: which is faster and by how much, or "no difference measurable here"."""
        to = to or self.baseline
        r, lo, hi = self.ratio(name, to)
        interval = f"{self.confidence:.0%} interval of the time ratio [{lo:.3f}, {hi:.3f}]"
        if hi < 1:
            text = f"{name} is faster than {to}: {1 / r:.2f}x ({interval})"
        elif lo > 1:
            text = f"{name} is slower than {to}: {r:.2f}x the time ({interval})"
        else:
            text = f"{name} against {to}: no difference measurable here ({interval})"
        if self.stamp is not None and self.stamp.busy:
            text += f"; {self.stamp.message}"
        return text

    @property
    def winner(self) -> str | None:
        """The fastest variant by median if its interval against every other excludes 1."""
        best = min(self.names, key=self.median)
        others = [n for n in self.names if n != best]
        if others and all(self.ratio(best, n)[2] < 1 for n in others):
            return best
        return None

    def to_json(self) -> dict:
        """Everything, JSON-ready: samples, medians, minima, loops, ratios and intervals."""
        out = {"baseline": self.baseline, "confidence": self.confidence, "order": self.order,
               "winner": self.winner, "variants": {}}
        for name in self.names:
            r, lo, hi = self.ratio(name)
            q1, _, q3 = (statistics.quantiles(self.seconds[name], n=4)
                         if len(self.seconds[name]) > 1 else [self.seconds[name][0]] * 3)
            out["variants"][name] = {
                "median_s": self.median(name), "min_s": self.min(name), "q1_s": q1, "q3_s": q3,
                "loops": self.loops[name], "samples": len(self.seconds[name]),
                "seconds": self.seconds[name],
                "ratio_to_baseline": r, "ratio_low": lo, "ratio_high": hi,
                "verdict": self.verdict(name) if name != self.baseline else "baseline"}
        if self.stamp is not None:
            out["load"] = self.stamp.to_json()
        return out

    def __str__(self) -> str:
        lines = [f"{'':>16}{'median':>12}{'min':>12}  ratio to {self.baseline} "
                 f"[{self.confidence:.0%} interval]"]
        for name in self.names:
            r, lo, hi = self.ratio(name)
            lines.append(f"{name:>16}{self.median(name) * 1e3:>10.3f}ms"
                         f"{self.min(name) * 1e3:>10.3f}ms  {r:.3f} [{lo:.3f}, {hi:.3f}]")
        lines += [self.verdict(n) for n in self.names if n != self.baseline]
        if self.stamp is not None:
            lines.append(self.stamp.message)
        return "\n".join(lines)


def compare(variants: dict[str, Callable[[], object]], *, samples: int = 15,
            min_sample_seconds: float = 0.05, warmup: int = 2, calibration_calls: int = 5,
            max_loops: int = 10_000, baseline: str | None = None, confidence: float = 0.95,
            device: torch.device | str | None = None, before: Callable[[], None] | None = None,
            reduce: Callable[[float], float] | None = None, stamp: LoadStamp | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Comparison:
    """Time ``variants`` interleaved and compare each with the baseline.

    1. Each variant is called ``warmup`` times, then ``calibration_calls`` times one by one;
       their median sizes its loop: ``ceil(min_sample_seconds / median)`` calls (at most
       ``max_loops``), so a sample lasts well above the timer's resolution and time slice.
    2. ``samples`` rounds, each timing one loop of every variant, starting with a different
       variant each round (A B C, B C A, C A B, ...): a slow moment hurts every variant alike.
    3. Each ratio to the baseline gets a percentile bootstrap interval, rounds resampled whole
       (``bootstrap_ratio``); ``Comparison.verdict`` names a winner only when it excludes 1.

    Args:
        variants: name -> the work to time, called with no arguments (one alone is timed,
            its ratio to itself 1).
        samples: rounds (samples per variant); 10 or more for a useful interval.
        min_sample_seconds, max_loops: the least a sample should last; the most calls in it.
        warmup, calibration_calls: untimed calls first; timed single calls sizing the loop.
        baseline: the variant ratios divide by (default the first).
        confidence: the level of the intervals.
        device, before, reduce, clock: as ``time_sample`` takes them (``reduce`` also applies
            to the calibration's median, so every rank loops alike); tests pass a fake clock.
        stamp: the ``wait_for_quiet`` stamp to keep with the result.

    Returns:
        A ``Comparison``.
    """
    names = list(variants)
    if not names:
        raise ValueError("compare needs at least one variant to time, got none.")
    baseline = names[0] if baseline is None else baseline
    if baseline not in variants:
        raise ValueError(f"compare: baseline {baseline!r} is not one of the variants {names}.")
    if samples < 2 or min_sample_seconds < 0 or calibration_calls < 1 or max_loops < 1:
        raise ValueError(f"compare needs samples >= 2, min_sample_seconds >= 0, "
                         f"calibration_calls >= 1 and max_loops >= 1, got samples={samples}, "
                         f"min_sample_seconds={min_sample_seconds}, calibration_calls="
                         f"{calibration_calls}, max_loops={max_loops}.")

    timed = functools.partial(time_sample, device=device, before=before, reduce=reduce,
                              clock=clock)
    loops = {}
    for name in names:
        for _ in range(warmup):
            variants[name]()
        once = statistics.median(timed(variants[name], 1) for _ in range(calibration_calls))
        need = min_sample_seconds / max(once, 1e-9)
        loops[name] = int(min(max_loops, max(1, math.ceil(need - 1e-9))))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    order = []
    for r in range(samples):
        k = r % len(names)  # rotate: no variant always runs first
        for name in names[k:] + names[:k]:
            seconds[name].append(timed(variants[name], loops[name]))
            order.append(name)
    return Comparison(names, baseline, seconds, loops, order, confidence,
                      stamp.finish() if stamp is not None else None)
