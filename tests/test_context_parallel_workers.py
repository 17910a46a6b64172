"""Lesson 16's ring-attention worker: ``ring_against_sdpa`` compares with SDPA and can fail.

One launch at 3 ranks (the neighbours differ there): both layouts equal SDPA on the whole
sequence to rounding. A wrong comparison must show: the same worker with a sequence cut in the
other layout's order is far from SDPA (run in the same launch). And the GPT trained with
context parallelism on a (dp=2, cp=2) mesh: equal to one process, its ring bytes counted.
"""
import torch

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


_TINY = dict(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _train_both():
    right = W.train_context_parallel(_TINY, 4, 8, 2)
    original = W._positions
    try:            # every rank's positions counted from 0: the model must come out wrong
        W._positions = lambda seq_len, rank, world: torch.arange(seq_len // world)
        local = W.train_context_parallel(_TINY, 4, 8, 2)
    finally:
        W._positions = original
    return right, local


def test_gpt_on_dp_cp_mesh_equals_one_process():
    """(dp=2, cp=2), 2 steps, float64: losses and parameters equal one process; the rings send
    (6·cp − 4) blocks of keys per layer per step (k, v forward: 2(cp−1); backward k, v again:
    2(cp−1), and dk, dv a full turn: 2·cp); local position ids make it wrong."""
    per_rank = launch(_train_both, 4, timeout=120)
    cp, n_layer = 2, _TINY["n_layer"]
    for right, _ in per_rank:
        assert max(abs(a - b) / abs(b) for a, b in right["losses"]) < 1e-12, right
        assert max(right["params"]) < 1e-11, right
        assert right["ring_bytes"] == [n_layer * (6 * cp - 4) * right["block_bytes"]] * 2
    assert max(max(local["params"]) for _, local in per_rank) > 1e-6


def test_saved_bytes_shrink_by_cp_at_three_ranks():
    """cp = 1 and 3 in one launch: a block's saved bytes per rank are exactly 1/cp of cp = 1's;
    the ring saves only its own q, k, v, out (b, T/cp, C each) and lse (b, heads, T/cp)."""
    b, T, C, nh = 2, 12, 16, 2
    per_rank = launch(W.saved_bytes_per_rank, 3, _TINY | dict(block_size=T), b, T, timeout=120)
    for r in per_rank:
        assert set(r) == {1, 3}
        for cp in (1, 3):
            assert r[cp]["attention"] == (4 * b * T * C + b * nh * T) * 8 // cp, r
            assert r[cp]["block"] * cp == r[1]["block"], r
