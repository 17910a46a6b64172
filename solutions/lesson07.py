"""Lesson 07, exercise: average every gradient over the ranks, in place.

Checked by ``course_lib.checks.lesson07.check_average_gradients``.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

__all__ = ["average_gradients"]


def average_gradients(model: nn.Module) -> None:
    """After ``loss.backward()``: make every ``p.grad`` the average over the ranks, in place.

    Parameters without a gradient (frozen ones) are skipped. This is DDP's "naive" strategy,
    one blocking all-reduce per parameter after backward.
    """
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # in place: every rank gets the sum
        p.grad /= world_size                           # in place: the average
