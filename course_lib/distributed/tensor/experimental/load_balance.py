"""Who holds which positions of the sequence in context parallelism, and the work that gives.

With the contiguous layout rank r of cp holds the r-th slice of the sequence. Under a causal
mask the last rank's queries see every key and the first rank's see only their own: the ring
waits on the busiest rank at every step. The zigzag layout (torch's round-robin load balancer,
ring-flash-attention's ``zigzag``) cuts the sequence into 2*cp chunks and gives rank r chunks
r and 2*cp-1-r, one early and one late: every rank then does the same work. ``ring_attention_work``
counts it. PyTorch counterpart: ``torch.distributed.tensor.experimental._context_parallel``'s
``_load_balancer.py`` and ``context_parallel_unshard``. Read more: Liu et al. (2023), "Ring
Attention with Blockwise Transformers", and notebook 16.
"""
from __future__ import annotations

import dataclasses

import torch

from ._checks import check_layout, check_rank, divisible

__all__ = ["RingAttentionWork", "block_mask_kind", "ring_attention_work", "sequence_chunks",
           "zigzag_gather", "zigzag_split"]


def sequence_chunks(rank: int, world: int, layout: str = "contiguous") -> list[int]:
    """The chunks of the sequence rank ``rank`` holds, in order: ``[rank]`` of ``world`` chunks
    (contiguous) or ``[rank, 2*world-1-rank]`` of ``2*world`` chunks (zigzag)."""
    check_layout(layout, "sequence_chunks")
    check_rank(rank, world, "sequence_chunks")
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def block_mask_kind(query_chunk: int, key_chunk: int, is_causal: bool) -> str:
    """How the scores of one (query chunk, key chunk) block are masked, chunks of equal length:
    "full" (every key visible), "causal" (the diagonal block: each query sees the keys up to
    its own position) or "skip" (every key in the future: nothing to compute)."""
    if not is_causal or key_chunk < query_chunk:
        return "full"
    return "causal" if key_chunk == query_chunk else "skip"


def zigzag_split(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` under the zigzag layout: chunks ``rank`` and
    ``2*world-1-rank`` of ``2*world`` along ``dim``, joined (a new tensor)."""
    check_rank(rank, world, "zigzag_split")
    divisible(x.shape[dim], 2 * world, f"the sequence length (x.shape[{dim}])", "zigzag_split")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[c] for c in sequence_chunks(rank, world, "zigzag")], dim=dim)


def zigzag_gather(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's zigzag share (``shards[r]`` from rank r): the
    inverse of ``zigzag_split``."""
    world = len(shards)
    if world < 1:
        raise ValueError("zigzag_gather expects every rank's shard, in rank order, got none.")
    halves = [s.chunk(2, dim=dim) for s in shards]
    if any(len(h) != 2 or h[0].shape != h[1].shape for h in halves):
        raise ValueError("zigzag_gather: each shard holds two chunks of equal length along "
                         f"dim {dim} (what zigzag_split returns), got lengths "
                         f"{[s.shape[dim] for s in shards]}.")
    ordered = [None] * (2 * world)
    for rank, (first, second) in enumerate(halves):
        ordered[rank], ordered[2 * world - 1 - rank] = first, second
    return torch.cat(ordered, dim=dim)


@dataclasses.dataclass(frozen=True)
class RingAttentionWork:
    """The attention work of each rank at each ring step (``[rank][step]``).

    ``elements``: query-key scores that are not masked (what the matmuls must compute);
    ``blocks``: (query chunk, key chunk) blocks computed (a chunk is seq/cp positions long for
    the contiguous layout, seq/(2*cp) for the zigzag one).
    """
    layout: str
    seq_len: int
    world_size: int
    is_causal: bool
    elements: tuple[tuple[int, ...], ...]
    blocks: tuple[tuple[int, ...], ...]

    def per_rank(self) -> list[int]:
        """Unmasked scores each rank computes over the whole ring."""
        return [sum(steps) for steps in self.elements]

    def imbalance(self) -> float:
        """The busiest rank's work over the average rank's (1.0: balanced)."""
        totals = self.per_rank()
        return max(totals) * len(totals) / sum(totals)

    def critical_path(self) -> int:
        """Scores on the slowest path: each step of the ring waits for its busiest rank."""
        return sum(max(step) for step in zip(*self.elements))


def ring_attention_work(seq_len: int, world: int, *, layout: str = "contiguous",
                        is_causal: bool = True) -> RingAttentionWork:
    """Count the work of ring attention on a sequence of ``seq_len`` over ``world`` ranks.

    At step i rank r holds the keys of rank (r - i) mod world; every (query chunk, key chunk)
    block of it that is not skipped counts, the diagonal one by its unmasked half.
    """
    check_layout(layout, "ring_attention_work")
    check_rank(0, world, "ring_attention_work")
    n_chunks = world if layout == "contiguous" else 2 * world
    if seq_len < n_chunks:
        raise ValueError(f"ring_attention_work: expected at least one position per chunk, "
                         f"seq_len >= {n_chunks} for layout={layout!r} at {world} ranks, got "
                         f"seq_len = {seq_len}.")
    size = divisible(seq_len, n_chunks, "seq_len", "ring_attention_work")
    kinds = {"full": size * size, "causal": size * (size + 1) // 2, "skip": 0}
    elements, blocks = [], []
    for rank in range(world):
        mine = sequence_chunks(rank, world, layout)
        per_step, count = [], []
        for step in range(world):
            theirs = sequence_chunks((rank - step) % world, world, layout)
            found = [block_mask_kind(qc, kc, is_causal) for qc in mine for kc in theirs]
            per_step.append(sum(kinds[k] for k in found))
            count.append(sum(k != "skip" for k in found))
        elements.append(tuple(per_step))
        blocks.append(tuple(count))
    return RingAttentionWork(layout, seq_len, world, is_causal, tuple(elements), tuple(blocks))
