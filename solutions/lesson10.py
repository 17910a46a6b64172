"""Lesson 10, exercises: the benchmark loop of a collective; the alpha-beta fit of a ring
all-reduce; the wait for the slower rank; the share of a step's all-reduces during backward
and their tail; the model of a bucketed step's tail. No longer asked by the notebook, their
checkers kept: the predicted all-reduce time of a step, the alpha-beta time of a ring
all-reduce (lesson 02 derives it), the bus bandwidth of one raw row of a collectives results file.

Checked by ``course_lib.checks.lesson10.check_time_collective``, ``check_alpha_beta_fit``,
``check_slower_rank_wait``, ``check_overlap_of_step``, ``check_comm_after_backward``,
``check_predicted_comm``, ``check_ring_time`` and ``check_bus_bandwidth``.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from course_lib.devices import synchronize
from course_lib.distributed import current_device

__all__ = ["alpha_beta_fit", "bus_bandwidth", "comm_after_backward", "overlap_of_step",
           "predicted_comm", "ring_time", "slower_rank_wait", "time_collective"]


def time_collective(op, warmup: int, samples: int, loops: int) -> float:
    """Called on every rank: the seconds per call of ``op()``, the slowest rank's, median over
    ``samples`` samples of ``loops`` calls each, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(samples):
        dist.barrier()                       # every rank starts the sample together
        synchronize()                        # earlier GPU work is not this sample's
        start = time.perf_counter()
        for _ in range(loops):
            op()
        synchronize()                        # the work the loop queued is
        per_call = torch.tensor([(time.perf_counter() - start) / loops], dtype=torch.float64,
                                device=current_device())
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)   # ends when the slowest rank does
        times.append(per_call.item())
    return statistics.median(times)


def ring_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce of ``n_bytes`` over p ranks: ``2 (p - 1)`` steps (a
    reduce-scatter, then an all-gather), each one message of ``n / p`` bytes per rank."""
    return 2 * (p - 1) * (alpha + n_bytes / p * beta)


def alpha_beta_fit(sizes: list[float], times: list[float], p: int) -> tuple[float, float]:
    """Latency (s) and inverse bandwidth (s/byte) of a ring all-reduce over p ranks, from the
    line ``t = a + b n`` fitted on the relative error: ``t_ring = 2 (p - 1) alpha
    + 2 (p - 1) / p n beta``."""
    n, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    b, a = np.polyfit(n, t, 1, w=1 / t)      # residuals weighted by 1 / t: relative errors
    return float(a / (2 * (p - 1))), float(b * p / (2 * (p - 1)))


def slower_rank_wait(durations: list[list[float]]) -> float:
    """Seconds per step that meeting at every step costs over meeting once at the end, from
    ``durations[rank][step]``. Meeting every step, each step lasts as long as its slowest rank:
    the loop takes the sum over the steps of the largest duration. Meeting once, each rank runs
    its own steps and the loop ends with the rank whose sum is largest."""
    steps = len(durations[0])
    every_step = sum(max(step) for step in zip(*durations))   # zip: one tuple per step
    once = max(sum(d) for d in durations)
    return (every_step - once) / steps


def predicted_comm(message_bytes: list[float], p: int, alpha: float, beta: float) -> float:
    """Seconds of a step's all-reduces: one ring all-reduce per message, one after another."""
    return sum(ring_time(n, p, alpha, beta) for n in message_bytes)


def bus_bandwidth(row: dict) -> float:
    """GB/s of bus bandwidth of one all-reduce row (``world_size``, ``bytes``, ``seconds``).

    The typical operation's time is the median of the samples (each already seconds per
    operation); algorithm bandwidth = bytes / time; bus bandwidth = algbw * 2 (p - 1) / p.
    """
    p, n = row["world_size"], row["bytes"]
    seconds = statistics.median(row["seconds"])
    algbw = n / seconds                      # bytes per second
    return algbw * 2 * (p - 1) / p / 1e9     # GB/s


def overlap_of_step(calls: list[tuple[float, float]], backward_end: float) -> tuple[float, float]:
    """Exercise 4: one rank's stamped step. The share of the calls' summed time before
    backward's end (a call crossing it cut at the mark), and the time from backward's end to
    the last result (0 when every result came before it).

    Checked by ``course_lib.checks.lesson10.check_overlap_of_step``."""
    total = sum(end - start for start, end in calls)
    before = sum(max(0.0, min(end, backward_end) - start) for start, end in calls)
    last = max(end for _, end in calls)
    return before / total, max(0.0, last - backward_end)


def comm_after_backward(ready: list[float], sizes: list[float], p: int, alpha: float,
                        beta: float) -> float:
    """Exercise 5: the model's time from backward's end to the last all-reduce's end, the
    buckets' calls one at a time in launch order, each once its bucket is full.

    Checked by ``course_lib.checks.lesson10.check_comm_after_backward``."""
    free = 0.0                                  # when the line is free for the next call
    for r, n in zip(ready, sizes):
        start = max(r, free)
        free = start + 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta   # a ring all-reduce
    return free - max(ready)
