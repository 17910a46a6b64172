"""Sharded checkpoints (lesson 13; re-exported by ``course_lib.deploy``): N ranks' dim-0 rows
onto M ranks, as DCP's load does for FSDP's ``Shard(0)``, and a sharded model with its optimizer
saved and resumed with DCP on any number of ranks.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

__all__ = ["read_plan", "reshard", "resume_sharded", "save_sharded", "shard_rows"]


def shard_rows(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """The ``world_size`` dim-0 shards of ``tensor`` as torch's ``fully_shard`` holds them:
    ``torch.chunk``'s pieces of ``ceil(rows / world_size)`` rows, and for the ranks past the end
    (``chunk`` may return fewer pieces: 2 rows on 3 ranks) an empty ``(0, ...)`` tensor.
    """
    if world_size < 1:
        raise ValueError(f"shard_rows: world_size must be at least 1, got {world_size}.")
    pieces = list(torch.chunk(tensor, world_size, dim=0))
    empty = tensor.new_empty((0, *tensor.shape[1:]))
    return pieces + [empty] * (world_size - len(pieces))


def _chunk_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    # [start, stop) of each rank's rows under torch.chunk: blocks of ceil(rows / world_size)
    size = -(-rows // world_size)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world_size)]


def read_plan(pieces: list[tuple[int, int]], world_size: int
              ) -> list[list[tuple[int, int, int]]]:
    """What each of ``world_size`` new ranks reads from a tensor's saved dim-0 pieces.

    The course's version of DCP's load planner for ``fully_shard``'s ``Shard(0)``
    (``torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list``): a new
    rank holds the rows ``fully_shard`` gives it (``torch.chunk``'s split), and reads, from each
    saved piece that overlaps them, only the overlap. Nothing is put back together first.

    Args:
        pieces: the saved pieces of one tensor, ``(offset, length)`` each: the row of the whole
            tensor where the piece starts, and how many rows it has (0 for an empty piece).
        world_size: how many ranks load it.

    Returns:
        One list per new rank of ``(piece, start, stop)``: rows ``start`` up to (not including)
        ``stop`` of ``pieces[piece]``, counted within that piece; in piece order, no empty read.
    """
    if world_size < 1:
        raise ValueError(f"read_plan: world_size must be at least 1, got {world_size}.")
    rows = max((offset + length for offset, length in pieces), default=0)
    plan: list[list[tuple[int, int, int]]] = []
    for start, stop in _chunk_rows(rows, world_size):
        reads = []
        for i, (offset, length) in enumerate(pieces):
            first, last = max(start, offset), min(stop, offset + length)   # the overlap
            if first < last:
                reads.append((i, first - offset, last - offset))
        plan.append(reads)
    return plan


def reshard(shards: list[Mapping[str, torch.Tensor]], world_size: int
            ) -> list[dict[str, torch.Tensor]]:
    """A checkpoint's dim-0 shards saved by ``len(shards)`` ranks, laid out for ``world_size``.

    Each new rank's rows are copied from the saved shards that ``read_plan`` names, as DCP's
    load does: no tensor is put back together whole.

    Args:
        shards: one state dict per saving rank, in rank order, each tensor that rank's rows.
        world_size: how many ranks will load it; ``1`` gives the full state dict (in a list).

    Returns:
        One state dict per loading rank: the rows ``fully_shard`` on ``world_size`` ranks holds.
    """
    if not shards:
        raise ValueError("reshard: expected one state dict per saving rank, got none.")
    keys = list(shards[0])
    if any(list(s) != keys for s in shards):
        raise ValueError("reshard: every rank's state dict must have the same keys, in order.")
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for k in keys:
        saved = [s[k] for s in shards]
        offsets = itertools.accumulate((len(t) for t in saved), initial=0)
        pieces = list(zip(offsets, (len(t) for t in saved)))
        for rank, reads in enumerate(read_plan(pieces, world_size)):
            out[rank][k] = torch.cat([saved[0][:0]] + [saved[i][a:b] for i, a, b in reads])
    return out


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Save a sharded model and its optimizer with DCP: every rank writes its own rows.

    ``get_state_dict`` gives both state dicts as this rank holds them, without a copy (the
    optimizer's moments keyed by parameter name, sharded like them); ``dcp.save`` writes one
    file per rank and a ``.metadata`` into the directory ``path``. Every rank calls it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def resume_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Load ``save_sharded``'s directory into ``model`` and ``optimizer``, sharded on this group
    (which may have another number of ranks): ``dcp.load`` reads the saved rows this rank holds
    into this layout's state dicts, ``set_state_dict`` puts them in place, the optimizer's
    ``param_groups`` (its learning rate) included. Every rank calls it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)   # this layout's dicts to fill
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)                           # each rank reads its rows
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
