"""Megatron-LM's conjugate operations: how a tensor enters and leaves a tensor-parallel region.

PyTorch counterpart: the redistributions of DTensor that ``ColwiseParallel`` / ``RowwiseParallel``
insert (``Replicate`` -> ``Shard``, ``Partial`` -> ``Replicate``); the names here are Megatron's
(``megatron/core/tensor_parallel/mappings.py``). Read more: Shoeybi et al. (2019), section 3, and
notebook 14.

- ``copy_to_tensor_model_parallel_region`` (Megatron's f): identity forward, all-reduce backward.
  Every rank uses the whole input, so the input's gradient is the sum of every rank's part.
- ``reduce_from_tensor_model_parallel_region`` (g): all-reduce forward, identity backward.
  Each rank holds a partial sum of the output; every rank's gradient of it is the same.
- ``gather_from_tensor_model_parallel_region``: all-gather of the last dimension forward, keep
  this rank's slice backward; ``scatter_to_tensor_model_parallel_region``: its conjugate.

f and g are each other's transpose: one all-reduce in the forward of g, one in the backward of f.
With one rank every operation is the identity and nothing is sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import divisible, group_rank_size

__all__ = ["copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region"]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over the group, in a new tensor (autograd saw ``x``: never overwrite it)."""
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of the last dimension."""
    rank, world = group_rank_size(group, "scatter_to_tensor_model_parallel_region")
    width = divisible(x.shape[-1], world, "the last dimension", "split along the last dimension")
    return x[..., rank * width:(rank + 1) * width].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order."""
    _, world = group_rank_size(group, "gather_from_tensor_model_parallel_region")
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Conjugate(torch.autograd.Function):
    """``there(x, group)`` forward, its conjugate ``back(grad, group)`` backward: the pairs the
    lessons do not spell out as classes (all-gather / split here, split / all-gather along the
    sequence in ``sequence``)."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.group), None, None, None


def _world(group) -> int:
    return group_rank_size(group, "a tensor-parallel region")[1]


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: ``x`` unchanged forward; its gradient all-reduced over ``group`` backward."""
    return x if _world(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: the sum of every rank's ``x`` forward; the gradient passed through backward."""
    return x if _world(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension (rank order); backward keeps
    this rank's slice of the gradient."""
    return x if _world(group) == 1 else _Conjugate.apply(x, group, _gather_last, _split_last)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of ``x``'s last dimension; backward all-gathers the gradient."""
    return x if _world(group) == 1 else _Conjugate.apply(x, group, _split_last, _gather_last)
