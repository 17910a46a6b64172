"""Checks for ``ddp``, kept out of the lesson's module: arguments, devices, hooks, unused gradients.
Each raises a clear error where torch's DDP would fail later, hang, or let the replicas drift."""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def check_arguments(module: nn.Module, device_ids: Sequence[int | torch.device] | None,
                    output_device: int | torch.device | None, bucket_cap_mb: float | None,
                    strategy: str, strategies: Collection[str],
                    process_group: dist.ProcessGroup | None, **flags: Any) -> tuple:
    """Raise a clear error for arguments DistributedDataParallel cannot use; return
    ``check_devices``'s ``(device, device_ids, output_device)``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel expects an nn.Module, got "
                        f"{type(module).__name__}.")
    if strategy not in strategies:
        raise ValueError(f"DistributedDataParallel: strategy must be one of "
                         f"{', '.join(map(repr, strategies))}; got {strategy!r}.")
    if bucket_cap_mb is not None and (
            not isinstance(bucket_cap_mb, int | float) or isinstance(bucket_cap_mb, bool)
            or math.isnan(bucket_cap_mb) or not bucket_cap_mb > 0):
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a number of MiB > 0 "
                         f"(None: torch's default, 25; math.inf: one bucket), got "
                         f"{bucket_cap_mb!r}.")
    dim = flags.pop("dim")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"DistributedDataParallel: dim must be an int, got {dim!r}.")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"DistributedDataParallel: {name} must be True or False, got "
                            f"{value!r}.")
    if process_group is None and not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel needs a process group, and none is "
                           "initialised in this process. Call torch.distributed."
                           "init_process_group (or course_lib.distributed."
                           "init_distributed_mode) first, or start the workers with "
                           "course_lib.distributed.launch or torchrun.")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("DistributedDataParallel expected a module with at least one "
                         "parameter that requires grad, found none: there is nothing to "
                         "synchronise (call the module directly).")
    return check_devices(module, device_ids, output_device)


def check_devices(module: nn.Module, device_ids: Sequence[int | torch.device] | None,
                  output_device: int | torch.device | None) -> tuple:
    """``(device, device_ids, output_device)`` as DDP keeps them (all None for a CPU module)."""
    devices = {p.device for p in module.parameters()}
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"DistributedDataParallel: device_ids can only be None or hold one "
                         f"device (one process per device), got {list(device_ids)}.")
    if not device_ids or len(devices) != 1 or next(iter(devices)).type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError(f"DistributedDataParallel: device_ids and output_device work only "
                             f"with a module on one accelerator, but got device_ids "
                             f"{device_ids}, output_device {output_device}, and module "
                             f"parameters on {sorted(map(str, devices))}. Leave both None (as "
                             f"torch requires for CPU modules).")
        return None, None, None
    (module_device,) = devices
    wanted = device_ids[0]
    device = wanted if isinstance(wanted, torch.device) else torch.device(module_device.type,
                                                                          wanted)
    if device != module_device:
        raise ValueError(f"DistributedDataParallel: device_ids {list(device_ids)} names "
                         f"{device}, but the module is on {module_device}. Move the module to "
                         f"this rank's device first (module.to(device)), then wrap it.")
    return device, [device.index], device.index if output_device is None else output_device


def check_requires_grad(named: Sequence[tuple[str, torch.Tensor]],
                        frozen: Sequence[tuple[str, torch.Tensor]],
                        find_unused_parameters: bool) -> None:
    """Refuse parameters frozen, or unfrozen, after wrapping: the buckets were made before."""
    now_frozen = [name for name, p in named if not p.requires_grad]
    if now_frozen and not find_unused_parameters:
        raise RuntimeError(_frozen_after_wrapping(now_frozen))
    thawed = [name for name, p in frozen if p.requires_grad]
    if thawed:
        raise RuntimeError(
            f"DistributedDataParallel: {', '.join(thawed)} was frozen (requires_grad=False) "
            f"when the module was wrapped and requires grad now: its gradient would never "
            f"be averaged and the replicas would drift apart. Set requires_grad first, then "
            f"wrap: build a new DistributedDataParallel(module).")


def check_comm_hook(hook: Any, already_registered: bool) -> None:
    """``register_comm_hook`` takes one callable, once (as in torch)."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook expects a callable hook(state, bucket), got "
                        f"{type(hook).__name__}.")
    if already_registered:
        raise RuntimeError("register_comm_hook can be called only once per "
                           "DistributedDataParallel (as in torch); build a new one to "
                           "change the hook.")


def check_future(hook: Any, future: Any) -> None:
    """A hook must return a future (``torch.futures.Future`` or ``get_future()``'s)."""
    if not isinstance(future, torch._C.Future):
        name = getattr(hook, "__qualname__", repr(hook))
        raise TypeError(
            f"The communication hook {name} returned a {type(future).__name__}; a hook must "
            f"return a torch.futures.Future whose value is the averaged bucket buffer, for "
            f"example dist.all_reduce(bucket.buffer(), async_op=True).get_future()"
            f".then(lambda fut: fut.value()[0]), or fut = torch.futures.Future(); "
            f"fut.set_result(tensor); return fut.")


def check_result(result: Any, buffer: torch.Tensor, index: int) -> None:
    """The future's value must be a tensor shaped like the bucket's buffer."""
    if not isinstance(result, torch.Tensor) or result.shape != buffer.shape:
        found = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
        raise RuntimeError(f"A communication hook must return a future of a tensor shaped "
                           f"like bucket.buffer(), {tuple(buffer.shape)}; bucket "
                           f"{index} got {found}.")


def arrived_twice(index: int, name: str) -> RuntimeError:
    return RuntimeError(f"Bucket {index}: the gradient of {name} arrived twice in one backward; "
                        "expected each gradient once per synchronised backward.")


def raise_unused(strategy: Any, unused: list[torch.Tensor]) -> None:
    """Wait for the all-reduces already started (no peer is left hanging), then raise."""
    for bucket in strategy.buckets:
        if bucket.future is not None:
            bucket.wait()
    frozen = [strategy.name_of[id(p)] for p in unused if not p.requires_grad]
    if frozen:
        raise RuntimeError(_frozen_after_wrapping(frozen))
    names = ", ".join(strategy.name_of[id(p)] for p in unused)
    raise RuntimeError(
        f"DistributedDataParallel expected a gradient for every parameter that requires "
        f"grad, but {names} got none in this backward pass. If some parameters take no part "
        f"in the loss in some steps, pass find_unused_parameters=True (they then count as "
        f"zero); if they never do, set requires_grad=False on them before wrapping the "
        f"module.")


def _frozen_after_wrapping(names: list[str]) -> str:
    """The message for parameters frozen after DistributedDataParallel was built."""
    return (f"DistributedDataParallel: {', '.join(names)} required grad when the module was "
            f"wrapped and was frozen (requires_grad=False) afterwards. DDP decides which "
            f"gradients to average when it is built, so it still waits for these. Freeze first, "
            f"then wrap: call requires_grad_(False) on them, then build a new "
            f"DistributedDataParallel(module) (or pass find_unused_parameters=True to let "
            f"them count as unused).")
