"""Worker functions of notebook 13 (after training): checkpoints across parallel layouts.

``launch`` starts fresh processes that import each function by module and name, so the workers
live here, never in a notebook cell. A small float64 MLP is trained under torch's
``fully_shard`` (FSDP2: every parameter a DTensor sharded on dim 0, ``torch.chunk``'s way) and
saved with ``torch.distributed.checkpoint`` (DCP): one file per rank and a ``.metadata`` that
says where each piece of each tensor is. The same directory is then read back on any number of
processes: DCP reshards on load. Read more: PyTorch's "Getting Started with Distributed
Checkpoint (DCP)" and ``torch/distributed/checkpoint/state_dict.py``.

- ``train_and_save``: train a few steps beside one process on the whole batch, save with DCP,
  gather a full state dict to rank 0 (``get_model_state_dict(full_state_dict=True)``).
- ``load_resharded``: load that directory into a model sharded on a different number of ranks.
- ``adam_train_and_save`` / ``adam_resume``: the same MLP under ``fully_shard`` with Adam, model
  AND optimizer saved through ``get_state_dict`` and DCP, resumed on another number of ranks
  with ``set_state_dict``, one more step checked against the run that never stopped.
- ``zero1_save``: the same MLP with the course's ZeRO-1 (``ZeroRedundancyOptimizer``) and Adam;
  the optimizer's sharded state consolidated on rank 0 and saved in one ``torch.save`` file.
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
from course_lib.distributed import current_device
from course_lib.distributed.optim import ZeroRedundancyOptimizer
from course_lib.train_ddp import save_checkpoint

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
    from torch.distributed.device_mesh import init_device_mesh
    _bound_collectives()                      # every worker but zero1_save starts here
    from torch.distributed.fsdp import fully_shard
    # the mesh of this group's device: fully_shard's default takes a GPU per rank when CUDA exists
    mesh = init_device_mesh(current_device().type, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


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

    Each rank takes its ``batch / k`` rows of every batch; one process beside it takes the whole
    batch (the oracle). Then ``dcp.save({"model": state}, checkpoint_id=path)``, the state dict
    of DTensors as the model holds it (each rank writes its own shards), and the full state dict
    gathered to rank 0.

    Returns:
        ``{"rank", "world", "local" (this rank's shards), "full" (rank 0: the full state dict,
        else {}), "one" (the one-process model's state dict), "probe" (the sharded model's
        outputs on ``probe_batch()``), and with ``adam_path``: "adam" (what
        ``adam_train_and_save(adam_path, steps)`` returns, run by the same processes)}``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    rank, world = dist.get_rank(), dist.get_world_size()
    one = build_mlp()
    model = _shard(copy.deepcopy(one))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_one = torch.optim.SGD(one.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        X = torch.randn(batch, SIZES[0], dtype=torch.float64, generator=gen)   # (B, SIZES[0])
        y = torch.randn(batch, SIZES[-1], dtype=torch.float64, generator=gen)  # (B, SIZES[-1])
        for net, optimizer, rows in ((model, opt, slice(rank * batch // world,
                                                         (rank + 1) * batch // world)),
                                     (one, opt_one, slice(None))):
            loss = F.mse_loss(net(X[rows]), y[rows])    # FSDP averages the ranks' gradients
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)   # sharded, in place
    full = _full(model)
    with torch.no_grad():
        probe = model(probe_batch())
    out = {"rank": rank, "world": world, "local": _local(model), "full": full,
           "one": {k: v.detach().clone() for k, v in one.state_dict().items()}, "probe": probe}
    if adam_path is not None:                            # one start of the processes for both
        out["adam"] = adam_train_and_save(adam_path, steps)
    return out


def load_resharded(path: str) -> dict:
    """Load the DCP directory ``path`` into ``build_mlp(seed=7)`` sharded over this group.

    The model is built from other weights, sharded (``fully_shard``), and its own state dict of
    DTensors is handed to ``dcp.load``, which reads, from every file, the rows this rank now
    holds (DCP reshards on load) and writes them into those DTensors in place.

    Returns:
        ``{"rank", "world", "local" (this rank's shards after the load), "full" (rank 0: the
        full state dict, else {}), "probe" (outputs on ``probe_batch()``)}``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    model = _shard(build_mlp(seed=7))
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)                  # each rank reads the rows it holds
    set_model_state_dict(model, state["model"])
    full = _full(model)
    with torch.no_grad():
        probe = model(probe_batch())
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "local": _local(model),
            "full": full, "probe": probe}


def resume_batch(step: int, batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of the Adam runs, ``(X, y)``: the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(batch, SIZES[0], dtype=torch.float64, generator=gen),    # (B, SIZES[0])
            torch.randn(batch, SIZES[-1], dtype=torch.float64, generator=gen))   # (B, SIZES[-1])


def _adam_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, batch: int) -> None:
    # one Adam step on this rank's rows of batch ``step`` (FSDP averages the ranks' gradients)
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % world:
        raise ValueError(f"batch {batch} must split evenly over {world} ranks, so that the "
                         f"mean of the ranks' losses is the whole batch's; pick a multiple.")
    X, y = resume_batch(step, batch)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(X[rows]), y[rows]).backward()
    opt.step()


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

    ``course_lib.deploy.save_sharded``: ``get_state_dict`` gives both state dicts as the ranks
    hold them (Adam's moments sharded like their parameters, keyed by parameter name) and
    ``dcp.save`` writes them, each rank its own rows. Then one more step, as if the run had
    never stopped: the step a resumed run must reproduce.

    Returns:
        ``{"rank", "world", "saved" (rank 0: the full model and optimizer state dicts at the
        save, else ``({}, {})``), "next" (rank 0: the full model state dict one step later)}``.
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
    ``course_lib.deploy.resume_sharded``: ``get_state_dict`` gives the state dicts of this
    layout to fill (on a fresh optimizer it first creates Adam's state, with a step at learning
    rate 0); ``dcp.load`` reads into them the rows this rank holds; ``set_state_dict`` puts them
    in place. Then the step the saved run took next (batch ``steps``). ``save_to``: also save
    the resumed state there, with this group's layout (before that step).

    Returns:
        ``{"rank", "world", "local_rows" (this rank's rows of each parameter and of its Adam
        ``exp_avg``: ``{name: (rows, rows)}``), "loaded" (rank 0: the full model and optimizer
        state dicts after the load), "next" (rank 0: the full model state dict one step
        later)}``.
    """
    model, opt = _sharded_adam(seed=7, lr=lr)                  # other weights, a fresh Adam

    resume_sharded(model, opt, path)          # get_state_dict, dcp.load, set_state_dict
    if save_to is not None:
        save_sharded(model, opt, save_to)
    return _after_resume(model, opt, steps, batch)


def _after_resume(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int) -> dict:
    # adam_resume's report: the loaded state (full, on rank 0), the rows of each parameter and
    # of its exp_avg on this rank, and the full model after the next step (batch ``steps``)
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
    ``consolidate_state_dict(to=0)`` on every rank and, on rank 0, ``torch.save`` of
    ``{"model": ..., "optimizer": zero.state_dict()}``: the unsharded Adam's format.

    Returns:
        ``{"rank", "held" (how many parameters' state this rank kept), "one_model",
        "one_optimizer" (one process's model and Adam state dicts on the whole batches)}``.
    """
    _bound_collectives()
    rank, world = dist.get_rank(), dist.get_world_size()
    one = build_mlp()
    model = copy.deepcopy(one)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    opt_one = torch.optim.Adam(one.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(2)
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    for _ in range(steps):
        X = torch.randn(batch, SIZES[0], dtype=torch.float64, generator=gen)   # (B, SIZES[0])
        y = torch.randn(batch, SIZES[-1], dtype=torch.float64, generator=gen)  # (B, SIZES[-1])
        zero.zero_grad(set_to_none=True)
        F.mse_loss(model(X[rows]), y[rows]).backward()
        for p in model.parameters():                     # DDP's job, done by hand: the mean
            dist.all_reduce(p.grad)
            p.grad /= world
        zero.step()                                      # steps its shard, all-gathers the rest
        opt_one.zero_grad(set_to_none=True)
        F.mse_loss(one(X), y).backward()
        opt_one.step()
    zero.consolidate_state_dict(to=0)                    # every rank calls it
    if rank == 0:
        save_checkpoint({"model": model.state_dict(), "optimizer": zero.state_dict()}, path)
    dist.barrier()                                       # the file is complete
    return {"rank": rank, "held": len(zero.optim.state), "one_model": one.state_dict(),
            "one_optimizer": opt_one.state_dict()}
