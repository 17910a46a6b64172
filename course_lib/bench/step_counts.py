"""What one training step launches and sends: kernels counted at dispatch, gradient buckets as
torch's DDP reducer groups them. Lesson 10 feeds both to its projection.

PyTorch counterparts: ``torch.profiler`` lists the kernels a step really runs on a GPU (this
counts operations on any device, about one kernel each); the bucketing is torch's own
``dist._compute_bucket_assignment_by_size``, called as ``DistributedDataParallel`` calls it
(``_ddp_init_helper`` in ``torch/nn/parallel/distributed.py``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountKernels", "kernels_per_step", "nbytes", "torch_bucket_bytes"]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` together."""
    return sum(t.numel() * t.element_size() for t in tensors)


class CountKernels(TorchDispatchMode):
    """Counts the operations that compute, about one kernel launch each; views only relabel
    memory and are not counted."""

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in func._schema.returns)
        self.kernels += not view
        return func(*args, **(kwargs or {}))


def kernels_per_step(net: nn.Module, input_shape: Sequence[int] = (8, 1, 28, 28),
                     classes: int = 10, *, foreach: bool = False) -> int:
    """Operations of one SGD step of ``net`` (forward, cross-entropy, backward, update),
    counted on the second step. ``foreach=False``: one update per tensor, as d2l's
    from-scratch loop does; ``foreach=True``: ``torch.optim.SGD``'s update on a GPU, one
    multi-tensor operation for all of them."""
    X = torch.zeros(*input_shape)
    y = torch.arange(input_shape[0]) % classes
    opt = torch.optim.SGD(net.parameters(), lr=0.1, foreach=foreach)
    for counting in (False, True):
        counter = CountKernels()
        with counter if counting else contextlib.nullcontext():
            F.cross_entropy(net(X), y).backward()
            opt.step()
            opt.zero_grad()
    return counter.kernels


def torch_bucket_bytes(net: nn.Module, caps: Sequence[int]) -> list[int]:
    """Bytes of each gradient bucket torch's reducer uses for ``net`` once it has rebuilt them.

    The first iteration puts every parameter in one bucket; before the second forward the
    reducer rebuilds them (``dist._compute_bucket_assignment_by_size``) in the order the
    gradients arrived, which this approximates by reverse registration order (close for a chain
    of layers; not checked against a run): bucket ``i`` capped at ``caps[min(i, len(caps) -
    1)]`` bytes, closing once full. ``caps`` as ``DistributedDataParallel`` passes them:
    ``[first, rest]`` by default (``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, then 25
    MiB), ``[cap]`` with ``bucket_cap_mb``.
    """
    params = list(net.parameters())
    order = list(range(len(params)))[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], list(caps), [False] * len(params), order)
    return [nbytes(params[i] for i in b) for b in buckets]
