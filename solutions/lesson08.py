"""Lesson 08, exercises: this rank's shard of an epoch, and the exact accuracy of a whole
evaluation set computed by every rank.

Checked by ``course_lib.checks.lesson08.check_epoch_shards`` and ``check_exact_accuracy``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["epoch_shard", "exact_accuracy"]


def exact_accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` on all of X, y, every example counted once whatever the world size.

    Every rank is given the whole set and evaluates its stride X[rank::k] (the shards differ by
    at most one example, and nothing is padded); the integer pair (correct, count) is summed
    over the ranks, so every rank returns the same, exact number.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    X_mine, y_mine = X[rank::world], y[rank::world]                 # (about N / k, ...)
    with torch.no_grad():
        correct = int((model(X_mine).argmax(dim=1) == y_mine).sum())
    counts = torch.tensor([correct, len(y_mine)], dtype=torch.int64)  # integers: exact
    dist.all_reduce(counts)                                           # sums over the ranks
    return counts[0].item() / counts[1].item()


def epoch_shard(n: int, rank: int, world_size: int, epoch: int, seed: int = 0) -> list[int]:
    """The indices of ``range(n)`` rank ``rank`` trains on in ``epoch``, as a
    ``DistributedSampler`` gives them after ``set_epoch(epoch)``.

    One permutation per epoch, drawn from ``seed + epoch`` (the same on every rank, a new one
    every epoch), padded to a multiple of ``world_size`` by repeating it from its start (as
    torch does, also when the padding is longer than the data), then every ``world_size``-th
    index from ``rank`` on.
    """
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()            # the same on every rank
    total = -(-n // world_size) * world_size                  # ceil(n / k) * k
    order = [perm[i % n] for i in range(total)]               # pad from the start, cyclically
    return order[rank::world_size]                            # every k-th, from position rank
