"""Collectives written by hand from point-to-point operations (``isend`` / ``irecv``).

PyTorch counterparts: ``dist.all_reduce``, ``dist.broadcast``, ``dist.all_gather`` (which gloo
and NCCL implement with the same ring and tree schedules). Read more:
https://pytorch.org/docs/stable/distributed.html#point-to-point-communication and notebook 06.

``ring_allreduce`` is the textbook schedule, short enough to read in a minute; notebook 06 shows
it. ``ring_allreduce_pipelined`` (in ``_ring_pipelined``, re-exported here) is the same ring with
each chunk cut into segments that are passed on as soon as they arrive, as gloo's and NCCL's
rings do: the benchmarks use it. The shape checks are in ``_collective_checks``.
``ring_chunk_bounds`` is the one chunking of every ring in the course (lesson 02's ring over
devices, these rings over ranks, and the checkers), so "chunk c" means the same range everywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._collective_checks import check_same, src_problem, tensor_list_problem
from ._ring_pipelined import ring_allreduce_pipelined

__all__ = ["ring_all_gather", "ring_allreduce", "ring_allreduce_pipelined", "ring_chunk_bounds",
           "tree_broadcast"]


def ring_chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the n ring chunks of a flat tensor of ``numel`` elements.

    Sizes differ by at most one (the first ``numel % n`` chunks get one more element); with
    fewer elements than ring members some chunks are empty, and the ring still works.
    """
    if n < 1:
        raise ValueError(f"ring_chunk_bounds needs n >= 1 ring members, got {n}.")
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for c in range(n):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _peers(group) -> tuple[int, int, int, int]:
    """(rank, world_size, global rank of the right neighbour, of the left) on the ring."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return rank, world, glob((rank + 1) % world), glob((rank - 1) % world)


def _exchange(send: torch.Tensor, right: int, recv: torch.Tensor, left: int, group) -> None:
    """Send to the right neighbour while receiving from the left one; empty chunks are skipped.

    The send and the receive go as one ``batch_isend_irecv``. Posted apart as blocking calls,
    send first, every rank would wait in its send for a receive its neighbour never reaches
    (gloo's blocking send waits for its receive even for a few elements; NCCL's can too);
    batched, they are posted together (on NCCL as one group, ncclGroupStart / ncclGroupEnd).
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, right, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_allreduce(tensor: torch.Tensor, group=None, *, check: bool = True) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, by a ring of sends and receives (textbook).

    The flat tensor is cut into ``p = world_size`` chunks. Reduce-scatter, ``p - 1`` steps: in
    step s every rank sends chunk ``rank - s`` to its right neighbour and adds the chunk
    ``rank - s - 1`` that arrives from its left one; afterwards rank r holds the full sum of
    chunk ``r + 1``. All-gather, ``p - 1`` steps: the finished chunks travel round the ring and
    overwrite the stale copies. Each rank sends ``2 (p - 1)`` chunks of ``1 / p`` of the tensor.
    ``check=True`` first makes sure every rank passed the same shape and dtype (a small
    all-gather; ``check=False`` skips it). Counterpart: ``dist.all_reduce`` (same result, up to
    the order of the additions).
    """
    rank, world, right, left = _peers(group)
    if world == 1:
        return tensor
    check_same("ring_allreduce", tensor, group, check=check)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = [flat[a:b] for a, b in ring_chunk_bounds(flat.numel(), world)]  # views
    incoming = torch.empty_like(chunks[0])                  # the largest chunk; this call's own
    for s in range(world - 1):                              # reduce-scatter
        send, mine = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        _exchange(send, right, incoming[:mine.numel()], left, group)
        mine.add_(incoming[:mine.numel()])
    for s in range(world - 1):                              # all-gather
        _exchange(chunks[(rank + 1 - s) % world], right, chunks[(rank - s) % world], left, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None, *,
                   check: bool = True) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank in place, along a binomial tree.

    In round k every rank that already has the data sends it to the rank ``2**k`` places
    further on, so ``p`` ranks are done after ``ceil(log2 p)`` rounds instead of ``p - 1``
    sends from ``src``. A rank never sends and receives in the same round, so plain blocking
    ``send`` / ``recv`` are safe here (on NCCL too). ``check=True`` first makes sure every rank
    passed the same shape, dtype and ``src`` (a small all-gather). Counterpart: ``dist.broadcast``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_same("tree_broadcast", tensor, group, check=check, problem=src_problem(src, world),
               src=src)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    me = (rank - src) % world  # position in the tree, with src at the root
    step = 1
    while step < world:
        if me < step and me + step < world:
            dist.send(tensor, glob((me + step + src) % world), group=group)
        elif step <= me < 2 * step:
            dist.recv(tensor, glob((me - step + src) % world), group=group)
        step *= 2
    return tensor


def ring_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                    group=None, *, check: bool = True) -> list[torch.Tensor]:
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank, passing pieces round a ring.

    In ``p - 1`` steps each rank forwards to its right neighbour the piece it received last.
    ``check=True`` first makes sure every rank passed the same shape and dtype (a small
    all-gather). Counterpart: ``dist.all_gather`` (same arguments).
    """
    rank, world, right, left = _peers(group)
    check_same("ring_all_gather", tensor, group, check=check,
               problem=tensor_list_problem(tensor_list, tensor, world))
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        _exchange(tensor_list[(rank - step) % world], right,
                  tensor_list[(rank - step - 1) % world], left, group)
    return tensor_list
