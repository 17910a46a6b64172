"""DistributedDataParallel from scratch: one replica per process, gradients averaged in backward.

PyTorch counterpart: ``torch.nn.parallel.DistributedDataParallel``
(torch/nn/parallel/distributed.py; the buckets live in torch/csrc/distributed/c10d/reducer.cpp).
Read more: picotron's ``data_parallel/`` (the same steps, naive then bucketed), PyTorch's DDP
design notes (https://pytorch.org/docs/stable/notes/ddp.html) and Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020).

Three strategies, in the order the notebook teaches them (``strategy=``):

1. ``"naive"``: wait until backward has produced every gradient, then all-reduce them one by one.
2. ``"overlap"``: a hook starts each gradient's all-reduce (``async_op=True``) as soon as autograd
   has produced it, while backward goes on computing the others; wait once backward is done.
3. ``"bucketed"``: the same with gradients packed into flat buckets of at most ``bucket_cap_mb``:
   a few large all-reduces instead of one per parameter (each one pays a fixed latency).

Every strategy moves gradients in ``Bucket`` s (in the first two each parameter is a bucket of
one) and hands each bucket to a communication hook ``hook(state, bucket) -> Future[Tensor]``
(default ``allreduce_hook``: the average), so torch's hooks and ours work with all three.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

__all__ = [
    "STRATEGIES",
    "Bucket",
    "BucketedStrategy",
    "DistributedDataParallel",
    "NaiveStrategy",
    "OverlapStrategy",
    "allreduce_hook",
    "assign_buckets",
    "bf16_compress_hook",
    "bytes_on_wire",
]

MB = 1024 * 1024  # torch's DDP counts bucket_cap_mb in MiB too
CommHook = Callable[[Any, "Bucket"], torch.futures.Future]


# ------------------------------------------------------------------------------------------------
# Communication hooks: hook(state, bucket) -> a future of the averaged bucket buffer
# ------------------------------------------------------------------------------------------------

def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over the ranks: divide by the world size, all-reduce (sum), asynchronously.

    DDP's default. Dividing before summing keeps the sum in range (it matters in float16).

    Args:
        process_group: the group to average over (None: the default group).
        bucket: a ``Bucket`` (or torch's ``GradBucket``); its ``buffer()`` is averaged in place.

    Returns:
        A future whose value is the averaged buffer.
    """
    buffer = bucket.buffer()                                 # (n,) the bucket's gradients, flat
    buffer.div_(dist.get_world_size(process_group))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket sending half the bytes: cast to bfloat16, all-reduce, cast back, divide.

    bfloat16 keeps float32's range with 8 bits of mantissa: each value travels with about 3
    significant digits. PyTorch counterpart:
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`` (which
    divides before the all-reduce, in bfloat16; here the division happens after, in the
    buffer's own precision).

    Args:
        process_group: the group to average over (None: the default group).
        bucket: a ``Bucket`` (or torch's ``GradBucket``); its ``buffer()`` receives the average.

    Returns:
        A future whose value is the averaged buffer.
    """
    buffer = bucket.buffer()                                 # (n,) float32, say
    compressed = buffer.to(torch.bfloat16)                   # (n,) bfloat16: 2 bytes a value
    world_size = dist.get_world_size(process_group)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0]).div_(world_size)        # (n,) back in the buffer's dtype
        return buffer

    return work.get_future().then(decompress)


def bytes_on_wire(ddp: DistributedDataParallel, dtype: torch.dtype | None = None) -> int:
    """Bytes each rank sends per synchronised step, counted as a ring all-reduce sends them.

    A ring all-reduce of N bytes over p ranks sends 2 (p - 1) / p * N bytes from every rank
    (reduce-scatter, then all-gather): this sums that over the buckets. Compare the default
    with ``dtype=torch.bfloat16`` to see what ``bf16_compress_hook`` saves.

    Args:
        ddp: a ``DistributedDataParallel`` (its buckets say how much is sent).
        dtype: the type the hook sends; default each bucket's own (the gradients' dtype).

    Returns:
        Bytes sent by one rank in one step.
    """
    p = dist.get_world_size(ddp.process_group)
    payload = sum(b.buffer().numel() * (dtype or b.buffer().dtype).itemsize
                  for b in ddp.reducer.buckets)
    return 2 * (p - 1) * payload // p


# ------------------------------------------------------------------------------------------------
# Buckets
# ------------------------------------------------------------------------------------------------

def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameters into buckets of at most ``bucket_cap_bytes``, last parameter first.

    Backward produces gradients roughly in reverse registration order (last layer first), so
    bucket 0 fills first. A parameter larger than the cap gets a bucket of its own; a bucket
    holds one dtype and one device.

    Args:
        params: the parameters in registration order (``module.parameters()``).
        bucket_cap_bytes: most bytes per bucket.

    Returns:
        For each bucket, in launch order, the indices of its parameters in ``params``.
    """
    closed: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (indices, bytes)
    for i in reversed(range(len(params))):
        p = params[i]
        key, size = (p.dtype, p.device), p.numel() * p.element_size()
        indices, used = open_.get(key, ([], 0))
        if indices and used + size > bucket_cap_bytes:  # full: close it, start the next one
            closed.append(indices)
            indices, used = [], 0
        open_[key] = (indices + [i], used + size)
    buckets = closed + [indices for indices, _ in open_.values()]
    return sorted(buckets, key=lambda b: -b[0])  # as torch: by the first gradient to arrive


class Bucket:
    """Gradients of a few parameters packed in one flat buffer, sent by one all-reduce.

    The protocol, one method per step, in the order they happen in a training step:
    ``mark_ready(param)`` as autograd produces each gradient (copies it into the buffer; True
    when it was the last one), ``launch(hook, state)`` to start the all-reduce, ``wait()`` after
    backward, ``copy_back()`` to write the averaged values into each ``param.grad``.

    It also offers the interface of ``torch.distributed.GradBucket`` (``buffer``, ``index``,
    ``parameters``, ``gradients``, ``is_last``, ``set_buffer``), so communication hooks written
    for torch's DDP run on it unchanged.

    Args:
        index: position in launch order (bucket 0 holds the last layers' parameters).
        params: the parameters, all of one dtype and one device.
        names: their qualified names (``"fc2.weight"``), for messages.
        is_last: whether it is the last bucket launched in a step.
    """

    def __init__(self, index: int, params: Sequence[torch.Tensor], names: Sequence[str],
                 is_last: bool):
        self._index, self._params, self.names, self._is_last = index, list(params), names, is_last
        self.numels = [p.numel() for p in self._params]
        self.offsets = [0, *accumulate(self.numels)][:-1]    # where each gradient starts
        self._buffer = torch.zeros(sum(self.numels), dtype=params[0].dtype,
                                   device=params[0].device)  # (n,) on the parameters' device
        self._views = self._shaped(self._buffer)             # [(*p.shape) views of the buffer]
        self._slot = {id(p): i for i, p in enumerate(self._params)}
        self.reset()

    def reset(self) -> None:
        """Forget the current step: nothing ready, nothing in flight."""
        self.ready = [False] * len(self._params)
        self.pending = len(self._params)
        self.future: torch.futures.Future | None = None
        self.result: torch.Tensor | None = None

    def mark_ready(self, param: torch.Tensor) -> bool:
        """Copy ``param.grad`` into the buffer (zeros if it has none); True if it was the last."""
        i = self._slot[id(param)]
        if self.ready[i]:
            raise RuntimeError(f"Bucket {self._index}: the gradient of {self.names[i]} arrived "
                               "twice in one backward; expected each gradient once per "
                               "synchronised backward.")
        if param.grad is None:
            self._views[i].zero_()
        else:
            self._views[i].copy_(param.grad)                 # (*p.shape) into the flat buffer
        self.ready[i] = True
        self.pending -= 1
        return self.pending == 0

    def launch(self, hook: CommHook, state: Any) -> None:
        """Start averaging the buffer: ``hook(state, self)`` returns a future, the work goes on."""
        self.future = hook(state, self)

    def wait(self) -> None:
        """Block until the bucket's all-reduce is done and keep its result (the averaged buffer)."""
        result = self.future.wait()
        if not isinstance(result, torch.Tensor) or result.shape != self._buffer.shape:
            found = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise RuntimeError(f"A communication hook must return a future of a tensor shaped "
                               f"like bucket.buffer(), {tuple(self._buffer.shape)}; bucket "
                               f"{self._index} got {found}.")
        self.result = result

    def copy_back(self, skip: Collection[int] = ()) -> None:
        """Write the averaged gradients into each ``param.grad`` (not those whose id is in skip)."""
        for p, average in zip(self._params, self._shaped(self.result)):  # (*p.shape)
            if id(p) in skip:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(average)  # the parameter's layout, as torch
            else:
                p.grad.copy_(average)

    def unready(self) -> list[torch.Tensor]:
        """The parameters whose gradient has not arrived in this backward."""
        return [p for p, ready in zip(self._params, self.ready) if not ready]

    def _shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        return [flat[o:o + n].view(p.shape)
                for o, n, p in zip(self.offsets, self.numels, self._params)]

    # torch.distributed.GradBucket's interface, for communication hooks
    def buffer(self) -> torch.Tensor:
        """The flat buffer, (sum of the parameters' numel,)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer's values with ``buffer``'s."""
        self._buffer.copy_(buffer)

    def index(self) -> int:
        """Position in launch order."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in a step."""
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients the bucket holds."""
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """The gradients, as views of the buffer shaped like each parameter."""
        return list(self._views)

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, {len(self._params)} params, "
                f"{self._buffer.numel() * self._buffer.element_size() / MB:.2f} MB: "
                f"{', '.join(self.names)})")


# ------------------------------------------------------------------------------------------------
# The three strategies: when each bucket is launched
# ------------------------------------------------------------------------------------------------

class _Strategy:
    """What the strategies share: the buckets, the hook, and what happens once backward is done."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], *,
                 bucket_cap_bytes: int, process_group: dist.ProcessGroup,
                 find_unused_parameters: bool):
        names = [name for name, _ in named_params]
        params = [p for _, p in named_params]
        order = self.assign(params, bucket_cap_bytes)
        self.buckets = [Bucket(i, [params[j] for j in idx], [names[j] for j in idx],
                               is_last=i == len(order) - 1) for i, idx in enumerate(order)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.parameters()}
        self.name_of = {id(p): name for name, p in named_params}
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.hook: CommHook = allreduce_hook
        self.state: Any = process_group
        self.next_bucket = 0  # buckets are launched in index order, the same on every rank

    @staticmethod
    def assign(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
        """One bucket per parameter, the last parameter first."""
        return [[i] for i in reversed(range(len(params)))]

    def grad_ready(self, param: torch.Tensor) -> None:
        """Called by DDP's hook when ``param.grad`` is final for this backward."""
        raise NotImplementedError

    def sync(self) -> None:
        """After backward: every bucket launched and waited for."""
        raise NotImplementedError

    def launch_ready_buckets(self) -> None:
        """Launch the next buckets, in index order, as long as they are full.

        In order, because collectives are matched by the order each rank issues them: a rank
        that launched bucket 3 before bucket 2 would sum its bucket 3 with a peer's bucket 2.
        """
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self.buckets[self.next_bucket].launch(self.hook, self.state)
            self.next_bucket += 1

    def finish(self) -> None:
        """End of backward: deal with unused parameters, sync, write the averages into ``.grad``."""
        try:
            unused = [p for bucket in self.buckets for p in bucket.unready()]
            if unused and not self.find_unused_parameters:
                self._raise_unused(unused)
            for p in unused:  # a zero contribution (or a stale .grad, as torch's reducer does)
                self.bucket_of[id(p)].mark_ready(p)
            self.sync()
            untouched = self._unused_everywhere(unused)
            for bucket in self.buckets:
                bucket.copy_back(skip=untouched)
        finally:
            self.reset()

    def reset(self) -> None:
        """Ready for the next backward."""
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0

    def _unused_everywhere(self, unused: list[torch.Tensor]) -> set[int]:
        """Ids of the parameters no rank used: their ``.grad`` stays untouched, as in torch."""
        if not self.find_unused_parameters:
            return set()
        params = [p for bucket in self.buckets for p in bucket.parameters()]
        unused_ids = {id(p) for p in unused}
        used = torch.tensor([id(p) not in unused_ids for p in params], dtype=torch.int32,
                            device=self.buckets[0].buffer().device)  # (P,) 1 where used here
        dist.all_reduce(used, group=self.process_group)             # (P,) ranks that used it
        return {id(p) for p, count in zip(params, used.tolist()) if count == 0}

    def _raise_unused(self, unused: list[torch.Tensor]) -> None:
        """Wait for the all-reduces already started (no peer is left hanging), then raise."""
        for bucket in self.buckets:
            if bucket.future is not None:
                bucket.wait()
        names = ", ".join(self.name_of[id(p)] for p in unused)
        raise RuntimeError(
            f"DistributedDataParallel expected a gradient for every parameter that requires "
            f"grad, but {names} got none in this backward pass. If some parameters take no part "
            f"in the loss in some steps, pass find_unused_parameters=True (they then count as "
            f"zero); if they never do, set requires_grad=False on them.")


class NaiveStrategy(_Strategy):
    """1. ``"naive"``: nothing is sent during backward; then one blocking all-reduce per parameter.

    Each parameter is a bucket of one, so a communication hook sees one parameter at a time.
    """

    def grad_ready(self, param: torch.Tensor) -> None:
        """Note the gradient (copied into its bucket); send nothing yet."""
        self.bucket_of[id(param)].mark_ready(param)

    def sync(self) -> None:
        """One parameter after the other: send, wait, next."""
        for bucket in self.buckets:
            bucket.launch(self.hook, self.state)
            bucket.wait()


class OverlapStrategy(_Strategy):
    """2. ``"overlap"``: each gradient's all-reduce starts as soon as autograd has produced it.

    The all-reduce runs in the background (``async_op=True``) while backward computes the
    gradients of earlier layers; the waiting happens once, after backward. Each parameter is a
    bucket of one, so a communication hook sees one parameter at a time.
    """

    def grad_ready(self, param: torch.Tensor) -> None:
        """Copy the gradient into its bucket and start its all-reduce (in bucket order)."""
        self.bucket_of[id(param)].mark_ready(param)
        self.launch_ready_buckets()

    def sync(self) -> None:
        """Launch what an unused parameter held back, then wait for every bucket."""
        self.launch_ready_buckets()
        for bucket in self.buckets:
            bucket.wait()


class BucketedStrategy(OverlapStrategy):
    """3. ``"bucketed"``: the overlap strategy with many gradients per all-reduce.

    Every all-reduce pays a fixed latency (about 1 ms on gloo over loopback), so a few large
    messages beat many small ones. Buckets are filled last layer first (``assign_buckets``) and
    each is launched when its last gradient arrives: the first buckets travel while backward
    is still computing the rest.
    """

    @staticmethod
    def assign(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
        """Buckets of at most ``bucket_cap_bytes``, the last parameter first."""
        return assign_buckets(params, bucket_cap_bytes)


#: ``strategy=`` name -> class, in teaching order.
STRATEGIES: dict[str, type[_Strategy]] = {
    "naive": NaiveStrategy,
    "overlap": OverlapStrategy,
    "bucketed": BucketedStrategy,
}


# ------------------------------------------------------------------------------------------------
# The module
# ------------------------------------------------------------------------------------------------

def _broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with the group's rank 0 values: one broadcast per dtype and device."""
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])  # (total numel,) one message
            dist.broadcast(flat, src=src, group=group)
            offsets = [0, *accumulate(t.numel() for t in same)]
            for t, start, end in zip(same, offsets, offsets[1:]):
                t.copy_(flat[start:end].view(t.shape))


class DistributedDataParallel(nn.Module):
    """Data parallelism over processes: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    At construction every parameter and buffer is broadcast from the group's rank 0, so all
    replicas start equal. When ``loss.backward()`` returns, the ``.grad`` of every parameter
    that requires grad holds the average over the ranks (a callback queued on the autograd
    engine does the last step), so the optimizer steps stay equal too.

    Args:
        module: the model, already on this rank's device.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: most MiB per bucket (strategy ``"bucketed"``).
        broadcast_buffers: take rank 0's buffers (batch-norm statistics) before each forward.
        find_unused_parameters: let parameters without a gradient in a step count as zero
            instead of raising.
        strategy: ``"naive"``, ``"overlap"`` or ``"bucketed"`` (see the module docstring).
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, strategy: str = "bucketed"):
        super().__init__()
        _check_arguments(module, bucket_cap_mb, strategy, process_group)
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.strategy = strategy
        self.require_backward_grad_sync = True   # False inside no_sync()
        self.require_forward_param_sync = True   # as torch: buffers follow rank 0 when True
        _broadcast_coalesced([*module.parameters(), *module.buffers()], self.process_group)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel expected a module with at least one "
                             "parameter that requires grad, found none: there is nothing to "
                             "synchronise (call the module directly).")
        self.reducer = STRATEGIES[strategy](
            named, bucket_cap_bytes=int(bucket_cap_mb * MB), process_group=self.process_group,
            find_unused_parameters=find_unused_parameters)
        self._comm_hook_registered = False
        self._expect_hooks = False     # a synchronised forward ran: its backward averages
        self._callback_queued = False  # the end-of-backward callback of this backward
        hook = _weak_grad_hook(self)
        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for _, p in named]

    def forward(self, *args, **kwargs):
        """Run the module (after taking rank 0's buffers) and arm the gradient hooks."""
        buffers = list(self.module.buffers())
        if self.broadcast_buffers and self.require_forward_param_sync and buffers:
            # as torch: the copy does not count as an in-place change for autograd
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                _broadcast_coalesced(buffers, self.process_group)
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self._expect_hooks, self._callback_queued = True, False
            self.reducer.reset()
        else:
            self.require_forward_param_sync = False
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate gradients locally without communicating.

        The first synchronised backward after it averages the accumulated sums. As in torch,
        the forward pass must run inside the context.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Average buckets with ``hook(state, bucket) -> Future[Tensor]`` instead of the default.

        The future's value must be a tensor shaped like ``bucket.buffer()``: it becomes the
        bucket's gradients. torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work
        as well as ours. With ``"naive"`` and ``"overlap"`` each bucket holds one parameter.

        Args:
            state: passed to the hook as is (for the default hooks: the process group).
            hook: the communication hook.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook expects a callable hook(state, bucket), got "
                            f"{type(hook).__name__}.")
        if self._comm_hook_registered:
            raise RuntimeError("register_comm_hook can be called only once per "
                               "DistributedDataParallel (as in torch); build a new one to "
                               "change the hook.")
        self.reducer.hook, self.reducer.state = hook, state
        self._comm_hook_registered = True

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Autograd hook: ``param.grad`` is final for this backward; hand it to the strategy."""
        if not self._expect_hooks:
            return  # the forward ran under no_sync() or without grad: accumulate locally
        if not self._callback_queued:  # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        with torch.no_grad():
            self.reducer.grad_ready(param)

    def _finish_backward(self) -> None:
        """Queued callback: runs once backward is done, before ``loss.backward()`` returns."""
        self._expect_hooks, self._callback_queued = False, False
        with torch.no_grad():
            self.reducer.finish()


def _weak_grad_hook(ddp: DistributedDataParallel) -> Callable[[torch.Tensor], None]:
    """``ddp._grad_ready`` as a hook that does not keep ``ddp`` alive once the caller drops it.

    The hooks stay on the parameters: without this, wrapping a model again (say, to try
    another strategy) would keep the old wrapper, its buckets and its hooks working forever.
    """
    ref = weakref.ref(ddp)

    def hook(param: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._grad_ready(param)

    return hook


def _check_arguments(module: nn.Module, bucket_cap_mb: float, strategy: str,
                     process_group: dist.ProcessGroup | None) -> None:
    """Raise a clear error for arguments DistributedDataParallel cannot use."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel expects an nn.Module, got "
                        f"{type(module).__name__}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"DistributedDataParallel: strategy must be one of "
                         f"{', '.join(map(repr, STRATEGIES))}; got {strategy!r}.")
    if (not isinstance(bucket_cap_mb, int | float) or isinstance(bucket_cap_mb, bool)
            or not bucket_cap_mb > 0):
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a number of MiB > 0 "
                         f"(torch's default is 25), got {bucket_cap_mb!r}.")
    if process_group is None and not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel needs a process group, and none is "
                           "initialised in this process. Call torch.distributed."
                           "init_process_group (or course_lib.distributed."
                           "init_distributed_mode) first, or start the workers with "
                           "course_lib.distributed.launch or torchrun.")
