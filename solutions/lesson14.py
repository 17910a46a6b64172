"""Lesson 14, exercises: tensor parallelism in Megatron-LM's style, in three steps.

1. ``f`` and ``g``: Megatron's conjugate operations, each a ``torch.autograd.Function``: f the
   identity forward and an all-reduce (sum) of the gradient backward, g an all-reduce (sum)
   forward and the identity backward (``check_conjugates``; the notebook's ``my_conjugate.py``);
2. ``ColumnParallelLinear`` and ``RowParallelLinear``: an existing ``nn.Linear`` split over the
   ranks by output features (rows of its weight) and by input features (columns of its weight),
   with f before the column-parallel product and g after the row-parallel one, the row-parallel
   bias added once, after g (``check_parallel_linears``; ``my_linears.py``);
3. ``parallel_mlp``: a GPT MLP with ``fc`` column-parallel and ``proj`` row-parallel, nothing
   between them: one all-reduce forward, one backward (``check_megatron_mlp``; ``my_mlp.py``).

In the notebook they are three files, each importing the one before (``from my_conjugate import
f, g``); here they are one module, so f and g are defined above the layers that use them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ColumnParallelLinear", "Copy", "Reduce", "RowParallelLinear", "f", "g",
           "parallel_mlp"]


# ---- my_conjugate.py ---------------------------------------------------------------------------

class Copy(torch.autograd.Function):
    """f: identity forward; backward, the gradient summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)           # the same values; a new tensor for autograd

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()           # never overwrite a tensor autograd handed us
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None             # no gradient for the group


class Reduce(torch.autograd.Function):
    """g: forward, the sum over the group; backward, the gradient passed through."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()                 # all_reduce writes in place: not into x, autograd may need it
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group=None):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""
    return Copy.apply(x, group)


def g(x, group=None):
    """Megatron's g: all-reduce (sum) forward, identity backward."""
    return Reduce.apply(x, group)


# ---- my_linears.py (from my_conjugate import f, g) ---------------------------------------------

def _block(size: int, group, what: str, layer: str) -> slice:
    """This rank's block of ``size`` items: ``rank * size / t`` to ``(rank + 1) * size / t``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if size % world:
        raise ValueError(f"{layer}: {what} = {size} is not divisible by the world size {world}, "
                         "so the ranks cannot hold equal blocks.")
    per = size // world
    return slice(rank * per, (rank + 1) * per)


class ColumnParallelLinear(nn.Module):
    """``linear`` split by output features: this rank keeps its block of rows of the weight."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        out_features, _ = linear.weight.shape
        rows = _block(out_features, group, "out_features", "ColumnParallelLinear")
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())        # (out/t, in)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach()[rows].clone())                    # (out/t,)

    def forward(self, x):                                   # (..., in), the same on every rank
        return F.linear(f(x, self.group), self.weight, self.bias)   # (..., out/t): my features


class RowParallelLinear(nn.Module):
    """``linear`` split by input features: this rank keeps its block of columns of the weight
    and the whole bias."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        _, in_features = linear.weight.shape
        cols = _block(in_features, group, "in_features", "RowParallelLinear")
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())     # (out, in/t)
        self.bias = None if linear.bias is None else \
            nn.Parameter(linear.bias.detach().clone())                          # (out,)

    def forward(self, x):                                   # (..., in/t): my block of features
        y = g(F.linear(x, self.weight), self.group)         # (..., out): the sum of the parts
        return y if self.bias is None else y + self.bias    # the bias once, after the sum


# ---- my_mlp.py (from my_linears import ColumnParallelLinear, RowParallelLinear) ----------------

def parallel_mlp(mlp, group=None):
    """The Megatron MLP, in place: ``fc`` column-parallel, ``proj`` row-parallel; its forward
    (``proj(gelu(fc(x)))``) is unchanged."""
    mlp.fc = ColumnParallelLinear(mlp.fc, group)     # (B, T, C) -> (B, T, 4C/t)
    mlp.proj = RowParallelLinear(mlp.proj, group)    # (B, T, 4C/t) -> (B, T, C)
    return mlp
