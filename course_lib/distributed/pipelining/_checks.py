"""The checks of ``schedules``: its arguments, an order of operations (each forward and backward
once, a backward after its forward), and whether all ranks run one program (else their sends
and receives never pair up, and every rank waits until the process group's timeout).
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

Op = tuple[str, int]

_NAME_BYTES = 48      # a schedule's name is sent as this many bytes at most
_FIELDS = 4           # num_stages, n_microbatches, order digest, name length; then the name


def check_sizes(who: str, num_stages, num_microbatches, stage=None) -> None:
    """ValueError unless p >= 1, m >= 1 (integers) and, when given, 0 <= stage < p."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who} expects an integer {name} >= 1, got {value!r}.")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool)
                              or not 0 <= stage < num_stages):
        raise ValueError(f"{who} expects stage in 0 ... {num_stages - 1} (one of num_stages="
                         f"{num_stages}), got {stage!r}.")


def check_order(order: Sequence, stage: int, num_microbatches: int) -> list[Op]:
    """``order`` as a list of ``(kind, microbatch)``: every ``("F", i)`` and ``("B", i)`` for
    i < m exactly once, ``B(i)`` after ``F(i)``; or ValueError saying what is wrong."""
    check_sizes("check_order", 1, num_microbatches)
    ops: list[Op] = []
    for op in order:
        if (not isinstance(op, (tuple, list)) or len(op) != 2 or op[0] not in ("F", "B")
                or not isinstance(op[1], int) or not 0 <= op[1] < num_microbatches):
            raise ValueError(f"stage {stage}: expected operations (\"F\" or \"B\", micro-batch "
                             f"0 ... {num_microbatches - 1}), found {op!r}.")
        ops.append((op[0], op[1]))
    want = {(k, i) for k in "FB" for i in range(num_microbatches)}
    if len(ops) != len(set(ops)) or set(ops) != want:
        twice = sorted({op for op in ops if ops.count(op) > 1})
        missing = sorted(want - set(ops))
        raise ValueError(f"stage {stage}: every forward and backward of {num_microbatches} "
                         f"micro-batches exactly once; missing {missing}, repeated {twice}.")
    for i in range(num_microbatches):
        if ops.index(("B", i)) < ops.index(("F", i)):
            raise ValueError(f"stage {stage}: B({i}) comes before F({i}); a backward needs its "
                             "forward's activations.")
    return ops


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
    micro-batches, stages and the same orders (``digest``): one small ``all_gather``."""
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
