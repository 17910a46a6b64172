"""Collectives written by hand from point-to-point operations (``isend`` / ``irecv``).

PyTorch counterparts: ``dist.all_reduce``, ``dist.broadcast``, ``dist.all_gather`` (which gloo
and NCCL implement with the same ring and tree schedules). Read more:
https://pytorch.org/docs/stable/distributed.html#point-to-point-communication and notebook 06.

``ring_allreduce`` is the textbook schedule, short enough to read in a minute; notebook 06 shows
it. ``ring_allreduce_pipelined`` is the same ring with each chunk cut into segments that are
passed on as soon as they arrive, as gloo's and NCCL's rings do: the benchmarks use it.
``ring_chunk_bounds`` is the one chunking of every ring in the course (lesson 02's ring over
devices, these rings over ranks, and the checkers), so "chunk c" means the same range everywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

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
    """Send to the right neighbour while receiving from the left one; empty chunks are skipped."""
    ops = []
    if recv.numel():  # the receive first: the data can land in place as soon as it arrives
        ops.append(dist.irecv(recv, left, group=group))
    if send.numel():
        ops.append(dist.isend(send, right, group=group))
    for op in ops:
        op.wait()


#: Pipelining: each chunk travels in segments of about this size (at most MAX_SEGMENTS of them),
#: so one segment is passed on while the next is still arriving, as in gloo's and NCCL's rings.
SEGMENT_BYTES = 2 * 2**20
MAX_SEGMENTS = 8


def ring_allreduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, by a ring of sends and receives (textbook).

    The flat tensor is cut into ``p = world_size`` chunks. Reduce-scatter, ``p - 1`` steps: in
    step s every rank sends chunk ``rank - s`` to its right neighbour and adds the chunk
    ``rank - s - 1`` that arrives from its left one; afterwards rank r holds the full sum of
    chunk ``r + 1``. All-gather, ``p - 1`` steps: the finished chunks travel round the ring and
    overwrite the stale copies. Each rank sends ``2 (p - 1)`` chunks of ``1 / p`` of the tensor.
    Counterpart: ``dist.all_reduce`` (same result, up to the order of the additions).
    """
    rank, world, right, left = _peers(group)
    if world == 1:
        return tensor
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


def ring_allreduce_pipelined(tensor: torch.Tensor, group=None,
                             segments: int | None = None) -> torch.Tensor:
    """``ring_allreduce`` with pipelined segments: the fast version, for the benchmarks.

    The flat tensor is cut into ``p = world_size`` chunks. In step s (of ``2 (p - 1)``) every
    rank sends chunk ``rank - s`` to its right neighbour and receives chunk ``rank - s - 1`` from
    its left one. In the first ``p - 1`` steps (reduce-scatter) it adds the received chunk into
    its own; afterwards rank r holds the full sum of chunk ``r + 1``. In the last ``p - 1``
    steps (all-gather) the finished chunks travel round the ring and land in place. What a rank
    sends in step s + 1 is what it received in step s. Each rank sends ``2 (p - 1) / p`` times
    the tensor, whatever ``p``: the bandwidth-optimal schedule of gloo's and NCCL's rings.

    Args:
        tensor: the same shape and dtype on every rank; overwritten with the sum.
        group: the process group (default: the whole world).
        segments: pieces per chunk (default: about ``SEGMENT_BYTES`` each, 1 for small
            tensors). A piece is sent on as soon as it has arrived (and been added), so the
            steps overlap instead of waiting for whole chunks. ``segments=1`` is the textbook
            schedule.

    Returns:
        ``tensor``, for convenience.
    """
    if segments is not None and (not isinstance(segments, int) or segments < 1):
        raise ValueError(f"ring_allreduce_pipelined expects segments >= 1 (or None for the "
                         f"default), got {segments!r}; segments=1 is the textbook schedule.")
    rank, world, right, left = _peers(group)
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = [flat[a:b] for a, b in ring_chunk_bounds(flat.numel(), world)]  # views, no copies
    largest = chunks[0].numel()
    if segments is None:
        segments = max(1, min(MAX_SEGMENTS, largest * flat.element_size() // SEGMENT_BYTES))
    spare = torch.empty(2 * largest, dtype=flat.dtype, device=flat.device)  # this call's own:
    spare = (spare[:largest], spare[largest:])  # reduce-scatter receives alternate between halves

    def pieces(t: torch.Tensor) -> list[torch.Tensor]:
        m = t.numel()
        return [t[j * m // segments:(j + 1) * m // segments] for j in range(segments)]

    sends = []

    def send(step: int, j: int) -> None:
        piece = pieces(chunks[(rank - step) % world])[j]
        if piece.numel():  # empty chunks (fewer elements than ranks) are not sent at all
            sends.append(dist.isend(piece, right, group=group, tag=step * segments + j))

    def receive(step: int):
        target = chunks[(rank - step - 1) % world]
        into = spare[step % 2][:target.numel()] if step < world - 1 else target
        ops = [dist.irecv(piece, left, group=group, tag=step * segments + j) if piece.numel()
               else None for j, piece in enumerate(pieces(into))]
        return ops, pieces(into), pieces(target)

    steps = 2 * (world - 1)
    incoming = receive(0)
    for j in range(segments):
        send(0, j)
    for step in range(steps):
        ops, arrived, target = incoming
        if step + 1 < steps:
            incoming = receive(step + 1)  # posted early: the data can land as soon as it comes
        for j in range(segments):
            if ops[j] is not None:
                ops[j].wait()
            if step < world - 1:  # reduce-scatter: add the neighbour's partial sum into ours
                target[j].add_(arrived[j])
            if step + 1 < steps:
                send(step + 1, j)  # and pass it on at once
    for op in sends:
        op.wait()

    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Copy ``tensor`` from rank ``src`` to every rank in place, along a binomial tree.

    In round k every rank that already has the data sends it to the rank ``2**k`` places
    further on, so ``p`` ranks are done after ``ceil(log2 p)`` rounds instead of ``p - 1``
    sends from ``src``. Counterpart: ``dist.broadcast``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"tree_broadcast expects src in 0..{world - 1} (a rank of the group), "
                         f"got {src!r}; dist.broadcast refuses it too.")
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
                    group=None) -> list[torch.Tensor]:
    """Fill ``tensor_list[r]`` with rank r's ``tensor`` on every rank, passing pieces round a ring.

    In ``p - 1`` steps each rank forwards to its right neighbour the piece it received last.
    Counterpart: ``dist.all_gather`` (same arguments).
    """
    rank, world, right, left = _peers(group)
    if len(tensor_list) != world:
        raise ValueError(f"ring_all_gather expects a list of {world} tensors (one per rank), "
                         f"got {len(tensor_list)}.")
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        _exchange(tensor_list[(rank - step) % world], right,
                  tensor_list[(rank - step - 1) % world], left, group)
    return tensor_list
