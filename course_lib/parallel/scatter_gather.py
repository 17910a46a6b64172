"""Split the arguments of a forward call over devices, and join the outputs again.

PyTorch counterpart: ``torch.nn.parallel.scatter_gather`` (``scatter_kwargs``, ``gather``);
read ``torch/nn/parallel/scatter_gather.py``. The tensor-level pieces (``scatter`` of one tensor,
``gather`` of a list of tensors) are in ``course_lib.parallel.comm``, as torch keeps them in
``torch.nn.parallel.comm``. Lesson 05.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..devices import Device, as_device
from .comm import gather as gather_tensors
from .comm import scatter

__all__ = ["gather", "scatter_kwargs"]


def _is_namedtuple(obj: Any) -> bool:
    """A ``collections.namedtuple`` or ``typing.NamedTuple`` (torch's ``_is_namedtuple``)."""
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def _scatter_obj(obj: Any, devices: list[torch.device]) -> list[Any]:
    """One part of ``obj`` per device, as torch's ``scatter_gather.scatter``: tensors are split
    along dim 0; namedtuples (rebuilt field by field, same type), tuples, lists and dicts (same
    type) element by element; anything else, and empty containers, go to every device."""
    if isinstance(obj, torch.Tensor):
        return scatter(obj, devices)
    if isinstance(obj, (tuple, list, dict)) and obj:
        items = obj.values() if isinstance(obj, dict) else obj
        per_device = zip(*[_scatter_obj(x, devices) for x in items])  # one tuple per device
        if _is_namedtuple(obj):
            return [type(obj)(*parts) for parts in per_device]
        if isinstance(obj, tuple):
            return list(per_device)
        if isinstance(obj, list):
            return [list(parts) for parts in per_device]
        return [type(obj)(zip(obj.keys(), parts)) for parts in per_device]
    return [obj] * len(devices)


def _nested_tensors(obj: Any, path: str):
    """(path, tensor) for every tensor ``_scatter_obj`` splits inside ``obj``, nested included."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from _nested_tensors(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from _nested_tensors(x, f"{path}[{k!r}]")


def _batch_tensors(inputs: tuple, kwargs: dict[str, Any]):
    """(name, tensor) for every tensor argument with a batch dimension, at any depth of tuples,
    lists and dicts: ``argument 0``, ``argument 1[0]``, ``mask=``, ``extra['a']=``."""
    for i, x in enumerate(inputs):
        yield from _nested_tensors(x, f"argument {i}")
    for k, x in kwargs.items():
        for path, t in _nested_tensors(x, k):
            yield f"{path}=", t


def scatter_kwargs(inputs: tuple, kwargs: dict[str, Any],
                   devices: Sequence[Device]) -> tuple[list[tuple], list[dict[str, Any]]]:
    """Split the positional and keyword arguments of a forward call over ``devices``.

    Every tensor is split along dim 0 (``course_lib.comm.scatter``: sizes of ``torch.chunk``,
    so a small batch may use fewer devices), also inside tuples, lists and dicts; other values
    go to every device unchanged.

    Raises:
        ValueError: when the tensors it splits (nested ones included) have different batch
            sizes; the message names each one (``argument 0[1]``, ``mask=``) with its size.

    Returns:
        ``(inputs_per_device, kwargs_per_device)``, of equal length k <= ``len(devices)``.
    """
    devices = [as_device(d) for d in devices]
    sizes = {name: t.shape[0] for name, t in _batch_tensors(inputs, kwargs)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"scatter_kwargs splits every tensor argument (also inside tuples, "
                         f"lists and dicts) along dim 0, but their batch sizes differ: {sizes}. "
                         "Pass tensors with the same batch size (or non-tensor values, which "
                         "are given to every device).")
    if not inputs and not kwargs:             # nothing to split: one call on devices[0]
        return [()], [{}]
    ins = _scatter_obj(tuple(inputs), devices) if inputs else []
    kws = _scatter_obj(dict(kwargs), devices) if kwargs else []
    k = min(len(ins) if inputs else len(devices), len(kws) if kwargs else len(devices))
    ins = list(ins[:k]) if inputs else [()] * k
    kws = list(kws[:k]) if kwargs else [{}] * k
    return ins, kws


def gather(outputs: Sequence[Any], device: Device) -> Any:
    """Concatenate the replicas' outputs along dim 0 on ``device`` (differentiable).

    Tensors are concatenated (``course_lib.comm.gather``); tuples, namedtuples, lists and dicts
    of tensors element by element, keeping their type; ``None`` stays ``None``. As torch's
    ``scatter_gather.gather``.

    Raises:
        ValueError: for 0-d tensors (e.g. a loss computed inside ``forward``): there is no batch
            dimension to join along. Return per-example values and reduce after the gather.
            Also when the replicas' tuples differ in length, or their dicts in keys.
    """
    device = as_device(device)
    if not outputs:
        raise ValueError("gather needs the outputs of at least one replica, got none.")
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("gather joins outputs along dim 0 but got 0-d tensors; return a "
                             "tensor with a batch dimension (e.g. reduction='none') and reduce "
                             "after the gather.")
        return gather_tensors(list(outputs), device)
    if first is None:
        return None
    if isinstance(first, dict):
        if any(o.keys() != first.keys() for o in outputs):
            raise ValueError(f"gather expects every replica to return a dict with the same "
                             f"keys, got {[list(o) for o in outputs]}.")
        return type(first)((k, gather([o[k] for o in outputs], device)) for k in first)
    if isinstance(first, (tuple, list)):
        if any(len(o) != len(first) for o in outputs):
            raise ValueError(f"gather expects every replica to return a {type(first).__name__} "
                             f"of the same length, got lengths {[len(o) for o in outputs]}.")
        parts = [gather(list(p), device) for p in zip(*outputs)]
        return type(first)._make(parts) if _is_namedtuple(first) else type(first)(parts)
    raise TypeError(f"gather expects tensors or tuples/lists/dicts of tensors, got "
                    f"{type(first).__name__}.")
