"""Where the time of one ``DataParallel`` step goes: scatter, replicate, forward, gather, backward.

PyTorch counterpart: ``torch.profiler`` gives the same breakdown from a trace; this times each
phase of the course's ``DataParallel`` by hand, with every GPU synchronized around it. Lesson 05.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import Device, as_device, synchronize
from ..parallel import gather, parallel_apply, replicate, scatter, scatter_kwargs
from ..timing import Timer

__all__ = ["step_breakdown"]


def step_breakdown(module: nn.Module, X: torch.Tensor, y: torch.Tensor,
                   devices: Sequence[Device], *, repeat: int = 3) -> dict[str, float]:
    """Median seconds of each phase of one data-parallel training step (no optimizer step).

    Phases: ``scatter``, ``replicate``, ``forward`` (``parallel_apply``), ``gather`` (outputs
    onto ``devices[0]`` and the loss), ``backward`` (through every replica into ``module``).
    GPUs are synchronized around each phase, which removes the overlap a real step would have:
    the sum is an upper bound of the step. The module's gradients are left set.
    """
    devices = [as_device(d) for d in devices]
    phases = ("scatter", "replicate", "forward", "gather", "backward")
    times: dict[str, list[float]] = {p: [] for p in phases}
    sync_all = lambda: [synchronize(d) for d in set(devices)]  # noqa: E731
    for _ in range(repeat):
        module.zero_grad(set_to_none=True)
        t = Timer()
        sync_all()
        with t:
            X_shards, kw = scatter_kwargs((X,), {}, devices)
            y_shards = scatter(y, devices[:len(X_shards)])
            sync_all()
        times["scatter"].append(t.elapsed)
        with t:
            replicas = replicate(module, devices[:len(X_shards)])
            sync_all()
        times["replicate"].append(t.elapsed)
        with t:
            outs = parallel_apply(replicas, X_shards, kw)
            sync_all()
        times["forward"].append(t.elapsed)
        with t:
            y_hat = gather(outs, devices[0])                              # (B, C) on devices[0]
            loss = F.cross_entropy(y_hat, gather(y_shards, devices[0]))
            sync_all()
        times["gather"].append(t.elapsed)
        with t:
            loss.backward()
            sync_all()
        times["backward"].append(t.elapsed)
    return {p: sorted(ts)[len(ts) // 2] for p, ts in times.items()}
