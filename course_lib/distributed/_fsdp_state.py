"""Bookkeeping behind ``course_lib.distributed.fsdp`` that lesson 11 need not read.

* ``ShardedCheckpoints``: full-tensor checkpoints under the module's own names (loadable at
  another world size) and ``clip_grad_norm_``, as torch's FSDP1;
* ``Join`` and ``agree_on_use``: at the start of backward the ranks agree (one all-reduce of
  flags) which unit calls any rank used, so that every rank runs the same reduce-scatters in
  the same order;
* ``ShardedPlaceholder``, ``assign_units``, ``split_by_kind``, ``cast_hooks`` and the checks.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_leaves

from ._same_tensors import communication_device
from .compat import all_gather_into_tensor


def check_arguments(module, compute_dtype, policy) -> None:
    if not dist.is_initialized():
        raise RuntimeError("FullyShardedDataParallel shards over the ranks of a process group: "
                           "call dist.init_process_group first (or run under "
                           "course_lib.distributed.launch / torchrun).")
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel expects an nn.Module, got "
                        f"{type(module).__name__}.")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                          and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype must be a floating dtype such as torch.bfloat16 or "
                         f"torch.float16 (or None), got {compute_dtype!r}.")
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be a function submodule -> bool, got {policy!r}.")
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            raise TypeError(f"FullyShardedDataParallel: parameter {name} has dtype {p.dtype}; "
                            "only floating-point parameters can be trained and sharded.")


def assign_units(module: nn.Module, policy, shared: set[int]) -> list:
    """[(unit, [(owner module, name, param)])]: each parameter to its nearest enclosing
    unit, unless it is shared by several modules (those stay replicated)."""
    unit_of: dict[int, nn.Module | None] = {id(module): module if policy(module) else None}
    found: dict[int, list] = {}
    order: list[nn.Module] = []
    for m in module.modules():
        for child in m.children():
            if id(child) not in unit_of:
                unit_of[id(child)] = child if policy(child) else unit_of[id(m)]
        unit = unit_of[id(m)]
        for name, p in m._parameters.items():
            if p is None or unit is None or id(p) in shared:
                continue
            if id(unit) not in found:
                found[id(unit)] = []
                order.append(unit)
            found[id(unit)].append((m, name, p))
    return [(u, found[id(u)]) for u in order]


def split_by_kind(entries: list[tuple]) -> dict[tuple, list[tuple]]:
    """Entries grouped so that one flat vector can hold each group: (requires_grad, dtype)."""
    groups: dict[tuple, list[tuple]] = {}
    for entry in entries:
        p = entry[-1]
        groups.setdefault((p.requires_grad, p.dtype), []).append(entry)
    return groups


def cast_hooks(module: nn.Module, names: list[str], dtype: torch.dtype) -> list:
    """Hooks around ``module``'s forward that let it see its parameters ``names`` cast to
    ``dtype`` (differentiably: the gradient arrives in the parameter's own dtype)."""
    def pre(m: nn.Module, args) -> None:
        for name in names:
            p = m._parameters.pop(name)
            m.__dict__[f"_fsdp_master_{name}"] = p
            m.__dict__[name] = p.to(dtype)

    def post(m: nn.Module, args, output) -> None:
        for name in names:
            if f"_fsdp_master_{name}" in m.__dict__:
                m.__dict__.pop(name, None)
                m._parameters[name] = m.__dict__.pop(f"_fsdp_master_{name}")

    return [module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True)]


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
    """Collective: the norm of all gradients as one vector, the same on every rank.
    ``sharded`` pieces (padding cut off) count over the ranks, ``replicated`` ones once."""
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
    """(missing, unexpected) keys; raise for a wrong shape, or (``strict``) a key mismatch."""
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
    """What a module holds for a sharded parameter between uses: a meta tensor (shape, no
    memory) that refuses to compute, as loudly as torch's FSDP2's sharded DTensor."""

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


class ShardedCheckpoints:
    """``FullyShardedDataParallel``'s checkpoints and gradient clipping."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Collective: scale every gradient so that the norm of them all, as one vector, is at
        most ``max_norm``; return that norm before clipping (a tensor, the same on every rank),
        as torch's ``FullyShardedDataParallel.clip_grad_norm_``. Use it instead of
        ``torch.nn.utils.clip_grad_norm_(fsdp.parameters(), ...)``, which sees only this
        rank's slices (each rank would clip by its own factor). Sharded gradients count once
        over all ranks (their ``norm ** p`` summed, padding left out), replicated ones once."""
        norm_type = check_norm_type(max_norm, norm_type)
        sharded = [h.shard.grad for h in self.handles if h.shard.grad is not None]
        replicated = [p.grad for p in self._replicated_params if p.grad is not None]
        valid = [h.shard.grad[:h.valid] for h in self.handles if h.shard.grad is not None]
        total = grad_norm(valid, replicated, norm_type, self.process_group,
                          communication_device(self.process_group, self._device))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch: no branch, no sync
        for g in sharded + replicated:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective (every rank calls it): the whole model, as ``module.state_dict()`` was
        before sharding: its own names (no prefix), full tensors, on every rank."""
        values = {name: t for h in self.handles for name, t in zip(h.names, _full_tensors(h))}
        values |= {name: p.detach().clone() for p in self._replicated_params
                   for name in self._param_names[id(p)]}
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        return {name: values[name] if name in values else buffers[name].detach().clone()
                for name in self._state_names if name in values or name in buffers}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Collective: ``full_state_dict()`` (the module's own names, full tensors), as torch's
        FSDP1 with ``StateDictType.FULL_STATE_DICT``; ``prefix`` added to each name (a parent
        module's state_dict passes its own). ``keep_vars`` is accepted and ignored: the
        values are fresh tensors."""
        if args:
            raise TypeError("FullyShardedDataParallel.state_dict takes keyword arguments only "
                            "(destination=, prefix=, keep_vars=).")
        out = destination if destination is not None else {}
        for name, t in self.full_state_dict().items():
            out[prefix + name] = t
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``load_full_state_dict``: takes what ``state_dict()`` gives."""
        if assign:
            raise ValueError("FullyShardedDataParallel.load_state_dict: assign=True is not "
                             "supported (the parameters are flat shards); use assign=False.")
        return self.load_full_state_dict(state_dict, strict=strict)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        """The inverse of ``full_state_dict()``: every rank passes the same whole model (the
        module's own names, full tensors, saved at any world size) and keeps its slices.
        Returns ``(missing_keys, unexpected_keys)`` as ``nn.Module.load_state_dict``; with
        ``strict`` (default) either raises. Collective only when ``strict=False`` leaves a
        unit partly loaded (its other parameters are gathered to fill the slice)."""
        missing, unexpected = check_state_dict(state_dict, self._state_names,
                                               self._full_shapes, strict)
        for h in self.handles:
            if all(n in state_dict for n in h.names):
                _load(h, [state_dict[n] for n in h.names])
            elif any(n in state_dict for n in h.names):
                _load(h, [state_dict.get(n, t) for n, t in zip(h.names, _full_tensors(h))])
        for p in self._replicated_params:
            for name in self._param_names[id(p)]:
                if name in state_dict:
                    p.copy_(state_dict[name])
                    break
        for name, b in self.module.named_buffers(remove_duplicate=False):
            if name in state_dict and b is not None:
                b.copy_(state_dict[name])
        return _IncompatibleKeys(missing, unexpected)


def _full_tensors(handle) -> list[torch.Tensor]:
    """Collective: every parameter of a ``FlatShard``, whole, in the master dtype."""
    full = torch.empty(handle.padded, dtype=handle.dtype, device=handle.shard.device)
    all_gather_into_tensor(full, handle.shard.detach(), group=handle.group)
    return [piece.view(shape).clone() for (*_, shape, _), piece in zip(handle.entries,
                                                                        handle.pieces(full))]


def _load(handle, tensors: list[torch.Tensor]) -> None:
    """A ``FlatShard``'s slice <- ``tensors`` (each parameter whole, in ``entries`` order)."""
    flat = torch.zeros(handle.padded, dtype=handle.dtype, device=handle.shard.device)
    torch.cat([t.detach().reshape(-1).to(flat) for t in tensors], out=flat[:handle.numel])
    handle.shard.copy_(flat[handle.start:handle.start + handle.shard.numel()])


def reached_nodes(roots: Iterable) -> set:
    """Every autograd node a backward started at ``roots`` (None skipped) runs."""
    seen: set = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions if n is not None and n not in seen)
    return seen


class Join(torch.autograd.Function):
    """Identity on the model's ``n`` outputs whose backward runs ``agree_on_use`` first; the
    unit calls' outputs that follow receive zeros or None in backward."""

    @staticmethod
    def forward(ctx, fsdp, gathers: list, n: int, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # None for an output the loss did not use
        ctx.fsdp, ctx.gathers, ctx.n, ctx.sync = fsdp, gathers, n, fsdp._forward_sync
        ctx.counts = [len(g.outputs) for g in gathers]
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors[n:]]
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        fsdp = ctx.fsdp
        fsdp._queue_finish()
        zeros = agree_on_use(fsdp, ctx, grads) if ctx.sync else [None] * len(ctx.like)
        return (None, None, None, *grads, *zeros)


def agree_on_use(fsdp, ctx, grads) -> list[torch.Tensor | None]:
    """One all-reduce of flags: which unit calls any rank used, which no_sync gradients wait.
    Sets ``fsdp._plan`` (for ``_finish_backward``); zeros for the outputs of calls used anywhere
    (every rank runs the same reduce-scatters in creation order), None for the others."""
    n = ctx.n
    nodes = [node for node, _ in ctx.next_functions]  # the n outputs, then units' outputs
    reached = reached_nodes(node for node, g in zip(nodes[:n], grads) if g is not None)
    called = {id(getattr(node, "gather", None)) for node in reached}  # _Unshard's nodes
    used, start = [], n
    for g, count in zip(ctx.gathers, ctx.counts):
        used.append(id(g) in called or any(o in reached for o in nodes[start:start + count]))
        start += count
    variables = {id(node.variable) for node in reached if hasattr(node, "variable")}
    replicated = [p for p in fsdp._replicated_params if p.requires_grad]
    flags = torch.tensor(used + [h.pending is not None for h in fsdp.handles]
                         + [id(p) in variables or id(p) in fsdp._pending_replicated
                            for p in replicated], dtype=torch.int32,
                         device=communication_device(fsdp.process_group, fsdp._device))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=fsdp.process_group)
    flags = flags.tolist()
    used = flags[:len(used)]
    pending = flags[len(used):len(used) + len(fsdp.handles)]
    called_handles = {id(g.handle) for g, u in zip(ctx.gathers, used) if u}
    fsdp._plan = {"handles": [h for h, p in zip(fsdp.handles, pending)
                              if p and id(h) not in called_handles],
                  "replicated": [p for p, f in zip(replicated,
                                                   flags[len(used) + len(fsdp.handles):]) if f]}
    zeros, start = [], 0
    for u, count in zip(used, ctx.counts):
        zeros += [torch.zeros(shape, dtype=dtype, device=device) if u else None
                  for shape, dtype, device in ctx.like[start:start + count]]
        start += count
    return zeros
