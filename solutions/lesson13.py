"""Lesson 13, exercises: a sharded checkpoint laid out for another number of ranks; loading a
checkpoint whatever its keys' prefixes, partly for fine-tuning; and the smaller
``strip_prefix`` of earlier versions of the lesson.

Also a sharded model and its Adam saved with DCP and resumed on another number of ranks
(``save_sharded`` / ``resume_sharded``).

Checked by ``course_lib.checks.lesson13.check_load_matching``, ``check_read_plan``,
``check_sharded_resume``, ``check_reshard`` and ``check_strip_prefix``.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["load_matching", "read_plan", "reshard", "resume_sharded", "save_sharded",
           "strip_prefix"]

#: What wrappers put in front of every key: DDP and DataParallel, torch.compile.
WRAPPERS = ("module.", "_orig_mod.")


def load_matching(model: nn.Module, state_dict: dict) -> tuple[list[str], list[str]]:
    """Load the tensors of ``state_dict`` that name a key of ``model``; report the others.

    A key names a model key as it is, or once its leading wrapper prefixes are removed, ONE at a
    time (a model whose own submodule is called ``module`` keeps its ``module.``). Every shape is
    checked before anything is copied.

    Returns:
        (missing_keys, unexpected_keys): the model's keys not loaded, the file's keys (as
        written in the file) that name no key of the model.
    """
    own = model.state_dict()
    renamed, unexpected = {}, []
    for key, value in state_dict.items():
        name = key
        while name not in own and name.startswith(WRAPPERS):
            name = name.split(".", 1)[1]                  # one wrapper prefix off
        if name not in own:
            unexpected.append(key)
        elif name in renamed:
            raise ValueError(f"two keys of the file name {name!r}; keep one of them.")
        else:
            renamed[name] = value
    wrong = [f"{k}: file {tuple(v.shape)}, model {tuple(own[k].shape)}"
             for k, v in renamed.items() if v.shape != own[k].shape]
    if wrong:                                             # before anything is copied
        raise ValueError(f"shapes differ, nothing loaded: {', '.join(wrong)}")
    model.load_state_dict(renamed, strict=False)
    return [k for k in own if k not in renamed], unexpected


def strip_prefix(state_dict: dict, prefix: str = "module.") -> dict:
    """A new dict whose keys lose ``prefix`` where they START with it; the tensors are kept.

    ``str.removeprefix`` touches only the start of a key, and only a key that has the prefix:
    ``"module.block.module.weight"`` -> ``"block.module.weight"``, ``"conv1.weight"`` unchanged.
    """
    return {key.removeprefix(prefix): value for key, value in state_dict.items()}


def reshard(shards: list[dict], world_size: int) -> list[dict]:
    """The dim-0 shards that ``len(shards)`` ranks saved, as ``world_size`` ranks hold them.

    Each tensor is put back together (the saving ranks' rows, in rank order), then split as
    ``fully_shard`` splits it: ``torch.chunk`` on dim 0, which may return fewer pieces than
    ranks; the ranks past the end get an empty ``(0, ...)`` tensor.
    """
    out: list[dict] = [{} for _ in range(world_size)]
    for key in shards[0]:
        full = torch.cat([s[key] for s in shards], dim=0)
        pieces = torch.chunk(full, world_size, dim=0)
        for rank in range(world_size):
            out[rank][key] = (pieces[rank] if rank < len(pieces)
                              else full.new_empty((0, *full.shape[1:])))
    return out


def read_plan(pieces: list[tuple[int, int]], world_size: int) -> list[list[tuple[int, int, int]]]:
    """For each of ``world_size`` new ranks, ``(piece, start, stop)``: the rows of each saved
    piece it reads, counted within that piece.

    A new rank holds ``torch.chunk``'s block of rows, ``[r * c, min((r + 1) * c, rows))`` with
    ``c = ceil(rows / world_size)``; from each piece it reads the overlap of the two ranges.
    """
    rows = max((offset + length for offset, length in pieces), default=0)
    c = -(-rows // world_size)
    plan = []
    for r in range(world_size):
        start, stop = min(r * c, rows), min((r + 1) * c, rows)
        plan.append([(i, max(start, o) - o, min(stop, o + n) - o)
                     for i, (o, n) in enumerate(pieces) if max(start, o) < min(stop, o + n)])
    return plan


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Both state dicts as this rank holds them (no copy), written by every rank to ``path``."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def resume_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """This layout's state dicts filled from ``path`` (each rank its rows), then put in place."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
