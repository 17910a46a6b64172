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
- ``zero1_save``: the same MLP with the course's ZeRO-1 (``ZeroRedundancyOptimizer``) and Adam;
  the optimizer's sharded state consolidated on rank 0 and saved in one ``torch.save`` file.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import current_device
from course_lib.distributed.optim import ZeroRedundancyOptimizer
from course_lib.train_ddp import save_checkpoint

__all__ = ["SIZES", "build_mlp", "load_resharded", "probe_batch", "train_and_save", "zero1_save"]

#: Layer widths, so that 3 ranks split rows as only ``torch.chunk`` does: 4 rows as 2, 2 and an
#: empty shard (not 2, 1, 1), 7 rows as 3, 3, 1 (not 3, 2, 2); 2 rows as 1, 1 and empty.
SIZES = (6, 4, 7, 2)


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


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
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


def train_and_save(path: str, steps: int = 3, batch: int = 12, lr: float = 0.1) -> dict:
    """Train ``build_mlp()`` under ``fully_shard`` for ``steps`` SGD steps; save it with DCP.

    Each rank takes its ``batch / k`` rows of every batch; one process beside it takes the whole
    batch (the oracle). Then ``dcp.save({"model": state}, checkpoint_id=path)``, the state dict
    of DTensors as the model holds it (each rank writes its own shards), and the full state dict
    gathered to rank 0.

    Returns:
        ``{"rank", "world", "local" (this rank's shards), "full" (rank 0: the full state dict,
        else {}), "one" (the one-process model's state dict), "probe" (the sharded model's
        outputs on ``probe_batch()``)}``.
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
    return {"rank": rank, "world": world, "local": _local(model), "full": full,
            "one": {k: v.detach().clone() for k, v in one.state_dict().items()},
            "probe": probe}


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
