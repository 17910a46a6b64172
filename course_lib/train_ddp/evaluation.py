"""Evaluation over ranks: exact (every test example counted once) and the popular padded count.

PyTorch counterpart: none in torch itself; the ImageNet example (github.com/pytorch/examples,
``imagenet/main.py``) evaluates with a ``DistributedSampler`` and then an auxiliary loader for
the examples it left out. Read more: notebook 08, and ``DistributedSampler``'s padding in
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler.

Both evaluate rank 0's model: DDP broadcasts buffers (BatchNorm's running statistics) only at
the start of a forward, so after the last training step every rank holds its own running
statistics; they are broadcast from rank 0 first, as DDP's next forward would, so that the
accuracy is the one of the model rank 0 saves in the checkpoint.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from .model import unwrap
from .sharding import _as_input

__all__ = ["EvalResult", "broadcast_buffers", "evaluate_exact", "evaluate_padded"]


class EvalResult(NamedTuple):
    """Correct predictions and examples counted, summed over the ranks."""

    correct: int
    count: int

    @property
    def accuracy(self) -> float:
        """``correct / count``."""
        return self.correct / self.count


@torch.no_grad()
def _count_correct(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                   device: torch.device) -> tuple[int, int]:
    """(correct, examples) of ``model`` on X, y, in batches, on this rank only."""
    correct = 0
    for start in range(0, len(y), batch_size):
        Xb = _as_input(X[start:start + batch_size], device)            # (B, 1, 28, 28)
        yb = y[start:start + batch_size].to(device)
        correct += int((model(Xb).argmax(dim=1) == yb).sum())
    return correct, len(y)


def _sum_over_ranks(correct: int, count: int, device: torch.device) -> EvalResult:
    t = torch.tensor([correct, count], dtype=torch.int64, device=device)  # integers: exact
    if dist.is_initialized():
        dist.all_reduce(t)
    return EvalResult(int(t[0]), int(t[1]))


@torch.no_grad()
def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """Give every rank the buffers of rank ``src`` (running statistics, batch counters).

    What torch's DDP does before each forward (``broadcast_buffers=True``); after the last
    step nothing has done it yet. A no-op without a process group or with one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for buffer in unwrap(model).buffers():
        dist.broadcast(buffer, src=src)


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Rank 0's model (its buffers broadcast), unwrapped, in eval mode; its mode restored after.

    Unwrapped: DDP's forward may communicate, and here the shards may differ in size.
    """
    module = unwrap(model)
    broadcast_buffers(module)
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def evaluate_exact(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                   device: torch.device) -> EvalResult:
    """Accuracy of rank 0's model over X, y, every example counted exactly once (any k).

    Rank 0's buffers are broadcast first (``broadcast_buffers``): a BatchNorm model is scored
    with the running statistics of the model the checkpoint stores, on every rank. Then rank r
    takes examples r, r+k, r+2k, ... (shards differ by at most one, no padding); the
    (correct, count) pairs are all-reduced as integers. ``.accuracy`` is the test accuracy.
    A collective: every rank calls it.
    """
    rank, k = _rank_and_world()
    with _evaluating(model) as net:
        correct, count = _count_correct(net, X[rank::k], y[rank::k], batch_size, device)
    return _sum_over_ranks(correct, count, device)


def evaluate_padded(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                    device: torch.device) -> EvalResult:
    """The popular, slightly wrong value: a ``DistributedSampler`` over the test set.

    The sampler pads the data with repeated examples so that every rank gets ceil(N / k):
    ``count`` is ``sampler.total_size`` (> N when k does not divide N), and the repeated
    examples are counted twice. Shown beside ``evaluate_exact`` to see by how much it errs.
    Rank 0's model is evaluated (its buffers broadcast first), as by ``evaluate_exact``.
    """
    rank, k = _rank_and_world()
    sampler = DistributedSampler(TensorDataset(X, y), num_replicas=k, rank=rank, shuffle=False)
    idx = torch.tensor(list(sampler), dtype=torch.int64)                # (total_size // k,)
    with _evaluating(model) as net:
        correct, count = _count_correct(net, X[idx], y[idx], batch_size, device)
    return _sum_over_ranks(correct, count, device)
