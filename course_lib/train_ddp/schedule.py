"""The recipe's optimizer and learning-rate schedule: the rate scaled with the global batch, a
linear warm-up, a cosine down to a floor.

PyTorch counterpart: ``torch.optim.SGD`` and ``torch.optim.lr_scheduler.LambdaLR`` (torchvision's
reference scripts chain ``LinearLR`` and ``CosineAnnealingLR`` to the same effect). Read more:
Goyal et al., "Accurate, Large Minibatch SGD" (2017), for the linear scaling rule and the
warm-up; notebook 08.
"""
from __future__ import annotations

import argparse
import functools
import math

import torch
from torch import nn

from ..distributed import DistInfo

__all__ = ["lr_factor", "make_optimizer"]


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, start: float,
              floor: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (from 0).

    A linear warm-up from ``start`` to 1 over ``warmup_steps``, then a cosine from 1 down to
    ``floor`` at ``total_steps``.
    """
    if step < warmup_steps:
        return start + (1 - start) * step / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_optimizer(model: nn.Module, args: argparse.Namespace, info: DistInfo,
                   steps_per_epoch: int):
    """SGD with momentum and weight decay, a per-step schedule, and the rule applied (text)."""
    k = info.world_size
    scale = {"linear": k, "sqrt": math.sqrt(k), "none": 1}[args.lr_scaling]
    peak = args.lr * scale
    warmup = round(args.warmup_epochs * steps_per_epoch) if scale > 1 else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=peak, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    schedule = functools.partial(lr_factor, total_steps=args.epochs * steps_per_epoch,
                                 warmup_steps=warmup, start=1 / scale, floor=args.lrf)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rule = (f"global batch {k * args.batch_size} = {k} rank(s) x {args.batch_size}; learning "
            f"rate {args.lr:g} x {scale:.3g} = {peak:.4g} ({args.lr_scaling} scaling rule: "
            f"--lr is one process's rate for --batch-size examples)")
    if warmup:
        rule += f", linear warm-up from {args.lr:g} over {warmup} step(s)"
    rule += f", cosine down to {peak * args.lrf:.3g}"
    return optimizer, scheduler, rule
