"""Lesson 11, exercises: sharded data parallelism in two steps.

1. ``ZeRO1``: a ZeRO stage-1 optimizer, each rank keeping and stepping the state of its own
   shard of the parameters, then broadcasting the updated values (``check_zero``);
2. ``ShardedLinear``: a simplified FSDP unit, one Linear layer whose weight and bias live as one
   flat padded shard per rank, gathered for forward, freed, gathered again for backward, its
   gradient reduce-scattered and averaged (``check_fsdp``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed.compat import all_gather_into_tensor, reduce_scatter_tensor

__all__ = ["GatherLinear", "ShardedLinear", "ZeRO1"]


class ZeRO1:
    """Exercise 1: ``optimizer_class`` sharded over the ranks (ZeRO stage 1)."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        rank, world = dist.get_rank(), dist.get_world_size()
        # 1. balance by size: largest first, each to the rank holding the fewest elements
        sizes = [0] * world
        self.owner = {}
        for p in sorted(self.params, key=lambda t: t.numel(), reverse=True):
            r = sizes.index(min(sizes))
            self.owner[p] = r
            sizes[r] += p.numel()
        # 2. this rank's optimizer sees only its shard (a group, which may be empty)
        mine = [p for p in self.params if self.owner[p] == rank]
        self.optim = optimizer_class([{"params": mine}], **defaults)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.optim.step()                            # only this rank's parameters move
        for p in self.params:                        # the same order on every rank
            dist.broadcast(p, src=self.owner[p])     # the owner's new values, to everyone


def _pad(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``flat`` (N,) padded with zeros to a multiple of ``world``."""
    pad = -flat.numel() % world
    return torch.cat([flat, flat.new_zeros(pad)])  # (ceil(N / world) * world,)


def _gather(shard: torch.Tensor, unit: ShardedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather the full flat vector; return the weight (out, in) and the bias (out,)."""
    full = shard.new_empty(shard.numel() * dist.get_world_size())   # (N padded,)
    all_gather_into_tensor(full, shard.detach().contiguous())
    n_w = unit.out_features * unit.in_features
    W = full[:n_w].view(unit.out_features, unit.in_features)       # (out, in)
    b = full[n_w:n_w + unit.out_features]                          # (out,)
    return W, b


class GatherLinear(torch.autograd.Function):
    """forward: gather, compute, free; backward: gather again, compute, reduce-scatter."""

    @staticmethod
    def forward(ctx, X, shard, unit):
        W, b = _gather(shard, unit)
        ctx.save_for_backward(X, shard)   # not W: it is freed when forward returns
        ctx.unit = unit
        return X @ W.T + b                # (B, out)

    @staticmethod
    def backward(ctx, grad_out):          # (B, out)
        X, shard = ctx.saved_tensors
        W, _ = _gather(shard, ctx.unit)   # gathered again, freed when backward returns
        grad_X = grad_out @ W                                            # (B, in)
        flat = torch.cat([(grad_out.T @ X).flatten(), grad_out.sum(0)])  # (N,)
        world = dist.get_world_size()
        full = _pad(flat, world)                                         # (N padded,)
        grad_shard = torch.empty_like(shard)
        reduce_scatter_tensor(grad_shard, full)                          # the sum of my slice
        return grad_X, grad_shard / world, None                          # the average


class ShardedLinear(nn.Module):
    """Exercise 2: a Linear layer kept as this rank's slice of its flat, padded parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        flat = torch.cat([linear.weight.detach().flatten(), linear.bias.detach()])  # (N,)
        rank, world = dist.get_rank(), dist.get_world_size()
        full = _pad(flat, world)                       # (N padded,)
        size = full.numel() // world
        self.shard = nn.Parameter(full[rank * size:(rank + 1) * size].clone())  # (N padded / W,)

    def forward(self, X):
        return GatherLinear.apply(X, self.shard, self)
