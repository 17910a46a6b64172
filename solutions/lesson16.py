"""Lesson 16, exercises: context parallelism, in two steps.

1. ``merge(out_a, lse_a, out_b, lse_b)``: the online-softmax merge of two partial attentions,
   in log space so that nothing overflows, a row that sees no key at all giving 0
   (``check_merge``);
2. ``ring_step(k, v, group=None)``: one step of ring attention, this rank's blocks sent to the
   next rank of the group and the previous rank's received, paired in one
   ``dist.batch_isend_irecv`` (``check_ring_step``; the notebook's ``my_ring.py``);
3. ``ring_attention_forward(q, k, v, group=None, is_causal=False)``: the forward ring loop,
   contiguous layout, built on the two (``check_ring_attention``; ``my_ring_attention.py``).

In the notebook the first is a cell and the others files; here they are one module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["merge", "partial", "ring_attention_forward", "ring_step"]


# ---- exercise 1: the online-softmax merge ------------------------------------------------------

def merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over key sets a and b, from attention over each alone."""
    lse = torch.logaddexp(lse_a, lse_b)                       # log(e^lse_a + e^lse_b), no overflow
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)   # no key at all: 0
    share_a = torch.exp(lse_a - finite).unsqueeze(-1)         # set a's share of the mass
    share_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return share_a * out_a + share_b * out_b, lse


# ---- exercise 2, my_ring.py: one ring step -----------------------------------------------------

def ring_step(k, v, group=None):
    """Send k and v to the next rank of ``group``; return those of the previous rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if group is not None:                                      # P2POp peers are global ranks
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)     # new buffers: k, v are in flight
    ops = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
           dist.P2POp(dist.irecv, k_in, prev, group), dist.P2POp(dist.irecv, v_in, prev, group)]
    for work in dist.batch_isend_irecv(ops):                   # one batch: sends and receives
        work.wait()
    return k_in, v_in


# ---- exercise 3, my_ring_attention.py: the forward ring loop -----------------------------------

def partial(q, k, v, causal=False):
    """(out, lse) of the queries q over this block of keys alone (the scaffold gives it);
    ``causal``: the diagonal block, each query seeing the keys up to its own position."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5              # (B, H, Sq, Sk)
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                               # (B, H, Sq)
    return torch.softmax(s, dim=-1) @ v, lse


def ring_attention_forward(q, k, v, group=None, is_causal=False):
    """This rank's slice of attention over the whole sequence (contiguous layout)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = torch.zeros_like(q)                                      # (B, H, S/cp, D)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # no key yet
    for step in range(world):
        source = (rank - step) % world                             # whose keys this rank holds
        if not is_causal or source <= rank:                        # a later rank's: the future
            block_out, block_lse = partial(q, k, v, causal=is_causal and source == rank)
            out, lse = merge(out, lse, block_out, block_lse)
        if step < world - 1:
            k, v = ring_step(k, v, group)                          # the previous rank's block
    return out
