"""Run a script under a launcher from a notebook cell: ``torchrun(...)``, ``mpirun(...)``.

PyTorch counterpart: ``torchrun`` (``python -m torch.distributed.run``); Open MPI's ``mpirun``.
Each helper streams the script's output into the cell, fails the cell on a non-zero exit (the
exception shows the last lines the command printed), kills every process it started on a timeout,
and takes them all down with it if its own process is killed, even by SIGKILL (``!torchrun ...``
in a cell would do none of these). Read more: https://pytorch.org/docs/stable/elastic/run.html
and notebook 06.
"""
from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..devices import num_gpus
from .launch import find_free_port
from .processes import kill_processes, stop_process_groups, tagged_processes

__all__ = ["EXAMPLES", "CommandFailed", "CommandTimeout", "example_path", "mpirun",
           "run_commands", "torchrun"]

#: Where the runnable example scripts live (``course_lib/examples/``).
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: How many of a command's last output lines an error shows.
TAIL_LINES = 40


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``text``, indented, with a note of how many were left out."""
    all_lines = (text or "").rstrip("\n").splitlines()
    shown = all_lines[-lines:]
    head = (f"  [... {len(all_lines) - len(shown)} earlier line(s) left out]\n"
            if len(all_lines) > len(shown) else "")
    return head + "".join(f"  | {line}\n" for line in shown) if shown else "  (no output)\n"


class CommandFailed(subprocess.CalledProcessError):
    """A command of ``run_commands`` exited with a non-zero status; the message ends with the
    last lines it printed (``.output`` holds all of it). A ``CalledProcessError``, as before."""

    def __str__(self) -> str:
        return (f"{super().__str__()}\nIts last output lines:\n{_tail(self.output)}"
                f"(the whole output is in the exception's .output)")


class CommandTimeout(subprocess.TimeoutExpired):
    """``run_commands`` ran past its timeout; every process was killed. The message ends with
    the last lines printed (``.output``). A ``subprocess.TimeoutExpired``, as before."""

    def __str__(self) -> str:
        return (f"{super().__str__()} Everything it started was killed. Its last output "
                f"lines:\n{_tail(self.output)}(the whole output is in the exception's "
                f".output; pass a larger timeout if it was only slow)")


# The watchdog: a tiny process (plain Python, untagged) reading a pipe whose write end only the
# caller holds. However the caller exits (SIGKILL included), the read returns, and it SIGKILLs
# every process tagged with the run's tag (torch elastic's workers live in sessions of their own).
_WATCHDOG = r"""
import os, signal, sys, time
tag = ("COURSE_RUN_TAG=" + sys.argv[1]).encode()
signal.signal(signal.SIGINT, signal.SIG_IGN)
while os.read(0, 4096):
    pass
def tagged():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/" + entry + "/environ", "rb") as f:
                    if tag in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found
end = time.monotonic() + 30
while time.monotonic() < end:
    pids = tagged()
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.1)
"""


def _start_watchdog(tag: str) -> tuple[subprocess.Popen | None, int | None]:
    """The watchdog process and the write end of its pipe (None, None where there is no /proc)."""
    if not os.path.isdir("/proc"):
        return None, None
    read_end, write_end = os.pipe()  # not inherited by the commands (close_fds, non-inheritable)
    try:
        watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, tag], stdin=read_end,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return watchdog, write_end


def example_path(name: str) -> Path:
    """Path of a runnable example script in ``course_lib/examples/`` (``"hello_dist.py"``)."""
    path = EXAMPLES / name
    if not path.is_file():
        found = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
        raise FileNotFoundError(f"no example {name!r} in {EXAMPLES}; there are {found}.")
    return path


def _shown(arg) -> str:
    """A command-line argument as echoed: a path relative to where you are, not this machine's."""
    text = str(arg)
    if os.path.isabs(text) and os.path.exists(text) and text != sys.executable:
        return os.path.relpath(text)
    return text


def _stop(procs: Sequence[subprocess.Popen], tag: str) -> None:
    """SIGTERM each command's process group, SIGKILL what is left (also the tagged workers
    torch elastic starts in sessions of their own), reap the leaders."""
    stop_process_groups([p.pid for p in procs], term_grace=3.0)
    kill_processes(tagged_processes("COURSE_RUN_TAG", tag))
    for p in procs:
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
    are stopped and ``CommandFailed`` (a ``subprocess.CalledProcessError``) is raised; after
    ``timeout`` seconds every process group is killed and ``CommandTimeout`` (a
    ``subprocess.TimeoutExpired``) is raised; both show the last lines printed. Everything the
    commands start is tagged (``COURSE_RUN_TAG`` in its environment); a watchdog process kills
    it all if the caller dies without cleaning up (a notebook kernel killed, say).

    Returns:
        The combined stdout and stderr of each command.
    """
    if labels is None:
        labels = [""] if len(commands) == 1 else [f"[{i}] " for i in range(len(commands))]
    tag = f"{os.getpid()}-{time.monotonic_ns()}"  # marks everything these commands start
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {}),
                "COURSE_RUN_TAG": tag}
    lines: queue.Queue = queue.Queue()
    outputs: list[list[str]] = [[] for _ in commands]
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []

    def pump(i: int, stream) -> None:
        for line in stream:
            lines.put((i, line))
        lines.put((i, None))

    watchdog, lifeline = _start_watchdog(tag)
    try:
        for i, cmd in enumerate(commands):
            p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=full_env,
                                 start_new_session=True)
            procs.append(p)
            pumps.append(threading.Thread(target=pump, args=(i, p.stdout), daemon=True))
            pumps[-1].start()
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
        _stop(procs, tag)
        for t in pumps:  # the last lines of a stopped command, for the error below
            t.join(timeout=2)
        while not lines.empty():
            i, line = lines.get_nowait()
            if line is not None:
                outputs[i].append(line)
        for p in procs:  # one pipe per command: closed whatever happened
            if p.stdout is not None:
                p.stdout.close()
        if lifeline is not None:
            os.close(lifeline)       # the watchdog wakes, finds nothing tagged, and exits
            try:
                watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a busy CPU: it exits when it is scheduled
                pass
    texts = ["".join(o) for o in outputs]
    for cmd, code, text in zip(commands, codes, texts):
        if code not in (None, 0):
            raise CommandFailed(code, [str(c) for c in cmd], output=text)
    if timed_out or None in codes:
        raise CommandTimeout([str(c) for c in commands[0]], timeout, output="".join(texts))
    return texts


def torchrun(script: str | Path, *script_args: str, nproc_per_node: int = 2, nnodes: int = 1,
             rdzv: str = "static", timeout: float = 120.0, echo: bool = True) -> list[str]:
    """Run ``script`` under torchrun from a notebook cell; raise on failure or timeout.

    One node: ``python -m torch.distributed.run --standalone --nproc_per_node=N script``.
    Several nodes are simulated on this machine: ``nnodes`` torchrun commands run side by side,
    exactly what you would type on K machines (with the first one's address):

    - ``rdzv="static"``: ``--nnodes=K --node_rank=i --master_addr=127.0.0.1 --master_port=P``;
      every node is told its rank, and all must start.
    - ``rdzv="c10d"``: ``--nnodes=K --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:P
      --rdzv-id=JOB``; no node rank is given, the nodes agree on one at the rendezvous (what
      elastic and fault-tolerant jobs use).

    Returns:
        The output of each torchrun command (one per node).
    """
    if rdzv not in ("static", "c10d"):
        raise ValueError(f"torchrun's rdzv must be 'static' or 'c10d', got {rdzv!r}.")
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes == 1:
        commands = [base + ["--standalone", str(script), *script_args]]
    else:
        port = find_free_port()
        static = ["--master_addr=127.0.0.1", f"--master_port={port}"]
        c10d = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=course-{port}"]
        commands = [base + [f"--nnodes={nnodes}",
                            *([f"--node_rank={i}", *static] if rdzv == "static" else c10d),
                            str(script), *script_args] for i in range(nnodes)]
    if echo:
        for c in commands:
            print("$ " + " ".join(["torchrun", *map(_shown, c[3:])]))
    labels = [f"[node{i}] " for i in range(nnodes)] if nnodes > 1 else [""]
    env = None
    if nnodes > 1:
        # Every simulated node sees this machine's GPUs: each would give its local rank 0 GPU 0,
        # and NCCL refuses two ranks on one GPU. Give each node its own GPUs where there are
        # enough to go round, as K real machines would have, else none (gloo on the CPU).
        gpus = num_gpus()
        if gpus >= nnodes * nproc_per_node:
            commands = [["env", "CUDA_VISIBLE_DEVICES=" + ",".join(
                str(i * nproc_per_node + j) for j in range(nproc_per_node))] + c
                for i, c in enumerate(commands)]
        else:
            env = {"CUDA_VISIBLE_DEVICES": ""}
    return run_commands(commands, timeout, env=env, labels=labels, echo=echo)


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
        print("$ " + " ".join(["mpirun", *map(_shown, cmd[1:])]).replace(sys.executable, "python"))
    return run_commands([cmd], timeout, echo=echo)[0]
