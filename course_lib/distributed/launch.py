"""Start worker processes from a notebook: ``launch(fn, world_size, *args)``.

PyTorch counterpart: ``torch.multiprocessing.spawn`` (and accelerate's ``notebook_launcher``),
made bounded and loud: a rank that raises, dies or hangs makes ``launch`` raise, and no worker
process outlives the call. Read more: https://pytorch.org/docs/stable/multiprocessing.html and
notebook 06. ``run_worker`` is what each worker process runs: the canonical worker of a
multi-process program (join the group, work, report, leave), worth reading on its own.
"""
from __future__ import annotations

import importlib
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..devices import cpu_cores
from .env import _check_timeout, choose_backend
from .processes import (
    descendant_processes,
    kill_processes,
    pid_alive,
    pid_temp_folder,
    stop_process_groups,
    tagged_processes,
)

__all__ = ["LaunchTimeout", "WorkerError", "find_free_port", "launch", "run_worker"]


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


_GUARD = re.compile(r"""if\s+(__name__\s*==\s*['"]__main__['"]"""
                    r"""|['"]__main__['"]\s*==\s*__name__)""")


def unguarded_main_script(again: str) -> str | None:
    """Advice when the running script keeps its code outside ``if __name__ == "__main__":``
    (each worker imports it, so each would ``again``); None in a notebook, under ``python -c``
    or ``-m package``, and for a guarded script."""
    main = sys.modules.get("__main__")
    path, spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if not path or not str(path).endswith(".py") or (spec and spec.name.endswith("__main__")):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return None
    if _GUARD.search(source):
        return None
    return (f"your script {os.path.basename(path)} runs its code when it is imported, and each "
            "worker process imports the script that started it (Python's multiprocessing "
            f"does), so every one would {again}. Put the script's code under "
            "if __name__ == \"__main__\": and run it again.")


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


def run_worker(rank: int, world_size: int, backend: str, init_method: str, timeout_s: float,
               env: dict[str, str], payload: bytes, conn) -> None:
    """What each process started by ``launch`` runs: join the group, call fn, report, leave.

    The reply goes back through ``conn``: ``("ok", pickled result)`` or ``("error", message,
    traceback)``. Any exception, ``SystemExit`` included, becomes a reply, never a silent exit.
    """
    os.setpgrp()  # our own process group: launch can kill us and anything we started at once
    _die_with_parent()
    tag = f"{env['COURSE_LAUNCH_DIR']}#{rank}"  # in the environment of everything we start
    _watch_launcher(int(env["COURSE_LAUNCHER_PID"]), env["COURSE_LAUNCH_DIR"], rank, tag)
    try:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), COURSE_LAUNCH="1",
                          COURSE_LAUNCH_TAG=tag)
        torch.set_num_threads(max(1, cpu_cores() // world_size))
        # NCCL: bind this rank's GPU to the group, so that barrier() and collectives need not
        # guess it (torch warns when they do)
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        fn, args = pickle.loads(payload)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s),
                                device_id=device_id)
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
    _kill_what_we_started(tag)


def _kill_what_we_started(tag: str) -> None:
    """Kill this worker's descendants, by parenthood or by ``tag`` in their environment."""
    kill_processes(descendant_processes([os.getpid()]) + tagged_processes("COURSE_LAUNCH_TAG",
                                                                           tag))


def _watch_launcher(launcher: int, folder: str, rank: int, tag: str, every: float = 0.5) -> None:
    """Die (with everything this worker started) within ``every`` s of the launcher's death:
    under the forkserver ``PR_SET_PDEATHSIG`` watches the forkserver, not the launcher. Rank 0
    also removes the rendezvous folder and the launcher's multiprocessing folder."""
    def watch() -> None:
        while pid_alive(launcher):
            time.sleep(every)
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            if os.environ.get("COURSE_MP_DIR"):
                shutil.rmtree(os.environ["COURSE_MP_DIR"], ignore_errors=True)
        _kill_what_we_started(tag)  # children that left our group
        os.killpg(0, signal.SIGKILL)  # our own group: this worker and its children

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent exits (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: launch's own kill still applies
        pass


_PRELOADED = False
#: Prefix of the multiprocessing folder of a process that calls ``launch``; its pid follows.
_MP_PREFIX = "pymp-course-"


def _mp_temp_dir() -> str:
    """multiprocessing's temporary folder (the forkserver's socket), ``pymp-course-PID-*``
    unless it has one already: named by pid, so that those left by a ``kill -9`` are removed."""
    import multiprocessing.process
    import multiprocessing.util

    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is None:
        folder = pid_temp_folder(_MP_PREFIX, "-")  # and those of launchers killed earlier
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True),
                                      exitpriority=-100)  # as multiprocessing does for its own
        config["tempdir"] = folder
    return config["tempdir"]


def _context(start_method: str):
    """A torch.multiprocessing context; the forkserver imports torch once, not per worker."""
    global _PRELOADED
    _mp_temp_dir()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver" and not _PRELOADED:
        # Import once in the server what each worker would: the main module (for -m, its
        # top-level package: runpy warns otherwise), torch, and torch._dynamo (DDP and every
        # optimizer's first step import it: 3 to 7 s per worker on a 2-core machine).
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        preload = ["__main__", "torch", "torch.distributed", "torch._dynamo", __name__]
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
        backend: "gloo" or "nccl"; default ``choose_backend(world_size)``: NCCL when every
            rank can have its own GPU, else gloo.
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
    timeout = _check_timeout(timeout, "launch")
    if init_method not in {"file", "tcp", "env"}:
        raise ValueError(f"init_method must be 'file', 'tcp' or 'env', got {init_method!r}.")
    backend = choose_backend(world_size, backend=backend).backend
    _check_importable(fn)
    unguarded = unguarded_main_script("run it, and call launch, again")
    if unguarded:
        raise RuntimeError(f"launch: {unguarded}")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise ValueError(f"launch could not pickle fn and its arguments for the workers: "
                         f"{type(e).__name__}: {e}") from e

    tmpdir = tempfile.mkdtemp(prefix=f"course_launch_{os.getpid()}_")  # whose it is, by pid
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "COURSE_LAUNCHER_PID": str(os.getpid()), "COURSE_LAUNCH_DIR": tmpdir,
           "COURSE_MP_DIR": _mp_temp_dir()}
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
            p = ctx.Process(target=run_worker, name=f"launch-rank{rank}", daemon=True,
                            args=(rank, world_size, backend, url, timeout, env, payload, send_end))
            p.start()
            send_end.close()  # the child holds the other copy; EOF tells us it is gone
            procs.append(p)
            conns.append(recv_end)
        return _collect(procs, conns, deadline, timeout)
    finally:
        # Every worker's group, and what they started in sessions of their own: found by
        # parenthood (while the worker lives) or by the COURSE_LAUNCH_DIR in its environment.
        pids = [p.pid for p in procs if p.pid is not None]
        escaped = descendant_processes(pids)
        stop_process_groups(pids)
        kill_processes(escaped + tagged_processes("COURSE_LAUNCH_DIR", tmpdir))
        for p in procs:  # reap
            p.join(timeout=1)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


#: What a rank's collective raises when a peer went away: the effect, not the cause.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "NCCL communicator was aborted")


def _peer_lost(what: str) -> bool:
    return any(text in what for text in _PEER_LOST)


def _died(procs, rank: int) -> WorkerError:
    """The error for a rank whose process ended without reporting a result."""
    procs[rank].join(timeout=5)
    code = procs[rank].exitcode
    how = (f"was killed by signal {-code}" if code is not None and code < 0
           else f"exited with code {code}")
    return WorkerError(f"rank {rank} {how} without reporting a result (see its stderr above).",
                       rank)


def _root_cause(procs, pending: dict, rank: int, what: str, tb: str, deadline: float,
                grace: float = 3.0) -> tuple[int, str, str]:
    """A rank lost its peer: for ``grace`` s, wait for the rank that raised first (or died)."""
    until = min(deadline, time.monotonic() + grace)
    while pending and time.monotonic() < until:
        for c in wait_for_any(list(pending), timeout=max(0.0, until - time.monotonic())):
            other = pending.pop(c)
            try:
                reply = c.recv()
            except EOFError:
                raise _died(procs, other) from None
            if reply[0] == "error" and not _peer_lost(reply[1]):
                return other, reply[1], reply[2]
    return rank, what, tb


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
                raise _died(procs, rank) from None
            if reply[0] == "error":
                _, what, tb = reply
                if _peer_lost(what):  # a consequence: wait a moment for the rank that caused it
                    rank, what, tb = _root_cause(procs, pending, rank, what, tb, deadline)
                raise WorkerError(f"rank {rank} raised {what}\n\nTraceback in rank {rank}:\n{tb}",
                                  rank)
            results[rank] = pickle.loads(reply[1])
    for p in procs:  # every worker replied: give each a moment to tear its group down
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    return [results[r] for r in range(len(procs))]
