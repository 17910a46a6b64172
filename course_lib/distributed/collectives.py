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
    """Send to the right neighbour while receiving from the left one; empty chunks are skipped.

    The send and the receive go as one ``batch_isend_irecv``: NCCL runs a rank's point-to-point
    operations in order on one stream, so a receive queued on its own before the send (or after
    it) waits for a peer that is itself waiting: a deadlock once messages pass NCCL's buffer.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, right, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


#: every torch dtype, in a fixed order: ``_check_same`` sends a dtype as its index here
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_MAX_DIMS = 8


def _check_same(who: str, tensor: torch.Tensor, group, problem: str | None = None,
                **agreed) -> None:
    """Raise ValueError in every rank unless all ranks pass the same shape, dtype and ``agreed``.

    One small ``all_gather`` of (problem?, dtype, ndim, numel, agreed values, shape) per call:
    ranks whose tensors differ would otherwise exchange chunks of different sizes and hang, or
    crash. ``problem``: this rank's own argument error, raised here after the others learn that
    this rank stops (so that they stop too instead of waiting for it).
    """
    values = [v if isinstance(v, int) else -2 for v in agreed.values()]
    meta = [problem is not None, _DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel(),
            *values, *list(tensor.shape)[:_MAX_DIMS]]
    meta += [-1] * (4 + len(values) + _MAX_DIMS - len(meta))
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else tensor.device
    mine = torch.tensor(meta, dtype=torch.int64, device=device)   # (4 + len(agreed) + 8,)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [row.tolist() for row in everyone]
    if problem is not None:
        raise ValueError(problem)
    stopped = [r for r, row in enumerate(rows) if row[0]]
    if stopped:
        raise ValueError(f"{who}: rank(s) {stopped} were given invalid arguments (their own "
                         "error says which); every rank stops.")
    if all(row == rows[0] for row in rows):
        return

    def held(row: list[int]) -> str:
        ndim, start = row[2], 4 + len(values)
        shape = tuple(row[start:start + ndim]) if ndim <= _MAX_DIMS else f"{row[3]} elements"
        extra = "".join(f", {k}={v}" for k, v in zip(agreed, row[4:start]))
        return f"{shape} {_DTYPES[row[1]]}{extra}"

    found = "; ".join(f"rank {r}: {held(row)}" for r, row in enumerate(rows))
    what = "tensor shape and dtype" + "".join(f", the same {k}" for k in agreed)
    raise ValueError(f"{who}: every rank must pass the same {what}; found {found}. Give each "
                     "rank a tensor of the same shape and dtype (torch's collectives require "
                     "it too).")


#: Pipelining: each chunk travels in segments of about this size (at most MAX_SEGMENTS of them),
#: so one segment is passed on while the next is still arriving, as in gloo's and NCCL's rings.
SEGMENT_BYTES = 2 * 2**20
MAX_SEGMENTS = 8


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
    if check:
        _check_same("ring_allreduce", tensor, group)
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


def _pieces(t: torch.Tensor, segments: int) -> list[torch.Tensor]:
    """``t`` cut into ``segments`` views whose sizes differ by at most one."""
    m = t.numel()
    return [t[j * m // segments:(j + 1) * m // segments] for j in range(segments)]


def ring_allreduce_pipelined(tensor: torch.Tensor, group=None, segments: int | None = None, *,
                             check: bool = True) -> torch.Tensor:
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
            tensors; never more than the elements of a chunk). A piece is sent on as soon as it
            has arrived (and been added), so the steps overlap instead of waiting for whole
            chunks. ``segments=1`` is the textbook schedule.
        check: first make sure every rank passed the same shape, dtype and segments (one small
            all-gather); ``False`` skips it.

    Returns:
        ``tensor``, for convenience.
    """
    problem = None
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool)
                                 or segments < 1):
        problem = (f"ring_allreduce_pipelined expects segments >= 1 (or None for the default), "
                   f"got {segments!r}; segments=1 is the textbook schedule.")
    rank, world, right, left = _peers(group)
    if check and world > 1:
        _check_same("ring_allreduce_pipelined", tensor, group, problem,
                    segments=-1 if segments is None else segments)
    elif problem is not None:
        raise ValueError(problem)
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
    problem = None
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
        problem = (f"tree_broadcast expects src in 0..{world - 1} (a rank of the group), "
                   f"got {src!r}; dist.broadcast refuses it too.")
    if check and world > 1:
        _check_same("tree_broadcast", tensor, group, problem, src=src)
    elif problem is not None:
        raise ValueError(problem)
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
    problem = None
    if len(tensor_list) != world:
        problem = (f"ring_all_gather expects a list of {world} tensors (one per rank), got "
                   f"{len(tensor_list)}.")
    elif any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        found = [f"{tuple(t.shape)} {t.dtype}" for t in tensor_list]
        problem = (f"ring_all_gather expects tensor_list to hold tensors of tensor's shape "
                   f"{tuple(tensor.shape)} and dtype {tensor.dtype}, found {found}.")
    if check and world > 1:
        _check_same("ring_all_gather", tensor, group, problem)
    elif problem is not None:
        raise ValueError(problem)
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        _exchange(tensor_list[(rank - step) % world], right,
                  tensor_list[(rank - step - 1) % world], left, group)
    return tensor_list
