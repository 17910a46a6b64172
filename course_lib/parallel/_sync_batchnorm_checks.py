"""Checks for ``sync_batchnorm``: every rank's layer the same size (else gloo fails obscurely
or aborts, and NCCL may hang, in the all-gather of 1 + 2C numbers per rank).
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

_first_runs = itertools.count(1)  # how many SyncBatchNorm layers this process has checked


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def check_same_channels(layer: torch.nn.Module, x: torch.Tensor,
                        group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless ``layer.num_features`` is the same on
    all of them. One all-gather of one number per rank; call it once per layer, in training mode,
    at the same point on every rank (the layer's first synchronised forward)."""
    k = next(_first_runs)
    mine = torch.tensor([layer.num_features], dtype=torch.int64, device=x.device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    channels = [int(t.item()) for t in every]
    if len(set(channels)) == 1:
        return
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, channels))
    raise ValueError(
        f"SyncBatchNorm expects the same number of channels on every rank, but the "
        f"{_ordinal(k)} SyncBatchNorm layer to run in training on rank {dist.get_rank()} "
        f"({layer!r}) has different num_features on the ranks: {per_rank}. Its statistics "
        f"are joined across the ranks channel by channel, so every rank must run the same "
        f"model: build it the same way on every rank (same widths, same layers in the same "
        f"order), or give a layer that is not shared a process_group of the ranks that have it.")
