"""torch.distributed boilerplate in one place: who am I, which backend, which device?

PyTorch counterpart: ``torch.distributed.init_process_group`` joins the processes that
``torchrun`` (``torch.distributed.run``) or ``torch.multiprocessing.spawn`` started; read more at
https://pytorch.org/docs/stable/distributed.html and in notebook 06.

``init_distributed_mode()`` is the one place that reads torchrun's, Open MPI's or Slurm's
environment variables (the set-up block at the top of nanoGPT's ``train.py``, as a function);
``choose_backend`` is the one place that decides gloo or NCCL and each rank's device, once for the
whole job; ``is_main_process``, ``reduce_value`` and ``cleanup`` are the small helpers every
training script needs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..devices import cpu_cores, num_gpus

__all__ = ["BackendChoice", "DistInfo", "choose_backend", "cleanup", "current_device",
           "first_host", "init_distributed_mode", "is_main_process", "reduce_value"]


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
    launcher: str  # "torchrun", "mpirun", "slurm", "launch" (distributed.launch) or "none"

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


#: Each launcher's variables: (name, rank, world size, local rank).
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def _integer(env, key: str, default: int | None = None) -> int:
    """The integer in ``env[key]``; an error that names the variable when it is not one."""
    text = env.get(key)
    if text is None:
        if default is None:
            raise ValueError(f"init_distributed_mode: {key} is not set.")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"init_distributed_mode: {key}={text!r} is not an integer; the "
                         "launcher sets it to a number (unset it to run as one process).") from None


def _from_environment(env) -> tuple[str, int, int, int] | None:
    """(launcher, rank, world_size, local_rank) from torchrun, Open MPI or Slurm variables.

    Validated up front, naming the variable: a rank without a world size, a value that is not
    an integer, a rank outside ``0 .. world_size - 1``.
    """
    for launcher, rank_key, size_key, local_key in _LAUNCHERS:
        if rank_key not in env:
            continue
        if size_key not in env:
            if launcher == "slurm":  # SLURM_PROCID alone: a Slurm job, but not a task of a step
                continue
            raise ValueError(f"init_distributed_mode: {rank_key} is set but {size_key} is not; "
                             f"a {launcher} job sets both. Set {size_key} to the number of "
                             f"processes, or unset {rank_key} to run as one process.")
        rank, world_size = _integer(env, rank_key), _integer(env, size_key)
        local_rank = _integer(env, local_key, default=0)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"init_distributed_mode: {rank_key}={rank} with {size_key}="
                             f"{world_size}; expected 0 <= {rank_key} < {size_key}.")
        return launcher, rank, world_size, local_rank
    return None


def _local_world_size(env, world_size: int) -> int:
    """Processes on this machine, from the launcher's variable (validated, named)."""
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if key not in env:
            continue
        text = env[key]
        # Slurm writes one count per node, e.g. "2(x3),1": the first one is taken
        slurm = re.fullmatch(r"\s*(\d+)(\(x\d+\))?(,.*)?", text)
        value = int(slurm.group(1)) if slurm and key.startswith("SLURM") else _integer(env, key)
        if value < 1:
            raise ValueError(f"init_distributed_mode: {key}={text!r}; expected the number of "
                             "processes on this machine, at least 1.")
        return min(value, world_size)  # an allocation may hold more tasks than this step runs
    return world_size


def _check_port(env) -> None:
    """MASTER_PORT, when set, is a TCP port: an error naming it instead of torch's own."""
    if "MASTER_PORT" not in env:
        return
    port = _integer(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ValueError(f"init_distributed_mode: MASTER_PORT={env['MASTER_PORT']!r} is not a "
                         "TCP port; expected an integer in 1..65535 (a free one, e.g. 29500).")


def _check_timeout(timeout, who: str) -> float:
    """A finite number of seconds > 0 (nan or inf would wait for ever or overflow)."""
    import math

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{who} expects timeout as a finite number of seconds > 0, got "
                         f"{timeout!r}; e.g. timeout=300.")
    return float(timeout)


@dataclass(frozen=True)
class BackendChoice:
    """The job-wide decision of ``choose_backend``: a backend, and each rank's device."""

    backend: str
    gpu_per_rank: bool  # every local rank has a GPU of its own (else every rank uses the CPU)
    reason: str

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank with this local rank (``cuda:{local_rank % GPUs}`` or cpu)."""
        if not self.gpu_per_rank:
            return torch.device("cpu")
        return torch.device("cuda", local_rank % max(1, num_gpus()))


def choose_backend(local_world_size: int, *, gpus: int | None = None,
                   gpus_per_task: bool = False, backend: str | None = None) -> BackendChoice:
    """Decide gloo or NCCL once for the whole job, from facts every rank shares.

    Every local rank gets a GPU of its own (NCCL), or none does (gloo on the CPU): a per-rank
    decision ("does my local rank have a GPU?") would let rank 0 pick NCCL and rank 1 gloo on a
    machine with one GPU and two processes, and the group could never form.

    Args:
        local_world_size: processes on this machine.
        gpus: GPUs this process sees (default ``num_gpus()``).
        gpus_per_task: the launcher gave each process its own GPUs through
            ``CUDA_VISIBLE_DEVICES`` (Slurm's ``--gpus-per-task``): every process sees only its
            own, so ``gpus >= 1`` is enough.
        backend: force "gloo" or "nccl" (NCCL is refused when the GPUs do not go round).

    Returns:
        A ``BackendChoice``; ``.device(local_rank)`` gives each rank's device.
    """
    if not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"choose_backend expects local_world_size >= 1, got "
                         f"{local_world_size!r}.")
    gpus = num_gpus() if gpus is None else gpus
    enough = gpus >= 1 if gpus_per_task else gpus >= local_world_size
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}.")
    if backend == "nccl" and not enough:
        raise ValueError(f"backend='nccl' needs a GPU per process: {local_world_size} "
                         f"process(es) on this machine, {gpus} GPU(s). Use backend='gloo' or "
                         "fewer processes per machine.")
    if backend == "gloo" or (backend is None and not (enough and dist.is_nccl_available())):
        why = ("gloo was asked for" if backend == "gloo" else
               "no GPU" if gpus == 0 else
               f"{gpus} GPU(s) for {local_world_size} process(es) on this machine: not one each"
               if not enough else "NCCL is not compiled into this torch")
        return BackendChoice("gloo", False, f"gloo on the CPU ({why})")
    how = "one GPU per task from the launcher" if gpus_per_task else \
        f"{gpus} GPU(s) for {local_world_size} process(es)"
    return BackendChoice("nccl", True, f"nccl, one GPU per rank ({how})")


def current_device() -> torch.device:
    """This rank's device inside a process group: its current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed_mode(backend: str | None = None, timeout: float = 300.0,
                          verbose: bool = True) -> DistInfo:
    """Join the process group described by the environment, or run as one process.

    Reads, in this order: torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (and its
    ``MASTER_ADDR`` / ``MASTER_PORT``); Open MPI's ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` /
    ``_LOCAL_RANK``; Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` with the
    first host of ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``) as
    master. Under mpirun and Slurm, ``MASTER_PORT`` defaults to 29500 and under mpirun
    ``MASTER_ADDR`` to 127.0.0.1 (pass ``-x MASTER_ADDR=host`` for several nodes). The backend
    is chosen once for the job by ``choose_backend``: NCCL with GPU ``local_rank`` when every
    process on the machine has a GPU of its own, else gloo on the CPU with
    ``cores // processes-on-this-node`` threads for every rank.

    Args:
        backend: force "gloo" or "nccl" (default: as above).
        timeout: seconds before a collective that cannot complete raises.
        verbose: print one line saying what was found.

    Returns:
        A ``DistInfo`` (rank, world_size, local_rank, backend, device, launcher). When a group
        already exists (inside ``launch``'s workers), it is described, not created again.
    """
    _check_timeout(timeout, "init_distributed_mode")
    env = os.environ
    found = _from_environment(env)
    if dist.is_initialized():  # inside launch's workers, or called twice: use the group as it is
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(env.get("LOCAL_RANK", rank))
        backend, device = dist.get_backend(), current_device()
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
    _check_port(env)
    local_world_size = _local_world_size(env, world_size)
    choice = choose_backend(local_world_size, backend=backend,
                            gpus_per_task=launcher == "slurm" and "SLURM_GPUS_PER_TASK" in env)
    backend, device = choice.backend, choice.device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, cpu_cores() // local_world_size))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    if verbose:
        print(f"init_distributed_mode: {launcher}, rank {rank}/{world_size} (local rank "
              f"{local_rank}), {choice.reason}, {device}, master {env['MASTER_ADDR']}:"
              f"{env['MASTER_PORT']}", flush=True)
    return DistInfo(rank, world_size, local_rank, backend, device, launcher)


def is_main_process() -> bool:
    """True on rank 0, and in a process that is not part of a group (log and save there)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _pin_to_cores() -> list[int] | None:
    """On a CPU, bind the calling thread of this rank to cores of its own: rank r of w gets the
    r-th of w equal slices of the cores the process may use, so that two ranks' main threads
    do not take turns on one core while another waits. Only the calling thread (and threads it
    starts later) is bound: gloo's threads, started with the process group, still run on any
    core, where ``mpirun --bind-to core`` binds every thread of a process. Benchmarks of
    collectives call it first (lesson 10). Nothing where a rank has a GPU, where
    there are fewer cores than ranks, or where the OS has no affinity call (macOS, Windows).

    Returns:
        The cores this thread now runs on, or None where nothing was bound.
    """
    if not dist.is_initialized() or current_device().type != "cpu" or \
            not hasattr(os, "sched_setaffinity"):
        return None
    cores, rank, world = sorted(os.sched_getaffinity(0)), dist.get_rank(), dist.get_world_size()
    if len(cores) < world:
        return None
    share = len(cores) // world
    mine = cores[rank * share:(rank + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine


def _slowest(seconds: float) -> float:
    """The largest ``seconds`` over the ranks, on every rank: a step (or a collective) is as
    slow as its slowest rank (``timing.compare``'s ``reduce``)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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
        t = torch.tensor(float(value), dtype=torch.float64, device=current_device())
    dist.all_reduce(t)
    if average:
        t = (t if t.is_floating_point() else t.double()) / dist.get_world_size()
    return t if is_tensor else t.item()


def cleanup() -> None:
    """Tear the process group down (no-op without one)."""
    if dist.is_initialized():
        dist.destroy_process_group()
