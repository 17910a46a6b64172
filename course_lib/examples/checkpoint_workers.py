"""Worker functions of notebook 13 (after training): checkpoints across parallel layouts.

A small float64 MLP is trained under torch's ``fully_shard`` (FSDP2: every parameter a DTensor
sharded on dim 0, ``torch.chunk``'s way) and saved with ``torch.distributed.checkpoint`` (DCP):
one file per rank and a ``.metadata`` that says where each piece of each tensor is. The same
directory is then read back on any number of processes: DCP reshards on load (``train_and_save``,
``load_resharded``; with Adam's state too: ``adam_train_and_save``, ``adam_resume``). The course's
ZeRO-1 instead consolidates the optimizer's state on rank 0, in one file (``zero1_save``). Read
more: PyTorch's "Getting Started with Distributed Checkpoint (DCP)" and
``torch/distributed/checkpoint/state_dict.py``.
"""
from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from course_lib.deploy import resume_sharded, save_sharded
from course_lib.distributed.optim import ZeroRedundancyOptimizer
from course_lib.train_ddp import save_checkpoint

from .workers import _torch_fully_shard

__all__ = ["COLLECTIVE_TIMEOUT_S", "SIZES", "adam_resume", "adam_train_and_save", "build_mlp",
           "dcp_read_plan", "load_resharded", "probe_batch", "resume_batch", "train_and_save",
           "zero1_save"]

#: Layer widths, so that 3 ranks split rows as only ``torch.chunk`` does: 4 rows as 2, 2 and an
#: empty shard (not 2, 1, 1), 7 rows as 3, 3, 1 (not 3, 2, 2); 2 rows as 1, 1 and empty.
SIZES = (6, 4, 7, 2)

#: Seconds a collective of these workers may wait for its peers before it raises (gloo: "Timed
#: out waiting ... for recv operation"). ``launch`` gives its group its own whole timeout (300 s
#: in notebook 13), so a stuck collective would wait until launch kills every rank with no word
#: of where; under this bound the stuck rank raises first and launch reports its traceback.
COLLECTIVE_TIMEOUT_S = 120


def _bound_collectives() -> None:
    # every collective on the default group from here on (fully_shard's mesh and DCP use it);
    # torch 2.11 has only the private name that later releases keep as a deprecated alias
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def build_mlp(seed: int = 0) -> nn.Sequential:
    """The lesson's small float64 MLP, ``SIZES`` wide, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def probe_batch(n: int = 6, seed: int = 1) -> torch.Tensor:
    """``n`` fixed float64 inputs on which every layout's outputs are compared: (n, SIZES[0])."""
    return torch.randn(n, SIZES[0], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def dcp_read_plan(pieces: list[tuple[int, int]], world_size: int, cols: int = 3
                  ) -> list[list[tuple[int, int, int]]]:
    """DCP's own read plan for a ``(rows, cols)`` tensor saved as ``pieces`` along dim 0.

    Runs torch's planner step (``planner_helpers.create_read_items_for_chunk_list``, what
    ``dcp.load`` calls for each tensor of each rank) on the saved pieces' metadata and on each
    new rank's ``torch.chunk`` block of rows, and writes every ``ReadItem`` as ``(piece, start,
    stop)``: the rows of the saved piece it copies, counted within that piece. The oracle of
    ``course_lib.deploy.read_plan``.
    """
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from course_lib.deploy import shard_rows

    def chunk(offset: int, length: int) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([offset, 0]),
                                    sizes=torch.Size([length, cols]))

    rows = max((offset + length for offset, length in pieces), default=0)
    saved = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float64),
                                  size=torch.Size([rows, cols]),
                                  chunks=[chunk(o, n) for o, n in pieces])
    index = torch.arange(rows)                         # each new rank's rows, as fully_shard's
    plan = []
    for mine in shard_rows(index, world_size):
        first = int(mine[0]) if len(mine) else rows
        items = create_read_items_for_chunk_list("w", saved, [chunk(first, len(mine))])
        plan.append(sorted((item.storage_index.index, item.storage_offsets[0],
                            item.storage_offsets[0] + item.lengths[0]) for item in items))
    return plan


def _shard(model: nn.Module) -> nn.Module:
    _bound_collectives()                      # every worker but zero1_save starts here
    return _torch_fully_shard(model)


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    # this rank's piece of every parameter (DTensor.to_local): rows chunk(world)[rank] of dim 0
    return {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    # every rank calls it (all-gathers inside); rank 0 gets the full tensors on the CPU
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def train_and_save(path: str, steps: int = 3, adam_path: str | None = None, batch: int = 12,
                   lr: float = 0.1) -> dict:
    """Train ``build_mlp()`` under ``fully_shard`` for ``steps`` SGD steps; save it with DCP.

    Each rank takes its ``batch / k`` rows of every batch, one process beside it the whole batch
    (the oracle). Then ``dcp.save`` of the state dict of DTensors as the model holds it (each rank
    writes its own shards), and the full state dict gathered to rank 0. Returns ``{"rank",
    "world", "local" (this rank's shards), "full" (rank 0: the full state dict, else {}), "probe"
    (outputs on ``probe_batch()``), "one" (the one-process model's state dict)}``, and with
    ``adam_path`` "adam": ``adam_train_and_save(adam_path, steps)``, run by the same processes.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    one = build_mlp()
    model = _shard(copy.deepcopy(one))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_one = torch.optim.SGD(one.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        X, y = _batch(gen, batch)
        _mse_step(model, opt, X[_my_rows(batch)], y[_my_rows(batch)])   # FSDP averages the
        _mse_step(one, opt_one, X, y)                                      # ranks' gradients
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)   # sharded, in place
    out = {**_report(model), "one": {k: v.detach().clone() for k, v in one.state_dict().items()}}
    if adam_path is not None:                            # one start of the processes for both
        out["adam"] = adam_train_and_save(adam_path, steps)
    return out


def load_resharded(path: str) -> dict:
    """Load the DCP directory ``path`` into ``build_mlp(seed=7)`` sharded over this group.

    The model, built from other weights and sharded, hands its own state dict of DTensors to
    ``dcp.load``, which reads from every file the rows this rank now holds (DCP reshards on load).
    Returns ``{"rank", "world", "local", "full", "probe"}`` after the load, as ``train_and_save``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    model = _shard(build_mlp(seed=7))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)                  # each rank reads the rows it holds
    set_model_state_dict(model, state["model"])
    return _report(model)


def _report(model: nn.Module) -> dict:
    full = _full(model)
    with torch.no_grad():
        probe = model(probe_batch())
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": _local(model),
            "full": full, "probe": probe}


def _mse_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
              y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(X), y).backward()
    opt.step()


def _batch(gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch, SIZES[0], dtype=torch.float64, generator=gen),    # (B, SIZES[0])
            torch.randn(batch, SIZES[-1], dtype=torch.float64, generator=gen))   # (B, SIZES[-1])


def _my_rows(batch: int) -> slice:
    rank, world = dist.get_rank(), dist.get_world_size()
    return slice(rank * batch // world, (rank + 1) * batch // world)


def resume_batch(step: int, batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of the Adam runs, ``(X, y)``: the same in every process."""
    return _batch(torch.Generator().manual_seed(1000 + step), batch)


def _adam_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, batch: int) -> None:
    # one Adam step on this rank's rows of batch ``step`` (FSDP averages the ranks' gradients)
    world = dist.get_world_size()
    if batch % world:
        raise ValueError(f"batch {batch} must split evenly over {world} ranks, so that the "
                         f"mean of the ranks' losses is the whole batch's; pick a multiple.")
    X, y = resume_batch(step, batch)
    _mse_step(model, opt, X[_my_rows(batch)], y[_my_rows(batch)])


def _full_training_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    # every rank calls it (it all-gathers); rank 0 gets the model's and Adam's full tensors.
    # A copy: Adam's ``step`` is not sharded, and the dict holds the optimizer's own tensor,
    # which the next step would change in place.
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return copy.deepcopy(get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def _sharded_adam(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    # build_mlp(seed) sharded over this group (fully_shard), and a fresh Adam on it
    model = _shard(build_mlp(seed=seed))
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def adam_train_and_save(path: str, steps: int = 3, batch: int = 12, lr: float = 0.05) -> dict:
    """Train ``build_mlp()`` under ``fully_shard`` with Adam; save model and optimizer with DCP.

    ``course_lib.deploy.save_sharded``: ``get_state_dict`` gives both state dicts as the ranks hold
    them (Adam's moments sharded like their parameters, keyed by parameter name), ``dcp.save``
    writes them. Then one more step, the one a resumed run must reproduce. Returns ``{"rank",
    "world", "saved" (rank 0: the full model and optimizer state dicts at the save, else ``({},
    {})``), "next" (rank 0: the full model state dict one step later)}``.
    """
    model, opt = _sharded_adam(seed=0, lr=lr)
    for step in range(steps):
        _adam_step(model, opt, step, batch)

    save_sharded(model, opt, path)                             # get_state_dict, dcp.save

    saved = _full_training_state(model, opt)                   # for the notebook's comparison
    _adam_step(model, opt, steps, batch)                       # the run that never stopped
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "saved": saved,
            "next": _full_training_state(model, opt)[0]}


def adam_resume(path: str, steps: int = 3, batch: int = 12, lr: float = 0.05,
                save_to: str | None = None) -> dict:
    """Resume ``adam_train_and_save``'s checkpoint on this group, whatever its size.

    A model built from other weights, sharded over this group, with a fresh Adam, filled by
    ``course_lib.deploy.resume_sharded`` (``get_state_dict`` of this layout, which on a fresh
    optimizer first creates Adam's state with a step at learning rate 0; ``dcp.load``;
    ``set_state_dict``); then the step the saved run took next (batch ``steps``). ``save_to``: also
    save the resumed state there, in this group's layout, before that step. Returns ``{"rank",
    "world", "local_rows" ({name: (rows of the parameter, rows of its ``exp_avg``)} on this rank),
    "loaded" (rank 0: the full state dicts after the load), "next" (as ``adam_train_and_save``)}``.
    """
    model, opt = _sharded_adam(seed=7, lr=lr)                  # other weights, a fresh Adam

    resume_sharded(model, opt, path)          # get_state_dict, dcp.load, set_state_dict
    if save_to is not None:
        save_sharded(model, opt, save_to)
    loaded = _full_training_state(model, opt)
    local_rows = {name: (p.to_local().shape[0], opt.state[p]["exp_avg"].to_local().shape[0])
                  for name, p in model.named_parameters()}
    _adam_step(model, opt, steps, batch)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local_rows": local_rows,
            "loaded": loaded, "next": _full_training_state(model, opt)[0]}


def zero1_save(path: str, steps: int = 3, batch: int = 12, lr: float = 0.05) -> dict:
    """Train ``build_mlp()`` with the course's ZeRO-1 and Adam; rank 0 saves one full file.

    Gradients are averaged over the ranks by hand (each rank on its rows of every batch); the
    ``ZeroRedundancyOptimizer`` keeps the Adam state of this rank's parameters only. Then
    ``consolidate_state_dict(to=0)`` on every rank and, on rank 0, ``torch.save`` of ``{"model",
    "optimizer": zero.state_dict()}``: the unsharded Adam's format. Returns ``{"rank", "held" (how
    many parameters' state this rank kept), "one_model", "one_optimizer" (one process's)}``.
    """
    _bound_collectives()
    rank, world = dist.get_rank(), dist.get_world_size()
    one = build_mlp()
    model = copy.deepcopy(one)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    opt_one = torch.optim.Adam(one.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(2)
    rows = _my_rows(batch)
    for _ in range(steps):
        X, y = _batch(gen, batch)
        zero.zero_grad(set_to_none=True)
        F.mse_loss(model(X[rows]), y[rows]).backward()
        for p in model.parameters():                     # DDP's job, done by hand: the mean
            dist.all_reduce(p.grad)
            p.grad /= world
        zero.step()                                      # steps its shard, all-gathers the rest
        _mse_step(one, opt_one, X, y)
    zero.consolidate_state_dict(to=0)                    # every rank calls it
    if rank == 0:
        save_checkpoint({"model": model.state_dict(), "optimizer": zero.state_dict()}, path)
    dist.barrier()                                       # the file is complete
    return {"rank": rank, "held": len(zero.optim.state), "one_model": one.state_dict(),
            "one_optimizer": opt_one.state_dict()}
