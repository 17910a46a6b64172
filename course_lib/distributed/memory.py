"""Memory per rank: what parameters, gradients and optimizer state hold, and the peak of a step.

PyTorch counterpart: ``torch.cuda.max_memory_allocated`` / ``torch.cuda.memory_stats`` on a GPU
(a CPU has no such counter: ``PeakMemory`` counts live tensors instead). Read more:
Rajbhandari et al., "ZeRO" (SC 2020), section 3.1 (the 16 bytes per parameter of mixed-precision
Adam) and section 5 (what each stage divides by the number of ranks); lesson 11.

``zero_formula`` is the paper's accounting; ``tensor_bytes``, ``optimizer_state_bytes`` and
``PeakMemory`` measure what a rank really holds, to be printed beside it.
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["STAGES", "PeakMemory", "grad_bytes", "optimizer_state_bytes", "tensor_bytes",
           "zero_formula"]

#: What each ZeRO stage shards (divides by the world size), in the paper's names.
STAGES = {0: "DDP (nothing sharded)", 1: "ZeRO-1: optimizer state (P_os)",
          2: "ZeRO-2: + gradients (P_os+g)", 3: "ZeRO-3 / FSDP: + parameters (P_os+g+p)"}


def zero_formula(num_params: int, world_size: int, stage: int, *, param_bytes: float = 2,
                 grad_bytes: float = 2, optimizer_bytes: float = 12) -> dict[str, float]:
    """Bytes per rank by the ZeRO paper's count, for ``num_params`` parameters.

    Mixed-precision Adam (the defaults): 2 bytes of float16 parameter, 2 of float16 gradient and
    12 of optimizer state (float32 master copy, momentum, variance): 16 per parameter. Stage 1
    divides the optimizer state by the world size, stage 2 also the gradients, stage 3 (FSDP)
    also the parameters. Float32 Adam: ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``
    (16 again: the master copy is the parameter itself).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)} ({STAGES}), got {stage!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}.")
    n = world_size
    out = {"params": num_params * param_bytes / (n if stage >= 3 else 1),
           "grads": num_params * grad_bytes / (n if stage >= 2 else 1),
           "optimizer": num_params * optimizer_bytes / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by views, or a tied
    parameter listed twice, counts once; None is skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[StorageWeakRef(storage).cdata] = storage.nbytes()
    return sum(seen.values())


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes held by the ``.grad`` of ``params``."""
    return tensor_bytes(p.grad for p in params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (moments, step counters) on this rank; for a
    sharded optimizer, pass its local one (``ZeroRedundancyOptimizer.optim``)."""
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


class _LiveTensors(TorchDispatchMode):
    """Track every storage an op returns; after each op, sum what is still alive."""

    def __init__(self, peak: PeakMemory):
        super().__init__()
        self.peak = peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.peak._track(t)
        self.peak._update()
        return out


class PeakMemory:
    """Context manager: the most bytes alive at once on ``device`` during the block.

    On CUDA: ``torch.cuda.max_memory_allocated`` (everything the caching allocator handed out).
    On a CPU: live tensors counted by hand. Tensors alive at entry are found through the garbage
    collector (or given as ``tensors``); every tensor an operation returns inside the block is
    tracked (a ``TorchDispatchMode`` sees each op), and its storage counts until every tensor
    seen on it is freed (``.grad`` is such a second tensor); after each op the live
    total is summed from each storage's current size (so a storage resized to 0, as FSDP frees
    its gathered weights, counts 0). Memory a kernel allocates and frees internally, and
    buffers of the communication library, are not seen.

    What the peak is made of (CPU only): set ``phase`` inside the block (``m.phase =
    "backward"``) and each storage remembers the phase it was made in ("before" for those alive
    at entry); at each new peak every live storage is labelled ``classify(tensor, phase)`` (or
    "made in <phase>" where that returns None) and the bytes are summed per label.

    Attributes, after the block: ``peak`` (bytes), ``start`` (bytes alive at entry),
    ``end`` (bytes alive at exit), ``breakdown`` ({label: bytes} at the peak, summing to
    ``peak``; CPU only, empty on CUDA).
    """

    def __init__(self, device: torch.device | str = "cpu",
                 tensors: Iterable[torch.Tensor] | None = None,
                 classify: Callable[[torch.Tensor, str], str | None] | None = None):
        self.device = torch.device(device)
        self._given = None if tensors is None else list(tensors)
        self._live: dict[int, list[weakref.ref]] = {}  # storage -> tensors on it
        self._made_in: dict[int, str] = {}
        self.classify = classify
        self.phase = "before"
        self.peak = self.start = self.end = 0
        self.breakdown: dict[str, int] = {}

    def _track(self, t: torch.Tensor) -> None:
        """Remember ``t`` (a weak reference): its storage counts while any tensor seen on it
        lives. Every such tensor is kept, not only the first: autograd hands a gradient to
        ``.grad`` as a new tensor on the same storage (``detach``) and drops the first."""
        if t.device.type == "cpu" and t.layout == torch.strided:
            key = StorageWeakRef(t.untyped_storage()).cdata
            refs = [r for r in self._live.get(key, []) if r() is not None]
            if not refs:
                self._made_in[key] = self.phase
            if not any(r() is t for r in refs):
                refs.append(weakref.ref(t))
            self._live[key] = refs

    def _alive(self, key: int) -> torch.Tensor | None:
        """A live tensor on storage ``key``, or None when every one seen has been freed."""
        return next((t for t in (r() for r in self._live[key]) if t is not None), None)

    def _total(self) -> int:
        total, dead = 0, []
        for key in self._live:
            t = self._alive(key)
            if t is None:
                dead.append(key)
            else:
                total += t.untyped_storage().nbytes()
        for key in dead:
            del self._live[key], self._made_in[key]
        return total

    def _update(self) -> None:
        total = self._total()
        if total > self.peak or not self.breakdown:
            self.peak = max(self.peak, total)
            self._label()

    def _label(self) -> None:
        """{label: bytes} of the storages alive now (called at each new peak)."""
        parts: dict[str, int] = {}
        for key in self._live:
            t = self._alive(key)
            if t is not None:
                made_in = self._made_in[key]
                label = self.classify(t, made_in) if self.classify is not None else None
                label = label or f"made in {made_in}"
                parts[label] = parts.get(label, 0) + t.untyped_storage().nbytes()
        self.breakdown = parts

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        # type(), not isinstance(): some module objects warn when asked for __class__
        found = self._given if self._given is not None else [
            o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        for t in found:
            self._track(t)
            if isinstance(t, torch.Tensor) and t.grad is not None:
                self._track(t.grad)
        self.start = self.peak = self._total()
        self._label()
        self._mode = _LiveTensors(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.end = torch.cuda.memory_allocated(self.device)
            return
        try:
            self._mode.__exit__(*exc)
        finally:
            self.end = self._total()
            if self.end > self.peak:
                self.peak = self.end
                self._label()
