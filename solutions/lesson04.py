"""Lesson 04, exercises: one data-parallel SGD step written by hand, and the numbers of the
scaling questions.

Checked by ``course_lib.checks.lesson04`` (``check_train_batch``, ``check_lr_for_shard_means``,
``check_shard_mean_weights``, ``check_scaled_batch``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from course_lib.models.lenet import lenet, sgd
from course_lib.parallel.comm import allreduce, split_batch

__all__ = ["lr_for_shard_means", "scaled_batch", "shard_mean_weights", "train_batch"]


def train_batch(X: torch.Tensor, y: torch.Tensor, device_params: Sequence[list[torch.Tensor]],
                devices: Sequence[torch.device], lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of data-parallel SGD on LeNet, the devices in turn (no threads)."""
    B = y.shape[0]
    X_shards, y_shards = split_batch(X, y, devices)     # shard i on devices[i]; maybe fewer
    loss, correct = 0.0, 0
    for params in device_params:
        for p in params:
            p.grad = torch.zeros_like(p)                # a device without a shard adds zeros
    for Xi, yi, params in zip(X_shards, y_shards, device_params):
        y_hat = lenet(Xi, params)                       # (B_i, 10) on devices[i]
        shard_loss = F.cross_entropy(y_hat, yi, reduction="sum") / B  # its share of the mean
        shard_loss.backward()
        loss = loss + shard_loss.detach().to(devices[0])
        correct = correct + (y_hat.argmax(dim=1) == yi).sum().to(devices[0])
    for grads in zip(*[[p.grad for p in params] for params in device_params]):
        allreduce(list(grads))                          # every replica: the whole gradient
    for params in device_params:
        sgd(params, lr)                                 # the same step everywhere
    return loss, correct


def lr_for_shard_means(k: int, lr: float) -> float:
    """The allreduce adds k shard means (each about the batch mean): divide lr by k."""
    return lr / k


def shard_mean_weights(sizes: tuple[int, ...]) -> list[float]:
    """Averaging k shard means: an example of a shard of n counts 1/(k n), B/(k n) times 1/B."""
    k, B = len(sizes), sum(sizes)
    return [B / (k * n) for n in sizes]


def scaled_batch(per_device: int, k: int, base_lr: float,
                 num_examples: int = 60000) -> tuple[int, float, int]:
    """(global batch, linearly scaled lr, steps per epoch) on k devices."""
    global_batch = per_device * k
    return global_batch, base_lr * k, -(-num_examples // global_batch)
