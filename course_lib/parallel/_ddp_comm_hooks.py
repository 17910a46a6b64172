"""Communication hooks beyond DDP's default, as torch keeps them in
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``.

A hook is ``hook(state, bucket) -> Future[Tensor]`` (``ddp.allreduce_hook`` is the default);
lesson 07 registers ``bf16_compress_hook`` with ``register_comm_hook`` to halve the bytes sent
(re-exported by ``course_lib.parallel.ddp``); lesson 10 times a step with ``divide_only_hook``,
which sends nothing (re-exported by ``course_lib.bench.step_comm``).
"""
from __future__ import annotations

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
