"""``replicate``: one copy of a module per device, with differentiable parameters.

PyTorch counterpart: ``torch.nn.parallel.replicate`` (read ``torch/nn/parallel/replicate.py``).
Source: d2l's "Concise Implementation for Multiple GPUs" chapter; lesson 05.

Unlike torch's, it also works with *logical* devices on a CPU-only machine
(``course_lib.devices.devices(2)`` is ``[cpu, cpu]``): every replica but the first owns copies.

How the replicas relate to the module (the same rules as torch's ``replicate``):

- Parameters: replica j's parameters are differentiable copies of the module's (replica 0 on the
  module's own device holds views of them, the others real copies), so ``backward`` through the
  replicas sums every replica's gradient into the module's ``.grad``. For a model without
  batch norm (or in ``eval()`` mode) the gradients equal those of the plain module on the whole
  batch.
- Buffers (batch-norm running statistics): copied without gradient. Replica 0 on the module's own
  device holds the module's very buffer tensors, so its in-place updates land on the module; the
  other replicas update copies that are thrown away after the step.

Two consequences, as with ``nn.DataParallel``: in ``train()`` mode each replica's batch norm
normalizes with the mean and variance of *its own shard*, so the outputs and gradients differ
from the plain module on the whole batch (``nn.SyncBatchNorm`` is the fix, in the multi-process
lessons); and the running statistics track only the shard of replica 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..devices import Device, as_device

__all__ = ["replicate"]


def _copy_param(p: torch.Tensor, j: int, device: torch.device) -> torch.Tensor:
    """Replica j's copy of parameter ``p``: differentiable, so gradients flow back to ``p``."""
    if j == 0 and device == p.device:
        return p.view_as(p)                 # no copy: a view of the module's own parameter
    return p.to(device, copy=True)          # a real copy, even on a repeated (logical) device


def _copy_buffer(b: torch.Tensor, j: int, device: torch.device) -> torch.Tensor:
    """Replica j's copy of buffer ``b``: replica 0 on ``b``'s device shares it, others copy."""
    if j == 0 and device == b.device:
        return b                            # the module's own tensor: updates land on the module
    return b.detach().to(device, copy=True)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing everything but its parameter, buffer and child tables.

    Forward hooks are shared too, so a hook on the module also fires on every replica.
    (``nn.Module._replicate_for_data_parallel`` does the same.)
    """
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = {}                # the copies become plain attributes (not leaves)
    replica._buffers = replica._buffers.copy()
    replica._modules = replica._modules.copy()
    replica._is_replica = True              # torch's flag: zero_grad() on a replica warns
    return replica


def replicate(module: nn.Module, devices: Sequence[Device]) -> list[nn.Module]:
    """One copy of ``module`` per device whose parameters are differentiable copies of its own.

    Backward through any replica accumulates gradients into ``module``'s parameters. Replica 0
    shares the module's parameters (as views) and buffers when ``devices[0]`` is the module's
    device; the other replicas own copies, also when a device is repeated (logical CPU devices).
    See the module docstring for what this means for batch norm.

    Args:
        module: the network to copy (left unchanged).
        devices: one device per replica; ints are GPU indices; repeats allowed.

    Returns:
        ``[replica_0, ..., replica_{k-1}]``, replica j on ``devices[j]``.
    """
    devices = [as_device(d) for d in devices]
    if not devices:
        raise ValueError("replicate needs at least one device, got an empty list.")
    params = list(module.parameters())       # each shared parameter once
    buffers = list(module.buffers())
    param_copies = {id(p): [_copy_param(p, j, d) for j, d in enumerate(devices)] for p in params}
    buffer_copies = {id(b): [_copy_buffer(b, j, d) for j, d in enumerate(devices)]
                     for b in buffers}

    modules = list(module.modules())          # each shared submodule once, root first
    index = {id(m): i for i, m in enumerate(modules)}
    copies = [[_shallow_copy(m) for m in modules] for _ in devices]  # copies[j][i]
    for i, m in enumerate(modules):
        for j in range(len(devices)):
            replica = copies[j][i]
            for name, child in m._modules.items():
                replica._modules[name] = None if child is None else copies[j][index[id(child)]]
            for name, p in m._parameters.items():
                if p is None:
                    replica._parameters[name] = None
                else:
                    setattr(replica, name, param_copies[id(p)][j])  # a plain tensor attribute
            for name, b in m._buffers.items():
                replica._buffers[name] = None if b is None else buffer_copies[id(b)][j]
    return [copies[j][0] for j in range(len(devices))]
