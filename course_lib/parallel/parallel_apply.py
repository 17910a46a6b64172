"""``parallel_apply``: call one function per device, each in its own thread.

PyTorch counterpart: ``torch.nn.parallel.parallel_apply`` (read
``torch/nn/parallel/parallel_apply.py``). It is the course's one thread-per-device runner:
``DataParallel`` runs its replicas with it (lesson 05) and ``course_lib.train.train_batch`` its
per-device forward and backward (lesson 04).

What a worker thread must be handed, because PyTorch keeps it per thread:

- grad mode (``torch.no_grad()`` in the caller would otherwise not reach the replicas);
- autocast (``torch.autocast`` in the caller would otherwise leave the replicas in float32);
- the current CUDA device (each thread makes its own GPU current);
- for a CPU "device", a cap of ``cores // k`` intra-op threads, so that k workers share the
  cores instead of k teams of threads fighting over them. The caller's own setting is restored.

PyTorch releases the GIL inside its kernels, so GPUs work at the same time while Python code
(module calls, hooks) still runs one thread at a time.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..devices import Device, as_device, cpu_cores, cpu_threads

__all__ = ["parallel_apply"]


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


class _ThreadState:
    """What the caller's thread had switched on, to be switched on again in a worker thread."""

    def __init__(self, cpu_threads: int):
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in ("cpu", "cuda")}
        self.cpu_threads = cpu_threads

    @contextlib.contextmanager
    def enter(self, device: torch.device | None) -> Iterator[None]:
        """Inside a worker: grad mode, autocast, the current GPU or a CPU thread cap."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for kind, (enabled, dtype) in self.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(kind, dtype=dtype))
            if device is not None and device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            elif device is not None and device.type == "cpu":
                stack.enter_context(cpu_threads(self.cpu_threads))
            yield


def parallel_apply(modules: Sequence[Callable], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict[str, Any]] | None = None,
                   devices: Sequence[Device | None] | None = None, *,
                   threads: bool = True) -> list[Any]:
    """``[modules[i](*inputs[i], **kwargs_tup[i]) for each i]``, one thread per call.

    Args:
        modules: callables, usually replicas from ``replicate`` (or plain functions).
        inputs: one entry per call: a tuple of positional arguments, or a single argument.
        kwargs_tup: optional keyword arguments per call.
        devices: the device of each call (default: the device of its first input tensor, if
            any). A GPU is made current in its thread; a CPU device caps the thread's intra-op
            threads at ``cores // len(modules)``.
        threads: False runs the calls one after another in this thread (nothing to hand over);
            the results are the same.

    Returns:
        The results in call order (``[]`` for no modules, as torch's). An exception raised in
        a call is re-raised here, with a note naming the call (replica) and its device.
    """
    k = len(modules)
    if len(inputs) != k:
        raise ValueError(f"parallel_apply got {k} modules but {len(inputs)} inputs; pass one "
                         "input (or tuple of inputs) per module.")
    if kwargs_tup is None:
        kwargs_tup = [{}] * k
    if len(kwargs_tup) != k:
        raise ValueError(f"parallel_apply got {k} modules but {len(kwargs_tup)} kwargs dicts; "
                         "pass one per module or none.")
    args = [x if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    if devices is None:
        devices = [getattr(_first_tensor(a), "device", None) for a in args]
    if len(devices) != k:
        raise ValueError(f"parallel_apply got {k} modules but {len(devices)} devices.")
    devices = [None if d is None else as_device(d) for d in devices]
    if k == 0:
        return []  # nothing to call, as torch's on a machine with GPUs
    state = _ThreadState(cpu_threads=max(1, cpu_cores() // k))
    results: list[Any] = [None] * k
    errors: list[BaseException | None] = [None] * k

    def call(i: int, handed_over: bool) -> None:
        try:
            if handed_over:
                with state.enter(devices[i]):
                    results[i] = modules[i](*args[i], **kwargs_tup[i])
            else:  # the caller's own thread: its settings apply as they are
                results[i] = modules[i](*args[i], **kwargs_tup[i])
        except BaseException as e:  # noqa: B036 - re-raised in the caller's thread below
            e.add_note(f"(raised in replica {i} on {devices[i] or 'its device'}, inside "
                       "course_lib.parallel.parallel_apply)")
            errors[i] = e

    if not threads or k == 1:
        for i in range(k):
            call(i, handed_over=False)
            if errors[i] is not None:
                break
    else:
        caller_threads = torch.get_num_threads()
        pool = [threading.Thread(target=call, args=(i, True), name=f"replica-{i}")
                for i in range(k)]
        try:
            for th in pool:
                th.start()
        finally:
            for th in pool:
                if th.ident is not None:  # started
                    th.join()
            torch.set_num_threads(caller_threads)  # whether the cap is per thread or not
    for e in errors:
        if e is not None:
            raise e
    return results
