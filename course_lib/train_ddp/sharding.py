"""Each rank's share of the training data: a ``DistributedSampler``, or sharding by hand.

PyTorch counterpart: ``torch.utils.data.DistributedSampler`` (``set_epoch`` every epoch);
``StridedShards`` is the same idea without a DataLoader. Read more:
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler and
notebook 08.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..data import load_fashion_mnist
from ..distributed import DistInfo

__all__ = ["StridedShards", "load_data", "make_loader"]


def _as_input(X: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Images as the model takes them: float in [0, 1] on ``device`` (uint8 is scaled here)."""
    X = X.to(device, non_blocking=True)
    return X.float().div_(255) if X.dtype == torch.uint8 else X


class StridedShards:
    """Sharding by hand, without a DataLoader: rank r takes examples r, r+k, r+2k, ...

    Each epoch every rank draws the same permutation (seeded with ``seed + epoch``), drops the
    last ``N % k`` examples so that every rank takes the same number of steps (a rank with one
    step more would wait forever in DDP's all-reduce), and takes its stride of what is left.

    Args:
        X: uint8 or float images (N, 1, 28, 28); y: labels (N,).
        batch_size: examples per rank per step.
        rank, world_size: this rank, and k.
        seed: the shuffle's seed (the same on every rank).
    """

    def __init__(self, X: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int,
                 world_size: int, seed: int = 0):
        if len(y) < world_size:
            raise ValueError(f"StridedShards: {len(y)} examples cannot give each of "
                             f"{world_size} ranks one; use more examples or fewer ranks.")
        self.X, self.y, self.batch_size = X, y, batch_size
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation (call it every epoch, as with a DistributedSampler)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil((len(self.y) // self.world_size) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.y), generator=g)
        usable = len(order) - len(order) % self.world_size
        mine = order[:usable][self.rank::self.world_size]                # (N // k,)
        for start in range(0, len(mine), self.batch_size):
            idx = mine[start:start + self.batch_size]
            yield self.X[idx], self.y[idx]                                # (B, 1, 28, 28), (B,)


def make_loader(X: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, info: DistInfo
                ) -> tuple[Iterable, DistributedSampler | StridedShards]:
    """This rank's training batches, and the object whose ``set_epoch`` reshuffles them."""
    if args.sharding == "strided":
        shards = StridedShards(X, y, args.batch_size, info.rank, info.world_size, args.seed)
        return shards, shards
    dataset = TensorDataset(X, y)
    # drop_last=False: the sampler pads with repeated examples so that every rank gets
    # ceil(N / k) of them, hence the same number of steps.
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                 shuffle=True, seed=args.seed, drop_last=False)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler), sampler


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """(X_train, y_train, X_test, y_test): uint8 images (N, 1, 28, 28), int64 labels (N,).

    ``--train-samples`` / ``--test-samples`` take the first N examples; asking for more than
    the set holds is an error (not silently fewer).
    """
    train_iter, test_iter = load_fashion_mnist(args.batch_size, quick=False, seed=args.seed)
    for flag, n, have in (("--train-samples", args.train_samples, len(train_iter.y)),
                          ("--test-samples", args.test_samples, len(test_iter.y))):
        if n is not None and n > have:
            raise ValueError(f"{flag} {n}: the set has only {have} examples; pass at most "
                             f"{have}, or leave {flag} out to take them all.")
    n_train, n_test = args.train_samples, args.test_samples
    return (train_iter.X[:n_train], train_iter.y[:n_train],
            test_iter.X[:n_test], test_iter.y[:n_test])
