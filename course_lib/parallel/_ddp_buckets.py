"""Bookkeeping around ``ddp``'s buckets that lesson 07 need not read, as torch keeps it in its
reducer (torch/csrc/distributed/c10d/reducer.cpp):

* ``GradBucketInterface``: ``torch.distributed.GradBucket``'s methods, so that communication
  hooks written for torch's DDP run on ``ddp.Bucket`` unchanged, and the bucket's small helpers
  (views shaped like each parameter, the parameters still awaited, its repr);
* ``Rebuild``: the buckets rebuilt once, in the order the first synchronised backward produced
  the gradients (rank 0's), and the parameters that no rank used in a step (left alone);
* ``weak_hook``: a DDP method as an autograd hook that does not keep the DDP object alive.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..distributed._same_tensors import communication_device


class GradBucketInterface:
    """``torch.distributed.GradBucket``'s methods on a bucket with ``_buffer`` (the flat buffer),
    ``_index`` (its place in launch order), ``_is_last``, ``_params`` and ``_views`` (each
    parameter's gradient, a view of the buffer); ``set_buffer`` copies values in."""

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

    def _shaped(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        return [flat[o:o + n].view(p.shape)
                for o, n, p in zip(self.offsets, self.numels, self._params)]

    def __repr__(self) -> str:
        return (f"Bucket(index={self._index}, {len(self._params)} params, "
                f"{self._buffer.numel() * self._buffer.element_size() / 2**20:.2f} MB: "
                f"{', '.join(self.names)})")


class Rebuild:
    """For a strategy with ``params``, ``buckets``, ``bucket_of``, ``assign`` and ``build``:
    the rebuild in arrival order, and the parameters unused on every rank."""

    #: Whether the first synchronised backward sends nothing before the rebuild: where a
    #: bucket holds several parameters the rebuild changes where each gradient sits in it.
    delay_first_step = False

    def note_arrival(self, param: torch.Tensor) -> bool:
        """Note the order gradients arrive in, in the first synchronised backward; True if
        the gradient must wait for the rebuild (``delay_first_step``)."""
        if self.arrivals is None:
            return False
        self.arrivals[self.index_of[id(param)]] = None
        return self.delay_first_step

    def rebuild_buckets(self, unused: list[torch.Tensor]) -> None:
        """Once, at the end of the first synchronised backward: buckets in the order the
        gradients arrived (those of ``unused`` last); with ``delay_first_step`` the gradients
        that arrived are copied in, to be sent.

        Every rank takes rank 0's order (one broadcast), so all launch the same buckets in the
        same order. torch rebuilds before the next forward and sends the first step in its one
        initial bucket; with ``delay_first_step`` the first step here already travels in the
        rebuilt buckets, so every step sums each element in the same layout, and a run resumed
        from a checkpoint (whose new DDP starts over) stays bitwise equal to one never
        stopped, at any world size (a + b + c in another order is another float).
        """
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

    def unused_everywhere(self, unused: list[torch.Tensor]) -> set[int]:
        """Ids of the parameters no rank used since the last synchronisation.

        Their ``.grad`` stays untouched, as in torch. A parameter used in a ``no_sync()``
        micro-step counts as used: its accumulated gradient is averaged like any other.
        """
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
