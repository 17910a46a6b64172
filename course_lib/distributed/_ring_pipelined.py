"""The pipelined ring all-reduce the benchmarks time, kept out of the lesson's ``collectives``.

``collectives.ring_allreduce`` is the textbook schedule; ``ring_allreduce_pipelined`` is the same
ring with each chunk cut into segments that are passed on as soon as they arrive, as gloo's and
NCCL's rings do. Re-exported by ``course_lib.distributed.collectives``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._collective_checks import check_same, segments_problem

#: Pipelining: each chunk travels in segments of about this size (at most MAX_SEGMENTS of them),
#: so one segment is passed on while the next is still arriving, as in gloo's and NCCL's rings.
SEGMENT_BYTES = 2 * 2**20
MAX_SEGMENTS = 8


def _pieces(t: torch.Tensor, segments: int) -> list[torch.Tensor]:
    """``t`` cut into ``segments`` views whose sizes differ by at most one."""
    m = t.numel()
    return [t[j * m // segments:(j + 1) * m // segments] for j in range(segments)]


def ring_allreduce_pipelined(tensor: torch.Tensor, group=None, segments: int | None = None, *,
                             check: bool = True) -> torch.Tensor:
    """``ring_allreduce`` with pipelined segments: the fast version, for the benchmarks.

    The chunks and the ``2 (p - 1)`` steps of ``ring_allreduce`` (reduce-scatter, then
    all-gather): each rank sends ``2 (p - 1) / p`` times the tensor, whatever ``p``, the
    bandwidth-optimal schedule of gloo's and NCCL's rings.

    Args:
        tensor: the same shape and dtype on every rank; overwritten with the sum.
        group: the process group (default: the whole world).
        segments: pieces per chunk (default: about ``SEGMENT_BYTES`` each, 1 for small
            tensors; never more than the elements of a chunk). A piece is sent on as soon as it
            has arrived (and been added), so the steps overlap instead of waiting for whole
            chunks. ``segments=1`` is the textbook schedule.
        check: first make sure every rank passed the same shape, dtype and segments (one small
            all-gather); ``False`` skips it.

    Returns:
        ``tensor``, for convenience.
    """
    from .collectives import _peers, ring_chunk_bounds  # the textbook ring's (imports this file)

    rank, world, right, left = _peers(group)
    check_same("ring_allreduce_pipelined", tensor, group, check=check,
               problem=segments_problem(segments), segments=-1 if segments is None else segments)
    if world == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = [flat[a:b] for a, b in ring_chunk_bounds(flat.numel(), world)]  # views, no copies
    largest = chunks[0].numel()
    if segments is None:
        segments = max(1, min(MAX_SEGMENTS, largest * flat.element_size() // SEGMENT_BYTES))
    segments = max(1, min(segments, largest))  # a segment holds at least one element
    # reduce-scatter receives alternate between two halves of a spare buffer (this call's own)
    spare = torch.empty(2 * largest, dtype=flat.dtype, device=flat.device)
    spare = (spare[:largest], spare[largest:])
    # every view built once: piece j of each chunk, and of each half for each chunk size
    chunk_pieces = [_pieces(c, segments) for c in chunks]
    spare_pieces = {(h, c.numel()): _pieces(spare[h][:c.numel()], segments)
                    for h in (0, 1) for c in chunks}
    steps = 2 * (world - 1)

    def arrives(step: int) -> list[torch.Tensor]:
        """Where step's pieces land: a spare half (reduce-scatter) or the chunk itself."""
        c = (rank - step - 1) % world
        return spare_pieces[step % 2, chunks[c].numel()] if step < world - 1 else chunk_pieces[c]

    def post(step: int, j: int) -> list:
        """Piece j of step ``step``: its send and its receive, as one batch (NCCL-safe)."""
        send, into = chunk_pieces[(rank - step) % world][j], arrives(step)[j]
        tag = step * segments + j
        ops = ([dist.P2POp(dist.isend, send, right, group, tag)] if send.numel() else []) + (
            [dist.P2POp(dist.irecv, into, left, group, tag)] if into.numel() else [])
        return dist.batch_isend_irecv(ops) if ops else []

    in_flight = [post(0, j) for j in range(segments)]
    for step in range(steps):
        target, arrived = chunk_pieces[(rank - step - 1) % world], arrives(step)
        for j in range(segments):
            for work in in_flight[j]:
                work.wait()
            if step < world - 1:  # reduce-scatter: add the neighbour's partial sum into ours
                target[j].add_(arrived[j])
            if step + 1 < steps:
                in_flight[j] = post(step + 1, j)  # and pass it on at once

    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor
