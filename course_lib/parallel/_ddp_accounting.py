"""What a ``ddp.DistributedDataParallel`` costs: bytes sent per step, bytes of gradient memory.

Both read the buckets of a built DDP and change nothing; lesson 07 compares them across
strategies, hooks and ``gradient_as_bucket_view``. Re-exported by ``course_lib.parallel.ddp``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel


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


def gradient_memory_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of memory holding gradients: the bucket buffers plus every ``.grad`` stored elsewhere.

    Storage shared by several tensors counts once. Without ``gradient_as_bucket_view`` each
    gradient exists twice (its ``.grad`` and its slot in a bucket); with it, ``.grad`` is a view
    of the bucket buffer and only the buffers count.

    Args:
        ddp: a ``DistributedDataParallel`` after a backward pass (before it, ``.grad`` is None).

    Returns:
        Bytes, on this rank.
    """
    storages: dict[tuple, int] = {}  # (device, address) -> bytes
    tensors = [b.buffer() for b in ddp.reducer.buckets]
    tensors += [p.grad for p in ddp.module.parameters() if p.grad is not None]
    for t in tensors:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
