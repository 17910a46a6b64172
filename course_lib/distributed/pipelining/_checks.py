"""The check a pipeline schedule runs at the start of every step: do all ranks run one program?

Stages that run different schedules, or different numbers of micro-batches, post sends and
receives that never pair up, and would wait on each other until the process group's timeout
(minutes). ``check_same_program`` asks every rank once per step, in one small ``all_gather``,
what it runs (the schedule's name, the number of micro-batches and of stages, and a digest of
every stage's order) and raises on every rank, naming which rank runs what, when they differ.
Kept out of ``schedules.py`` so that the lesson's ``step`` reads top to bottom.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

_NAME_BYTES = 48      # a schedule's name is sent as this many bytes at most
_FIELDS = 4           # num_stages, n_microbatches, order digest, name length; then the name


def order_digest(orders: Sequence[Sequence]) -> int:
    """A 32-bit digest of every stage's order (``orders[s]`` the order of stage s)."""
    text = repr([[(str(kind), int(i)) for kind, i in order] for order in orders])
    return zlib.crc32(text.encode())


def _encode(name: str, n_microbatches: int, num_stages: int, digest: int) -> torch.Tensor:
    raw = name.encode()[:_NAME_BYTES]
    code = torch.zeros(_FIELDS + _NAME_BYTES, dtype=torch.int64)
    code[:_FIELDS] = torch.tensor([num_stages, n_microbatches, digest, len(raw)])
    code[_FIELDS:_FIELDS + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    return code


def _decode(code: torch.Tensor) -> tuple[str, int, int, int]:
    num_stages, n_microbatches, digest, length = (int(v) for v in code[:_FIELDS])
    name = bytes(int(v) for v in code[_FIELDS:_FIELDS + length]).decode(errors="replace")
    return name, n_microbatches, num_stages, digest


def _describe(program: tuple[str, int, int, int], with_digest: bool) -> str:
    name, m, p, digest = program
    order = f" (order digest {digest:08x})" if with_digest else ""
    return f"{name}{order} with {m} micro-batch{'es' if m != 1 else ''} on {p} stages"


def check_same_program(stage, name: str, n_microbatches: int, digest: int) -> None:
    """Raise on every rank of ``stage.group`` unless all run ``name`` with as many
    micro-batches, stages and the same orders (``digest``, from ``order_digest``).

    One ``all_gather`` of ``_FIELDS + _NAME_BYTES`` integers (a few hundred bytes); nothing
    with one stage.
    """
    if stage.num_stages == 1:
        return
    mine = _encode(name, n_microbatches, stage.num_stages, digest).to(stage._wire)
    world = dist.get_world_size(stage.group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=stage.group)
    programs = [_decode(code.cpu()) for code in gathered]
    if len(set(programs)) == 1:
        return
    same_words = len({(n, m, p) for n, m, p, _ in programs}) == 1   # only the orders differ
    runs: dict[tuple, list[int]] = {}
    for rank, program in enumerate(programs):
        runs.setdefault(program, []).append(rank)
    who = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"run{'s' if len(ranks) == 1 else ''} {_describe(program, same_words)}"
        for program, ranks in runs.items())
    raise RuntimeError(
        f"the pipeline's ranks run different programs: {who}. Every stage must run the same "
        "schedule with the same n_microbatches (stage i on rank i); otherwise their sends and "
        "receives never pair up and every rank waits until the process group's timeout. "
        f"Build the same schedule on every rank (this is rank {stage.stage_index}).")
