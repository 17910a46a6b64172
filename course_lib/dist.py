"""torch.distributed boilerplate in one place: launch workers, read the launcher's environment.

PyTorch counterparts: ``torch.multiprocessing.spawn`` and ``torchrun`` (``torch.distributed.run``)
start the processes; ``torch.distributed.init_process_group`` joins them; ``dist.all_reduce`` is
what ``ring_allreduce`` rebuilds from ``isend`` / ``irecv``. Read more:
https://pytorch.org/docs/stable/distributed.html and notebook 06.

- ``launch(fn, world_size, *args)``: the notebook's launcher (like accelerate's
  ``notebook_launcher``): bounded, loud on failure, leaves no process behind.
- ``init_distributed_mode()``: the one place that reads torchrun's, Open MPI's or Slurm's
  environment variables (the set-up block at the top of nanoGPT's ``train.py``, as a function).
- ``ring_allreduce``, ``tree_broadcast``, ``ring_all_gather``: collectives written by hand.
- ``torchrun(...)`` and ``mpirun(...)``: run a script under a launcher from a notebook cell, show
  its output, fail the cell on a non-zero exit, kill everything on a timeout.
"""
from __future__ import annotations

import importlib
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .devices import cpu_cores, num_gpus

__all__ = [
    "DistInfo",
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

#: Where the runnable example scripts live (``course_lib/examples/``).
EXAMPLES = Path(__file__).resolve().parent / "examples"


# ------------------------------------------------------------------------------------------------
# launch: worker processes from a notebook
# ------------------------------------------------------------------------------------------------

class WorkerError(RuntimeError):
    """A worker of ``launch`` raised (or died); the message holds its traceback."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class LaunchTimeout(TimeoutError):
    """``launch`` reached its ``timeout`` before every worker had returned."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for tcp:// and env:// rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(fn: Callable) -> None:
    """Raise a clear error when worker processes could not import ``fn`` by its name."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None:  # a callable object, a functools.partial: pickle says
        return
    where = f"{module}.{qualname}"
    hint = ("Worker processes are fresh interpreters: they import fn by module and name. Put the "
            "function in a .py file (for example a module in course_lib, or one written with "
            "%%writefile next to the notebook) and import it from there.")
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"launch expects an importable function, got {where}, defined in a "
                         f"notebook cell or an interactive session. {hint}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"launch expects a module-level function, got {where} (a lambda or a "
                         f"function defined inside another function). {hint}")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"launch cannot import fn as {where} ({e}). {hint}") from e
    if obj is not fn:
        raise ValueError(f"{where} names a different object than the fn given to launch "
                         f"(was it redefined?). {hint}")


def _pick_backend(world_size: int) -> str:
    """NCCL when every rank gets a GPU of its own, gloo otherwise."""
    if dist.is_nccl_available() and num_gpus() >= world_size:
        return "nccl"
    return "gloo"


def _worker(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
            env: dict[str, str], payload: bytes, conn) -> None:
    """Entry point of each process started by ``launch``; reports through ``conn``."""
    os.setpgrp()  # our own process group: launch can kill us and anything we started at once
    _die_with_parent()
    try:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), COURSE_LAUNCH="1")
        torch.set_num_threads(max(1, cpu_cores() // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        fn, args = pickle.loads(payload)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        # Every rank fully connected before any may return and exit: without this, a rank whose
        # fn makes no collective can leave while a peer is still connecting to it.
        dist.barrier()
        result = fn(*args)
        reply = ("ok", pickle.dumps(result))
    except BaseException as e:  # noqa: B036 - everything goes back to the parent, loudly
        reply = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        conn.send(reply)
    except Exception as e:  # the result would not pickle, or the parent is gone
        conn.send(("error", f"could not send the result back: {type(e).__name__}: {e}",
                   traceback.format_exc()))
    finally:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent exits (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: launch's own kill still applies
        pass


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member that is not a zombie."""
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it exited while we looked
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:  # state, ..., pgrp
                return True
        return False
    try:  # no /proc: ask the kernel (zombies count as alive here)
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _wait_groups_gone(pgids: Sequence[int], timeout: float = 10.0) -> None:
    """Block until every process in these groups has died (a SIGKILL is not instantaneous:
    the process must be scheduled to die, which takes a while on a loaded machine)."""
    end = time.monotonic() + timeout
    for pgid in pgids:
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.02)


def _kill(procs) -> None:
    """SIGKILL each live worker and its process group, reap it, and wait until all are gone."""
    pids = [p.pid for p in procs if p.pid is not None]
    for pid in pids:
        for kill in (os.killpg, os.kill):  # the group (anything the worker started), then it
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
    _wait_groups_gone(pids)


_PRELOADED = False


def _context(start_method: str):
    """A torch.multiprocessing context; the forkserver imports torch once, not per worker."""
    global _PRELOADED
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _PRELOADED:
        # Workers re-import the main module of a script (or of `python -m pkg.mod`) before they
        # run: import it (for -m, its top-level package: importing pkg.mod itself would make
        # runpy warn) in the server once, with torch, and forking a worker costs little.
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        preload = ["__main__", "torch", "torch.distributed", __name__]
        ctx.set_forkserver_preload(preload + ([main_spec.name.partition(".")[0]] if main_spec
                                              else []))
        _PRELOADED = True
    return ctx


def launch(fn: Callable, world_size: int, *args, backend: str | None = None,
           timeout: float = 300.0, init_method: str = "file",
           start_method: str = "forkserver") -> list:
    """Run ``fn(*args)`` in ``world_size`` new processes joined in one process group.

    Each worker gets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` in its environment, an
    initialised default group (ask ``dist.get_rank()``), ``cores // world_size`` torch threads
    (at least 1) and ``GLOO_SOCKET_IFNAME=lo``. The group is torn down after ``fn`` returns.

    Failure is bounded and loud: when a rank raises or dies, the others are killed at once and
    ``WorkerError`` carries that rank's traceback; when ``timeout`` seconds pass first, every
    worker is killed and ``LaunchTimeout`` is raised. No worker outlives the call.

    Args:
        fn: a module-level function that worker processes can import (not one defined in a
            notebook cell: workers are fresh interpreters that import ``fn`` by name).
        world_size: number of processes (>= 1).
        *args: passed to ``fn`` in every rank (must pickle).
        backend: "gloo" or "nccl"; default NCCL when every rank can have its own GPU, else gloo.
        timeout: seconds for the whole launch; also each collective's timeout in the workers.
        init_method: "file" (a rendezvous file in a fresh temporary directory: no port to
            collide with), "tcp" (``tcp://127.0.0.1:PORT``) or "env" (``env://`` reading
            ``MASTER_ADDR`` / ``MASTER_PORT``, which launch sets to a free port).
        start_method: "forkserver" (default: a server process imports torch once and forks
            each worker from it, so a launch takes a fraction of a second instead of
            seconds) or "spawn" (a fresh interpreter per worker). Both need ``fn`` importable.

    Returns:
        ``fn``'s return values, ordered by rank.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch expects an integer world_size >= 1, got {world_size!r}.")
    if timeout <= 0:
        raise ValueError(f"launch expects a positive timeout in seconds, got {timeout!r}.")
    if init_method not in {"file", "tcp", "env"}:
        raise ValueError(f"init_method must be 'file', 'tcp' or 'env', got {init_method!r}.")
    backend = backend or _pick_backend(world_size)
    if backend == "nccl" and num_gpus() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: {world_size} ranks, "
                         f"{num_gpus()} GPU(s). Use backend='gloo' or fewer ranks.")
    _check_importable(fn)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(f"launch could not pickle fn and its arguments for the workers: "
                         f"{type(e).__name__}: {e}") from e

    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    tmpdir = tempfile.mkdtemp(prefix="course_launch_")
    if init_method == "file":
        url = f"file://{tmpdir}/rendezvous"
    elif init_method == "tcp":
        url = f"tcp://127.0.0.1:{find_free_port()}"
    else:
        url = "env://"
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))

    ctx = _context(start_method)
    deadline = time.monotonic() + timeout
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"launch-rank{rank}", daemon=True,
                            args=(rank, world_size, backend, url, timeout, env, payload, send_end))
            p.start()
            send_end.close()  # the child holds the other copy; EOF tells us it is gone
            procs.append(p)
            conns.append(recv_end)
        return _collect(procs, conns, deadline, timeout)
    finally:
        _kill([p for p in procs if p.is_alive()])
        for p in procs:
            p.join(timeout=1)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(procs, conns, deadline: float, timeout: float) -> list:
    """Wait for one reply per rank; raise on the first error, a silent death, or the deadline."""
    results: dict[int, object] = {}
    pending = {c: rank for rank, c in enumerate(conns)}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(pending.values())
            raise LaunchTimeout(f"launch timed out after {timeout:g} s: rank(s) {missing} had "
                                "not returned (a hang in a collective, or a slow fn?). Every "
                                "worker was killed; raise timeout= if the work needs longer.")
        for c in wait_for_any(list(pending), timeout=left):
            rank = pending.pop(c)
            try:
                reply = c.recv()
            except EOFError:
                procs[rank].join(timeout=5)
                code = procs[rank].exitcode
                how = (f"was killed by signal {-code}" if code is not None and code < 0
                       else f"exited with code {code}")
                raise WorkerError(f"rank {rank} {how} without reporting a result "
                                  "(see its stderr above).", rank) from None
            if reply[0] == "error":
                _, what, tb = reply
                raise WorkerError(f"rank {rank} raised {what}\n\nTraceback in rank {rank}:\n{tb}",
                                  rank)
            results[rank] = pickle.loads(reply[1])
    for p in procs:  # every worker replied: give each a moment to tear its group down
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    return [results[r] for r in range(len(procs))]


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


# ------------------------------------------------------------------------------------------------
# Collectives by hand, from point-to-point operations
# ------------------------------------------------------------------------------------------------

def _peers(group) -> tuple[int, int, int, int]:
    """(rank, world_size, global rank of the right neighbour, of the left) on the ring."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, world, glob((rank + 1) % world), glob((rank - 1) % world)


def _exchange(send: torch.Tensor, right: int, recv: torch.Tensor, left: int, group) -> None:
    """Send to the right neighbour while receiving from the left one; empty chunks are skipped."""
    ops = []
    if recv.numel():  # the receive first: the data can land in place as soon as it arrives
        ops.append(dist.irecv(recv, left, group=group))
    if send.numel():
        ops.append(dist.isend(send, right, group=group))
    for op in ops:
        op.wait()


#: One receive buffer per (dtype, device), grown on demand: a fresh 32 MB buffer per call costs
#: thousands of page faults (about a tenth of a 64 MB allreduce on loopback).
_SCRATCH: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of at least ``numel`` elements (its first ``numel`` are returned)."""
    buf = _SCRATCH.get((dtype, device))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


#: Pipelining: each chunk travels in segments of about this size (at most MAX_SEGMENTS of them),
#: so one segment is passed on while the next is still arriving, as in gloo's and NCCL's rings.
SEGMENT_BYTES = 2 * 2**20
MAX_SEGMENTS = 8


def ring_allreduce(tensor: torch.Tensor, group=None, segments: int | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, by a ring of sends and receives.

    The flat tensor is cut into ``p = world_size`` chunks. In step s (of ``2 (p - 1)``) every
    rank sends chunk ``rank - s`` to its right neighbour and receives chunk ``rank - s - 1`` from
    its left one. In the first ``p - 1`` steps (reduce-scatter) it adds the received chunk into
    its own; afterwards rank r holds the full sum of chunk ``r + 1``. In the last ``p - 1``
    steps (all-gather) the finished chunks travel round the ring and land in place. What a rank
    sends in step s + 1 is what it received in step s. Each rank sends ``2 (p - 1) / p`` times
    the tensor, whatever ``p``: the bandwidth-optimal schedule of gloo's and NCCL's rings.

    Args:
        tensor: the same shape and dtype on every rank; overwritten with the sum.
        group: the process group (default: the whole world).
        segments: pieces per chunk (default: about ``SEGMENT_BYTES`` each, 1 for small
            tensors). A piece is sent on as soon as it has arrived (and been added), so the
            steps overlap instead of waiting for whole chunks. ``segments=1`` is the textbook
            schedule.

    Returns:
        ``tensor``, for convenience.
    """
    rank, world, right, left = _peers(group)
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    n = flat.numel()
    bounds = [i * n // world for i in range(world + 1)]  # chunk sizes differ by at most one
    chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(world)]  # views, no copies
    largest = -(-n // world)
    if segments is None:
        segments = max(1, min(MAX_SEGMENTS, largest * flat.element_size() // SEGMENT_BYTES))
    spare = _scratch(2 * largest, flat.dtype, flat.device)  # reduce-scatter receives alternate
    spare = (spare[:largest], spare[largest:])  # between these two halves

    def pieces(t: torch.Tensor) -> list[torch.Tensor]:
        m = t.numel()
        return [t[j * m // segments:(j + 1) * m // segments] for j in range(segments)]

    sends = []

    def send(step: int, j: int) -> None:
        piece = pieces(chunks[(rank - step) % world])[j]
        if piece.numel():  # empty chunks (fewer elements than ranks) are not sent at all
            sends.append(dist.isend(piece, right, group=group, tag=step * segments + j))

    def receive(step: int):
        target = chunks[(rank - step - 1) % world]
        into = spare[step % 2][:target.numel()] if step < world - 1 else target
        ops = [dist.irecv(piece, left, group=group, tag=step * segments + j) if piece.numel()
               else None for j, piece in enumerate(pieces(into))]
        return ops, pieces(into), pieces(target)

    steps = 2 * (world - 1)
    incoming = receive(0)
    for j in range(segments):
        send(0, j)
    for step in range(steps):
        ops, arrived, target = incoming
        if step + 1 < steps:
            incoming = receive(step + 1)  # posted early: the data can land as soon as it comes
        for j in range(segments):
            if ops[j] is not None:
                ops[j].wait()
            if step < world - 1:  # reduce-scatter: add the neighbour's partial sum into ours
                target[j].add_(arrived[j])
            if step + 1 < steps:
                send(step + 1, j)  # and pass it on at once
    for op in sends:
        op.wait()

    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank in place, along a binomial tree.

    In round k every rank that already has the data sends it to the rank ``2**k`` places
    further on, so ``p`` ranks are done after ``ceil(log2 p)`` rounds instead of ``p - 1``
    sends from ``src``. Counterpart: ``dist.broadcast``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    me = (rank - src) % world  # position in the tree, with src at the root
    step = 1
    while step < world:
        if me < step and me + step < world:
            dist.send(tensor, glob((me + step + src) % world), group=group)
        elif step <= me < 2 * step:
            dist.recv(tensor, glob((me - step + src) % world), group=group)
        step *= 2
    return tensor


def ring_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                    group=None) -> list[torch.Tensor]:
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank, passing pieces round a ring.

    In ``p - 1`` steps each rank forwards to its right neighbour the piece it received last.
    Counterpart: ``dist.all_gather`` (same arguments).
    """
    rank, world, right, left = _peers(group)
    if len(tensor_list) != world:
        raise ValueError(f"ring_all_gather expects a list of {world} tensors (one per rank), "
                         f"got {len(tensor_list)}.")
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        _exchange(tensor_list[(rank - step) % world], right,
                  tensor_list[(rank - step - 1) % world], left, group)
    return tensor_list


# ------------------------------------------------------------------------------------------------
# Launchers from a notebook cell: torchrun and mpirun, bounded and loud
# ------------------------------------------------------------------------------------------------

def example_path(name: str) -> Path:
    """Path of a runnable example script in ``course_lib/examples/`` (``"hello_dist.py"``)."""
    path = EXAMPLES / name
    if not path.is_file():
        found = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
        raise FileNotFoundError(f"no example {name!r} in {EXAMPLES}; there are {found}.")
    return path


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each command's whole process group, then SIGKILL what is left of it.

    The group is signalled even when its leader has already exited: a command's children
    (``sleep 300 &`` in a shell script, torchrun's workers) may outlive it.
    """
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if _group_alive(p.pid)]
        if not live:
            break
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if sig == signal.SIGTERM:
            _wait_groups_gone([p.pid for p in live], timeout=max(0.0, end - time.monotonic()))
    _wait_groups_gone([p.pid for p in procs])
    for p in procs:  # reap the leaders
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def run_commands(commands: Sequence[Sequence[str]], timeout: float = 120.0, *,
                 env: dict[str, str] | None = None, labels: Sequence[str] | None = None,
                 echo: bool = True) -> list[str]:
    """Run commands side by side, show their output, and fail loudly.

    Each command runs in its own session (process group). Its output lines are printed as
    they come (prefixed with its label when there are several). On a non-zero exit the others
    are stopped and ``subprocess.CalledProcessError`` is raised; after ``timeout`` seconds
    every process group is killed and ``subprocess.TimeoutExpired`` is raised.

    Returns:
        The combined stdout and stderr of each command.
    """
    if labels is None:
        labels = [""] if len(commands) == 1 else [f"[{i}] " for i in range(len(commands))]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    lines: queue.Queue = queue.Queue()
    outputs: list[list[str]] = [[] for _ in commands]
    procs: list[subprocess.Popen] = []

    def pump(i: int, stream) -> None:
        for line in stream:
            lines.put((i, line))
        lines.put((i, None))

    try:
        for i, cmd in enumerate(commands):
            p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=full_env,
                                 start_new_session=True)
            procs.append(p)
            threading.Thread(target=pump, args=(i, p.stdout), daemon=True).start()
        deadline, open_streams, timed_out = time.monotonic() + timeout, len(procs), False
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                i, line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in procs):
                    # one command failed; the others may wait for it forever: a short grace
                    deadline = min(deadline, time.monotonic() + 2)
                continue
            if line is None:
                open_streams -= 1
            else:
                outputs[i].append(line)
                if echo:
                    print(labels[i] + line, end="", flush=True)
        for p in procs:
            try:
                p.wait(timeout=0 if timed_out else 5)
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p in procs]  # None: still running, stopped below
    finally:
        _stop(procs)
    texts = ["".join(o) for o in outputs]
    for cmd, code, text in zip(commands, codes, texts):
        if code not in (None, 0):
            raise subprocess.CalledProcessError(code, [str(c) for c in cmd], output=text)
    if timed_out or None in codes:
        raise subprocess.TimeoutExpired([str(c) for c in commands[0]], timeout,
                                        output="".join(texts))
    return texts


def torchrun(script: str | Path, *script_args: str, nproc_per_node: int = 2, nnodes: int = 1,
             timeout: float = 120.0, echo: bool = True) -> list[str]:
    """Run ``script`` under torchrun from a notebook cell; raise on failure or timeout.

    One node: ``python -m torch.distributed.run --standalone --nproc_per_node=N script``.
    Several nodes are simulated on this machine: ``nnodes`` torchrun commands with
    ``--nnodes=K --node_rank=i --master_addr=127.0.0.1 --master_port=P``, run side by side,
    exactly what you would type on K machines (with the first one's address as master).

    Returns:
        The output of each torchrun command (one per node).
    """
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes == 1:
        commands = [base + ["--standalone", str(script), *script_args]]
    else:
        port = find_free_port()
        commands = [base + [f"--nnodes={nnodes}", f"--node_rank={i}", "--master_addr=127.0.0.1",
                            f"--master_port={port}", str(script), *script_args]
                    for i in range(nnodes)]
    if echo:
        for c in commands:
            print("$ " + " ".join(["torchrun", *map(str, c[3:])]))
    labels = [f"[node{i}] " for i in range(nnodes)] if nnodes > 1 else [""]
    return run_commands(commands, timeout, labels=labels, echo=echo)


def mpirun(script: str | Path, *script_args: str, np: int = 2, timeout: float = 120.0,
           echo: bool = True) -> str:
    """Run ``python script`` under Open MPI's ``mpirun -np N`` from a notebook cell.

    The script does not call MPI itself: mpirun starts the processes and sets
    ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``, which ``init_distributed_mode``
    reads to join a gloo group at ``MASTER_ADDR:MASTER_PORT`` (passed with ``-x``).
    ``--oversubscribe`` lets N exceed the cores; as root, ``--allow-run-as-root`` is needed.

    Returns:
        mpirun's output. Raises ``FileNotFoundError`` when ``mpirun`` is not installed.
    """
    exe = shutil.which("mpirun")
    if exe is None:
        raise FileNotFoundError("mpirun is not installed (Debian/Ubuntu: apt-get install "
                                "openmpi-bin; `make setup` does it where apt is usable).")
    cmd = [exe, "-np", str(np), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={find_free_port()}",
            "-x", "GLOO_SOCKET_IFNAME=lo", "-x", "PYTHONUNBUFFERED=1",
            sys.executable, str(script), *script_args]
    if echo:
        print("$ " + " ".join(["mpirun", *cmd[1:]]).replace(sys.executable, "python"))
    return run_commands([cmd], timeout, echo=echo)[0]
