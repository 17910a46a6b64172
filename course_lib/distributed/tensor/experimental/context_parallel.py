"""Ring attention: attention over a sequence split across ranks (context parallelism).

Each rank holds a slice of the sequence: its queries, keys and values. Keys and values travel
around the ring (one paired send to the next rank and receive from the previous per step, through
``dist.batch_isend_irecv``) while each rank attends its queries to every block of keys that
passes, merging the partial results with the online-softmax (log-sum-exp) rule. The backward
pass rings too: the gradients of keys and values travel with them and arrive home after a full
turn. PyTorch counterpart: ``torch.distributed.tensor.experimental.context_parallel``
(``_templated_ring_attention`` and its backward). Read more: Liu et al. (2023), "Ring Attention
with Blockwise Transformers"; zhuzilin/ring-flash-attention; notebook 16.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._checks import check_layout, check_partials, check_qkv, group_rank_size
from .load_balance import block_mask_kind, sequence_chunks

__all__ = ["merge_partial_attention", "ring_attention"]


# ---- one block of attention, forward and backward ----------------------------------------------

def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of a and of b, from attention over each (the online softmax).

    Args:
        out_a: (..., S, D) softmax-weighted values over key set a; lse_a: (..., S), the
            log-sum-exp of each query's scores over a (-inf: no key of a visible).
        out_b, lse_b: the same over key set b.

    Returns:
        ``(out, lse)`` over both key sets: lse = log(e^lse_a + e^lse_b), and out the average of
        out_a and out_b weighted by each set's share e^(lse_a - lse), e^(lse_b - lse).
    """
    check_partials(out_a, lse_a, out_b, lse_b, "merge_partial_attention")
    lse = torch.logaddexp(lse_a, lse_b)                            # (..., S), never overflows
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no key at all: 0, not nan
    share_a = torch.exp(lse_a - finite).unsqueeze(-1)              # (..., S, 1) in [0, 1]
    share_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return share_a * out_a + share_b * out_b, lse


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """(B, H, Sq, Sk) scaled scores; on the diagonal block the future keys are -inf."""
    s = (q @ k.transpose(-2, -1)) * scale                          # (B, H, Sq, Sk)
    if kind == "causal":
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _block_forward(q, k, v, scale: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q to one block of keys alone: (out (B, H, Sq, D), lse (B, H, Sq))."""
    s = _scores(q, k, scale, kind)
    lse = torch.logsumexp(s, dim=-1)                               # (B, H, Sq)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _block_backward(dout, q, k, v, lse, delta, scale: float, kind: str):
    """Gradients of one block (q, k, v) given the final lse and delta = rowsum(dout * out)."""
    p = torch.exp(_scores(q, k, scale, kind) - lse.unsqueeze(-1))  # final weights of these keys
    dv = p.transpose(-2, -1) @ dout                                # (B, H, Sk, D)
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))    # softmax's backward
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv  # dq, dk, dv


# ---- the ring ---------------------------------------------------------------------------------

class _RingStep:
    """Send tensors to the next rank of the group and receive as many from the previous one,
    all in one ``batch_isend_irecv`` (NCCL runs it as one operation: no send waits on a
    receive queued behind it); ``start`` posts, ``finish`` waits and returns what arrived."""

    def __init__(self, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.group, self.next, self.prev = group, to_global((rank + 1) % world), \
            to_global((rank - 1) % world)                          # P2POp peers are global ranks
        self.works, self.incoming = [], []

    def start(self, *tensors: torch.Tensor) -> None:
        self.incoming = [torch.empty_like(t) for t in tensors]     # never the buffers being sent
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in self.incoming]
        self.works = dist.batch_isend_irecv(ops)                   # same order on every rank

    def finish(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.incoming


def _blocks(rank: int, source: int, world: int, layout: str, is_causal: bool, size: int):
    """(query slice, key slice, kind) of every block to compute when this rank holds the keys
    of rank ``source``; local slices of ``size`` positions per chunk, skipped blocks left out."""
    mine, theirs = sequence_chunks(rank, world, layout), sequence_chunks(source, world, layout)
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            kind = block_mask_kind(qc, kc, is_causal)
            if kind != "skip":
                yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), kind


class _RingAttention(torch.autograd.Function):
    """Forward: keys and values go round the ring, partial attentions merged as they pass.
    Backward: they go round again, their gradients travelling with them."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, group, layout: str, scale: float):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        size = q.shape[2] // len(sequence_chunks(rank, world, layout))  # positions per chunk
        own_k, own_v = k, v                                        # k, v will be others' soon
        out = torch.zeros_like(q)                                  # (B, H, S/cp, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        ring = _RingStep(group)
        for step in range(world):
            if step < world - 1:
                ring.start(k, v)                                   # travels while we compute
            for qs, ks, kind in _blocks(rank, (rank - step) % world, world, layout, is_causal,
                                        size):
                block_out, block_lse = _block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                      scale, kind)
                out[:, :, qs], lse[:, :, qs] = merge_partial_attention(
                    out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if step < world - 1:
                k, v = ring.finish()                               # rank - step - 1's keys
        ctx.save_for_backward(q, own_k, own_v, out, lse)
        ctx.is_causal, ctx.group, ctx.layout, ctx.scale = is_causal, group, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        size = q.shape[2] // len(sequence_chunks(rank, world, ctx.layout))
        delta = (dout * out).sum(-1)                               # (B, H, S/cp)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kv_ring, grad_ring = _RingStep(ctx.group), _RingStep(ctx.group)
        for step in range(world):
            if step < world - 1:
                kv_ring.start(k, v)
            for qs, ks, kind in _blocks(rank, (rank - step) % world, world, ctx.layout,
                                        ctx.is_causal, size):
                dq_, dk_, dv_ = _block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks],
                                                v[:, :, ks], lse[:, :, qs], delta[:, :, qs],
                                                ctx.scale, kind)
                dq[:, :, qs] += dq_
                dk[:, :, ks] += dk_                                # dk, dv of the keys held now
                dv[:, :, ks] += dv_
            if world > 1:
                grad_ring.start(dk, dv)                            # they follow their keys
            if step < world - 1:
                k, v = kv_ring.finish()
            if world > 1:
                dk, dv = grad_ring.finish()
        return dq, dk, dv, None, None, None, None                 # dk, dv: home after a turn


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                   group=None, layout: str = "contiguous",
                   scale: float | None = None) -> torch.Tensor:
    """This rank's slice of ``F.scaled_dot_product_attention`` over the whole sequence.

    Args:
        q, k, v: (batch, heads, seq/cp, head_dim), this rank's positions of the sequence: the
            r-th slice (``layout="contiguous"``) or chunks r and 2*cp-1-r of 2*cp
            (``layout="zigzag"``, see ``zigzag_split``), cp the size of ``group``.
        is_causal: each query attends only to keys at its position or before.
        group: the context-parallel group (default: every rank).
        scale: the scores' factor, 1/sqrt(head_dim) by default (as SDPA).

    Returns:
        (batch, heads, seq/cp, head_dim): attention of this rank's queries to every key, in
        the dtype of q (computed in float32 at least); differentiable with respect to q, k, v.
    """
    check_layout(layout, "ring_attention")
    check_qkv(q, k, v, layout, "ring_attention")
    group_rank_size(group, "ring_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)               # bf16 in, float32 sums
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))
    return _RingAttention.apply(q, k, v, is_causal, group, layout, scale).to(dtype)
