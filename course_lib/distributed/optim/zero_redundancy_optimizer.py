"""ZeRO stage 1 from scratch: the optimizer state sharded over the ranks, the parameters not.

PyTorch counterpart: ``torch.distributed.optim.ZeroRedundancyOptimizer``
(torch/distributed/optim/zero_redundancy_optimizer.py), with the same name, the same positional
order and the same checkpoint protocol. Read more: Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models" (SC 2020), section 5.1 (P_os), and
lesson 11.

Under DDP every rank runs the same optimizer step on the same averaged gradients: each rank
holds (and updates) a full copy of Adam's two moments, 8 of the 16 bytes per parameter of
mixed-precision training. ZeRO-1 assigns each parameter to one rank (``partition_parameters``,
balanced by size); that rank alone keeps its state and steps it, then sends the updated values
to every other rank (one ``broadcast`` per owner). The result is the unsharded optimizer's,
bit for bit: every element is updated by the same arithmetic, only on one rank instead of all.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ._checks import check_same_params, check_torch_options

__all__ = ["ZeroRedundancyOptimizer", "partition_parameters"]


def partition_parameters(param_groups: list[dict], world_size: int) -> list[list[torch.Tensor]]:
    """Assign every parameter to one rank, balancing the number of elements per rank.

    Greedy, as torch's: within each group, largest parameter first, each to the rank holding the
    fewest elements so far (ties: the lowest rank); the running totals carry over from one group
    to the next, so adding a group later never moves an existing parameter.

    Args:
        param_groups: an optimizer's ``param_groups`` (dicts with a ``"params"`` list).
        world_size: number of ranks.

    Returns:
        ``shards[r]``: the parameters rank ``r`` owns, in the order they appear in the groups.
    """
    sizes = [0] * world_size
    owner: dict[int, int] = {}
    for group in param_groups:
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = min(range(world_size), key=lambda r: sizes[r])
            owner[id(p)] = rank
            sizes[rank] += p.numel()
    return [[p for g in param_groups for p in g["params"] if owner[id(p)] == r]
            for r in range(world_size)]


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap ``optimizer_class`` so that each rank keeps the state of its own shard only (ZeRO-1).

    Use it where the unsharded optimizer would go: ``backward()`` (with gradients averaged by DDP
    or by hand), then ``step()``, ``zero_grad()``. ``param_groups`` holds every parameter with
    its group's options (a learning-rate scheduler can change them); ``optim`` is this rank's
    local optimizer, over its shard only.

    Args:
        params: an iterable of tensors, or of dicts (parameter groups with their own options).
        optimizer_class: the optimizer to shard, for example ``torch.optim.AdamW``.
        process_group: the ranks to shard over (None: the default group).
        parameters_as_bucket_view, overlap_with_ddp: torch's; accepted as False (their
            default), refused with an explanation when True: this version does neither.
        **defaults: options for ``optimizer_class`` (``lr=...``, ``weight_decay=...``).

    At construction every rank's parameters are checked to be the same (number, order, groups,
    shapes, dtypes): an error on every rank names the first difference.

    Checkpoints, as torch's: ``consolidate_state_dict(to=0)`` on every rank, then
    ``state_dict()`` on rank 0 returns the unsharded optimizer's state dict (the state as
    consolidated, the groups' options as they are now);
    ``load_state_dict(sd)`` on every rank takes that full dict and keeps its shard's part.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict],
                 optimizer_class: type[Optimizer], process_group: dist.ProcessGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any):
        if not dist.is_initialized():
            raise RuntimeError("ZeroRedundancyOptimizer shards over the ranks of a process "
                               "group: call dist.init_process_group first (or run under "
                               "course_lib.distributed.launch / torchrun).")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be an optimizer class such as "
                            f"torch.optim.AdamW, got {optimizer_class!r}.")
        check_torch_options(parameters_as_bucket_view=parameters_as_bucket_view,
                            overlap_with_ddp=overlap_with_ddp)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._optimizer_class = optimizer_class
        self.optim: Optimizer | None = None  # built once every group is known
        self._consolidated: dict[int, dict] | None = None  # the whole state, on rank `to`
        super().__init__(params, defaults)    # calls add_param_group for each group
        check_same_params(self.param_groups, process_group)  # a collective, as DDP's check
        self._shards = partition_parameters(self.param_groups, self.world_size)
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._copy_options(self.optim.param_groups, self.param_groups)  # betas, eps, ... too

    # ---- the shard of this rank ----------------------------------------------------------------

    def _local_groups(self) -> list[dict]:
        """Each group's options with this rank's parameters only (possibly none)."""
        mine = {id(p) for p in self._shards[self.rank]}
        return [{**_options(g), "params": [p for p in g["params"] if id(p) in mine]}
                for g in self.param_groups]

    @staticmethod
    def _copy_options(source: list[dict], target: list[dict]) -> None:
        """Copy every option but ``params`` from each group of ``source`` to ``target``'s."""
        for src, dst in zip(source, target):
            dst.update(_options(src))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (a dict with ``"params"`` and options); its parameters are assigned to
        ranks after the existing ones, which keep their owner and their state."""
        super().add_param_group(param_group)
        if self.optim is None:  # still in __init__
            return
        self._shards = partition_parameters(self.param_groups, self.world_size)
        self.optim.add_param_group(self._local_groups()[-1])
        self._copy_options(self.optim.param_groups[-1:], self.param_groups[-1:])

    # ---- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's shard with the local optimizer, then broadcast each shard from its
        owner so that every rank holds every updated parameter."""
        self._copy_options(self.param_groups, self.optim.param_groups)  # a scheduler's lr
        if closure is None:
            loss = self.optim.step()
        else:
            with torch.enable_grad():
                loss = self.optim.step(closure)
        self._broadcast_shards()
        return loss

    def _broadcast_shards(self) -> None:
        """One broadcast per owner (and dtype): its parameters packed into one flat buffer. The
        buffer is made once, for the largest owner's shard, and each owner packs into a slice of
        it, so that one buffer (per dtype) is alive however many owners there are. (A choice of
        this course: torch's version broadcasts each parameter in place, or, with
        ``parameters_as_bucket_view=True``, buckets the parameters are views of: no copy.)"""
        if self.world_size == 1:
            return  # one rank owns everything: nothing to send, no buffer
        runs = [(owner, key, params, sum(p.numel() for p in params))
                for owner, shard in enumerate(self._shards)
                for key, params in _by_dtype_and_device(shard).items()]
        sizes: dict[tuple, int] = {}   # (dtype, device) -> the largest run's numel
        for _, key, _, n in runs:
            sizes[key] = max(sizes.get(key, 0), n)
        buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
        for owner, key, params, n in runs:
            src = owner if self.process_group is None else dist.get_global_rank(
                self.process_group, owner)
            flat = buffers[key][:n]
            torch.cat([p.detach().reshape(-1) for p in params], out=flat)   # (sum of numel,)
            dist.broadcast(flat, src=src, group=self.process_group)
            if owner != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    # ---- checkpoints -------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's shard of the state on rank ``to``, where
        ``state_dict()`` then returns it whole. Every rank must call it."""
        local = self.optim.state_dict()
        local["state"] = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                          for i, s in local["state"].items()}
        gathered = [None] * self.world_size if self.rank == to else None
        dst = to if self.process_group is None else dist.get_global_rank(self.process_group, to)
        dist.gather_object(local, gathered, dst=dst, group=self.process_group)
        if self.rank != to:
            self._consolidated = None
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict] = {}
        for rank, shard_sd in enumerate(gathered):
            for local_i, s in shard_sd["state"].items():
                state[index[id(self._shards[rank][local_i])]] = s
        self._consolidated = dict(sorted(state.items()))

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state dict, in the unsharded optimizer's format; only on the
        rank that ``consolidate_state_dict(to=...)`` named, after that call.

        Built when asked, as torch's: the state is the one consolidated, the groups' options
        (a learning rate a scheduler changed since) are the current ones.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self.rank}: no consolidated "
                "state here. Each rank holds only its shard: call "
                "consolidate_state_dict(to=RANK) on every rank first, then state_dict() on "
                "that rank (as with torch's ZeroRedundancyOptimizer).")
        state_dict = super().state_dict()  # the groups now, with global indices; no state
        state_dict["state"] = dict(self._consolidated)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated) state dict on every rank; each keeps its shard's part."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"load_state_dict: the state dict has groups of {sizes} parameters, "
                             f"this optimizer {[len(g['params']) for g in self.param_groups]}: "
                             "was it saved from the same model and parameter groups?")
        params = [p for g in self.param_groups for p in g["params"]]
        saved_index = [i for g in groups for i in g["params"]]
        index_of = {id(p): i for p, i in zip(params, saved_index)}
        local_state, local_groups, n = {}, [], 0
        mine = {id(p) for p in self._shards[self.rank]}
        for group, saved in zip(self.param_groups, groups):
            group.update(_options(saved))
            ids = []
            for p in group["params"]:
                if id(p) in mine:
                    if index_of[id(p)] in state_dict["state"]:
                        local_state[n] = state_dict["state"][index_of[id(p)]]
                    ids.append(n)
                    n += 1
            local_groups.append({**_options(saved), "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _options(group: dict) -> dict:
    """A parameter group's options: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def _by_dtype_and_device(params: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """``params`` split into runs that can share one flat buffer: (dtype, device) -> params."""
    runs: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        runs.setdefault((p.dtype, p.device), []).append(p)
    return runs
