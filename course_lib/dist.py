"""torch.distributed boilerplate in one place: who am I, and how do the processes start?

PyTorch counterparts: ``torch.distributed.init_process_group`` joins the processes that
``torchrun`` (``torch.distributed.run``) or ``torch.multiprocessing.spawn`` started; read more at
https://pytorch.org/docs/stable/distributed.html and in notebook 06.

- ``init_distributed_mode()``: the one place that reads torchrun's, Open MPI's or Slurm's
  environment variables (the set-up block at the top of nanoGPT's ``train.py``, as a function),
  with ``is_main_process``, ``reduce_value`` and ``cleanup``. Defined here.
- ``launch(fn, world_size, *args)``: the notebook's launcher (like accelerate's
  ``notebook_launcher``), bounded, loud on failure, leaving no process behind: ``course_lib.spawn``.
- ``ring_allreduce``, ``tree_broadcast``, ``ring_all_gather``: collectives written by hand from
  ``isend`` / ``irecv``: ``course_lib.collectives``.
- ``torchrun(...)`` and ``mpirun(...)``: run a script under a launcher from a notebook cell, show
  its output, fail the cell on a non-zero exit, kill everything on a timeout: ``course_lib.run``.

Every name above is importable from ``course_lib.dist``, the module homework should use.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import ring_all_gather, ring_allreduce, tree_broadcast
from .devices import cpu_cores, num_gpus
from .run import EXAMPLES, example_path, mpirun, run_commands, torchrun
from .spawn import LaunchTimeout, WorkerError, find_free_port, launch

__all__ = [
    "DistInfo",
    "EXAMPLES",
    "LaunchTimeout",
    "WorkerError",
    "cleanup",
    "example_path",
    "find_free_port",
    "first_host",
    "init_distributed_mode",
    "is_main_process",
    "launch",
    "mpirun",
    "reduce_value",
    "ring_all_gather",
    "ring_allreduce",
    "run_commands",
    "torchrun",
    "tree_broadcast",
]


# ------------------------------------------------------------------------------------------------
# init_distributed_mode: the one place that reads the launcher's environment
# ------------------------------------------------------------------------------------------------

@dataclass
class DistInfo:
    """Who this process is: what ``init_distributed_mode`` found and set up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    launcher: str  # "torchrun", "mpirun", "slurm", "launch" (course_lib.dist.launch) or "none"

    @property
    def distributed(self) -> bool:
        return self.launcher != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"node[01-04,07],gpu1"`` -> ``"node01"``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first entry
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end].strip()
    # each bracket group keeps its first item (zero padding kept): rack[1-2]-n[01-04] -> rack1-n01
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], entry)


def _from_environment(env) -> tuple[str, int, int, int] | None:
    """(launcher, rank, world_size, local_rank) from torchrun, Open MPI or Slurm variables."""
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also launch's workers)
        return "torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "OMPI_COMM_WORLD_RANK" in env:  # before Slurm: mpirun inside an allocation sets both
        return ("mpirun", int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return ("slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                int(env.get("SLURM_LOCALID", 0)))
    return None


def _local_world_size(env, world_size: int) -> int:
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if key in env:
            return int(env[key])
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(re.match(r"\d+", env["SLURM_NTASKS_PER_NODE"]).group())
    return world_size


def init_distributed_mode(backend: str | None = None, timeout: float = 300.0,
                          verbose: bool = True) -> DistInfo:
    """Join the process group described by the environment, or run as one process.

    Reads, in this order: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (and its
    ``MASTER_ADDR`` / ``MASTER_PORT``); Open MPI's ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` /
    ``_LOCAL_RANK``; Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` with the
    first host of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``) as
    master. Under mpirun and Slurm, ``MASTER_PORT`` defaults to 29500 and under mpirun
    ``MASTER_ADDR`` to 127.0.0.1 (pass ``-x MASTER_ADDR=host`` for several nodes). Each process
    uses GPU ``local_rank`` with NCCL when it has one, else the CPU with gloo and
    ``cores // processes-on-this-node`` threads.

    Args:
        backend: force "gloo" or "nccl" (default: as above).
        timeout: seconds before a collective that cannot complete raises.
        verbose: print one line saying what was found.

    Returns:
        A ``DistInfo`` (rank, world_size, local_rank, backend, device, launcher). When a group
        already exists (inside ``launch``'s workers), it is described, not created again.
    """
    env = os.environ
    found = _from_environment(env)
    if dist.is_initialized():  # inside launch's workers, or called twice: use the group as it is
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(env.get("LOCAL_RANK", rank))
        backend = dist.get_backend()
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        launcher = "launch" if env.get("COURSE_LAUNCH") or not found else found[0]
        return DistInfo(rank, world_size, local_rank, backend, device, launcher)
    if found is None:
        if verbose:
            print("init_distributed_mode: no launcher found (no RANK/WORLD_SIZE from torchrun, "
                  "OMPI_COMM_WORLD_* from mpirun or SLURM_PROCID from srun): running as a "
                  "single process, not distributed.")
        device = torch.device("cuda", 0) if num_gpus() else torch.device("cpu")
        return DistInfo(0, 1, 0, None, device, "none")
    launcher, rank, world_size, local_rank = found
    if launcher != "torchrun":
        if launcher == "slurm":
            nodes = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                     or env.get("SLURM_NODELIST") or "127.0.0.1")
            env.setdefault("MASTER_ADDR", first_host(nodes))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    use_gpu = num_gpus() > local_rank
    backend = backend or ("nccl" if use_gpu and dist.is_nccl_available() else "gloo")
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, cpu_cores() // _local_world_size(env, world_size)))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    if verbose:
        print(f"init_distributed_mode: {launcher}, rank {rank}/{world_size} (local rank "
              f"{local_rank}), {backend} on {device}, master {env['MASTER_ADDR']}:"
              f"{env['MASTER_PORT']}", flush=True)
    return DistInfo(rank, world_size, local_rank, backend, device, launcher)


def is_main_process() -> bool:
    """True on rank 0, and in a process that is not part of a group (log and save there)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def reduce_value(value, average: bool = True):
    """Sum (or mean, with ``average``) of ``value`` over all ranks; unchanged without a group.

    Args:
        value: a tensor or a Python number (a loss to log, a count of correct predictions).
        average: divide the sum by the world size.

    Returns:
        The same kind of thing: a new tensor for a tensor, a float for a number.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    is_tensor = torch.is_tensor(value)
    if is_tensor:
        t = value.detach().clone()
    else:
        on_gpu = dist.get_backend() == "nccl"
        t = torch.tensor(float(value), dtype=torch.float64,
                         device=torch.cuda.current_device() if on_gpu else "cpu")
    dist.all_reduce(t)
    if average:
        t = (t if t.is_floating_point() else t.double()) / dist.get_world_size()
    return t if is_tensor else t.item()


def cleanup() -> None:
    """Tear the process group down (no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
