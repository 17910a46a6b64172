"""``nn.DataParallel`` rebuilt from its four parts: scatter, replicate, parallel_apply, gather.

PyTorch counterpart: ``torch.nn.DataParallel`` (read ``torch/nn/parallel/data_parallel.py``: its
``forward`` is the same four lines as ``DataParallel.forward`` below). Source: d2l's "Concise
Implementation for Multiple GPUs" chapter; lesson 05. The parts live in their own modules, as in
torch: ``scatter_gather``, ``replicate``, ``parallel_apply``.

Unlike torch's, it also works on a CPU-only machine with *logical* devices
(``course_lib.devices.devices(2)`` is ``[cpu, cpu]``): the batch is really split and each replica
runs in its own thread. That proves correctness, not speed: both "devices" share the same cores.
See ``course_lib.parallel.replicate`` for what the replicas share with the module (and why batch
norm sees only a shard).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..devices import Device, as_device, try_all_gpus
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallel"]


class DataParallel(nn.Module):
    """Split each batch over devices, run a replica of ``module`` on each shard, join the outputs.

    ``forward`` reads like torch's: scatter, replicate, parallel_apply, gather. The module must
    live on ``device_ids[0]``; the output lands there; ``backward`` puts the summed gradients on
    the module's parameters, so an optimizer over ``module.parameters()`` works as usual.

    Differences from ``nn.DataParallel``: devices may be CPUs (also repeated, as logical
    devices), where torch's keeps ``device_ids=[]`` and just calls the module; only dim 0.

    Args:
        module: the network, on ``device_ids[0]``.
        device_ids: devices (ints are GPU indices). Default ``try_all_gpus()``: every GPU, or
            ``[cpu]`` (one device, no split) on a CPU-only machine; pass
            ``course_lib.devices.devices(2)`` to split over two logical CPU devices.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Device] | None = None):
        super().__init__()
        if device_ids is None:
            device_ids = try_all_gpus()
        self.module = module
        self.device_ids = [as_device(d) for d in device_ids]
        if not self.device_ids:
            raise ValueError("DataParallel needs at least one device; got device_ids=[]. "
                             "Pass e.g. course_lib.devices.devices(2).")
        missing = [d for d in self.device_ids if d.type == "cuda"
                   and (d.index or 0) >= torch.cuda.device_count()]
        if missing:
            raise ValueError(
                f"DataParallel got device_ids {list(device_ids)}, naming GPU(s) "
                f"{[str(d) for d in missing]}, but this machine has {torch.cuda.device_count()} "
                "GPU(s). On a CPU use logical devices: DataParallel(net, "
                "course_lib.devices.devices(2)).")
        self.output_device = self.device_ids[0]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_module_device()
        inputs, kwargs_tup = self.scatter(inputs, kwargs, self.device_ids)
        if len(inputs) == 1:                  # one device (or a batch of one): no replicas
            return self.module(*inputs[0], **kwargs_tup[0])
        replicas = self.replicate(self.module, self.device_ids[:len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kwargs_tup)
        return self.gather(outputs, self.output_device)

    # The four parts, as methods (like torch's) so that a subclass can change one of them.
    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[torch.device]):
        return scatter_kwargs(inputs, kwargs, device_ids)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device]) -> list[nn.Module]:
        return replicate(module, device_ids)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                       kwargs_tup: Sequence[dict]) -> list[Any]:
        return parallel_apply(replicas, inputs, kwargs_tup)

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        return gather(outputs, output_device)

    def _check_module_device(self) -> None:
        src = self.device_ids[0]
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if not _same_device(t.device, src):
                raise RuntimeError(
                    f"DataParallel expects the module on device_ids[0] = {src}, but found a "
                    f"parameter or buffer on {t.device}. Move it first: module.to({str(src)!r}).")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 name the same device when cuda:0 is current."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None
                                                             else cur)
    return True
