"""Lesson 14, exercises: tensor parallelism in Megatron-LM's style, in four steps.

1. ``f`` and ``g``: Megatron's conjugate operations, each a ``torch.autograd.Function``: f the
   identity forward and an all-reduce (sum) of the gradient backward, g an all-reduce (sum)
   forward and the identity backward (``check_conjugates``; the notebook's ``my_conjugate.py``);
2. ``ColumnParallelLinear`` and ``RowParallelLinear``: an existing ``nn.Linear`` split over the
   ranks by output features (rows of its weight) and by input features (columns of its weight),
   with f before the column-parallel product and g after the row-parallel one, the row-parallel
   bias added once, after g (``check_parallel_linears``; ``my_linears.py``);
3. ``parallel_mlp``: a GPT MLP with ``fc`` column-parallel and ``proj`` row-parallel, nothing
   between them: one all-reduce forward, one backward (``check_megatron_mlp``; ``my_mlp.py``);
4. ``vocab_parallel_cross_entropy``: the cross-entropy of logits split over the ranks by
   vocabulary, without gathering them: the largest logit (all-reduce MAX, no gradient), the sum
   of exponentials and the target's logit (one rank holds it, the others add 0), both summed
   through g; three all-reduces of one number per position (``check_vocab_parallel_cross_entropy``;
   ``my_loss.py``, which imports g from ``my_conjugate``).

In the notebook they are four files, each importing what it uses from the ones before (``from
my_conjugate import f, g``); here they are one module, so f and g are defined above the layers
that use them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ColumnParallelLinear", "Copy", "Reduce", "RowParallelLinear", "f", "g",
           "parallel_mlp", "vocab_parallel_cross_entropy"]


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


# ---- my_loss.py (from my_conjugate import g) ---------------------------------------------------

def vocab_parallel_cross_entropy(logits_shard, targets, group=None):
    """The mean cross-entropy (``F.cross_entropy``) of the full logits, from this rank's block
    ``logits_shard`` (..., V/t) of the vocabulary (rank r: classes r*V/t to (r+1)*V/t) and the
    targets (...), ids in [0, V), the same on every rank. A scalar, the same on every rank;
    its gradient reaches ``logits_shard``. Per position, loss = log(sum_j exp(z_j - m)) -
    (z_y - m), with m the largest logit."""
    rank = dist.get_rank(group)
    per = logits_shard.shape[-1]
    start = rank * per
    m = logits_shard.detach().amax(dim=-1)                     # (...): a shift, no gradient
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)      # the largest of the vocabulary
    shifted = logits_shard - m.unsqueeze(-1)                   # (..., V/t), every one <= 0
    sum_exp = g(shifted.exp().sum(dim=-1), group)              # (...): every block's part
    here = (targets >= start) & (targets < start + per)        # (...): the target is mine
    local = (targets - start).masked_fill(~here, 0)            # an index in my block
    target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~here, 0.0)
    target = g(target, group)                                  # (...): from the one rank
    return (sum_exp.log() - target).mean()
