"""Lesson 06, exercise 1: the canonical worker of a multi-process program, which hands its
result back through a queue; exercise 2: an allreduce from send and recv; exercise 3: the rounds
of a tree broadcast; exercise 4: what the ring sends.

Checked by ``course_lib.checks.lesson06.check_spawn_worker``, ``check_dist_allreduce``,
``check_tree_rounds`` and ``check_elements_sent``. The worker is started once per rank, e.g. by
``torch.multiprocessing.spawn(spawn_worker, args=(world_size, init_method, results),
nprocs=world_size)`` with ``results = torch.multiprocessing.get_context("spawn").SimpleQueue()``.
"""
import torch
import torch.distributed as dist

__all__ = ["allreduce", "elements_sent", "rounds", "spawn_worker"]


def spawn_worker(rank: int, world_size: int, init_method: str, results) -> None:
    """Join the group, all-reduce ``rank + 1``, put ``(rank, sum)`` on ``results``, leave.

    ``spawn`` discards what a worker returns: the result goes back through the queue, one pair
    per rank, so that the parent knows which rank said what.
    """
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)                      # every rank: 1 + 2 + ... + world_size
        results.put((rank, x.item()))           # a float: plain data crosses the queue
    finally:
        dist.destroy_process_group()            # always leave, even after an error


def allreduce(tensor: torch.Tensor) -> None:
    """Exercise 2: an allreduce from send and recv only: every rank ends with the sum, in place.

    Checked by ``course_lib.checks.lesson06.check_dist_allreduce``. The simplest correct
    pattern: rank 0 receives every other rank's tensor and adds it, then sends the sum back
    (2 (p - 1) full messages through rank 0; the ring of this lesson spreads them instead).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        received = torch.empty_like(tensor)
        for src in range(1, world):
            dist.recv(received, src=src)        # blocks until rank src has sent
            tensor += received                  # in place: the caller's tensor
        for dst in range(1, world):
            dist.send(tensor, dst=dst)
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)                # the sum, written into the caller's tensor


def rounds(p: int) -> int:
    """Exercise 3: the rounds ``tree_broadcast`` needs for ``p`` ranks (the holders double each
    round): ``ceil(log2 p)``, counted the way its loop counts."""
    step, count = 1, 0
    while step < p:
        step, count = step * 2, count + 1
    return count


def elements_sent(n: int, p: int, rank: int = 0) -> int:
    """Exercise 4: the elements rank ``rank`` sends in ``ring_allreduce`` of ``n`` elements over
    ``p`` ranks: ``p - 1`` chunks in each phase, cut by ``ring_chunk_bounds``."""
    from course_lib.distributed import ring_chunk_bounds

    bounds = ring_chunk_bounds(n, p)

    def size(c: int) -> int:
        return bounds[c][1] - bounds[c][0]

    scatter = sum(size((rank - s) % p) for s in range(p - 1))       # reduce-scatter
    gather = sum(size((rank - s + 1) % p) for s in range(p - 1))    # all-gather
    return scatter + gather
