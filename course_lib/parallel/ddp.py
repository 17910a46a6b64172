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

Every strategy moves gradients in ``Bucket`` s (in the first two a bucket holds one parameter)
and hands each to a communication hook ``hook(state, bucket) -> Future[Tensor]`` (default
``allreduce_hook``: the average), so torch's hooks and ours work with all three.

Beside it (all importable from here): ``_ddp_buckets`` (bucket sizes, the rebuild in arrival
order, unused parameters), ``_ddp_comm_hooks``, ``_ddp_checks`` (argument checks, error texts),
``_ddp_accounting`` (bytes counted); the equal start in ``distributed._same_tensors``.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves, tree_map

from ..distributed._same_tensors import _broadcast_coalesced, verify_same_model
from . import _ddp_checks as checks
from ._ddp_accounting import bytes_on_wire, gradient_memory_bytes
from ._ddp_buckets import (  # noqa: F401 - MB and the caps re-exported, as before
    DEFAULT_BUCKET_CAP_MB,
    FIRST_BUCKET_BYTES,
    MB,
    Buckets,
    GradBucketInterface,
    assign_buckets,
    strategy_options,
    weak_hook,
)
from ._ddp_comm_hooks import SlowLink, bf16_compress_hook, slow_link_hook

__all__ = ["STRATEGIES", "Bucket", "BucketedStrategy", "DistributedDataParallel",
           "NaiveStrategy", "OverlapStrategy", "SlowLink", "allreduce_hook", "assign_buckets",
           "bf16_compress_hook", "bytes_on_wire", "gradient_memory_bytes", "slow_link_hook"]

CommHook = Callable[[Any, "Bucket"], torch.futures.Future]


# --- Communication hooks: hook(state, bucket) -> a future of the averaged bucket buffer ----------

def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket over the ranks: divide by the world size, all-reduce (sum), asynchronously.

    DDP's default. Dividing before summing keeps the sum in range (it matters in float16).
    ``process_group``: the group (None: the default one); ``bucket``: a ``Bucket`` (or torch's
    ``GradBucket``) whose ``buffer()`` is averaged in place. Returns a future of that buffer.
    """
    buffer = bucket.buffer()                                 # (n,) the bucket's gradients, flat
    buffer.div_(dist.get_world_size(process_group))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# --- Buckets -------------------------------------------------------------------------------------

class Bucket(GradBucketInterface):
    """Gradients of a few parameters packed in one flat buffer, sent by one all-reduce.

    One method per step, in the order of a training step: ``mark_ready(param)`` as autograd
    produces each gradient (True for the last one), ``launch(hook, state)`` to start the
    all-reduce, ``wait()`` after backward, ``copy_back()`` to write the averages into ``.grad``.

    ``as_view=True`` (DDP's ``gradient_as_bucket_view``): each ``param.grad`` becomes a view of
    the buffer, so autograd accumulates into it and the gradients take half the memory.
    ``index``: the place in launch order; ``names``: the parameters' (for messages).
    """

    def __init__(self, index: int, params: Sequence[torch.Tensor], names: Sequence[str],
                 is_last: bool, as_view: bool = False):
        self._index, self._params, self.names, self._is_last = index, list(params), names, is_last
        self.as_view = as_view
        self.numels = [p.numel() for p in self._params]
        self.offsets = [0, *accumulate(self.numels)][:-1]    # where each gradient starts
        self._buffer = torch.zeros(sum(self.numels), dtype=params[0].dtype,
                                   device=params[0].device)  # (n,) on the parameters' device
        self._views = self._shaped(self._buffer)             # [(*p.shape) views of the buffer]
        self._slot = {id(p): i for i, p in enumerate(self._params)}
        if as_view:
            self._adopt_grads()                              # a .grad already there: a view
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
            raise checks.arrived_twice(self._index, self.names[i])
        view, grad = self._views[i], param.grad
        if grad is None:
            view.zero_()
        elif not (self.as_view and grad.data_ptr() == view.data_ptr()):
            view.copy_(grad)                                 # (*p.shape) into the flat buffer
            if self.as_view:
                param.grad = view                            # from now on autograd adds here
        self.ready[i] = True
        self.pending -= 1
        return self.pending == 0

    def launch(self, hook: CommHook, state: Any) -> None:
        """Start averaging the buffer: ``hook(state, self)`` returns a future, the work goes on."""
        future = hook(state, self)
        checks.check_future(hook, future)
        self.future = future

    def wait(self) -> None:
        """Block until the bucket's all-reduce is done and keep its result (the averaged buffer)."""
        result = self.future.wait()
        checks.check_result(result, self._buffer, self._index)
        self.result = result

    def copy_back(self, skip: Collection[int] = ()) -> None:
        """Write the averaged gradients into each ``param.grad`` (not those whose id is in skip)."""
        if self.as_view:  # .grad is (or becomes) a view of the buffer: the buffer gets the result
            return self._copy_back_as_view(skip)
        for p, average in zip(self._params, self._shaped(self.result)):  # (*p.shape)
            if id(p) in skip:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(average)  # the parameter's layout, as torch
            else:
                p.grad.copy_(average)


# --- The three strategies: when each bucket is launched ------------------------------------------

class _Strategy(Buckets):
    """What the strategies share: the buckets, the hook, and what happens once backward is done.

    Each strategy adds ``grad_ready(param)``, which DDP's hook calls when ``param.grad`` is final
    for this backward, and ``sync()``, which leaves every bucket launched and waited for. The
    bookkeeping (arguments, reset, the rebuild in arrival order) is in ``Buckets``.
    """

    hook = staticmethod(allreduce_hook)  # register_comm_hook replaces it (and ``state``)

    def build(self, assignment: list[list[int]]) -> None:
        """Make the buckets: ``assignment`` lists each bucket's parameter indices, launch order."""
        self.buckets = [Bucket(i, [self.params[j] for j in idx], [self.names[j] for j in idx],
                               is_last=i == len(assignment) - 1,
                               as_view=self.gradient_as_bucket_view)
                        for i, idx in enumerate(assignment)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.parameters()}
        self.next_bucket = 0  # buckets are launched in index order, the same on every rank

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
            unused = self.mark_unused_ready()  # zeros for them (or an error without find_unused)
            self.sync()
            untouched = self.unused_everywhere(unused)  # their .grad stays as it is
            for bucket in self.buckets:
                bucket.copy_back(skip=untouched)
            if self.arrivals is not None:  # one parameter per bucket: rebuilt for the next step
                self.rebuild_buckets(unused)
        finally:
            self.used_since_sync.clear()
            self.reset()


class NaiveStrategy(_Strategy):
    """1. ``"naive"``: nothing is sent during backward; then one blocking all-reduce per parameter
    (a bucket of one: a communication hook sees one parameter at a time)."""

    def grad_ready(self, param: torch.Tensor) -> None:
        """Note the gradient (copied into its bucket); send nothing yet."""
        if self.note_arrival(param):
            return
        self.bucket_of[id(param)].mark_ready(param)

    def sync(self) -> None:
        """One parameter after the other: send, wait, next."""
        for bucket in self.buckets:
            bucket.launch(self.hook, self.state)
            bucket.wait()


class OverlapStrategy(_Strategy):
    """2. ``"overlap"``: each gradient's all-reduce starts as soon as autograd has produced it.

    The all-reduce runs in the background (``async_op=True``) while backward computes the
    gradients of earlier layers; the waiting happens once, after backward. One parameter per
    bucket, as in the naive strategy.
    """

    def grad_ready(self, param: torch.Tensor) -> None:
        """Copy the gradient into its bucket and start its all-reduce (in bucket order)."""
        if self.note_arrival(param):  # only with delay_first_step (bucketed), in the first
            if self.all_arrived():    # step: sent once every gradient came and the buckets
                self.launch_ready_buckets()   # are rebuilt, when torch's one bucket would go
            return
        self.bucket_of[id(param)].mark_ready(param)
        self.launch_ready_buckets()

    def sync(self) -> None:
        """Launch what an unused parameter held back, then wait for every bucket."""
        self.launch_ready_buckets()
        for bucket in self.buckets:
            bucket.wait()


class BucketedStrategy(OverlapStrategy):
    """3. ``"bucketed"``: the overlap strategy with many gradients per all-reduce.

    Every all-reduce pays a fixed latency (notebook 06 measures gloo's over loopback), so a few
    large messages beat many small ones. Buckets are filled in the order gradients arrive
    (``assign_buckets``): the first step notes that order and waits for the buckets rebuilt in
    it (``delay_first_step``; torch sends its first step in one bucket). Where the buckets are
    never rebuilt (``find_unused_parameters`` without a static graph) they are torch's first
    buckets: filled in registration order, launched last bucket first. Each bucket is launched
    when its last gradient arrives: the first buckets travel while backward is still computing
    the rest.
    """

    delay_first_step = True
    assign = staticmethod(assign_buckets)


#: ``strategy=`` name -> class, in teaching order.
STRATEGIES: dict[str, type[_Strategy]] = {"naive": NaiveStrategy, "overlap": OverlapStrategy,
                                           "bucketed": BucketedStrategy}


# --- The module ----------------------------------------------------------------------------------

class DistributedDataParallel(nn.Module):
    """Data parallelism over processes: a drop-in for ``torch.nn.parallel.DistributedDataParallel``.

    At construction the ranks' parameter shapes are compared (an error names the first
    difference) and every parameter and buffer is broadcast from the group's rank 0: all
    replicas start equal. When ``loss.backward()`` returns, every ``.grad`` holds the average
    over the ranks (a callback queued on the autograd engine does the last step), so the
    optimizer steps stay equal too. torch's arguments, in torch's order; then ``strategy``.

    Args:
        module: the model, already on this rank's device.
        device_ids: None, or ``[the module's device]``: inputs are moved there (None on CPU).
        output_device, dim: accepted for torch's signature; they change nothing, as in torch's
            DDP with one device per process (``output_device`` must be None on CPU).
        broadcast_buffers: take rank 0's buffers (batch-norm statistics) at construction and
            before each synchronised forward; False: each rank keeps its own.
        process_group: the group to average over (default: the default group).
        bucket_cap_mb: most MiB per bucket (``"bucketed"``); None: 25, the first after the
            rebuild 1 MiB (as torch); ``math.inf``: one bucket per dtype and device.
        find_unused_parameters: parameters without a gradient in a step count as zero instead
            of raising (used in a ``no_sync()`` micro-step: used). Buckets are not rebuilt.
        gradient_as_bucket_view: each ``.grad`` a view of its bucket's buffer: no second copy.
        static_graph: every step uses the same parameters; as in torch, those unused in every
            step are left alone, and the buckets are rebuilt in any case.
        strategy: ``"naive"``, ``"overlap"`` or ``"bucketed"`` (see the module docstring).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, *,
                 strategy: str = "bucketed"):
        super().__init__()
        # this rank's one device (None on CPU), after checking every argument
        self.device, self.device_ids, self.output_device = checks.check_arguments(
            module, device_ids, output_device, bucket_cap_mb, strategy, STRATEGIES, process_group,
            dim=dim, broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        self.module, self.dim, self.strategy = module, dim, strategy
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers, self.static_graph = broadcast_buffers, static_graph
        self.find_unused_parameters, self.gradient_as_bucket_view = (find_unused_parameters,
                                                                     gradient_as_bucket_view)
        self.require_backward_grad_sync = True   # False inside no_sync()
        self.require_forward_param_sync = True   # as torch: buffers follow rank 0 when True
        verify_same_model(module, self.process_group, owner="DistributedDataParallel",
                          buffers=broadcast_buffers)  # as torch: without it, buffers may differ
        _broadcast_coalesced([*module.parameters(), *(module.buffers() if broadcast_buffers
                                                      else ())], self.process_group)
        self._named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
        self.reducer = STRATEGIES[strategy](  # the byte caps and when to rebuild: torch's rules
            self._named, process_group=self.process_group,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **strategy_options(bucket_cap_mb, find_unused_parameters, static_graph))
        self._comm_hook_registered = False
        self._expect_hooks = False     # a synchronised forward ran: its backward averages
        self._grads_arrived = False    # a gradient of this backward reached DDP's hook
        self._callback_queued = False  # the end-of-backward callback of this backward
        hook = weak_hook(self, "_grad_ready")
        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for _, p in self._named]

    def forward(self, *inputs, **kwargs):
        """Run the module (after taking rank 0's buffers) and arm the gradient hooks."""
        if torch.is_grad_enabled():
            checks.check_requires_grad(self._named, self._frozen, self.find_unused_parameters)
        if self.device is not None:  # as torch: inputs in tuples, lists and dicts too
            move = lambda x: x.to(self.device, non_blocking=True) if torch.is_tensor(x) else x
            inputs, kwargs = tree_map(move, inputs), tree_map(move, kwargs)
        buffers = list(self.module.buffers())
        if self.broadcast_buffers and self.require_forward_param_sync and buffers:
            # as torch: the copy does not count as an in-place change for autograd
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                _broadcast_coalesced(buffers, self.process_group)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self._expect_hooks, self._grads_arrived, self._callback_queued = True, False, False
            self.reducer.reset()
            hook = weak_hook(self, "_backward_started")  # on the outputs: see _backward_started
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        else:
            self.require_forward_param_sync = False
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate gradients locally without communicating; the first
        synchronised backward after it averages the sums. As in torch, run the forward inside."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Average buckets with ``hook(state, bucket) -> Future[Tensor]`` instead of the default.

        The future's value, a tensor shaped like ``bucket.buffer()``, becomes the bucket's
        gradients; torch's hooks work too. ``state`` is passed as is (for torch's: the group).
        """
        checks.check_comm_hook(hook, self._comm_hook_registered)
        self.reducer.hook, self.reducer.state = hook, state
        self._comm_hook_registered = True

    def _backward_started(self, grad: torch.Tensor) -> None:
        """Hook on the forward's outputs: backward reached them; queue the end-of-backward step
        here, in the caller's backward, not in a nested one (reentrant checkpointing's)."""
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Autograd hook: ``param.grad`` is final for this backward; hand it to the strategy."""
        if self.reducer.find_unused_parameters:  # as torch: used in any step since the sync
            self.reducer.used_since_sync.add(id(param))
        if not self._expect_hooks:
            return  # the forward ran under no_sync() or without grad: accumulate locally
        self._grads_arrived = True
        self._backward_started(param)  # queues the callback if no output hook ran
        with torch.no_grad():
            self.reducer.grad_ready(param)

    def _finish_backward(self) -> None:
        """Queued callback: runs once backward is done, before ``loss.backward()`` returns
        (nothing to do when no parameter got a gradient, as in ``torch.autograd.grad`` of the
        inputs: a later backward's are still expected)."""
        self._callback_queued = False
        if not (self._expect_hooks and self._grads_arrived):
            return
        self._expect_hooks = False
        with torch.no_grad():
            self.reducer.finish()
