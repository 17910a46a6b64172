"""Lesson 06, exercise 3: the canonical worker of a multi-process program; exercise 4: an
allreduce from send and recv.

Checked by ``course_lib.checks.lesson06.check_spawn_worker`` and ``check_dist_allreduce``. The
worker is started once per rank, e.g. by
``torch.multiprocessing.spawn(worker, args=(world_size, init_method), nprocs=world_size)``.
"""
import torch
import torch.distributed as dist

__all__ = ["allreduce", "worker"]


def worker(rank: int, world_size: int, init_method: str) -> float:
    """Join the group, all-reduce ``rank + 1``, leave the group; return the sum."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)                      # every rank: 1 + 2 + ... + world_size
        return x.item()
    finally:
        dist.destroy_process_group()            # always leave, even after an error


def allreduce(tensor: torch.Tensor) -> None:
    """Exercise 4: an allreduce from send and recv only: every rank ends with the sum, in place.

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
