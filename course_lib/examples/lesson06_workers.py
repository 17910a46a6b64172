"""Workers of notebook 06 that ``course_lib.distributed.launch`` starts (importable, so that
fresh processes can run them): one ring step posted send-first, and the timing of the
hand-written rings against ``dist.all_reduce``.

PyTorch counterpart: none; nccl-tests' ``all_reduce_perf`` times collectives the same way (a loop
of many operations per sample). The comparison itself is ``course_lib.timing.compare``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import current_device, ring_allreduce, ring_allreduce_pipelined
from ..distributed.env import _slowest
from ..timing import Comparison, LoadStamp, compare

__all__ = ["NOISY_MEDIAN_OVER_MIN", "median_over_min", "send_first_ring_step", "time_allreduces",
           "verdict_or_flag"]

#: The lesson's noise rule: when a variant's median is more than this many times its minimum,
#: most samples waited for something other than the messages (other programs on the cores), and
#: a ratio of medians says more about the machine than about the all-reduces.
NOISY_MEDIAN_OVER_MIN = 1.5


def send_first_ring_step(n: int = 5) -> list[float]:
    """One ring step as two blocking calls, ``send`` first on every rank: rank r sends ``n``
    copies of r to its right neighbour, then receives from its left one. Returns what arrived.
    On gloo every rank waits in ``send`` for a receive that its neighbour, itself sending,
    never posts: the step never ends, even for 5 elements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.full((n,), float(rank), device=current_device())
    theirs = torch.empty_like(mine)
    dist.send(mine, dst=(rank + 1) % world)
    dist.recv(theirs, src=(rank - 1) % world)
    return theirs.tolist()


def median_over_min(c: Comparison, name: str) -> float:
    """How far the median of ``name``'s samples sits above their minimum (1.0: no spread)."""
    return c.median(name) / c.min(name)


def verdict_or_flag(c: Comparison, name: str, limit: float = NOISY_MEDIAN_OVER_MIN) -> str:
    """``c.verdict(name)``, or a flag instead of it when the samples fail the noise rule.

    The rule applies to both sides of the ratio: ``name`` and the baseline it is divided by.
    """
    spread = {n: median_over_min(c, n) for n in (name, c.baseline)}
    noisy = [n for n, x in spread.items() if x > limit]
    if not noisy:
        return c.verdict(name)
    found = ", ".join(f"{n} {spread[n]:.2f}" for n in noisy)
    return f"{name} against {c.baseline}: NOISY, no verdict (med/min above {limit}: {found})"


def time_allreduces(sizes: list[int], segments: int, samples: int, min_sample_s: float,
                    stamp: LoadStamp | None = None) -> dict[int, Comparison] | None:
    """Time three all-reduces of float32 tensors of each size (bytes), interleaved, in every rank.

    The variants: ``dist.all_reduce`` (the baseline), the textbook ``ring_allreduce`` and
    ``ring_allreduce_pipelined`` with ``segments`` pieces per chunk (passed explicitly: its
    default, chunk bytes // 2 MiB, is one piece for chunks under 4 MiB, the textbook schedule).
    Every rank runs the same ``compare``: a barrier before each sample, each time the slowest
    rank's, so every rank loops the same number of times. The rings skip their argument check
    (``check=False``): it would add one small all-gather per call to what is timed. Returns, on
    rank 0, {bytes: Comparison}; None on the other ranks.
    """
    device = current_device()
    out = {}
    for nbytes in sizes:
        # zeros stay zeros however often they are summed: no overflow, no denormals
        x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)  # (n,) fp32
        variants = {"dist.all_reduce": lambda x=x: dist.all_reduce(x),
                    "ring": lambda x=x: ring_allreduce(x, check=False),
                    f"ring, {segments} segments": lambda x=x: ring_allreduce_pipelined(
                        x, segments=segments, check=False)}
        out[nbytes] = compare(variants, samples=samples, min_sample_seconds=min_sample_s,
                              warmup=2, calibration_calls=3, max_loops=2000, device=device,
                              before=dist.barrier, reduce=_slowest,
                              stamp=stamp if dist.get_rank() == 0 else None)
    return out if dist.get_rank() == 0 else None
