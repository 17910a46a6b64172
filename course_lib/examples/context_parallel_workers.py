"""Worker functions that notebook 16 (context parallelism and the mesh) hands to ``launch``.

- ``ring_against_sdpa``: ``ring_attention`` on this rank's slice of a sequence (contiguous and
  zigzag layouts, causal) against ``F.scaled_dot_product_attention`` on the whole sequence in
  this process: the largest difference of the output and of each gradient.
- ``mesh_lesson``: the mesh's groups beside torch's and the GPT trained on the mesh beside one
  process (``mesh_workers.mesh_groups`` and ``train_on_mesh``), in one launch; on the 2 x 2
  mesh also torch's own ``fully_shard`` + ``parallelize_module`` (``train_torch_mesh``).
- ``train_context_parallel``: the GPT on a ("dp", "cp") mesh, its attention ``ring_attention``
  over the "cp" group in the zigzag layout, each rank holding its chunks of every sequence of
  its dp slice (tokens, global position ids and labels alike), against one process on the whole
  batch; the bytes its rings send counted.
"""
from __future__ import annotations

import copy
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.distributed.device_mesh import init_device_mesh
from course_lib.distributed.env import current_device
from course_lib.distributed.recording import record_collectives
from course_lib.distributed.tensor.experimental import ring_attention, zigzag_split
from course_lib.examples import mesh_workers
from course_lib.models.gpt import GPT
from course_lib.utils.activation_memory import saved_tensor_bytes

from .workers import _gpt, _max_diff, _text_batches, _train_step

__all__ = ["mesh_lesson", "ring_against_sdpa", "saved_bytes_per_rank", "train_context_parallel"]


def _shard(x: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """This rank's positions of a whole (B, H, S, D) sequence under ``layout``."""
    return x.chunk(world, dim=2)[rank] if layout == "contiguous" else zigzag_split(x, rank, world)


def ring_against_sdpa(batch: int, heads: int, seq_per_rank: int, head_dim: int,
                      seed: int = 0) -> dict:
    """Causal ring attention against SDPA on the whole sequence, float64, for both layouts.

    Every rank draws the same q, k, v and output gradient for the whole sequence (seq_per_rank
    times the world, which 2 * world must divide for the zigzag layout), runs SDPA on all of it
    and ``ring_attention`` on its own positions. Returns ``{layout: {"out", "dq", "dk", "dv":
    largest difference on this rank's positions}}``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    S = seq_per_rank * world
    Q, K, V, dO = (torch.randn(batch, heads, S, head_dim, generator=gen, dtype=torch.float64)
                   for _ in range(4))                              # (B, H, S, D), the same
    whole = [t.clone().requires_grad_() for t in (Q, K, V)]         # everywhere
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(dO)
    want_out = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    result = {}
    for layout in ("contiguous", "zigzag"):
        mine = [_shard(t, rank, world, layout).requires_grad_() for t in (Q, K, V)]
        out = ring_attention(*mine, is_causal=True, layout=layout)  # (B, H, S/cp, D)
        out.backward(_shard(dO, rank, world, layout))
        pairs = [("out", out, want_out)] + [(f"d{n}", m.grad, w.grad) for n, m, w in
                                            zip("qkv", mine, whole)]
        result[layout] = {name: (got - _shard(want, rank, world, layout)).abs().max().item()
                          for name, got, want in pairs}
    return result


def mesh_lesson(config: dict, shape: tuple[int, ...], names: tuple[str, ...], batch_size: int,
                seq_len: int, steps: int, torch_too: bool = False) -> dict:
    """The mesh's groups (ours and torch's), the GPT on the mesh (float64, one step's
    collectives counted per dimension) and, with ``torch_too``, torch's version; the seconds
    the training took on this rank."""
    out = {"groups": mesh_workers.mesh_groups(shape, names)}
    start = time.perf_counter()
    out["run"] = mesh_workers.train_on_mesh(config, shape, names, batch_size, seq_len, steps,
                                            count=True)
    out["seconds"] = time.perf_counter() - start
    if torch_too:
        out["torch"] = mesh_workers.train_torch_mesh(config, batch_size, seq_len, steps)
    return out


# ---- the GPT with context parallelism ---------------------------------------------------------

def _positions(seq_len: int, rank: int, world: int) -> torch.Tensor:
    """The global position ids of this cp rank's tokens: its zigzag chunks of 0..seq_len-1."""
    return zigzag_split(torch.arange(seq_len), rank, world, dim=0)   # (T / cp,)


def _cp_forward(model: GPT, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``GPT.forward`` on a shard of every sequence: the position embeddings of the shard's
    own (global) positions instead of ``arange(T)``; the logits (b, T / cp, V)."""
    x = model.wte(idx) + model.wpe(pos)                            # (b, T / cp, C)
    for block in model.blocks:
        x = block(x)                                               # attention: the ring
    return model.lm_head(model.ln_f(x))


def train_context_parallel(config: dict, batch_size: int, seq_len: int, steps: int,
                           shape: tuple[int, int] = (2, 2), lr: float = 3e-3, seed: int = 0,
                           text_bytes: int | None = 20_000) -> dict:
    """Train the GPT on a ("dp", "cp") mesh beside one process on the whole batch, float64.

    Every batch (B, T) is cut over "dp" (rank i of the dp group takes the i-th B / dp
    sequences) and every sequence over "cp" in the zigzag layout: rank r of the cp group keeps
    chunks r and 2*cp-1-r of 2*cp of the tokens, of the position ids and of the labels.
    Attention is ``ring_attention`` over the cp group (``core_attention`` swapped); every
    other layer works on the rank's positions as they are. Each rank's loss is the sum of its
    tokens' losses over the batch's B * T tokens, so the gradients of all ranks summed (over
    "cp", then over "dp") are the gradient of the whole batch's mean loss.

    Returns ``{"coordinate", "losses": [(mesh, one)] per step, "params": [largest parameter
    difference after each step], "ring_bytes": [bytes this rank's rings sent in each step],
    "block_bytes": one (b, heads, T / cp, head_dim) block of keys}``.
    """
    dp_size, cp_size = shape
    dev = current_device()
    one = _gpt(config, seed, torch.float64)                        # the oracle, whole batch
    model = copy.deepcopy(one)
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=("dp", "cp"))
    dp, cp = mesh.get_group("dp"), mesh.get_group("cp")
    i, r = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    for block in model.blocks:
        block.attn.core_attention = partial(ring_attention, is_causal=True, group=cp,
                                            layout="zigzag")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_one = torch.optim.AdamW(one.parameters(), lr=lr)
    batches = _text_batches(batch_size, seq_len, seed, text_bytes)
    pos = _positions(seq_len, r, cp_size).to(dev)                  # (T / cp,) global ids
    losses, diffs, ring_bytes = [], [], []
    for _ in range(steps):
        X, Y = (t.to(dev) for t in next(batches))                  # (B, T): the whole batch
        x = zigzag_split(X.chunk(dp_size)[i], r, cp_size, dim=1)   # (B / dp, T / cp)
        y = zigzag_split(Y.chunk(dp_size)[i], r, cp_size, dim=1)   # labels: the same shard
        opt.zero_grad()
        with record_collectives(("isend",)) as sent:               # the rings' sends
            logits = _cp_forward(model, x, pos)                    # (B / dp, T / cp, V)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") \
                / X.numel()                                        # my tokens / all tokens
            loss.backward()
        total = loss.detach().clone()
        for t in [*(p.grad for p in model.parameters()), total]:  # the whole batch's gradient
            dist.all_reduce(t, group=cp)                            # and loss: sums over cp
            dist.all_reduce(t, group=dp)                            # then over dp
        opt.step()
        loss_one = _train_step(one, opt_one, X, Y)
        losses.append((total.item(), loss_one.item()))
        diffs.append(_max_diff(model.parameters(), one.parameters()))
        ring_bytes.append(sum(r.bytes for r in sent))
    c = one.config
    block = (batch_size // dp_size) * c.n_head * (seq_len // cp_size) * (c.n_embd // c.n_head)
    return dict(coordinate=mesh.get_coordinate(), losses=losses, params=diffs,
                ring_bytes=ring_bytes, block_bytes=block * 8)


# ---- what one rank keeps for backward -----------------------------------------------------------

def saved_bytes_per_rank(config: dict, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """Bytes one GPT block saves for backward on this rank, for every cp that divides the world.

    For each cp, the world is cut into groups of cp consecutive ranks (every rank calls
    ``new_group`` for every group, as torch requires); this rank runs the first block of the
    GPT, float64, its attention ``ring_attention`` over its group (zigzag layout), on its
    (batch_size, seq_len / cp, C) slice of the block's input, inside ``saved_tensor_bytes``
    (parameters not counted). Returns ``{cp: {"block": bytes, "attention": bytes}}``, the
    second the ring attention call alone, on this rank's q, k, v.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = _gpt(config, seed, torch.float64, device="cpu")
    block, c = gpt.blocks[0], gpt.config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, seq_len, c.n_embd, generator=gen, dtype=torch.float64)
    qkv = [torch.randn(batch_size, c.n_head, seq_len, c.n_embd // c.n_head, generator=gen,
                       dtype=torch.float64, requires_grad=True) for _ in range(3)]
    result = {}
    for cp in (n for n in range(1, world + 1) if world % n == 0):
        groups = [dist.new_group(list(range(g, g + cp))) for g in range(0, world, cp)]
        group, r = groups[rank // cp], rank % cp
        ring = partial(ring_attention, is_causal=True, group=group, layout="zigzag")
        block.attn.core_attention = ring
        mine = zigzag_split(x, r, cp, dim=1).requires_grad_()     # (b, T / cp, C)
        q, k, v = (zigzag_split(t.detach(), r, cp).requires_grad_() for t in qkv)
        result[cp] = {"block": saved_tensor_bytes(block, mine),
                      "attention": saved_tensor_bytes(ring, q, k, v)}
    return result
