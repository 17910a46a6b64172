"""Workers of notebook 06 that ``course_lib.distributed.launch`` starts (importable, so that
fresh processes can run them): the timing of the hand-written rings against ``dist.all_reduce``.

PyTorch counterpart: none; nccl-tests' ``all_reduce_perf`` times collectives the same way (a loop
of many operations per sample). The comparison itself is ``course_lib.timing.compare``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import current_device, ring_allreduce, ring_allreduce_pipelined
from ..timing import Comparison, LoadStamp, compare

__all__ = ["time_allreduces"]


def _slowest(seconds: float) -> float:
    """The largest ``seconds`` over the ranks: a collective is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64, device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _variants(x: torch.Tensor, segments: int) -> dict:
    """The three all-reduces of ``x`` that ``time_allreduces`` compares, by name."""
    return {
        "dist.all_reduce": lambda: dist.all_reduce(x),
        "ring": lambda: ring_allreduce(x, check=False),
        f"ring, {segments} segments": lambda: ring_allreduce_pipelined(
            x, segments=segments, check=False),
    }


def time_allreduces(sizes: list[int], segments: int, samples: int, min_sample_s: float,
                    stamp: LoadStamp | None = None) -> dict[int, Comparison] | None:
    """Time three all-reduces of float32 tensors of each size (bytes), interleaved, in every rank.

    The variants: ``dist.all_reduce`` (the baseline), the textbook ``ring_allreduce`` and
    ``ring_allreduce_pipelined`` with ``segments`` pieces per chunk (passed explicitly: its
    default is one piece for chunks under 2 MiB, the textbook schedule). Every rank runs the
    same ``compare``: a barrier before each sample, each time the slowest rank's, so every rank
    loops the same number of times. The rings skip their argument check (``check=False``): it
    would add one small all-gather per call to what is timed.

    Returns:
        On rank 0, {bytes: Comparison}; None on the other ranks.
    """
    device = current_device()
    out = {}
    for nbytes in sizes:
        # zeros stay zeros however often they are summed: no overflow, no denormals
        x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)  # (n,) fp32
        variants = _variants(x, segments)
        out[nbytes] = compare(variants, samples=samples, min_sample_seconds=min_sample_s,
                              warmup=2, calibration_calls=3, max_loops=2000, device=device,
                              before=dist.barrier, reduce=_slowest,
                              stamp=stamp if dist.get_rank() == 0 else None)
    return out if dist.get_rank() == 0 else None
