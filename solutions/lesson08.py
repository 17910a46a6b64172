"""Lesson 08, exercises: this rank's shard of an epoch, the per-rank entry point of a DDP
training script, and the exact accuracy of a whole evaluation set computed by every rank.

Checked by ``course_lib.checks.lesson08.check_epoch_shards``, ``check_recipe_entry`` and
``check_exact_accuracy``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["epoch_shard", "exact_accuracy", "train"]


def exact_accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` (in eval mode, then put back in its own mode) on all of X, y, every example counted once whatever
    the world size.

    Every rank is given the whole set and evaluates its stride X[rank::k] (the shards differ by
    at most one example, and nothing is padded); the integer pair (correct, count) is summed
    over the ranks, so every rank returns the same, exact number.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    X_mine, y_mine = X[rank::world], y[rank::world]                 # (about N / k, ...)
    was_training = model.training
    model.eval()                                                    # Dropout off, BatchNorm's
    try:                                                            # running statistics
        with torch.no_grad():
            correct = int((model(X_mine).argmax(dim=1) == y_mine).sum())
    finally:
        model.train(was_training)                                   # the mode it arrived in
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


def train(model: nn.Module, dataset: Dataset, epochs: int, batch_size: int,
          lr: float) -> nn.Module:
    """Every rank's entry point, started by a launcher that set RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT (as torchrun does): join the group, train on this rank's shard with a new
    shuffle every epoch and DDP's averaged gradients, print on rank 0 only, leave the group.
    """
    dist.init_process_group("gloo")                       # reads the launcher's variables
    try:
        rank = dist.get_rank()
        sampler = DistributedSampler(dataset)             # this rank's share, shuffled
        batches = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        ddp = DDP(model)                                  # averages gradients at every step
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)                      # a new order, the same on every rank
            total = 0.0
            for X, y in batches:
                loss = F.cross_entropy(ddp(X), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.item()
            if rank == 0:                                 # one line per epoch, not k
                print(f"epoch {epoch}: mean loss {total / len(batches):.4f} (rank 0's shard)")
        return model
    finally:
        dist.destroy_process_group()                      # also when training fails
