"""Communication hooks beyond DDP's default, as torch keeps them in
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``.

A hook is ``hook(state, bucket) -> Future[Tensor]`` (``ddp.allreduce_hook`` is the default).
Lesson 07 halves the bytes sent with ``bf16_compress_hook`` and times the strategies over a
slower link with ``slow_link_hook`` and ``SlowLink`` (no torch counterpart), all re-exported by
``course_lib.parallel.ddp``; lesson 10 times a step with ``divide_only_hook``, which sends nothing.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .ddp import Bucket


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket sending half the bytes: cast to bfloat16, all-reduce, cast back, divide.

    bfloat16 keeps float32's range with 8 significant bits (7 stored, 1 implicit): each value
    travels with 2 to 3 significant decimal digits. PyTorch counterpart:
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`` (which
    divides before the all-reduce, in bfloat16; here the division happens after, in the
    buffer's own precision). Arguments and result as ``allreduce_hook``'s.
    """
    buffer = bucket.buffer()                                 # (n,) float32, say
    compressed = buffer.to(torch.bfloat16)                   # (n,) bfloat16: 2 bytes a value
    world_size = dist.get_world_size(process_group)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0]).div_(world_size)        # (n,) back in the buffer's dtype
        return buffer

    return work.get_future().then(decompress)


def divide_only_hook(process_group: dist.ProcessGroup | None,
                     bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    """``allreduce_hook`` without its all-reduce: the bucket's buffer divided by the world size,
    returned in a completed future. A step with it does all a DDP step does but send."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


class SlowLink:
    """A link that adds ``latency_s`` to every message, carrying one message at a time: the
    state of ``slow_link_hook``.

    On GPUs NCCL's all-reduces run as kernels on a few of the GPU's multiprocessors beside the
    computation, and a small message spends much of its time waiting on the link; on a 2-core
    CPU, gloo's sums share the cores that compute. A ``SlowLink``
    adds the part of a message's cost that uses no core, as a network's latency does: each
    message is the real all-reduce, started at once, and its result is handed back
    ``latency_s`` after the link became free for it (the messages queue, in launch order),
    and not before the all-reduce itself ended. The waiting is a sleep in one thread.
    """

    def __init__(self, latency_s: float, process_group: dist.ProcessGroup | None = None):
        if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s)
                and latency_s >= 0):
            raise ValueError(f"SlowLink: latency_s must be a finite number of seconds >= 0, "
                             f"got {latency_s!r}.")
        self.latency_s, self.process_group = float(latency_s), process_group
        self.messages = 0                  # carried so far
        self._free_at = 0.0                # perf_counter time at which the link is next free
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._carry, name="SlowLink", daemon=True)
        self._thread.start()

    def send(self, result: torch.futures.Future) -> torch.futures.Future:
        """A future of ``result``'s value, set once the link has carried the message."""
        self._free_at = max(time.perf_counter(), self._free_at) + self.latency_s
        self.messages += 1
        delivered: torch.futures.Future = torch.futures.Future()
        self._queue.put((self._free_at, result, delivered))
        return delivered

    def _carry(self) -> None:
        while (item := self._queue.get()) is not None:
            arrives, result, delivered = item
            time.sleep(max(0.0, arrives - time.perf_counter()))
            try:
                delivered.set_result(result.wait())   # bounded by the group's timeout
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the message
                delivered.set_exception(e)

    def close(self) -> None:
        """Stop the link's thread once the messages queued have been carried."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def __repr__(self) -> str:
        return f"SlowLink(latency_s={self.latency_s}, messages={self.messages})"


def slow_link_hook(link: SlowLink, bucket):  # bucket unannotated: torch's DDP takes it too
    """``allreduce_hook`` over a ``SlowLink``: the bucket (a ``Bucket`` or torch's
    ``GradBucket``) averaged by the real all-reduce, handed back in a future once the link has
    carried it. Register as ``ddp.register_comm_hook(SlowLink(latency_s), slow_link_hook)``,
    on the course's DDP or torch's."""
    buffer = bucket.buffer()                                 # (n,) the bucket's gradients
    buffer.div_(dist.get_world_size(link.process_group))
    work = dist.all_reduce(buffer, group=link.process_group, async_op=True)
    return link.send(work.get_future().then(lambda fut: fut.value()[0]))
