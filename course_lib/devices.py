"""Devices with a CPU fallback: which GPUs exist, and lists of devices for the lessons.

PyTorch counterpart: ``torch.cuda.device_count`` and ``torch.device``; d2l's ``try_gpu`` /
``try_all_gpus`` (whose CPU fallback returns ``[]`` in d2l 1.0.3; ours never returns empty).
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import os
import platform
import warnings
from collections.abc import Iterator

import torch

__all__ = ["Device", "as_device", "cpu_cores", "cpu_threads", "devices", "hardware_summary",
           "num_gpus", "synchronize", "try_all_gpus", "try_gpu"]


#: What the course accepts as a device: ``torch.device("cuda:1")``, ``"cpu"``, or a GPU index.
Device = torch.device | str | int


def as_device(d: Device) -> torch.device:
    """``torch.device(d)``, where an int is a GPU index (``nn.DataParallel(device_ids=[0, 1])``)."""
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cuda", d)
    return torch.device(d)


def num_gpus() -> int:
    """Number of CUDA GPUs this process can see (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, otherwise the CPU."""
    if i < 0:
        raise ValueError(f"try_gpu expects a GPU index >= 0, got {i}.")
    return torch.device(f"cuda:{i}") if num_gpus() >= i + 1 else torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """All GPUs, or ``[cpu]`` when there is none. Never empty."""
    gpus = [torch.device(f"cuda:{i}") for i in range(num_gpus())]
    return gpus if gpus else [torch.device("cpu")]


def devices(n: int, *, warn: bool = False) -> list[torch.device]:
    """Exactly ``n`` (an integer >= 1) devices: the real GPUs first, then repeats of what exists.

    With fewer than ``n`` GPUs the list repeats devices (on a CPU-only machine ``n`` times the
    CPU): such a run proves that the algorithm is correct, not that it is fast. The lessons print
    the list, which shows the repeats; ``warn=True`` also emits a ``UserWarning`` (off by
    default: on a notebook's stderr it is noise in every lesson that asks for devices).
    """
    try:
        count = operator.index(n)  # any integer type (numpy's too), never a float or a bool
    except TypeError:
        count = None
    if count is None or isinstance(n, bool) or count < 1:
        raise ValueError(f"devices(n) expects an integer n >= 1, got {n!r}.")
    n = count
    real = try_all_gpus()
    out = [real[i % len(real)] for i in range(n)]
    if warn and n > num_gpus():
        what = f"{num_gpus()} GPU(s)" if num_gpus() else "no GPU"
        # Named after this file, relative to the repository: a warning located in the caller
        # would print a notebook's temporary file (/tmp/ipykernel_...), different on every run.
        warnings.warn_explicit(
            f"Asked for {n} devices but this machine has {what}; returning {n} devices that "
            f"repeat {sorted({str(d) for d in real})}. The lesson runs and shows correctness, "
            "not speed.", UserWarning, filename="course_lib/devices.py",
            lineno=inspect.currentframe().f_lineno, module=__name__)
    return out


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (all GPUs if None); a no-op on the CPU. CUDA kernels
    run asynchronously: without this, a timer measures only the launch."""
    if device is None:
        for i in range(num_gpus()):
            torch.cuda.synchronize(i)
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_cores() -> int:
    """CPU cores this process may use (respects affinity masks and containers)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Cap torch's intra-op threads at ``n`` for the body; restore the previous cap after (a
    worker sharing the cores with others takes ``cores // workers``: one per core is the honest
    "device" on a CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_summary() -> str:
    """One block of text naming the CPU, its cores, the GPUs and the torch version (the first
    cell of every notebook prints it, so stored outputs say what measured them)."""
    threads = torch.get_num_threads()
    isa = torch.backends.cpu.get_cpu_capability()   # the vector instructions torch's kernels use
    lines = [f"CPU:     {_cpu_name()} ({cpu_cores()} cores usable, {threads} torch "
             f"thread{'' if threads == 1 else 's'}, {isa} kernels)", f"GPUs:    {num_gpus()}"]
    for i in range(num_gpus()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB")
    lines += [f"torch:   {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
              f"python:  {platform.python_version()} on {platform.system()} {platform.machine()}"]
    return "\n".join(lines)
