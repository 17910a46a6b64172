"""Lesson 06, exercise 1: the canonical worker of a multi-process program, which hands its
result back through a queue; exercise 2: a ring allreduce from send and recv; exercise 3: the rounds
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
    """Exercise 2: a ring allreduce from point-to-point messages: every rank ends with the sum,
    in place.

    Checked by ``course_lib.checks.lesson06.check_dist_allreduce`` with ``ring=True``. The flat
    tensor is cut into p chunks (sizes differ by at most one); in each of p - 1 reduce-scatter
    steps rank r sends a chunk right and adds the chunk arriving from the left, then p - 1
    all-gather steps pass the finished chunks on. Each step posts its send and its receive
    together (``batch_isend_irecv``): two blocking calls, ``send`` first on every rank, could
    all wait in ``send`` (NCCL pairs them only this way).
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)                      # the caller's memory (a contiguous tensor)
    base, extra = divmod(flat.numel(), p)
    bounds = [(i * base + min(i, extra), (i + 1) * base + min(i + 1, extra)) for i in range(p)]
    chunk = [flat[a:b] for a, b in bounds]
    right, left = (rank + 1) % p, (rank - 1) % p

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = ([dist.P2POp(dist.isend, send, right)] if send.numel() else []) + (
            [dist.P2POp(dist.irecv, recv, left)] if recv.numel() else [])
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for s in range(p - 1):                      # reduce-scatter: rank r ends with chunk r + 1
        incoming = torch.empty_like(chunk[(rank - s - 1) % p])
        exchange(chunk[(rank - s) % p], incoming)
        chunk[(rank - s - 1) % p] += incoming
    for s in range(p - 1):                      # all-gather: pass the finished chunks on
        exchange(chunk[(rank + 1 - s) % p], chunk[(rank - s) % p])


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
