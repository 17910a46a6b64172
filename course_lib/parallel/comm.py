"""Communication between devices inside one process: replicate_params, allreduce, scatter.

PyTorch counterpart: ``torch.nn.parallel.comm`` (``broadcast``, ``reduce_add``, ``scatter``,
``gather``) and ``torch.nn.parallel.scatter``; the collectives of ``torch.distributed`` are the
multi-process sequel (notebook 06). Source: d2l's "Multiple GPUs" chapter (``get_params``,
``allreduce``, ``split_batch``), and the ring allreduce of Baidu / Horovod.

Every function works on any list of devices: several GPUs, one GPU, or the CPU repeated
(``course_lib.devices.devices(n)``). With repeated devices the tensors share a device but never
a buffer: each "device" owns its own copy, so the math is exactly that of separate devices.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..distributed.collectives import ring_chunk_bounds

__all__ = ["allreduce", "broadcast", "check_allreduce", "gather", "get_params", "ps_allreduce",
           "replicate_params", "ring_allreduce", "scatter", "split_batch"]

Device = torch.device | str


# --- replication -----------------------------------------------------------------------------

def get_params(params: Sequence[torch.Tensor], device: Device) -> list[torch.Tensor]:
    """Copies of ``params`` on ``device``, each a fresh leaf that requires grad.

    Always copies (``Tensor.to`` alone returns the same tensor when it is already on ``device``,
    and two "devices" sharing one parameter tensor would silently share its updates).
    """
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


def replicate_params(params: Sequence[torch.Tensor],
                     devices: Sequence[Device]) -> list[list[torch.Tensor]]:
    """One independent copy of ``params`` per device: ``replicate_params(params, devices)[i]``
    is on ``devices[i]``. (``course_lib.parallel.replicate`` copies a module instead.)"""
    return [get_params(params, d) for d in devices]


def broadcast(tensor: torch.Tensor, devices: Sequence[Device]) -> list[torch.Tensor]:
    """A copy of ``tensor`` on each of ``devices`` (always a new tensor, even on its own device).

    The copies stay in the autograd graph (gradients flow back to ``tensor``); call it on
    ``tensor.detach()`` to get plain data. Counterpart: ``torch.nn.parallel.comm.broadcast``.
    """
    return [tensor.to(d, copy=True) for d in devices]


# --- split and join along the batch dimension ------------------------------------------------

def scatter(tensor: torch.Tensor, devices: Sequence[Device]) -> list[torch.Tensor]:
    """Split ``tensor`` along dim 0 into the chunks of ``torch.chunk`` and put chunk i on
    ``devices[i]``.

    Like ``nn.parallel.scatter`` (which this calls when the tensor and every device are GPUs),
    the chunks have size ``ceil(B / n)`` except the last, which holds what is left (B=10 over 4
    devices: sizes 3, 3, 3, 1), so some batches run out before the last devices. Otherwise
    (a CPU tensor, CPU devices, mixed lists) the same split is done with ``torch.chunk`` and
    ``.to``. Chunks that stay on ``tensor``'s device are views of it. Differentiable either way.
    """
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("scatter needs at least one device, got an empty list.")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"scatter splits one tensor, got a {type(tensor).__name__}; for tuples, "
                        "namedtuples, lists and dicts of tensors use scatter_kwargs.")
    if tensor.dim() == 0:
        raise ValueError("scatter splits along dim 0 and needs a tensor with at least one "
                         "dimension, got a 0-d tensor.")
    if tensor.is_cuda and all(d.type == "cuda" for d in devices):
        # (a CPU tensor takes the path below: if it requires grad, the backward of torch's
        # Scatter gathers the gradient to device -1, and torch.nn.parallel.comm.gather warns that
        # -1 is deprecated (FutureWarning); without grad, both paths make the same chunks)
        return list(nn.parallel.scatter(tensor, devices))
    chunks = torch.chunk(tensor, len(devices), dim=0)      # sizes ceil(B/n), ..., remainder
    return [c.to(d) for c, d in zip(chunks, devices)]


def gather(tensors: Sequence[torch.Tensor], device: Device, dim: int = 0) -> torch.Tensor:
    """Concatenate ``tensors`` (from any devices) along ``dim`` on ``device``: the inverse of
    ``scatter``. Differentiable. Counterpart: ``torch.nn.parallel.comm.gather``."""
    if not tensors:
        raise ValueError("gather needs at least one tensor, got an empty list.")
    return torch.cat([t.to(device) for t in tensors], dim=dim)


def split_batch(X: torch.Tensor, y: torch.Tensor,
                devices: Sequence[Device]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a minibatch and its labels together over ``devices`` (the same chunks for both).

    The chunks are ``scatter``'s, ``torch.chunk``'s sizes as in ``nn.DataParallel``: chunks of
    ``ceil(B / n)`` examples, so a batch can run out before the last devices. A batch of fewer
    examples than devices is an error (no split at all gives every device one). When there are
    enough examples but ``torch.chunk``'s sizes still leave devices idle (5 or 6 over 4), the
    batch is split anyway, with a warning naming the idle devices and the next batch size that
    fills them all (a balanced split, ``B // n`` or ``B // n + 1`` examples each, would too).

    Returns:
        ``(X_shards, y_shards)``; shard i of each is on ``devices[i]``. There may be fewer
        shards than devices (see ``scatter``).

    Raises:
        ValueError: when ``X`` and ``y`` disagree on the batch size, or when the batch has
            fewer examples than there are devices (then no split can give every device one).

    Warns:
        UserWarning: when ``B >= n`` but the chunks leave some devices without examples.
    """
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"split_batch: X has {X.shape[0]} examples but y has {y.shape[0]} "
                         "labels; they must have the same size along dim 0.")
    B, n = X.shape[0], len(devices)
    if B < n:
        raise ValueError(
            f"split_batch: a batch of {B} examples over {n} devices: fewer examples than "
            f"devices, so some device gets none whatever the split. Use a batch size of at least "
            f"{n} that torch.chunk spreads over all {n} devices (every multiple of {n} is one; "
            f"{n} itself is the smallest) or fewer devices; drop_last=True in "
            "load_fashion_mnist (or a DataLoader) leaves out a short last batch.")
    X_shards, y_shards = scatter(X, devices), scatter(y, devices)
    if len(X_shards) < n:
        idle = list(range(len(X_shards), n))
        fills = next(b for b in range(B + 1, B + n + 1)      # a multiple of n is one of them
                     if len(torch.chunk(torch.empty(b), n)) == n)
        warnings.warn(
            f"split_batch: a batch of {B} over {n} devices leaves {len(idle)} of them without "
            f"examples (devices {idle}): torch.chunk cuts chunks of ceil({B} / {n}) = "
            f"{X_shards[0].shape[0]} and the batch fills only {len(X_shards)}. The next batch size "
            f"that fills all {n} is {fills} (every multiple of {n} does); a balanced split, "
            f"{B // n} or {B // n + 1} examples per device, would use them all at {B}.",
            stacklevel=2)
    return X_shards, y_shards


# --- allreduce, three ways ------------------------------------------------------------------

def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, one past the last byte) that ``t`` can touch."""
    start = t.storage_offset()
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    size = t.element_size()
    return t.untyped_storage().data_ptr(), start * size, (start + extent) * size


def _check_replicas(tensors: Sequence[torch.Tensor], who: str) -> None:
    """One tensor per device: same shape and dtype, and no two sharing memory."""
    if len(tensors) == 0:
        raise ValueError(f"{who} needs at least one tensor, got an empty list.")
    missing = [i for i, t in enumerate(tensors) if t is None]
    if missing:
        raise ValueError(f"{who} got None for tensors {missing} of {len(tensors)}. If these are "
                         "gradients (p.grad), they do not exist yet: call loss.backward() "
                         "first (a .grad is None until a backward pass reaches it).")
    wrong = [(i, type(t).__name__) for i, t in enumerate(tensors)
             if not isinstance(t, torch.Tensor)]
    if wrong:
        raise TypeError(f"{who} needs a list of tensors, one per device; got {wrong} "
                        "(index, type) among them.")
    shapes = [tuple(t.shape) for t in tensors]
    if len(set(shapes)) > 1:
        raise ValueError(f"{who} needs tensors of one shape, one per device; got shapes "
                         f"{shapes}.")
    dtypes = [t.dtype for t in tensors]
    if len(set(dtypes)) > 1:
        raise ValueError(f"{who} needs tensors of one dtype (the sum would be kept in the first "
                         f"one's); got {[str(d).replace('torch.', '') for d in dtypes]}. Convert "
                         "them first, e.g. t.float().")
    spans = [_span(t) for t in tensors if t.numel() > 0]
    for i in range(len(spans)):
        for j in range(i + 1, len(spans)):
            (a, a0, a1), (b, b0, b1) = spans[i], spans[j]
            if a == b and a0 < b1 and b0 < a1:
                raise ValueError(
                    f"{who} needs one buffer per device, but tensors {i} and {j} share memory "
                    "(the same tensor twice, or overlapping views of one): they are one buffer, "
                    "not one replica per device, and the sum would count it once per entry. "
                    "Pass copies, e.g. from replicate_params or broadcast.")


def _check_independent_replicas(device_params: Sequence[Sequence[torch.Tensor]],
                                who: str) -> None:
    """No tensor of one replica shares memory with a tensor of another (within one replica,
    tied weights may share)."""
    by_storage: dict[int, list[tuple[int, int, int, int]]] = {}
    for r, params in enumerate(device_params):
        for i, t in enumerate(params):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                ptr, lo, hi = _span(t)
                by_storage.setdefault(ptr, []).append((r, i, lo, hi))
    for spans in by_storage.values():
        for a in range(len(spans)):
            for b in range(a + 1, len(spans)):
                (ra, ia, a0, a1), (rb, ib, b0, b1) = spans[a], spans[b]
                if ra != rb and a0 < b1 and b0 < a1:
                    raise ValueError(
                        f"{who} needs one independent copy of the parameters per device, but "
                        f"parameter {ia} of replica {ra} and parameter {ib} of replica {rb} "
                        "share memory (the same tensors, or detached views of them, e.g. "
                        "p.detach()): every update would be applied once per replica. Use "
                        "replicate_params(params, devices), which copies.")


@torch.no_grad()
def allreduce(tensors: Sequence[torch.Tensor]) -> None:
    """The naive allreduce, in place: every tensor ends up holding the sum of all of them.

    Sum everything onto the first device, then copy the sum back into each tensor's own memory
    (``t.copy_(...)``, never ``tensors[i] = ...``, which would only rebind a list entry). Moves
    about 2(n-1) full tensors through the first device.

    Raises:
        ValueError: when the tensors differ in shape or dtype, or share memory.
    """
    _check_replicas(tensors, "allreduce")
    total = tensors[0].clone()                               # a new buffer on devices[0]
    for t in tensors[1:]:
        total += t.to(total.device)                           # reduce: n-1 copies in
    for t in tensors:
        t.copy_(total)                                        # broadcast: n-1 copies out


@torch.no_grad()
def ps_allreduce(tensors: Sequence[torch.Tensor], server: Device = "cpu") -> None:
    """The parameter-server pattern, in place: each worker pushes its tensor to ``server``, the
    server sums, each worker pulls the sum back.

    Every byte crosses the server's link twice per worker: 2n full tensors through one device
    (the first device in ``allreduce`` at least keeps its own). Real parameter servers also keep
    the weights and apply the optimizer step on the server; here only the sum is compared with
    the two allreduce algorithms.

    Raises:
        ValueError: when the tensors differ in shape or dtype, or share memory.
    """
    _check_replicas(tensors, "ps_allreduce")
    pushed = [t.to(server, copy=True) for t in tensors]      # push: n copies to the server
    total = pushed[0]
    for p in pushed[1:]:
        total += p                                            # the server sums
    for t in tensors:
        t.copy_(total)                                        # pull: n copies back


@torch.no_grad()
def ring_allreduce(tensors: Sequence[torch.Tensor], trace: list | None = None) -> None:
    """The ring allreduce, in place: reduce-scatter then all-gather over the ring 0 -> 1 -> ...
    -> n-1 -> 0.

    Each tensor is cut into n chunks. In each of the n-1 reduce-scatter steps, device i sends one
    chunk to device i+1, which adds it to its own copy of that chunk; afterwards device i holds
    the complete sum of chunk (i+1) mod n. In each of the n-1 all-gather steps, device i passes a
    complete chunk on to device i+1, which overwrites its copy. 2(n-1) steps, each moving 1/n of
    the tensor over every link at once: each device sends 2(n-1)/n of the tensor, under twice
    its size however large n is.

    Args:
        tensors: one tensor per device, all of one shape; they must not share memory.
        trace: if a list, one record per step is appended: ``{"phase": "reduce-scatter" or
            "all-gather", "step": s, "sends": [(src, dst, chunk), ...], "state": [flat copy of
            each tensor after the step]}`` (for drawing the ring; costs a copy per step).

    Raises:
        ValueError: when the shapes or dtypes differ or two tensors share memory.
    """
    _check_replicas(tensors, "ring_allreduce")
    n = len(tensors)
    # Work on flat views; a non-contiguous tensor gets a contiguous copy, written back at the end.
    flats = [t.view(-1) if t.is_contiguous() else t.reshape(-1).clone() for t in tensors]
    bounds = ring_chunk_bounds(flats[0].numel(), n)

    def chunk(i: int, c: int) -> torch.Tensor:
        start, end = bounds[c % n]
        return flats[i][start:end]                            # (about numel/n,) on devices[i]

    def record(phase: str, step: int, sends: list) -> None:
        if trace is not None:
            trace.append({"phase": phase, "step": step, "sends": sends,
                          "state": [f.detach().cpu().clone() for f in flats]})

    # Reduce-scatter: at step s device i sends chunk (i - s) to device i + 1, which adds it.
    for s in range(n - 1):
        sends = [(i, (i + 1) % n, (i - s) % n) for i in range(n)]
        # All devices send at once: first everything is received into fresh buffers...
        received = [chunk(src, c).to(flats[dst].device, copy=True) for src, dst, c in sends]
        for (_, dst, c), buf in zip(sends, received):        # ...then each receiver adds.
            chunk(dst, c).add_(buf)
        record("reduce-scatter", s, sends)
    # Device i now holds the full sum of chunk (i + 1). All-gather: pass complete chunks on.
    for s in range(n - 1):
        sends = [(i, (i + 1) % n, (i + 1 - s) % n) for i in range(n)]
        received = [chunk(src, c).to(flats[dst].device, copy=True) for src, dst, c in sends]
        for (_, dst, c), buf in zip(sends, received):
            chunk(dst, c).copy_(buf)
        record("all-gather", s, sends)
    for t, f in zip(tensors, flats):
        if not t.is_contiguous():
            t.copy_(f.view(t.shape))


# --- the check every allreduce must pass ----------------------------------------------------

def check_allreduce(fn: Callable[[list[torch.Tensor]], object],
                    devices: Sequence[Device], shape: tuple[int, ...] = (3, 5),
                    seed: int = 0) -> None:
    """Check that ``fn(tensors)`` is an in-place allreduce over ``devices``.

    Makes one random float64 tensor per device, keeps its own references to them, calls
    ``fn`` on a fresh list, and compares every kept tensor with the plain sum (the oracle). An
    allreduce that only rebinds list entries (``tensors[i] = total``) leaves the caller's
    tensors unchanged and fails here.

    Raises:
        AssertionError: naming the first device whose tensor does not hold the sum.
    """
    gen = torch.Generator().manual_seed(seed)
    held = [torch.randn(shape, generator=gen, dtype=torch.float64).to(d) for d in devices]
    expected = sum(t.cpu() for t in held)                    # the oracle: a plain sum
    fn(list(held))                                            # fn may do what it likes to a list
    for i, t in enumerate(held):
        if not torch.allclose(t.cpu(), expected):
            raise AssertionError(
                f"after {getattr(fn, '__name__', 'fn')}(tensors), the tensor on device {i} "
                f"({devices[i]}) does not hold the sum of all {len(held)} tensors (largest "
                f"difference {float((t.cpu() - expected).abs().max()):.3g}). Did the function "
                "write into the tensors (t.copy_(...), t[:] = ...) or only rebind list entries?")
