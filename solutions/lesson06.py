"""Lesson 06, exercise 3: the canonical worker of a multi-process program.

Checked by ``course_lib.checks.lesson06.check_spawn_worker``. Started once per rank, e.g. by
``torch.multiprocessing.spawn(worker, args=(world_size, init_method), nprocs=world_size)``.
"""
import torch
import torch.distributed as dist

__all__ = ["worker"]


def worker(rank: int, world_size: int, init_method: str) -> float:
    """Join the group, all-reduce ``rank + 1``, leave the group; return the sum."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)                      # every rank: 1 + 2 + ... + world_size
        return x.item()
    finally:
        dist.destroy_process_group()            # always leave, even after an error
