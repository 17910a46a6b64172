"""Argument checks and error texts of ``course_lib.distributed.tensor.experimental``."""
from __future__ import annotations

import torch

from ..parallel._checks import group_rank_size  # noqa: F401 - re-exported for this package

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object, where: str) -> None:
    """``layout`` is one of ``LAYOUTS``."""
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be 'contiguous' (rank r holds the r-th slice of "
                         "the sequence) or 'zigzag' (rank r holds chunks r and 2*cp-1-r of "
                         f"2*cp chunks), got {layout!r}.")


def check_qkv(q: object, k: object, v: object, layout: str, where: str) -> None:
    """q, k, v: floating tensors of one shape (batch, heads, local sequence, head_dim), one
    dtype and one device; the local sequence holds two equal chunks under the zigzag layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a tensor (batch, heads, seq/cp, head_dim), "
                            f"got {type(t).__name__}.")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be 4-D (batch, heads, seq/cp, head_dim), got "
                             f"shape {tuple(t.shape)}; reshape (batch, seq, heads, head_dim) "
                             "with .transpose(1, 2), as F.scaled_dot_product_attention expects.")
        if not t.is_floating_point():
            raise TypeError(f"{where}: {name} must be floating point (float64, float32, "
                            f"bfloat16 or float16), got {t.dtype}; convert it with .to().")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"{where}: q, k and v must have the same shape (batch, heads, seq/cp, "
                         f"head_dim) on this rank, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}. Each rank holds the same positions of all three.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{where}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}; convert them to one with .to().")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{where}: q, k and v must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}.")
    if q.shape[-1] == 0 or q.shape[2] == 0:
        raise ValueError(f"{where}: expected a positive head_dim and at least one position per "
                         f"rank, got shape {tuple(q.shape)}.")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"{where}: with layout='zigzag' each rank holds two chunks of equal "
                         f"length, so its sequence length must be even, got {q.shape[2]}. Make "
                         "the whole sequence a multiple of 2*cp (pad it) and shard it with "
                         "zigzag_split.")


def divisible(size: int, parts: int, what: str, where: str) -> int:
    """``size // parts``, or a clear error when ``parts`` does not divide ``size``."""
    if size % parts:
        raise ValueError(f"{where}: {what} = {size} is not divisible by {parts}, so the ranks "
                         f"cannot hold equal chunks. Pad the sequence to a multiple of {parts}.")
    return size // parts


def check_rank(rank: int, world: int, where: str) -> None:
    """world >= 1 and 0 <= rank < world."""
    if world < 1:
        raise ValueError(f"{where}: expected a world size >= 1, got {world}.")
    if not 0 <= rank < world:
        raise ValueError(f"{where}: expected 0 <= rank < world_size = {world}, got rank {rank}.")


def check_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor, where: str) -> None:
    """Two partial attentions of the same queries: outputs (..., S, D), log-sum-exps (..., S)."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"{where}: the two partial attentions must be of the same queries, got "
                         f"outputs {tuple(out_a.shape)} and {tuple(out_b.shape)}, log-sum-exps "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}.")
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"{where}: a log-sum-exp has one value per query, the output's shape "
                         f"without its last dimension: expected {tuple(out_a.shape[:-1])}, got "
                         f"{tuple(lse_a.shape)}.")
