"""``recalibrate_batch_norm`` (lesson 05), beside ``course_lib.train``, which re-exports it: a
model's batch-norm running statistics recomputed for its current weights ("precise BN").

PyTorch counterpart: ``torch.optim.swa_utils.update_bn`` (the same cumulative average; this one
also restores each layer's momentum and mode, and the old statistics if interrupted).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .devices import Device

__all__ = ["recalibrate_batch_norm"]


def recalibrate_batch_norm(net: nn.Module, batches: Iterable, device: Device | None = None
                           ) -> nn.Module:
    """Recompute every batch-norm layer's running statistics with the current weights.

    During training the running mean and variance follow the weights with momentum 0.1, so
    after few steps they still describe earlier weights, and ``eval()`` mode suffers. This runs
    the model over ``batches`` in train mode without gradients, with ``momentum=None`` (the
    cumulative average over the batches), then restores each layer's momentum. Parameters do
    not change. Known as "precise BN" (Wu and Johnson, 2021, "Rethinking batch in BatchNorm").

    Args:
        net: the model (its running statistics change; returned in the mode it came in).
        batches: ``(X, y)`` batches, typically training data.
        device: where to move each X (None: leave it where it is).

    Returns:
        ``net``.
    """
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    was_training = net.training
    saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
             for m in norms if m.track_running_stats]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: every batch weighs the same
    net.train()
    done = False
    try:
        with torch.no_grad():
            for X, _ in batches:
                net(X if device is None else X.to(device))
        done = True
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        net.train(was_training)
        if not done:  # interrupted: put the previous statistics back, not half-computed ones
            tracked = [m for m in norms if m.track_running_stats]
            for m, (mean, var, count) in zip(tracked, saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)
    return net
