"""Stopping what a launcher started: whole process groups, bounded in time, nothing left behind.

PyTorch counterpart: the teardown inside ``torch.distributed.elastic.multiprocessing`` (torchrun's
``PContext.close``). Both of the course's launchers use this one function: ``launch`` for its
worker processes and ``run_commands`` (``torchrun``, ``mpirun``) for the commands it started.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence

__all__ = ["descendant_processes", "group_alive", "kill_processes", "pid_alive",
           "pid_temp_folder", "stop_process_groups", "tagged_processes"]


def _live_processes() -> Iterator[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every live non-zombie process (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # after "pid (command)": state, ppid, pgrp, ... (the command may hold ")")
                state, ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # it exited while we looked
            continue
        if state not in ("Z", "X"):
            yield int(entry), int(ppid), int(pgrp)


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member that is not a zombie."""
    if os.path.isdir("/proc"):
        return any(pgrp == pgid for _, _, pgrp in _live_processes())
    try:  # no /proc: ask the kernel (zombies count as alive here)
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pid: int, sig: int) -> None:
    """Signal the group led by ``pid`` (anything it started), then ``pid`` itself."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pgids: Sequence[int], timeout: float) -> bool:
    """Block until every process in these groups has died (a SIGKILLed process must still be
    scheduled to die); False if the time ran out."""
    end = time.monotonic() + timeout
    for pgid in pgids:
        while group_alive(pgid):
            if time.monotonic() >= end:
                return False
            time.sleep(0.02)
    return True


def stop_process_groups(leaders: Sequence[int], *, term_grace: float = 0.0,
                        kill_wait: float = 10.0) -> None:
    """Stop every process group led by one of ``leaders`` (each started in its own group).

    With ``term_grace > 0``, SIGTERM first and wait up to that many seconds for the groups to
    exit on their own; then SIGKILL whatever is left and wait (at most ``kill_wait`` s) until
    it is gone. A group is signalled even when its leader has already exited: a command's
    children (``sleep 300 &`` in a shell script, torchrun's workers) may outlive it. The
    callers reap their own children (``Popen.wait``, ``Process.join``).
    """
    live = [pid for pid in leaders if group_alive(pid)]
    if live and term_grace > 0:
        for pid in live:
            _signal(pid, signal.SIGTERM)
        _wait_gone(live, term_grace)
        live = [pid for pid in live if group_alive(pid)]
    for pid in live:
        _signal(pid, signal.SIGKILL)
    _wait_gone(live, kill_wait)


def tagged_processes(key: str, value: str) -> list[int]:
    """Pids of the live processes whose environment holds ``key=value`` (Linux; else ``[]``).

    A launcher marks what it starts with such a tag, to find processes that left its process
    group (torch elastic starts every worker in a new session).
    """
    if not os.path.isdir("/proc"):
        return []
    needle = f"{key}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def descendant_processes(pids: Sequence[int]) -> list[int]:
    """Pids of every live descendant of ``pids`` (children, their children, ...; Linux /proc,
    else ``[]``), also those that started a session or process group of their own.

    Call it while the ancestors are alive: once one exits, its children are reparented (to
    init) and no longer found through it.
    """
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in _live_processes():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux /proc; else ask the kernel)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def pid_temp_folder(prefix: str, sep: str = "_") -> str:
    """A fresh temporary folder ``{prefix}{this pid}{sep}...``; the folders of that name whose
    process is gone (killed before it could remove its own) are removed first."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(prefix):].partition(sep)[0]
        if name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}{sep}")


def kill_processes(pids: Sequence[int], *, wait: float = 5.0) -> None:
    """SIGKILL each process (and the group it leads, if any); wait until they are gone."""
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    end = time.monotonic() + wait
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.02)

