"""Lesson 03, exercises: the devices torch.chunk uses; ``split_batch`` with torch's chunks; a
balanced split that gives every device work.

Checked by ``course_lib.checks.lesson03``: ``check_split_batch`` (``sizes="chunk"`` for
``split_batch``, ``"balanced"`` for ``balanced_split_batch``), ``check_balanced_sizes`` and
``check_devices_used``. The names are those the notebook's exercise cells define
(``# EXERCISE: name``), except ``balanced_scatter``: a helper of ``balanced_split_batch`` that
the notebook does not ask for (the tests judge it with ``check_scatter(balanced=True)``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["balanced_scatter", "balanced_sizes", "balanced_split_batch", "devices_used",
           "split_batch", "used_17_over_8", "used_5_over_4", "used_9_over_8"]


def split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Exercise 2: X and y cut alike by ``torch.chunk`` along dim 0, shard i on ``devices[i]``.

    The chunks of ``nn.parallel.scatter`` on any device list (it refuses the CPU). There may be
    fewer shards than devices: ``torch.chunk`` stops when the batch runs out.
    """
    n = len(devices)
    X_shards = [c.to(d) for c, d in zip(torch.chunk(X, n), devices)]   # (ceil(B/n), ...) each
    y_shards = [c.to(d) for c, d in zip(torch.chunk(y, n), devices)]   # the same sizes
    return X_shards, y_shards


def balanced_sizes(B: int, n: int) -> list[int]:
    """Exercise 3: n shard sizes summing to B, each ``B // n`` or ``B // n + 1``."""
    base, extra = divmod(B, n)
    return [base + 1 if i < extra else base for i in range(n)]


def balanced_scatter(tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """A helper for exercise 4: ``tensor`` cut along dim 0 in balanced sizes, chunk i on
    ``devices[i]`` (``torch.tensor_split(tensor, n)`` gives the same sizes)."""
    chunks = torch.split(tensor, balanced_sizes(tensor.shape[0], len(devices)))
    return [c.to(d) for c, d in zip(chunks, devices)]       # (B // n or B // n + 1, ...) each


def balanced_split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device]
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Exercise 4: ``split_batch`` that gives every device work: the same sizes for X and y."""
    return balanced_scatter(X, devices), balanced_scatter(y, devices)


def devices_used(B: int, n: int) -> int:
    """Exercises 1 and 5: devices that ``torch.chunk`` (``comm.scatter``) gives work, B over n."""
    return math.ceil(B / math.ceil(B / n))                   # chunks of ceil(B / n) examples


#: Exercise 1's prediction: chunks of ceil(5 / 4) = 2 examples, so 2, 2, 1.
used_5_over_4 = devices_used(5, 4)      # 3 devices

#: Exercise 5's predictions: chunks of ceil(B / 8) examples until the batch runs out.
used_9_over_8 = devices_used(9, 8)      # chunks of 2: 5 devices
used_17_over_8 = devices_used(17, 8)    # chunks of 3: 6 devices
