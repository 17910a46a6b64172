"""Checks for ``collectives``: do all ranks pass alike tensors (else a hand-written ring or tree
hangs, or crashes)? A rank's own argument error travels in the same all-gather, so that its
peers stop too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: every torch dtype, in a fixed order: ``check_same`` sends a dtype as its index here
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_MAX_DIMS = 8


def check_same(who: str, tensor: torch.Tensor, group, *, check: bool = True,
               problem: str | None = None, **agreed) -> None:
    """Raise ValueError in every rank unless all ranks pass the same shape, dtype and ``agreed``.

    With ``check`` and more than one rank: one small ``all_gather`` of (problem?, dtype, ndim,
    numel, agreed values, shape). ``problem``: this rank's own argument error, raised here
    (after the others learn that this rank stops, so that they stop too instead of waiting).
    """
    if not check or dist.get_world_size(group) == 1:
        if problem is not None:
            raise ValueError(problem)
        return
    values = [v if isinstance(v, int) else -2 for v in agreed.values()]
    meta = [problem is not None, _DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel(),
            *values, *list(tensor.shape)[:_MAX_DIMS]]
    meta += [-1] * (4 + len(values) + _MAX_DIMS - len(meta))
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else tensor.device
    mine = torch.tensor(meta, dtype=torch.int64, device=device)   # (4 + len(agreed) + 8,)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [row.tolist() for row in everyone]
    if problem is not None:
        raise ValueError(problem)
    stopped = [r for r, row in enumerate(rows) if row[0]]
    if stopped:
        raise ValueError(f"{who}: rank(s) {stopped} were given invalid arguments (their own "
                         "error says which); every rank stops.")
    if all(row == rows[0] for row in rows):
        return

    def held(row: list[int]) -> str:
        ndim, start = row[2], 4 + len(values)
        shape = tuple(row[start:start + ndim]) if ndim <= _MAX_DIMS else f"{row[3]} elements"
        extra = "".join(f", {k}={v}" for k, v in zip(agreed, row[4:start]))
        return f"{shape} {_DTYPES[row[1]]}{extra}"

    found = "; ".join(f"rank {r}: {held(row)}" for r, row in enumerate(rows))
    what = "tensor shape and dtype" + "".join(f", the same {k}" for k in agreed)
    raise ValueError(f"{who}: every rank must pass the same {what}; found {found}. Give each "
                     "rank a tensor of the same shape and dtype (torch's collectives require "
                     "it too).")


def src_problem(src, world: int) -> str | None:
    """What is wrong with ``tree_broadcast``'s ``src``, or None."""
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
        return (f"tree_broadcast expects src in 0..{world - 1} (a rank of the group), "
                f"got {src!r}; dist.broadcast refuses it too.")
    return None


def tensor_list_problem(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
                        world: int) -> str | None:
    """What is wrong with ``ring_all_gather``'s ``tensor_list``, or None."""
    if len(tensor_list) != world:
        return (f"ring_all_gather expects a list of {world} tensors (one per rank), got "
                f"{len(tensor_list)}.")
    if any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in tensor_list):
        found = [f"{tuple(t.shape)} {t.dtype}" for t in tensor_list]
        return (f"ring_all_gather expects tensor_list to hold tensors of tensor's shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}, found {found}.")
    return None


def segments_problem(segments) -> str | None:
    """What is wrong with ``ring_allreduce_pipelined``'s ``segments``, or None."""
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool)
                                 or segments < 1):
        return (f"ring_allreduce_pipelined expects segments >= 1 (or None for the default), "
                f"got {segments!r}; segments=1 is the textbook schedule.")
    return None
