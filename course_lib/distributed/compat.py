"""The flat-tensor collectives under the name the running torch offers, with no deprecation warning.

torch 2.14 renamed ``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor`` to
``dist.all_gather_single`` and ``dist.reduce_scatter_single`` and warns (``FutureWarning``) on the
old names; earlier releases have only the old names. The course calls them here, under the old
names that torch's documentation and every reference still use.

Whether the backend has them at all is decided from the backend's name, a fact every rank shares,
so every rank takes the same path. Where the backend lacks one, the same result comes from a
list all-gather, or an all-reduce of the whole vector (twice a reduce-scatter's traffic).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["FLAT_COLLECTIVE_NAMES", "all_gather_into_tensor", "has_native", "reduce_scatter_tensor"]

#: Every name this torch offers the flat-tensor pair under (the old ones; the new ones from 2.14).
FLAT_COLLECTIVE_NAMES = tuple(name for name in ("all_gather_into_tensor", "all_gather_single",
                                                "reduce_scatter_tensor", "reduce_scatter_single")
                              if hasattr(dist, name))

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def has_native(collective: str, group=None) -> bool:
    """Does this group's backend implement ``collective`` (``"all_gather_into_tensor"`` or
    ``"reduce_scatter_tensor"``) on flat tensors? By the backend's name, the same on every rank:
    gloo and NCCL do (torch 2.11 to 2.15); any other takes the fallback, slower, never wrong."""
    if collective not in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        raise ValueError(f"has_native: expected 'all_gather_into_tensor' or "
                         f"'reduce_scatter_tensor', got {collective!r}")
    return str(dist.get_backend(group)).lower() in _NATIVE_BACKENDS


#: The backends that run the flat-tensor pair themselves.
_NATIVE_BACKENDS = ("gloo", "nccl")


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``output`` (world * n,) <- every rank's ``input`` (n,), in rank order."""
    if has_native("all_gather_into_tensor", group):
        _ALL_GATHER(output, input, group=group)
    else:
        dist.all_gather(list(output.chunk(dist.get_world_size(group))), input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op=dist.ReduceOp.SUM, group=None) -> None:
    """``output`` (n,) <- ``op`` over ranks of this rank's slice of ``input`` (world * n,)."""
    if has_native("reduce_scatter_tensor", group):
        _REDUCE_SCATTER(output, input, op=op, group=group)
        return
    total = input.clone()
    dist.all_reduce(total, op=op, group=group)
    n, rank = output.numel(), dist.get_rank(group)
    output.copy_(total.reshape(-1)[rank * n:(rank + 1) * n].view_as(output))
