"""Lesson 03, exercises: a balanced split that gives every device work; devices torch.chunk uses.

Checked by ``course_lib.checks.lesson03``: ``check_balanced_sizes``, ``check_scatter`` (with
``balanced=True``), ``check_split_batch`` and ``check_devices_used``. The names are those the
notebook's exercise cells define (``# EXERCISE: name``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["balanced_scatter", "balanced_sizes", "balanced_split_batch", "devices_used",
           "used_17_over_8", "used_9_over_8"]


def balanced_sizes(B: int, n: int) -> list[int]:
    """Exercise 1: n shard sizes summing to B, each ``B // n`` or ``B // n + 1``."""
    base, extra = divmod(B, n)
    return [base + 1 if i < extra else base for i in range(n)]


def balanced_scatter(tensor: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """Exercise 2: ``tensor`` split along dim 0 in balanced sizes, chunk i on ``devices[i]``."""
    chunks = torch.split(tensor, balanced_sizes(tensor.shape[0], len(devices)))
    return [c.to(d) for c, d in zip(chunks, devices)]       # (B // n or B // n + 1, ...) each


def balanced_split_batch(X: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device]
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Exercise 3: ``split_batch`` that gives every device work: the same sizes for X and y."""
    return balanced_scatter(X, devices), balanced_scatter(y, devices)


def devices_used(B: int, n: int) -> int:
    """Exercise 4: devices that ``torch.chunk`` (so ``comm.scatter``) gives work, B over n."""
    return math.ceil(B / math.ceil(B / n))                   # chunks of ceil(B / n) examples


#: Exercise 4's predictions: chunks of ceil(B / 8) examples until the batch runs out.
used_9_over_8 = devices_used(9, 8)      # chunks of 2: 5 devices
used_17_over_8 = devices_used(17, 8)    # chunks of 3: 6 devices
