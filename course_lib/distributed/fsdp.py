"""Fully sharded data parallelism from scratch: parameters, gradients and optimizer state sharded.

PyTorch counterpart: ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1, whose flat
parameters this mirrors) and ``torch.distributed.fsdp.fully_shard`` (FSDP2, per-parameter
shards). Read more: Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel" (VLDB 2023); Rajbhandari et al., "ZeRO" (SC 2020), section 5 (stage 3, P_os+g+p);
lesson 11.

Each *unit* (by default every submodule that owns a 2-D ``weight``: Linear, Embedding, a user's
own layer) flattens its parameters into one vector, pads it to a multiple of the world size and
keeps only its slice: ``numel / world_size`` elements per rank, the ``nn.Parameter`` the
optimizer sees. Around the unit's forward: all-gather the slices into the full vector, run,
free it. Before the unit's backward: all-gather again (autograd kept references to the weights,
not their memory). After it: reduce-scatter the full gradient, so that each rank keeps the
averaged gradient of its own slice, and free the full vector. Parameters outside every unit
(norms, the biases of modules that are not units, parameters shared by two modules) stay whole
on every rank, as in DDP, with their gradients averaged when backward ends.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._fsdp_state import (
    Join,
    ShardedCheckpoints,
    ShardedPlaceholder,
    assign_units,
    cast_hooks,
    check_arguments,
    split_by_kind,
)
from ._same_tensors import verify_same_model
from .compat import all_gather_into_tensor, reduce_scatter_tensor

__all__ = ["FullyShardedDataParallel", "default_policy", "shard_bounds"]


def default_policy(module: nn.Module) -> bool:
    """True for a module that owns (directly) a 2-D parameter named ``weight``: Linear,
    Embedding, or a user's own layer of that shape, whatever its class."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Where rank ``rank``'s slice of a flat vector of ``numel`` elements lies: ``(start, stop)``
    in the vector padded with zeros to ``ceil(numel / world_size) * world_size`` elements."""
    size = -(-numel // world_size)  # ceil: every rank's slice has the same size
    return rank * size, (rank + 1) * size


# --- one flat, sharded group of a unit's parameters ----------------------------------------------

class _Gather:
    """One all-gathered copy of a ``FlatShard`` (per forward call): freed and refilled."""

    def __init__(self, handle: FlatShard, sync: bool = True):
        self.handle = handle
        self.sync = sync  # False inside no_sync(): keep the full gradient, do not reduce it
        self.full: torch.Tensor | None = None  # (padded,) in the compute dtype
        self.filled = False
        self.outputs: list[torch.Tensor] = []  # the unit's outputs, until the forward ends

    def refill(self) -> None:
        """Before backward: give the full vector its memory back and gather into it again."""
        if self.full is not None and not self.filled:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            # .data: writing through it does not bump the version autograd checks saved
            # tensors against (the same values come back, so nothing it saved changed)
            self.handle.gather_into(self.full.data)
            self.filled = True

    def free(self) -> None:
        """Release the full vector's memory (autograd's references keep a 0-byte storage)."""
        if self.full is not None and self.filled:
            self.full.untyped_storage().resize_(0)
            self.filled = False


class _Unshard(torch.autograd.Function):
    """forward: the slices of every rank gathered into the full vector; backward: the full
    gradient reduce-scattered into this rank's slice, averaged, in the master dtype."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, gather: _Gather) -> torch.Tensor:
        handle = gather.handle
        full = torch.empty(handle.padded, dtype=handle.compute_dtype, device=shard.device)
        handle.gather_into(full)                             # (padded,)
        gather.full, gather.filled = full, True
        ctx.gather = gather
        ctx.set_materialize_grads(False)  # None: no rank used this call (see Join)
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        gather, handle = ctx.gather, ctx.gather.handle
        if grad_full is None:  # autograd runs every node it can reach, used or not
            grad_shard = None
        elif gather.sync:
            grad_shard = handle.reduce_grad(handle.add_pending(grad_full))  # (S,) averaged
        else:                                       # no_sync(): kept whole, reduced later
            handle.accumulate(grad_full)
            grad_shard = None
        gather.free()
        gather.full = None  # drop the reference: the call is over
        return grad_shard, None


class FlatShard:
    """Some parameters of one unit, flattened, padded to a multiple of the world size, sharded:
    ``shard`` (an ``nn.Parameter``, ``padded / world_size`` elements) is this rank's slice."""

    def __init__(self, entries: list[tuple[nn.Module, str, nn.Parameter]], names: list[str], *,
                 compute_dtype: torch.dtype | None, group):
        self.group = group
        self.names = names  # each parameter's name in the wrapped module (for checkpoints)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.entries = [(m, name, p.shape, p.numel()) for m, name, p in entries]
        params = [p for _, _, p in entries]
        self.numel = sum(p.numel() for p in params)
        start, stop = shard_bounds(self.numel, self.world, self.rank)
        self.padded = (stop - start) * self.world
        self.start = start
        self.valid = max(0, min(stop, self.numel) - start)  # this slice without the padding
        self.pending: torch.Tensor | None = None  # (padded,) full gradient kept by no_sync()
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.dtype
        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=self.dtype, device=params[0].device)
            torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
            dist.broadcast(flat, src=_global(group, 0), group=group)  # rank 0's values for all
            self.shard = nn.Parameter(flat[start:stop].clone(),       # (S,)
                                      requires_grad=params[0].requires_grad)

    def gather_into(self, full: torch.Tensor) -> None:
        """``full`` (padded,) <- every rank's slice, cast to the compute dtype."""
        all_gather_into_tensor(full, self.shard.detach().to(self.compute_dtype), group=self.group)

    def reduce_grad(self, grad_full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the average over ranks of ``grad_full``, in the master dtype.

        Sum in the reduction (in the compute dtype), then divide once by the world size in the
        master dtype: for 2 or 4 ranks the division is exact, so float32 results equal one
        process's up to the order of the sums inside the batch.
        """
        out = torch.empty(self.padded // self.world, dtype=grad_full.dtype,
                          device=grad_full.device)
        reduce_scatter_tensor(out, grad_full.contiguous(), group=self.group)
        return out.to(self.dtype).div_(self.world)

    def accumulate(self, grad_full: torch.Tensor) -> None:
        """Inside ``no_sync()``: add ``grad_full`` (padded,) to the kept full gradient."""
        grad = grad_full.detach().to(self.dtype)
        self.pending = grad.clone() if self.pending is None else self.pending.add_(grad)

    def add_pending(self, grad_full: torch.Tensor) -> torch.Tensor:
        """``grad_full`` plus what ``no_sync()`` kept (then forgotten), in its dtype."""
        if self.pending is None:
            return grad_full
        total, self.pending = self.pending.add_(grad_full.to(self.dtype)), None
        return total.to(grad_full.dtype)

    def unshard(self, gather: _Gather) -> None:
        """Gather the full vector and set each module's attribute to its view of it."""
        full = _Unshard.apply(self.shard, gather)            # (padded,)
        for (module, name, shape, _), piece in zip(self.entries, self.pieces(full)):
            setattr(module, name, piece.view(shape))

    def pieces(self, full: torch.Tensor) -> list[torch.Tensor]:
        """``full`` (padded,) cut into each parameter's flat piece (then the padding)."""
        return full.split([numel for *_, numel in self.entries] + [self.padded - self.numel])

    def placeholders(self) -> None:
        """Between uses, each attribute is a ``ShardedPlaceholder``."""
        for (module, name, shape, _), full_name in zip(self.entries, self.names):
            setattr(module, name, ShardedPlaceholder.make(shape, self.dtype, full_name))


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


# --- the wrapper ---------------------------------------------------------------------------------

class FullyShardedDataParallel(ShardedCheckpoints, nn.Module):
    """Shard ``module``'s units over the ranks; train it like DDP: forward, backward, step.

    ``fsdp.parameters()`` are what the optimizer updates: for each unit its flat slices
    (``numel / world_size`` elements, padded with zeros to a multiple of the world size), plus
    the replicated parameters (outside every unit, or shared by several modules). When
    ``backward()`` returns, every one that requires grad has its ``.grad`` (float32 master dtype,
    its own shape), the average over ranks, as in DDP; no extra call. ``full_state_dict()``
    gives the whole model with ``module``'s own names (checkpoints and ``clip_grad_norm_``:
    ``_fsdp_state.ShardedCheckpoints``).

    Equivalence with one process on the whole batch, when each rank's loss is the mean over its
    equal slice: gradients are summed over ranks in the collective, then divided once by the
    world size in the master dtype (division by 2 or 4 is exact; the remaining difference from
    one process is the order of the sums over examples inside each layer's backward).

    Args:
        module: the model, on this rank's device; every rank builds the same one (rank 0's
            values are broadcast, as DDP does).
        compute_dtype: float16 or bfloat16: the gathered weights, the activations and the
            communication in that dtype; the master weights, their gradients and the optimizer
            state stay in the parameters' own dtype. None: compute in the parameters' dtype.
        policy: ``policy(submodule) -> bool`` picks the units (default ``default_policy``: every
            submodule owning a 2-D ``weight``). A unit holds the parameters of its subtree
            that no nested unit holds.
        process_group: the ranks to shard over (None: the default group).
    """

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | None = None,
                 policy: Callable[[nn.Module], bool] | None = None,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__()
        check_arguments(module, compute_dtype, policy)
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.compute_dtype = compute_dtype
        policy = policy or default_policy
        # before any other collective: a different model would pair them wrong
        verify_same_model(module, process_group, owner="FullyShardedDataParallel")
        self._full_shapes = {n: t.shape for n, t in module.state_dict(keep_vars=True).items()}
        self._state_names = list(self._full_shapes)
        self._param_names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._param_names.setdefault(id(p), []).append(name)
        shared = {i for i, names in self._param_names.items() if len(names) > 1}

        units = assign_units(module, policy, shared)
        self.handles: list[FlatShard] = []
        self._hooks = []
        for unit, entries in units:
            handles = []
            for group_entries in split_by_kind(entries).values():
                names = [self._param_names[id(p)][0] for *_, p in group_entries]
                handle = FlatShard(group_entries, names, compute_dtype=compute_dtype,
                                   group=process_group)
                for m, name, _ in group_entries:
                    del m._parameters[name]
                unit.register_parameter(f"flat_param_{len(handles)}", handle.shard)
                handle.placeholders()
                handles.append(handle)
            self.handles += handles
            self._hooks.append(unit.register_forward_pre_hook(self._pre_forward(handles)))
            self._hooks.append(unit.register_forward_hook(self._post_forward(handles),
                                                          always_call=True))
        self._setup_replicated(module)
        self._gathers: list[_Gather] = []
        self._finish_queued = False
        self._sync = self._forward_sync = True  # False inside no_sync()
        self._plan: dict | None = None          # what _finish_backward reduces (agree_on_use)
        self._pending_replicated: set[int] = set()  # ids of grads no_sync() left unreduced

    def _setup_replicated(self, module: nn.Module) -> None:
        """The parameters left whole (rank 0's values), cast for their owners' forward."""
        sharded = {id(h.shard) for h in self.handles}  # the originals are gone already
        replicated, seen = [], set()
        for m in module.modules():
            names = [n for n, p in m._parameters.items() if p is not None
                     and id(p) not in sharded]
            for name in names:
                p = m._parameters[name]
                if id(p) not in seen:
                    seen.add(id(p))
                    replicated.append(p)
            if names and self.compute_dtype is not None:
                self._hooks += cast_hooks(m, names, self.compute_dtype)
        with torch.no_grad():
            for t in replicated + [b for b in module.buffers()]:
                dist.broadcast(t, src=_global(self.process_group, 0), group=self.process_group)
        self._replicated_params = replicated
        self._device = next(iter([h.shard.device for h in self.handles]
                                 + [p.device for p in replicated]), torch.device("cpu"))

    # ---- hooks: gather before forward, free after, gather again before backward ----------------

    def _pre_forward(self, handles: list[FlatShard]):
        def hook(unit: nn.Module, args) -> None:
            gathers = [_Gather(h, self._forward_sync) for h in handles]
            for h, g in zip(handles, gathers):
                h.unshard(g)
            unit._fsdp_gathers = gathers
        return hook

    def _post_forward(self, handles: list[FlatShard]):
        def hook(unit: nn.Module, args, output) -> None:
            gathers = unit.__dict__.pop("_fsdp_gathers", [])
            for h in handles:
                h.placeholders()
            outputs = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not outputs or self._forward_sync:  # no_sync() keeps them until backward (torch
                for g in gathers:                   # FSDP1 too): its backward gathers nothing
                    g.free()
            if not outputs:
                return
            for g in gathers:
                g.outputs = outputs
            self._gathers += gathers
            for t in outputs:
                t.register_hook(self._pre_backward(gathers))
        return hook

    def _pre_backward(self, gathers: list[_Gather]):
        def hook(grad: torch.Tensor) -> None:
            self._queue_finish()
            for g in gathers:
                g.refill()
        return hook

    # ---- forward and the end of backward -----------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``; floating inputs cast to ``compute_dtype`` if set."""
        self._gathers = []  # an earlier forward's, whose backward never ran
        self._forward_sync = self._sync
        if self.compute_dtype is not None:
            cast = lambda t: (t.to(self.compute_dtype) if isinstance(t, torch.Tensor)
                              and t.is_floating_point() else t)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        output = self.module(*args, **kwargs)
        flat, spec = tree_flatten(output)
        slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if slots:  # backward starts at Join on every rank (see _fsdp_state)
            gathers = list(self._gathers)
            joined = Join.apply(self, gathers, len(slots), *(flat[i] for i in slots),
                                *(t for g in gathers for t in g.outputs))
            for i, t in zip(slots, joined):
                flat[i] = t
            output = tree_unflatten(flat, spec)
        for g in self._gathers:
            g.outputs = []  # Join has what it needs: keep no activation alive
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes of forwards run inside keep the gradients
        on this rank, whole and unreduced (units' full gradients beside their shards,
        replicated ones in ``.grad``); the first backward of a forward outside reduces them
        with its own. As torch's FSDP1 ``no_sync``: gathered parameters stay until backward
        (no second gather), so memory holds the whole model meanwhile."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _queue_finish(self) -> None:
        """From inside backward: run ``_finish_backward`` once the whole backward is done."""
        if not self._finish_queued:
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of backward: reduce what waited (no_sync), average the replicated gradients used
        on any rank, free what is still gathered."""
        self._finish_queued = False
        for g in self._gathers:
            g.free()
            g.full = None
        self._gathers = []
        plan, self._plan = self._plan, None
        replicated = [p for p in self._replicated_params if p.requires_grad]
        if not self._forward_sync:  # no_sync(): keep every gradient here, unreduced
            self._pending_replicated |= {id(p) for p in replicated if p.grad is not None}
            return
        if plan is None:  # the loss did not start from this FSDP's outputs
            plan = {"handles": [], "replicated": replicated}
        for h in plan["handles"]:  # kept by no_sync() on some rank, not called since
            zeros = torch.zeros(h.padded, dtype=h.compute_dtype, device=h.shard.device)
            grad = h.reduce_grad(h.add_pending(zeros))
            h.shard.grad = grad if h.shard.grad is None else h.shard.grad.add_(grad)
        self._pending_replicated.clear()
        params = plan["replicated"]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for group in split_by_kind([(None, "", p) for p in params]).values():
            grads = [p.grad for *_, p in group]
            dtype = self.compute_dtype or grads[0].dtype
            flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])  # (sum of numel,)
            dist.all_reduce(flat, group=self.process_group)              # the sum
            flat = flat.to(grads[0].dtype).div_(self.world_size)         # then the average
            for g, average in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(average.view_as(g))
