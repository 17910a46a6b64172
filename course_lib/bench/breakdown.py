"""Where the time of one ``DataParallel`` step goes: scatter, replicate, forward, gather, backward.

PyTorch counterpart: ``torch.profiler`` gives the same breakdown from a trace; this times each
phase of the course's ``DataParallel`` by hand, with every GPU synchronized around it. Lesson 05.

``step_breakdown`` gives each phase's median for one set of devices. ``compare_breakdown``
compares several sets (one device against two, say) as ``course_lib.timing.compare`` does: one
step of each set per round, the first set rotating, each phase's ratio with a bootstrap interval
over rounds. A step's phases cannot be interleaved (each needs the one before), its steps can.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import Device, as_device, synchronize
from ..parallel import gather, parallel_apply, replicate, scatter, scatter_kwargs
from ..timing import Comparison, LoadStamp, Timer

__all__ = ["PHASES", "Breakdown", "compare_breakdown", "step_breakdown"]

#: The phases of one step, in the order they run.
PHASES = ("scatter", "replicate", "forward", "gather", "backward")


def _one_step(module: nn.Module, X: torch.Tensor, y: torch.Tensor,
              devices: list[torch.device]) -> dict[str, float]:
    """Seconds of each phase of one step on ``devices``, GPUs synchronized around each."""
    sync_all = lambda: [synchronize(d) for d in set(devices)]  # noqa: E731
    times = {}

    @contextlib.contextmanager
    def timed(phase: str):
        with Timer() as t:
            yield
            sync_all()
        times[phase] = t.elapsed

    module.zero_grad(set_to_none=True)
    sync_all()
    with timed("scatter"):
        X_shards, kw = scatter_kwargs((X,), {}, devices)
        y_shards = scatter(y, devices[:len(X_shards)])
    with timed("replicate"):
        replicas = replicate(module, devices[:len(X_shards)])
    with timed("forward"):
        outs = parallel_apply(replicas, X_shards, kw)
    with timed("gather"):
        y_hat = gather(outs, devices[0])                              # (B, C) on devices[0]
        loss = F.cross_entropy(y_hat, gather(y_shards, devices[0]))
    with timed("backward"):
        loss.backward()
    return times


def step_breakdown(module: nn.Module, X: torch.Tensor, y: torch.Tensor,
                   devices: Sequence[Device], *, repeat: int = 3) -> dict[str, float]:
    """Median seconds of each phase of one data-parallel training step (no optimizer step).

    Phases: ``scatter``, ``replicate``, ``forward`` (``parallel_apply``), ``gather`` (outputs
    onto ``devices[0]`` and the loss), ``backward`` (through every replica into ``module``).
    GPUs are synchronized around each phase, which removes the overlap a real step would have:
    the sum is an upper bound of the step. The module's gradients are left set. To compare two
    sets of devices, use ``compare_breakdown`` (interleaved, with intervals).
    """
    if repeat < 1:
        raise ValueError(f"step_breakdown needs repeat >= 1 steps, got {repeat}.")
    devices = [as_device(d) for d in devices]
    steps = [_one_step(module, X, y, devices) for _ in range(repeat)]
    return {p: statistics.median(s[p] for s in steps) for p in PHASES}


@dataclass
class Breakdown:
    """The result of ``compare_breakdown``: each phase's seconds, one sample per round."""

    names: list[str]         # the sets of devices compared, in order; ``baseline`` the first
    seconds: dict[str, dict[str, list[float]]]   # name -> phase (or "total") -> one per round
    order: list[str]         # the names in the order their steps ran
    stamp: LoadStamp | None = None   # the machine's load when the comparison started

    @property
    def baseline(self) -> str:
        return self.names[0]

    def phase(self, phase: str) -> Comparison:
        """The interleaved comparison of one phase (or ``"total"``): medians, ratios to the
        baseline with their bootstrap intervals over rounds, verdicts."""
        if phase not in (*PHASES, "total"):
            raise ValueError(f"expected one of {[*PHASES, 'total']}, got {phase!r}.")
        return Comparison(names=list(self.names), baseline=self.baseline,
                          seconds={n: self.seconds[n][phase] for n in self.names},
                          loops={n: 1 for n in self.names}, order=list(self.order),
                          stamp=self.stamp)

    def median(self, name: str, phase: str = "total") -> float:
        return statistics.median(self.seconds[name][phase])

    def __str__(self) -> str:
        rounds = len(self.seconds[self.baseline]["total"])
        lines = [f"milliseconds per phase, median of {rounds} interleaved steps; last column: "
                 f"the total's ratio to {self.baseline} [95% interval]",
                 f"{'':12s}" + "".join(f"{p:>11s}" for p in (*PHASES, "total"))]
        total = self.phase("total")
        for name in self.names:
            r, lo, hi = total.ratio(name)
            lines.append(f"{name:12s}" + "".join(f"{1e3 * self.median(name, p):11.1f}"
                                                 for p in (*PHASES, "total"))
                         + f"   {r:.3f} [{lo:.3f}, {hi:.3f}]")
        if self.stamp is not None:
            lines.append(self.stamp.message)
        return "\n".join(lines)


def compare_breakdown(module: nn.Module, X: torch.Tensor, y: torch.Tensor,
                      variants: dict[str, Sequence[Device]], *, rounds: int = 7, warmup: int = 1,
                      stamp: LoadStamp | None = None) -> Breakdown:
    """Each phase of a ``DataParallel`` step on several sets of devices, interleaved.

    Each of ``rounds`` (2 or more; 7 for a useful interval) runs one step on every set in
    ``variants`` (name -> devices, at least two sets), starting with a different set each round,
    so a slow moment hurts every set alike; ``warmup`` untimed steps of each come first. A
    sample is one step (long enough on its own). ``Breakdown.phase(p)`` compares one phase with
    a bootstrap interval over rounds; the first variant is the baseline. ``module`` sits on the
    first device of every set; its gradients are left set by the last step. ``stamp``: the
    ``wait_for_quiet`` stamp to keep.
    """
    names = list(variants)
    if len(names) < 2:
        raise ValueError(f"compare_breakdown compares at least two sets of devices, got "
                         f"{names}; for one set use step_breakdown.")
    if rounds < 2 or warmup < 0:
        raise ValueError(f"compare_breakdown needs rounds >= 2 and warmup >= 0, got "
                         f"rounds={rounds}, warmup={warmup}.")
    sets = {n: [as_device(d) for d in variants[n]] for n in names}
    for name in names:
        for _ in range(warmup):
            _one_step(module, X, y, sets[name])
    seconds = {n: {p: [] for p in (*PHASES, "total")} for n in names}
    order = []
    for r in range(rounds):
        k = r % len(names)  # rotate: no set always runs first
        for name in names[k:] + names[:k]:
            step = _one_step(module, X, y, sets[name])
            for p in PHASES:
                seconds[name][p].append(step[p])
            seconds[name]["total"].append(sum(step.values()))
            order.append(name)
    return Breakdown(names=names, seconds=seconds, order=order, stamp=stamp)
