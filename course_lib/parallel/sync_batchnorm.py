"""SyncBatchNorm from scratch: batch statistics over the global batch, shared with ``all_reduce``.

PyTorch counterpart: ``torch.nn.SyncBatchNorm`` (torch/nn/modules/batchnorm.py, its autograd
function in torch/nn/modules/_functions.py), which refuses CPU tensors; this one works on gloo.
Read more: the SyncBatchNorm docs (https://pytorch.org/docs/stable/generated/torch.nn.
SyncBatchNorm.html), Ioffe & Szegedy (2015) for the batch-norm gradient, and notebook 07.

With data parallelism each rank sees only its shard of the batch, so a plain ``BatchNorm2d``
normalises with the shard's mean and variance. ``SyncBatchNorm`` normalises with the statistics
of the global batch instead, in two collectives per layer:

- forward: all-gather each rank's count, and each channel's mean and centred sum of squares,
  and combine them weighted by the counts: shards may have different sizes, and a plain mean of
  means would weigh a small shard too much. (Sums of x and x^2 would be simpler, but lose every
  digit of the variance when the mean is large against the spread.)
- backward: all-reduce each channel's ``sum(dy)`` and ``sum(dy * xhat)``: every example of the
  global batch moved the mean and variance, so every one contributes to every input gradient.

The weight and bias gradients stay this rank's share (sums over its shard), as in torch:
DistributedDataParallel averages them with all the other gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ._sync_batchnorm_checks import check_same_channels

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "global_batch_stats"]


def _channel_sums(t: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of a (N, C, *) tensor: (C,)."""
    return t.sum(dim=[d for d in range(t.dim()) if d != 1])


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...): broadcastable against ``like`` (N, C, *)."""
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


def global_batch_stats(x: torch.Tensor, group: dist.ProcessGroup | None
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean, biased variance (both (C,)) and example count of the batch joined over all ranks.

    Each rank sends its count n_r, mean m_r and centred sum of squares M2_r = sum (x - m_r)^2
    per channel (one all-gather of 1 + 2C numbers); they combine exactly (Chan's parallel
    variance): mean = sum n_r m_r / n, M2 = sum (M2_r + n_r (m_r - mean)^2), var = M2 / n.
    Not E[x^2] - E[x]^2: with a mean of 100 and a spread of 0.05 that is 10000.0025 - 10000,
    of which float32 (about 7 digits) keeps about one correct digit. torch's SyncBatchNorm
    all-gathers each rank's count, mean and invstd and combines them the same way
    (``batch_norm_gather_stats_with_counts``).
    """
    C, world = x.shape[1], dist.get_world_size(group)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x.detach().to(acc)                                        # (N, C, *)
    n_r = x.numel() // max(C, 1)                                   # examples per channel here
    if n_r > 0:
        var_r, mean_r = torch.var_mean(xa, dim=[d for d in range(x.dim()) if d != 1],
                                       correction=0)               # (C,), (C,) centred
    else:                                      # an empty shard still joins the collective
        var_r = mean_r = xa.new_zeros(C)
    mine = torch.cat([xa.new_full((1,), n_r), mean_r, var_r * n_r]).double()  # (1 + 2C,)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    counts, means, m2s = torch.stack(every).split([1, C, C], dim=1)  # (W, 1), (W, C), (W, C)
    n = int(counts.sum().item())
    if n <= 1:
        raise ValueError(f"SyncBatchNorm expected more than 1 value per channel over the "
                         f"global batch when training, got {n} (input shape on this rank "
                         f"{tuple(x.shape)}). Use a larger batch, or eval mode.")
    mean = (counts * means).sum(dim=0) / n                          # (C,)
    var = (m2s + counts * (means - mean) ** 2).sum(dim=0) / n       # (C,) biased, as BN uses
    return mean.to(x.dtype), var.to(x.dtype), n


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = weight * (x - mean) * invstd + bias, with mean and invstd of the global batch.

    ``mean`` and ``invstd`` come in as constants (computed without autograd); ``backward``
    adds their dependence on x by hand, with statistics of the upstream gradient summed over
    every rank.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)   # (N, C, *)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count, ctx.group = count, group
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight, x) + _per_channel(bias, x)
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        sum_dy = _channel_sums(dy)                                      # (C,) this rank
        sum_dy_xhat = _channel_sums(dy * xhat)                          # (C,) this rank
        dx = dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = sum_dy_xhat.clone()  # this rank's share; DDP averages it with the others
        if weight is not None and ctx.needs_input_grad[2]:
            dbias = sum_dy.clone()
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat])                     # (2C,)
            dist.all_reduce(both, group=ctx.group)                      # sums over every rank
            C = sum_dy.numel()
            mean_dy = _per_channel(both[:C] / ctx.count, dy)
            mean_dy_xhat = _per_channel(both[C:] / ctx.count, dy)
            scale = invstd if weight is None else invstd * weight       # (C,)
            dx = _per_channel(scale, dy) * (dy - mean_dy - xhat * mean_dy_xhat)  # (N, C, *)
        return dx, dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the global batch of all ranks, for inputs (N, C, *).

    A drop-in for ``torch.nn.SyncBatchNorm`` that also runs on gloo and the CPU. In training
    mode inside a process group of two or more ranks, the mean and variance are those of the
    batch joined over the ranks (shards of any sizes), and the running statistics are updated
    with them (the unbiased variance, as torch does). In eval mode it uses the running
    statistics (with ``track_running_stats=False``, this rank's own batch statistics, as torch)
    and never communicates; without a process group (or with one rank) it is a plain
    ``BatchNorm``. In training mode every rank must call it the same number of times: it
    communicates.

    Args:
        num_features: channels C of the input (N, C, *).
        eps: added to the variance before the square root.
        momentum: weight of the new batch in the running statistics (None: cumulative mean).
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics for eval mode.
        process_group: ranks to synchronise over (default: the default group).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: dist.ProcessGroup | None = None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group
        self._channels_checked = False  # every rank's layer has the same C (checked once)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input (N, C, *) with at least 2 "
                             f"dimensions, got shape {tuple(x.shape)}.")
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) expects {self.num_features} "
                             f"channels in dimension 1, got shape {tuple(x.shape)}.")

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (N, C, *) with the global batch's statistics (training mode)."""
        self._check_input_dim(x)
        if not self.training or self._world_size() == 1:
            # Eval mode never communicates, as torch's: running statistics if it tracks them,
            # else this rank's own batch statistics (a rank may evaluate any number of batches).
            return super().forward(x)
        if not self._channels_checked:  # once: a rank whose layer has another C fails clearly
            check_same_channels(self, x, self.process_group)
            self._channels_checked = True
        mean, var, n = global_batch_stats(x, self.process_group)       # (C,), (C,), int
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, n)
        invstd = torch.rsqrt(var + self.eps)                            # (C,)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, mean, invstd, n,
                                            self.process_group)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: int) -> None:
        """Exponential (or, with momentum None, cumulative) average, unbiased variance."""
        self.num_batches_tracked.add_(1)
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - m).add_(mean, alpha=m)
        self.running_var.mul_(1 - m).add_(var * n / (n - 1), alpha=m)


def convert_sync_batchnorm(module: nn.Module,
                           process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` (recursively) by a ``SyncBatchNorm``.

    As torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``: children are replaced in place,
    and each new layer takes over the old one's parameters and buffers (the same tensors,
    so an optimizer built before still updates them) and its train/eval mode.

    Args:
        module: a model, or a single BatchNorm layer.
        process_group: the group the new layers synchronise over (default: the default group).

    Returns:
        ``module`` with its BatchNorm layers converted (a new object if it was one itself).
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats, process_group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
