"""Bookkeeping around ``ddp``'s buckets, as torch keeps it in its reducer (reducer.cpp):

* ``assign_buckets``: which parameters share a bucket (torch's
  ``_compute_bucket_assignment_by_size``; lesson 07 shows it with ``BucketedStrategy``);
* ``GradBucketInterface``: ``torch.distributed.GradBucket``'s methods, for torch's hooks;
* ``Buckets``: a strategy's bookkeeping: the reset after each backward, the one rebuild in
  rank 0's arrival order, the parameters no rank used;
* ``strategy_options`` (torch's byte caps and rules) and ``weak_hook``.
"""
from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..distributed._same_tensors import communication_device
from ._ddp_checks import raise_unused

MB = 1024 * 1024  # torch's DDP counts bucket_cap_mb in MiB too
DEFAULT_BUCKET_CAP_MB = 25  # torch's default
#: Most bytes in the first bucket after the rebuild with the default cap (torch's constant)
FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MB)


def strategy_options(bucket_cap_mb: float | None, find_unused_parameters: bool,
                     static_graph: bool) -> dict[str, Any]:
    """torch's byte caps for ``bucket_cap_mb`` (None: 25 MiB, the first rebuilt bucket 1 MiB;
    ``math.inf``: one bucket per dtype and device) and its rules for rebuilding the buckets
    and finding unused parameters (always with a static graph)."""
    rebuild = static_graph or not find_unused_parameters
    cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    cap_bytes = sys.maxsize if math.isinf(cap) else int(cap * MB)
    return {"bucket_cap_bytes": cap_bytes,
            "first_bucket_bytes": FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap_bytes,
            "initial_cap_bytes": sys.maxsize if rebuild else cap_bytes, "rebuild": rebuild,
            "find_unused_parameters": find_unused_parameters or static_graph}


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int, *,
                   order: Sequence[int] | None = None,
                   first_bucket_bytes: int | None = None) -> list[list[int]]:
    """Group parameters into buckets of about ``bucket_cap_bytes``, in the order given.

    Each parameter joins the open bucket of its dtype and device (a bucket is one flat tensor),
    and the bucket is closed once it holds ``bucket_cap_bytes`` or more: the parameter that
    fills it stays in it, so a bucket can pass the cap by one parameter (torch's rule).
    ``first_bucket_bytes`` caps the first bucket of each dtype and device instead (default
    ``bucket_cap_bytes``; torch's DDP makes it 1 MiB so communication starts early).

    By default the order is the last parameter first: backward produces gradients roughly in
    reverse registration order (last layer first), so bucket 0 fills first. After the first
    iteration DDP passes the order the gradients really arrived in (``order``: indices into
    ``params``).

    Returns:
        For each bucket, in launch order, the indices of its parameters in ``params``.
    """
    order = list(reversed(range(len(params)))) if order is None else list(order)
    first = bucket_cap_bytes if first_bucket_bytes is None else first_bucket_bytes
    closed: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int, int]] = {}  # (dtype, device) -> (indices, bytes,
    for i in order:                                       #                    buckets closed)
        p = params[i]
        key, size = (p.dtype, p.device), p.numel() * p.element_size()
        indices, used, done = open_.get(key, ([], 0, 0))
        indices, used = indices + [i], used + size
        if used >= (first if done == 0 else bucket_cap_bytes):  # full: close it
            closed.append(indices)
            indices, used, done = [], 0, done + 1
        open_[key] = (indices, used, done)
    buckets = closed + [indices for indices, _, _ in open_.values() if indices]
    position = {i: k for k, i in enumerate(order)}
    return sorted(buckets, key=lambda b: position[b[0]])  # by the first gradient to arrive


def one_bucket_per_parameter(params: Sequence[torch.Tensor], bucket_cap_bytes: int,
                             order: Sequence[int] | None = None,
                             first_bucket_bytes: int | None = None) -> list[list[int]]:
    """The naive and overlap strategies' buckets: one per parameter, in ``order`` (default: the
    last parameter first); ``assign_buckets``'s signature, the caps unused."""
    return [[i] for i in (reversed(range(len(params))) if order is None else order)]


class GradBucketInterface:
    """``torch.distributed.GradBucket``'s methods on a bucket with ``_buffer``, ``_index``,
    ``_is_last``, ``_params`` and ``_views`` (each parameter's gradient in the buffer)."""

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def unready(self) -> list[torch.Tensor]:
        """The parameters whose gradient has not arrived in this backward."""
        return [p for p, ready in zip(self._params, self.ready) if not ready]

    def _adopt_grads(self) -> None:
        """``gradient_as_bucket_view``: a ``.grad`` already there keeps its value, in the buffer."""
        with torch.no_grad():
            for p, view in zip(self._params, self._views):
                if p.grad is not None:
                    p.grad = view.copy_(p.grad)

    def _copy_back_as_view(self, skip) -> None:
        """``copy_back`` with ``gradient_as_bucket_view``: the buffer takes the result and each
        ``.grad`` (but those whose id is in ``skip``) is a view of it."""
        if self.result.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(self.result)
        for p, view in zip(self._params, self._views):
            if id(p) not in skip and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                p.grad = view

    def _shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        return [flat[o:o + n].view(p.shape)
                for o, n, p in zip(self.offsets, self.numels, self._params)]

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, {len(self._params)} params, "
                f"{self._buffer.numel() * self._buffer.element_size() / 2**20:.2f} MB: "
                f"{', '.join(self.names)})")


class Buckets:
    """The bookkeeping of ``ddp``'s strategies (which add ``build``: ``buckets`` and
    ``bucket_of`` from an assignment); the byte caps as ``strategy_options`` gives them."""

    #: Whether the first synchronised backward sends nothing before the rebuild: where a
    #: bucket holds several parameters the rebuild changes where each gradient sits in it.
    delay_first_step = False
    assign = staticmethod(one_bucket_per_parameter)  # the bucketed strategy: assign_buckets

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], *,
                 bucket_cap_bytes: int, first_bucket_bytes: int, initial_cap_bytes: int,
                 rebuild: bool, process_group: dist.ProcessGroup, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool = False):
        self.names, self.params = [n for n, _ in named_params], [p for _, p in named_params]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.name_of = dict(zip(self.index_of, self.names))
        self.bucket_cap_bytes, self.first_bucket_bytes = bucket_cap_bytes, first_bucket_bytes
        self.process_group, self.find_unused_parameters = process_group, find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.state = process_group  # the hook's state (register_comm_hook replaces it)
        self.arrivals: dict[int, None] | None = {} if rebuild else None  # first step's order
        self.used_since_sync: set[int] = set()  # ids of parameters used under no_sync()
        # torch's first buckets: filled in registration order, launched last bucket first
        first = initial_cap_bytes if rebuild else first_bucket_bytes
        self.build(self.assign(self.params, initial_cap_bytes, order=range(len(self.params)),
                               first_bucket_bytes=first)[::-1])

    def reset(self) -> None:
        """Ready for the next backward."""
        for bucket in self.buckets:
            bucket.reset()
        self.next_bucket = 0
        if self.arrivals is not None:
            self.arrivals = {}

    def note_arrival(self, param: torch.Tensor) -> bool:
        """Note the order gradients arrive in, in the first synchronised backward; True if
        the gradient must wait for the rebuild (``delay_first_step``)."""
        if self.arrivals is None:
            return False
        self.arrivals[self.index_of[id(param)]] = None
        return self.delay_first_step

    def all_arrived(self) -> bool:
        """First step of ``"overlap"``: True, with the buckets rebuilt, once all have come."""
        if len(self.arrivals) < len(self.params):
            return False
        self.rebuild_buckets([])
        return True

    def rebuild_buckets(self, unused: list[torch.Tensor]) -> None:
        """Once, after the first synchronised backward: buckets in rank 0's arrival order
        (``unused`` last). With ``delay_first_step`` (unlike torch) the first step already
        travels in them, so that a run resumed from a checkpoint stays bitwise equal to one
        never stopped (a + b + c in another order is another float)."""
        arrivals = list(self.arrivals)
        arrived = [self.params[i] for i in arrivals]
        device = communication_device(self.process_group, self.params[0].device)
        order = torch.tensor(arrivals + [self.index_of[id(p)] for p in unused],
                             dtype=torch.int64, device=device)  # (P,)
        dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0),
                       group=self.process_group)
        self.arrivals = None
        self.build(self.assign(self.params, self.bucket_cap_bytes, order=order.tolist(),
                               first_bucket_bytes=self.first_bucket_bytes))
        for param in arrived if self.delay_first_step else ():
            self.bucket_of[id(param)].mark_ready(param)

    def mark_unused_ready(self) -> list[torch.Tensor]:
        """End of backward: mark ready the parameters whose gradient did not arrive (a clear
        error without ``find_unused_parameters``)."""
        arrived = set(self.arrivals or ())  # the first backward marked nothing ready yet
        unused = [p for bucket in self.buckets for p in bucket.unready()
                  if self.index_of[id(p)] not in arrived]
        if unused and not self.find_unused_parameters:
            raise_unused(self, unused)
        if self.arrivals is not None and self.delay_first_step:
            self.rebuild_buckets(unused)
        for p in unused:
            self.bucket_of[id(p)].mark_ready(p)
        return unused

    def unused_everywhere(self, unused: list[torch.Tensor]) -> set[int]:
        """Ids of the parameters no rank used since the last synchronisation (``no_sync()``
        micro-steps count); their ``.grad`` stays untouched, as in torch."""
        if not self.find_unused_parameters:
            return set()
        unused_ids = {id(p) for p in unused} - self.used_since_sync
        used = torch.tensor([id(p) not in unused_ids for p in self.params], dtype=torch.int32,
                            device=self.buckets[0].buffer().device)  # (P,) 1 where used here
        dist.all_reduce(used, group=self.process_group)             # (P,) ranks that used it
        return {id(p) for p, count in zip(self.params, used.tolist()) if count == 0}


def weak_hook(ddp: Any, method: str) -> Callable[[torch.Tensor], None]:
    """``ddp.<method>`` as a hook that does not keep ``ddp`` alive once the caller drops it
    (re-wrapping a model to try another strategy must not keep the old wrapper at work)."""
    ref = weakref.WeakMethod(getattr(ddp, method))
    return lambda tensor: None if (bound := ref()) is None else bound(tensor)
