"""Sequence parallelism: the LayerNorm and dropout regions that tensor parallelism leaves whole on
every rank, split along the sequence instead (Korthikanti et al. 2022, section 4.2.2).

PyTorch counterpart: ``torch.distributed.tensor.parallel.SequenceParallel`` (DTensor sharded on
the sequence dimension) with ``ColwiseParallel(input_layouts=Shard(1))`` /
``RowwiseParallel(output_layouts=Shard(1))``; Megatron's ``gather_from_sequence_parallel_region``
and ``reduce_scatter_to_sequence_parallel_region`` (``megatron/core/tensor_parallel/mappings.py``).
Read more: notebook 15.

Between the tensor-parallel regions every rank holds its block of T/t positions ``(B, T/t, C)``
(the course's layout is (batch, sequence, features): the sequence is dimension 1).

- g, ``gather_from_sequence_parallel_region``: all-gather along the sequence forward (the whole
  sequence enters the column-parallel layer), reduce-scatter backward.
- g-bar, ``reduce_scatter_to_sequence_parallel_region``: reduce-scatter forward (the row-parallel
  layer's partial sums, summed, each rank keeping its positions), all-gather backward.

A ring all-reduce is a reduce-scatter followed by an all-gather: the pair moves the bytes the
all-reduce of tensor parallelism moved. The column-parallel layer keeps only its shard of the
input for backward and gathers it again there (as Megatron does): an extra all-gather, so that
every activation of a layer is divided by t, sbh(34 + 5as/h) / t bytes in the paper's count.
LayerNorm weights (and the position embedding) see only this rank's positions: their gradients
are summed over the group (f, ``copy_to_tensor_model_parallel_region``, on the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import compat
from ._checks import divisible, group_rank_size
from .mappings import _Conjugate, copy_to_tensor_model_parallel_region

__all__ = ["SEQUENCE_DIM", "SequenceParallelLayerNorm", "SequenceParallelPositionEmbedding",
           "gather_from_sequence_parallel_region", "linear_with_sequence_parallel_input",
           "reduce_scatter_to_sequence_parallel_region", "row_parallel_output_along_sequence",
           "scatter_to_sequence_parallel_region"]

SEQUENCE_DIM = 1    # (B, T, C)


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on each rank -> (B, T, C), the ranks' blocks in rank order."""
    _, world = group_rank_size(group, "gather_from_sequence_parallel_region")
    parts = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)   # (t, B, T/t, C)
    compat.all_gather_into_tensor(parts.view(-1), x.contiguous().view(-1), group=group)
    return torch.cat(parts.unbind(0), dim=SEQUENCE_DIM)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums -> (B, T/t, C): the sum over ranks of this rank's positions."""
    _, world = group_rank_size(group, "reduce_scatter_to_sequence_parallel_region")
    divisible(x.shape[SEQUENCE_DIM], world, "the sequence length", "sequence parallelism")
    blocks = torch.stack(x.chunk(world, dim=SEQUENCE_DIM))                   # (t, B, T/t, C)
    out = torch.empty_like(blocks[0])
    compat.reduce_scatter_tensor(out.view(-1), blocks.view(-1), group=group)
    return out


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    rank, world = group_rank_size(group, "scatter_to_sequence_parallel_region")
    divisible(x.shape[SEQUENCE_DIM], world, "the sequence length", "sequence parallelism")
    return x.chunk(world, dim=SEQUENCE_DIM)[rank].contiguous()


class _GatherFromSequenceRegion(torch.autograd.Function):
    """g: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """g-bar: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    """``F.linear(g(x), weight, bias)`` that saves the shard x, not the gathered input, and
    gathers it again in backward (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
    with ``sequence_parallel``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, group), weight, bias)       # (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dtype = grad.dtype                # the forward's compute dtype (under autocast: 16-bit)
        total = _gather_seq(x, ctx.group).to(dtype)                # (B, T, in), again
        grad_x = _reduce_scatter_seq(grad @ weight.to(dtype), ctx.group)   # (B, T/t, in)
        grad_2d = grad.reshape(-1, grad.shape[-1])                 # (B*T, out/t)
        grad_w = grad_2d.t() @ total.reshape(-1, total.shape[-1])  # (out/t, in)
        grad_b = grad_2d.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b, None


def _world(group) -> int:
    return group_rank_size(group, "a sequence-parallel region")[1]


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: every rank's positions concatenated along the sequence (dimension 1) forward; the
    gradient reduce-scattered backward."""
    return x if _world(group) == 1 else _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g-bar: the sum over ranks of ``x``, of this rank's positions only, forward; the gradient
    all-gathered backward."""
    return x if _world(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's block of positions of ``x`` (the same on every rank); backward all-gathers."""
    return x if _world(group) == 1 else _Conjugate.apply(x, group, _split_seq, _gather_seq)


def linear_with_sequence_parallel_input(x: torch.Tensor, weight: torch.Tensor,
                                        bias: torch.Tensor | None = None,
                                        group=None) -> torch.Tensor:
    """A column-parallel linear layer of the whole sequence from this rank's positions
    ``x`` (B, T/t, in): all-gather forward, reduce-scatter of the input gradient backward, and
    only the shard ``x`` kept for backward."""
    if _world(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearWithSequenceParallelInput.apply(x, weight, bias, group)


def row_parallel_output_along_sequence(partial: torch.Tensor, bias: torch.Tensor | None,
                                       group=None) -> torch.Tensor:
    """A row-parallel layer's partial sums ``(B, T, out)`` leaving the tensor-parallel region
    along the sequence: reduce-scattered (g-bar) to this rank's positions ``(B, T/t, out)``, the
    whole bias added there. Every rank adds the bias to different positions, so its gradient is
    summed over the group (f on the bias)."""
    y = reduce_scatter_to_sequence_parallel_region(partial, group)
    if bias is None:
        return y
    return y + copy_to_tensor_model_parallel_region(bias, group)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` on this rank's positions; its weight and bias gradients summed over the
    group in backward (each rank saw only its positions)."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, *, group=None) -> SequenceParallelLayerNorm:
        """The same LayerNorm (its parameters, shared), sequence-parallel on ``group``."""
        group_rank_size(group, "SequenceParallelLayerNorm.from_layer_norm")
        layer = cls(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine,
                    bias=ln.bias is not None, group=group)
        layer.weight, layer.bias = ln.weight, ln.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = (None if p is None else copy_to_tensor_model_parallel_region(p, self.group)
                for p in (self.weight, self.bias))
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelPositionEmbedding(nn.Embedding):
    """``nn.Embedding`` of positions that returns this rank's block of them: ``(T/t, C)`` for
    positions ``(T,)``; the weight's gradient summed over the group in backward."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *,
                       group=None) -> SequenceParallelPositionEmbedding:
        """The same embedding (its weight, shared), sequence-parallel on ``group``."""
        group_rank_size(group, "SequenceParallelPositionEmbedding.from_embedding")
        layer = cls(*emb.weight.shape, group=group, _weight=emb.weight)
        return layer

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        rank, world = group_rank_size(self.group, "SequenceParallelPositionEmbedding")
        per_rank = divisible(pos.shape[0], world, "the sequence length",
                             "SequenceParallelPositionEmbedding")
        mine = pos[rank * per_rank:(rank + 1) * per_rank]                  # (T/t,)
        return F.embedding(mine, copy_to_tensor_model_parallel_region(self.weight, self.group))
