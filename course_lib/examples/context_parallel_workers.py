"""Worker functions that notebook 16 (context parallelism and the mesh) hands to ``launch``.

``launch`` starts fresh processes that import each function by module and name, so the workers
live here, never in a notebook cell.

- ``ring_against_sdpa``: ``ring_attention`` on this rank's slice of a sequence (contiguous and
  zigzag layouts, causal) against ``F.scaled_dot_product_attention`` on the whole sequence in
  this process: the largest difference of the output and of each gradient.
- ``mesh_lesson``: the mesh's groups beside torch's and the GPT trained on the mesh beside one
  process (``mesh_workers.mesh_groups`` and ``train_on_mesh``), in one launch; on the 2 x 2
  mesh also torch's own ``fully_shard`` + ``parallelize_module`` (``train_torch_mesh``).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.distributed.tensor.experimental import ring_attention, zigzag_split
from course_lib.examples import mesh_workers

__all__ = ["mesh_lesson", "ring_against_sdpa"]


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
