"""The cross-entropy of vocabulary-sharded logits, without ever gathering them.

PyTorch counterpart: ``torch.distributed.tensor.parallel.loss_parallel`` (DTensor logits sharded
on the class dimension); Megatron's ``vocab_parallel_cross_entropy``
(``megatron/core/tensor_parallel/cross_entropy.py``). Read more: notebook 14.

For one position with logits z over the vocabulary and target y,
``loss = log(sum_j exp(z_j - m)) - (z_y - m)`` with m the largest logit. Each rank holds a block
of z: three all-reduces of one number per position give m (max), sum_j exp(z_j - m) and z_y
(sums), instead of one all-gather of V numbers per position. Autograd differentiates through
the sums (g: identity backward, the loss being the same on every rank); m is a constant shift.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import check_logits_targets, group_rank_size
from .mappings import reduce_from_tensor_model_parallel_region

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, *,
                                 group=None) -> torch.Tensor:
    """``F.cross_entropy`` (mean over positions) of the full logits, from this rank's block.

    Args:
        logits_shard: ``(..., V / t)``, this rank's block of the vocabulary (rank r holds classes
            ``r * V / t`` to ``(r + 1) * V / t``, as a ``ColumnParallelLinear`` head gives).
        targets: ``(...)`` class ids in ``[0, V)``, the same on every rank.
        group: the tensor-parallel group (default: the whole world).

    Returns:
        The mean loss, a scalar, the same on every rank; its gradient reaches ``logits_shard``.
    """
    rank, world = group_rank_size(group, "vocab_parallel_cross_entropy")
    per_rank = logits_shard.shape[-1]
    check_logits_targets(logits_shard, targets, per_rank * world, "vocab_parallel_cross_entropy")

    # 1. the largest logit over the whole vocabulary: a shift for stability, no gradient
    logits_max = logits_shard.detach().amax(dim=-1)                       # (...)
    if world > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits_shard - logits_max.unsqueeze(-1)                     # (..., V/t)

    # 2. the target's logit: the one rank whose block holds the target contributes it
    start = rank * per_rank
    here = (targets >= start) & (targets < start + per_rank)              # (...)
    local = (targets - start).masked_fill(~here, 0)                       # (...)
    target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)    # (...)
    target_logit = target_logit.masked_fill(~here, 0.0)
    target_logit = reduce_from_tensor_model_parallel_region(target_logit, group)

    # 3. the softmax's denominator: every rank's sum of exponentials, added
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1), group)

    return (sum_exp.log() - target_logit).mean()
