"""Bookkeeping behind ``course_lib.distributed.fsdp`` that lesson 11 need not read.

* ``reached_nodes``: which autograd nodes a backward from some outputs will run (to tell the
  units a rank used from those it did not);
* ``grad_norm``: the global gradient norm over flat shards (padding left out) and replicated
  parameters, as torch's ``FullyShardedDataParallel.clip_grad_norm_``;
* ``check_state_dict`` / ``flat_values``: loading a full (unsharded) state dict into the shards;
* the errors' texts.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves


def reached_nodes(roots: Iterable) -> set:
    """Every autograd node reachable from ``roots`` (nodes, None skipped) through
    ``next_functions``: the nodes a backward started there runs."""
    seen: set = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return seen


def accumulated_variables(nodes: set) -> set[int]:
    """``id`` of every leaf tensor whose gradient one of ``nodes`` (AccumulateGrad) fills."""
    return {id(n.variable) for n in nodes if hasattr(n, "variable")}


def check_norm_type(max_norm, norm_type) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) \
            or not math.isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0, got "
                         f"{max_norm!r}.")
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) \
            or math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a number > 0 (2.0 for the "
                         f"Euclidean norm) or math.inf, got {norm_type!r}.")
    return float(norm_type)


def grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], norm_type: float,
              group, device: torch.device) -> torch.Tensor:
    """The norm of all the model's gradients as one vector, the same on every rank.

    ``sharded``: this rank's pieces of the sharded gradients (padding already cut off), each
    element on exactly one rank: their ``norm ** p`` is summed over ranks (the maximum for the
    inf norm). ``replicated``: gradients equal on every rank, counted once, here. Computed in
    the widest of the gradients' dtypes (float32 at least). Collective: one all-reduce of a
    scalar, on every rank even where ``sharded`` is empty."""
    dtype = torch.float32
    for g in sharded + replicated:
        dtype = torch.promote_types(dtype, g.dtype)

    def norm(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=dtype, device=device)
        return torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype).to(device)
             for g in grads]), norm_type)

    local, whole = norm(sharded), norm(replicated)
    if math.isinf(norm_type):
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return torch.maximum(total, whole)
    total = local ** norm_type
    dist.all_reduce(total, group=group)
    return (total + whole ** norm_type) ** (1.0 / norm_type)


def check_state_dict(state_dict, names: list[str], shapes: dict[str, torch.Size],
                     strict: bool) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys of ``state_dict`` against the module's ``names``; raise a clear
    error for a key of the wrong shape, or (``strict``) for any missing or unexpected key."""
    if not hasattr(state_dict, "keys"):
        raise TypeError(f"FullyShardedDataParallel.load_state_dict expects a dict of name -> "
                        f"tensor (as state_dict() or full_state_dict() return), got "
                        f"{type(state_dict).__name__}.")
    missing = [n for n in names if n not in state_dict]
    unexpected = [k for k in state_dict if k not in shapes]
    if strict and (missing or unexpected):
        hint = ""
        if any("flat_param" in k for k in unexpected):
            hint = (" Keys with 'flat_param' are padded shards of an older checkpoint; save "
                    "with state_dict() or full_state_dict(), which give full tensors.")
        elif any(k.startswith("module.") for k in unexpected):
            hint = " Strip the 'module.' prefix: FSDP uses the wrapped module's own names."
        raise RuntimeError(f"FullyShardedDataParallel.load_state_dict: missing keys "
                           f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                           f"keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. "
                           f"Expected the module's own names (full_state_dict() gives them) "
                           f"or pass strict=False to load only the keys that match.{hint}")
    for name in names:
        if name in state_dict:
            value = state_dict[name]
            if not isinstance(value, torch.Tensor) or value.shape != shapes[name]:
                found = (tuple(value.shape) if isinstance(value, torch.Tensor)
                         else type(value).__name__)
                raise RuntimeError(f"FullyShardedDataParallel.load_state_dict: {name} must be "
                                   f"a tensor of the full shape {tuple(shapes[name])}, got "
                                   f"{found}. Load a checkpoint of this model saved with "
                                   f"state_dict() or full_state_dict() (full, unsharded "
                                   f"tensors).")
    return missing, unexpected


#: what a placeholder still answers: its shape, dtype, device and the like, never its values
_METADATA = {"__get__", "size", "dim", "numel", "element_size", "is_floating_point",
             "is_complex", "__repr__", "__format__", "__len__", "__hash__", "nelement",
             "ndimension", "stride", "is_contiguous", "__reduce_ex__", "__deepcopy__"}


class ShardedPlaceholder(torch.Tensor):
    """What a unit's module holds between uses for a sharded parameter: a tensor on the meta
    device (shape, no memory) that refuses to compute. Reading the parameter anywhere but in
    its own unit's forward (a parent's ``F.linear(h, self.emb.weight)``, an ``nn.init`` call)
    would otherwise compute with no values; torch's FSDP2 keeps a sharded DTensor there and
    fails as loudly."""

    @staticmethod
    def make(shape: torch.Size, dtype: torch.dtype, name: str) -> ShardedPlaceholder:
        t = torch.Tensor._make_subclass(ShardedPlaceholder,
                                        torch.empty(shape, dtype=dtype, device="meta"))
        t._fsdp_name = name
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        name = next((a._fsdp_name for a in tree_leaves((args, kwargs))
                     if isinstance(a, ShardedPlaceholder)), "a sharded parameter")
        raise RuntimeError(
            f"FullyShardedDataParallel: {name} is sharded (each rank holds only a slice; the "
            f"module's attribute is an empty placeholder outside its unit's forward), and "
            f"{getattr(func, '__name__', func)} read it outside the forward of the module that "
            f"owns it. Use it only inside that module's forward (call the module), or make it "
            f"stay whole: share the same Parameter with the module that reads it (a tied head: "
            f"head.weight = emb.weight; shared parameters are replicated), or choose units "
            f"with a policy that puts the reading module and the owner in one unit, e.g. "
            f"policy=lambda m: m is model.")
