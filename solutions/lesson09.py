"""Lesson 09, exercises: SyncBatchNorm's forward and backward, and a checkpoint that resumes
bitwise.

Checked by ``course_lib.checks.lesson09.check_syncbn`` and ``check_resume``.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SyncBatchNorm", "capture", "global_stats", "restore"]


def global_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance (C,) of the batch joined over the ranks, and its count."""
    C, dims = x.shape[1], [0, 2, 3]
    stats = torch.cat([torch.tensor([x.numel() / C], dtype=x.dtype),
                       x.sum(dims), (x * x).sum(dims)])       # (1 + 2C,) counts and sums
    dist.all_reduce(stats)                                    # sums over every rank
    n = int(stats[0])
    mean = stats[1:1 + C] / n                                 # (C,) weighted by the counts
    return mean, stats[1 + C:] / n - mean * mean, n           # biased variance: to normalise


class _SyncBN(torch.autograd.Function):
    """y = weight * xhat + bias, xhat = (x - mean) * invstd with the global mean and invstd."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, n):      # x (n_r, C, H, W), this rank's
        C = x.shape[1]
        xhat = (x - mean.view(1, C, 1, 1)) * invstd.view(1, C, 1, 1)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.n = n
        return xhat * weight.view(1, C, 1, 1) + bias.view(1, C, 1, 1)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        C, dims = dy.shape[1], [0, 2, 3]
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)    # (C,) this rank's
        both = torch.cat([sum_dy, sum_dy_xhat])
        dist.all_reduce(both)                                 # every example moved mean, var
        mean_dy = (both[:C] / ctx.n).view(1, C, 1, 1)
        mean_dy_xhat = (both[C:] / ctx.n).view(1, C, 1, 1)
        dx = (weight * invstd).view(1, C, 1, 1) * (dy - mean_dy - xhat * mean_dy_xhat)
        # weight and bias: this rank's share (DDP averages them with every other gradient)
        return dx, sum_dy_xhat, sum_dy, None, None, None


class SyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are those of the global batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)                         # running statistics, no talk
        with torch.no_grad():
            mean, var, n = global_stats(x)
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)   # unbiased, as torch
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBN.apply(x, self.weight, self.bias, mean, invstd, n)


def capture(model: nn.Module, optimizer, scheduler, epoch: int) -> dict:
    """Everything the rest of the run depends on, after ``epoch`` epochs."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "epoch": epoch,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}


def restore(state: dict, model: nn.Module, optimizer, scheduler) -> int:
    """Put ``capture``'s state back; returns the number of epochs done."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["epoch"]
