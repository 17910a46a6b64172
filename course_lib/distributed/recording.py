"""Which collectives a piece of code calls, and how much each moves: ``record_collectives``.

While inside ``with record_collectives() as records:``, every call of a ``torch.distributed``
collective appends a ``CollectiveRecord`` to ``records``. The functions are replaced for the
duration in ``torch.distributed.distributed_c10d``, in ``torch.distributed`` and in every module
outside torch that imported them by name (``from torch.distributed import all_reduce``), and
restored in ``finally``. A collective called inside another (``all_gather_object`` calls
``all_gather``) counts once, as the outer one.

The benchmarks count traffic per phase with it, the checkers count what a learner's code sends,
and the tensor-parallel trace tags each call with the layer running (``context``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "CollectiveRecord", "record_collectives"]

#: every collective ``record_collectives`` watches by default (those the running torch lacks
#: are skipped)
COLLECTIVES = (
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
    "all_gather_single", "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
    "_all_gather_base", "_reduce_scatter_base")


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One call of a collective.

    ``elements`` and ``bytes`` measure the call's first tensor argument (else the tensors of its
    first list, summed): for ``all_reduce`` the tensor reduced, for ``all_gather(parts, x)``
    the piece ``x`` each rank gives. ``ranks`` are the global ranks of the group used (every
    rank for the default group). ``op`` is the ``ReduceOp`` passed, if any; ``requires_grad``
    whether any tensor handed over requires grad (autograd cannot follow a collective called
    directly); ``context`` what the caller's ``context()`` returned at the call. ``peer``, for
    ``send``, ``isend``, ``recv`` and ``irecv`` (also those ``batch_isend_irecv`` posts), is the
    global rank at the other end (None for a receive from any rank, and for collectives).
    """
    name: str
    elements: int
    bytes: int
    ranks: tuple[int, ...]
    op: object = None
    requires_grad: bool = False
    context: object = None
    peer: int | None = None


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call measures: its first tensor argument, else its first list's."""
    values = list(args) + list(kwargs.values())
    for v in values:
        if isinstance(v, torch.Tensor):
            return [v]
    for v in values:
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor):
            return [t for t in v if isinstance(t, torch.Tensor)]
    return []


def _requires_grad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(x, torch.Tensor) and x.requires_grad
               for v in (*args, *kwargs.values())
               for x in (v if isinstance(v, (list, tuple)) else (v,)))


def _group_ranks(group) -> tuple[int, ...]:
    if not dist.is_initialized():
        return ()
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):   # not a group this rank belongs to
        return ()


#: the argument naming the other rank of a point-to-point call: a global rank, or a rank within
#: ``group`` (``batch_isend_irecv`` passes the latter)
_PEERS = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}


def _peer(name: str, bound: dict) -> int | None:
    """The global rank at the other end of a point-to-point call, or None."""
    key = _PEERS.get(name)
    if key is None:
        return None
    if bound.get(key) is not None:
        return bound[key]
    group_peer, group = bound.get("group_" + key), bound.get("group")
    if group_peer is None or group is None or group is dist.group.WORLD:
        return group_peer
    return dist.get_global_rank(group, group_peer)


def _bound(fn: Callable) -> Callable[[tuple, dict], dict]:
    """A function giving the named arguments of a call of ``fn`` (empty if they do not bind)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return lambda args, kwargs: kwargs

    def arguments(args: tuple, kwargs: dict) -> dict:
        try:
            return signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return kwargs
    return arguments


@contextlib.contextmanager
def record_collectives(names: tuple[str, ...] | None = None, *,
                       context: Callable[[], object] | None = None
                       ) -> Iterator[list[CollectiveRecord]]:
    """Record every collective called inside the block (``names``, default ``COLLECTIVES``).

    Yields the list the records are appended to, in call order. ``context``, if given, is
    called at each collective and its value stored in the record (the phase or layer running).
    """
    from torch.distributed import distributed_c10d as c10d

    records: list[CollectiveRecord] = []
    names = COLLECTIVES if names is None else tuple(names)
    originals = {n: getattr(c10d, n) for n in names if callable(getattr(c10d, n, None))}
    by_id = {id(fn): n for n, fn in originals.items()}
    depth = [0]

    def recorded(name: str, fn: Callable) -> Callable:
        arguments = _bound(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:
                tensors = _tensors(args, kwargs)
                bound = arguments(args, kwargs)
                records.append(CollectiveRecord(
                    name=name, elements=sum(t.numel() for t in tensors),
                    bytes=sum(t.numel() * t.element_size() for t in tensors),
                    ranks=_group_ranks(bound.get("group")), op=bound.get("op"),
                    requires_grad=_requires_grad(args, kwargs),
                    context=context() if context is not None else None,
                    peer=_peer(name, bound)))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    stand_ins = {n: recorded(n, fn) for n, fn in originals.items()}
    replaced: list[tuple[dict, str, Callable]] = []
    for module in list(sys.modules.values()):
        module_name = getattr(module, "__name__", None)
        if not isinstance(module_name, str) or (
                module_name.startswith("torch") and module not in (dist, c10d)):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for key, value in list(namespace.items()):
            n = by_id.get(id(value))
            if n is not None and value is originals[n]:
                replaced.append((namespace, key, value))
    try:
        for namespace, key, value in replaced:
            namespace[key] = stand_ins[by_id[id(value)]]
        yield records
    finally:
        for namespace, key, value in replaced:
            namespace[key] = value
