"""Lesson 02, exercises: the ring allreduce, a butterfly allreduce, the ring's traffic.

Checked by ``course_lib.checks.lesson02``: ``check_ring_allreduce`` (the ring's schedule, bit for
bit), ``check_butterfly`` and ``check_ring_sends``. The names are those the notebook's exercise
cells define (``# EXERCISE: name``), so ``make grade`` can be tried on a copy with these pasted.
"""
from __future__ import annotations

import torch

from course_lib.devices import devices
from course_lib.distributed.collectives import ring_chunk_bounds
from course_lib.parallel import comm

__all__ = ["butterfly_allreduce", "ring_allreduce", "ring_allreduce_no_buffers",
           "ring_sends_from_trace", "ring_traffic"]


@torch.no_grad()
def butterfly_allreduce(tensors: list[torch.Tensor]) -> None:
    """Exercise 2: log2(n) rounds; in round r device i adds the tensor of device i XOR 2**r."""
    n = len(tensors)
    if n & (n - 1):
        raise ValueError(f"butterfly_allreduce needs a power-of-two number of devices, got {n}.")
    distance = 1
    while distance < n:
        # every device reads its partner's tensor before anyone writes
        received = [tensors[i ^ distance].to(tensors[i].device, copy=True) for i in range(n)]
        for t, r in zip(tensors, received):
            t += r                                    # in place: the caller's tensor changes
        distance *= 2


@torch.no_grad()
def ring_allreduce(tensors: list[torch.Tensor]) -> None:
    """Exercise 1: the ring allreduce, in place, adding straight into the receiver.

    ``comm.ring_allreduce`` receives every chunk into a fresh buffer first; in one memory that
    is not needed. In a step, device i reads chunk c = (i - s) mod n of its own tensor and
    device i + 1 writes that same chunk c of *its* tensor, while it reads chunk c + 1 for its own
    send: no chunk is read and written in one step, so the adds can go straight into the
    receiver.
    """
    n = len(tensors)
    flats = [t.view(-1) for t in tensors]             # contiguous tensors: flat views
    bounds = ring_chunk_bounds(flats[0].numel(), n)

    def chunk(i: int, c: int) -> torch.Tensor:
        start, end = bounds[c % n]
        return flats[i % n][start:end]

    for s in range(n - 1):                            # reduce-scatter
        for i in range(n):
            chunk(i + 1, i - s).add_(chunk(i, i - s).to(flats[(i + 1) % n].device))
    for s in range(n - 1):                            # all-gather
        for i in range(n):
            chunk(i + 1, i + 1 - s).copy_(chunk(i, i + 1 - s))


ring_allreduce_no_buffers = ring_allreduce     # its name before lesson 02 asked for the ring


def ring_sends_from_trace(numel: int, n: int) -> list[int]:
    """Exercise 3: elements each device sends in ``comm.ring_allreduce``, from its trace."""
    trace: list = []
    comm.ring_allreduce([torch.zeros(numel).to(d) for d in devices(n, warn=False)], trace=trace)
    bounds, sent = ring_chunk_bounds(numel, n), [0] * n
    for record in trace:
        for src, _dst, c in record["sends"]:
            sent[src] += bounds[c][1] - bounds[c][0]
    return sent


#: Exercise 3's answer: what each of 4 devices sends for a tensor of 1001 elements.
ring_traffic = ring_sends_from_trace(1001, 4)
