"""Lesson 00, exercises: every GPU or the CPU; timing queued work; the FLOPs of a matrix product.

Checked by ``course_lib.checks.lesson00.check_try_all_gpus``, ``check_time_queued`` and
``check_matmul_flops``.
"""
from __future__ import annotations

import time

import torch

__all__ = ["matmul_flops", "time_queued", "try_all_gpus"]


def try_all_gpus() -> list[torch.device]:
    """Every CUDA GPU this process sees, or ``[cpu]`` when there is none (never ``[]``)."""
    gpus = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return gpus or [torch.device("cpu")]


def matmul_flops(n: int, k: int, m: int) -> int:
    """``(n, k) @ (k, m)``: n*m outputs, each k multiplies and k adds."""
    return 2 * n * k * m


def time_queued(queue, work, repeat: int) -> list[float]:
    """``repeat`` timings of ``work`` run on ``queue``: warm up once, then for each timing wait
    for the queue before starting the clock and again before reading it."""
    queue.submit(work)              # warm-up: the first call pays one-time costs
    times = []
    for _ in range(repeat):
        queue.synchronize()         # nothing queued earlier runs inside the timing
        start = time.perf_counter()
        queue.submit(work)
        queue.synchronize()         # the work has run: now the clock means something
        times.append(time.perf_counter() - start)
    return times
