"""Lesson 16's ring-attention worker: ``ring_against_sdpa`` compares with SDPA and can fail.

One launch at 3 ranks (the neighbours differ there): both layouts equal SDPA on the whole
sequence to rounding. A wrong comparison must show: the same worker with a sequence cut in the
other layout's order is far from SDPA (run in the same launch).
"""
from course_lib.distributed import launch
from course_lib.examples import context_parallel_workers as W


def _both():
    right = W.ring_against_sdpa(1, 2, 4, 3)
    original = W._shard
    try:            # hand every layout the contiguous slices: zigzag must come out wrong
        W._shard = lambda x, rank, world, layout: x.chunk(world, dim=2)[rank]
        mixed = W.ring_against_sdpa(1, 2, 4, 3)
    finally:
        W._shard = original
    return right, mixed


def test_ring_against_sdpa_at_three_ranks():
    per_rank = launch(_both, 3, timeout=120)
    for right, _ in per_rank:
        assert set(right) == {"contiguous", "zigzag"}
        assert max(max(d.values()) for d in right.values()) < 1e-12, right
    assert max(max(m["zigzag"].values()) for _, m in per_rank) > 1e-3
