"""Megatron-LM's parallel layers: a linear split by output columns or by input rows, an
embedding split by vocabulary.

PyTorch counterpart: ``torch.distributed.tensor.parallel`` ``ColwiseParallel`` and
``RowwiseParallel`` applied to ``nn.Linear`` / ``nn.Embedding`` (DTensor does the bookkeeping);
Megatron's ``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding``
(``megatron/core/tensor_parallel/layers.py``) do it by hand, as here. Read more: Shoeybi et al.
(2019) and notebook 14.

With t ranks and ``Y = X A^T + b`` (A of shape (out, in)):

- column-parallel: rank r holds rows ``r*out/t : (r+1)*out/t`` of A (and of b) and computes its
  block of Y's columns; no communication forward, the input gradient all-reduced backward (f).
- row-parallel: rank r holds columns ``r*in/t : (r+1)*in/t`` of A, multiplies its block of X's
  columns, and the partial products are all-reduced forward (g); b is added once, after.

A column-parallel layer followed by a row-parallel one (the Megatron MLP) needs nothing between
them: one all-reduce forward, one backward.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    check_linear,
    check_plain_embedding,
    check_token_range,
    check_width,
    divisible,
    group_rank_size,
)
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .sequence import (
    linear_with_sequence_parallel_input,
    reduce_scatter_to_sequence_parallel_region,
    row_parallel_output_along_sequence,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), with the full fan-in."""
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(tensor, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its output features split over ``group``.

    Rank r holds ``weight`` of shape ``(out_features / t, in_features)``: rows
    ``r * out_features / t`` to ``(r + 1) * out_features / t`` of the full weight (and that block
    of the bias). The output is this rank's block of the features, or all of them when
    ``gather_output=True``. With ``sequence_parallel=True`` the input is this rank's block of
    positions ``(B, T/t, in)``, all-gathered along the sequence first (g; ``sequence.py``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.rank, self.world_size = group_rank_size(group, "ColumnParallelLinear")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_partition = divisible(out_features, self.world_size,
                                                    "out_features", "ColumnParallelLinear")
        self.weight = nn.Parameter(torch.empty(self.out_features_per_partition, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features_per_partition)) if bias else None
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, gather_output: bool = False,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's block of rows of an existing ``nn.Linear`` (same dtype and device)."""
        check_linear(linear, "ColumnParallelLinear.from_linear")
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, linear.bias is not None, group=group,
                    gather_output=gather_output, sequence_parallel=sequence_parallel)
        rows = slice(layer.rank * layer.out_features_per_partition,
                     (layer.rank + 1) * layer.out_features_per_partition)
        layer.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach()[rows].clone())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:                                 # (B, T/t, in) -> (B, T, out/t)
            y = linear_with_sequence_parallel_input(x, self.weight, self.bias, self.group)
        else:
            x = copy_to_tensor_model_parallel_region(x, self.group)   # grad all-reduced
            y = F.linear(x, self.weight, self.bias)                    # (..., out / t)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)   # (..., out)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} on rank {self.rank} of {self.world_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with its input features split over ``group``.

    Rank r holds ``weight`` of shape ``(out_features, in_features / t)``: columns
    ``r * in_features / t`` to ``(r + 1) * in_features / t`` of the full weight, and the whole
    bias, added once after the all-reduce. The input is this rank's block of the features
    (``input_is_parallel=True``, the output of a ``ColumnParallelLinear``) or the full input,
    which is then split here. With ``sequence_parallel=True`` the partial sums are
    reduce-scattered along the sequence (g-bar): the output is this rank's positions
    ``(B, T/t, out)``, and the bias's gradient is summed over the group.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.rank, self.world_size = group_rank_size(group, "RowParallelLinear")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_partition = divisible(in_features, self.world_size,
                                                   "in_features", "RowParallelLinear")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_partition))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _uniform_(self.weight, in_features)
        if self.bias is not None:
            _uniform_(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group=None, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's block of columns of an existing ``nn.Linear``, its whole bias."""
        check_linear(linear, "RowParallelLinear.from_linear")
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, linear.bias is not None, group=group,
                    input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel)
        cols = slice(layer.rank * layer.in_features_per_partition,
                     (layer.rank + 1) * layer.in_features_per_partition)
        layer.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            check_width(x, self.in_features, "RowParallelLinear(input_is_parallel=False)",
                        "Pass the full input.")
            x = scatter_to_tensor_model_parallel_region(x, self.group)   # (..., in / t)
        check_width(x, self.in_features_per_partition, "RowParallelLinear",
                    "With input_is_parallel=True the input is this rank's block of features "
                    "(a ColumnParallelLinear's output); for the full input pass "
                    "input_is_parallel=False.")
        y = F.linear(x, self.weight)                            # (..., out): a partial sum
        if self.sequence_parallel:                    # sequence.py: (B, T/t, out), my positions
            return row_parallel_output_along_sequence(y, self.bias, self.group)
        y = reduce_from_tensor_model_parallel_region(y, self.group)   # (..., out): the sum
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} on rank "
                f"{self.rank} of {self.world_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows (the vocabulary) split.

    Rank r holds rows ``r * num_embeddings / t`` to ``(r + 1) * num_embeddings / t``. Each rank
    looks up the tokens in its range, writes zeros for the others, and the all-reduce (g) adds
    the one non-zero row each token has; with ``sequence_parallel=True`` a reduce-scatter along
    the sequence (g-bar) instead: each rank gets its positions ``(B, T/t, C)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.rank, self.world_size = group_rank_size(group, "VocabParallelEmbedding")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_rank = divisible(num_embeddings, self.world_size, "num_embeddings",
                             "VocabParallelEmbedding")
        self.vocab_start_index = self.rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        nn.init.normal_(self.weight)   # nn.Embedding's initialisation

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, group=None,
                       sequence_parallel: bool = False) -> VocabParallelEmbedding:
        """This rank's block of rows of an existing ``nn.Embedding``."""
        check_plain_embedding(embedding, "VocabParallelEmbedding.from_embedding")
        layer = cls(*embedding.weight.shape, group=group, sequence_parallel=sequence_parallel)
        rows = slice(layer.vocab_start_index, layer.vocab_end_index)
        layer.weight = nn.Parameter(embedding.weight.detach()[rows].clone())
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_token_range(idx, self.num_embeddings, "VocabParallelEmbedding")
        outside = (idx < self.vocab_start_index) | (idx >= self.vocab_end_index)   # (B, T)
        local = (idx - self.vocab_start_index).masked_fill(outside, 0)            # (B, T)
        x = F.embedding(local, self.weight)                                        # (B, T, C)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)   # tokens of other ranks: zero rows
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(x, self.group)   # (B, T/t, C)
        return reduce_from_tensor_model_parallel_region(x, self.group)             # (B, T, C)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start_index} to "
                f"{self.vocab_end_index} on rank {self.rank} of {self.world_size}")
