"""Checkers for the exercises of lesson 12 (model and pipeline parallelism). Each returns the
verdict (truthy when right) and prints the first failing case; ``strict=True`` raises
``AssertionError`` on a wrong answer.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    check_order,
    gpipe_order,
    one_f_one_b_order,
    simulate_schedule,
    split_sequential,
)
from ._core import ExerciseResult, call_or_verdict, verdict
from .harness import StopRank, agree, call_answer, check_in_ranks, load_answer

__all__ = ["check_one_f_one_b", "check_stage", "max_in_flight"]

_NAME = "one_f_one_b"
_TRY = ("Play your orders with simulate_schedule(one_f_one_b, p, m) and look at them with "
        "draw_pipeline_timeline and checks.max_in_flight.")
_KIND = {"F": "a forward", "B": "a backward"}

#: (stages, micro-batches): fewer, as many and more micro-batches than stages
_CASES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 3), (3, 8), (4, 1), (4, 3), (4, 8),
          (5, 7)]


def max_in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward has run and backward not yet: activations held."""
    held = most = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def _given(orders: list[list]):
    """An order function that returns the orders already collected, stage by stage."""
    return lambda stage, num_stages, num_microbatches: orders[stage]


def _span(orders: list[list], p: int, m: int) -> float:
    return max(e.end for e in simulate_schedule(_given(orders), p, m))


def _first_divergence(got: list, want: list) -> str:
    """Where ``got`` first leaves ``want`` (both valid orders: there one runs F, the other B)."""
    k = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    return (f"at step {k} (counting from 0) 1F1B runs {_KIND[want[k][0]]}, yours "
            f"{_KIND[got[k][0]]} ({got[k][0]}{got[k][1]})")


def _diagnose(got: list, want: list, stage: int, p: int, m: int, orders: list[list]) -> str:
    """What a valid order that is not 1F1B's costs."""
    if got == gpipe_order(stage, p, m):
        return (" That is GPipe's order (all forwards, then all backwards): valid, but it holds "
                f"{m} micro-batches' activations at once; 1F1B holds at most "
                f"{max_in_flight(want)}.")
    if max_in_flight(got) > max_in_flight(want):
        return (f" It holds {max_in_flight(got)} micro-batches' activations at once; 1F1B at "
                f"most {max_in_flight(want)} (is the warm-up one forward too long?).")
    reference = [one_f_one_b_order(s, p, m) for s in range(p)]
    mine, best = _span(orders, p, m), _span(reference, p, m)
    if mine > best:
        return (f" With backward twice as long as forward the step takes {mine:g} time units "
                f"instead of 1F1B's {best:g}: a stage waits that need not (warm-up too short?).")
    return ""


def check_one_f_one_b(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Lesson 12's exercise: ``fn(stage, num_stages, num_microbatches)`` is 1F1B's order for one
    stage (``one_f_one_b_order``).

    The answer is a list of ``("F", i)`` / ``("B", i)``. For p from 1 to 5 stages and m from 1 to
    8 micro-batches (fewer than, as many as and more than the stages), the orders of all stages
    are played together (``simulate_schedule``): every operation exactly once, no backward
    before its forward, no deadlock, then the order must be 1F1B's. A valid order that is not is
    told what it costs (more activations in flight, or a longer step) and where it first
    differs, never 1F1B's whole order (the answer). ``None``, or a function that still raises
    ``NotImplementedError``, is "not answered yet".
    """
    if fn is None:
        return verdict(_NAME, None, "define your function and pass it here.", strict)
    for p, m in _CASES:
        orders = []
        for stage in range(p):
            where = f"stage={stage}, num_stages={p}, num_microbatches={m}"
            got, failed = call_or_verdict(_NAME, strict, fn, stage, p, m, after=f" for {where}.")
            if failed is not None:
                return failed
            try:
                orders.append(check_order(list(got), stage, m))
            except (TypeError, ValueError) as e:
                return verdict(_NAME, False, f"for {where}: {e} Your order: {got!r}.", strict)
        try:
            simulate_schedule(_given(orders), p, m)
        except ValueError as e:
            return verdict(_NAME, False, f"with num_stages={p}, num_microbatches={m} your "
                           f"orders {orders} never finish: {e} {_TRY}", strict)
        for stage in range(p):
            want = one_f_one_b_order(stage, p, m)
            if orders[stage] != want:
                why = _diagnose(orders[stage], want, stage, p, m, orders)
                return verdict(_NAME, False, f"for stage={stage}, num_stages={p}, "
                               f"num_microbatches={m} your order {orders[stage]} is valid but "
                               f"not 1F1B's: {_first_divergence(orders[stage], want)}.{why} "
                               f"{_TRY}", strict)
    stages, micro = sorted({p for p, _ in _CASES}), sorted({m for _, m in _CASES})
    return verdict(_NAME, True, f"1F1B's order on every stage for {len(_CASES)} (stages, "
                   f"micro-batches) pairs: {stages[0]} to {stages[-1]} stages, {micro[0]} to "
                   f"{micro[-1]} micro-batches.", strict)


# ---- a pipeline stage's forward_one and backward_one ---------------------------------------------

_STAGE_CASES = [(ScheduleGPipe, 1), (ScheduleGPipe, 4), (Schedule1F1B, 2), (Schedule1F1B, 4)]
#: the idea, not the code: the failure itself says which case and what went wrong
_STAGE_HINT = ("Each op is one rank's half of section 4's two-rank example, for one micro-batch. "
               "What arrives from the previous stage is a new tensor with no history: autograd "
               "can give you its gradient only if you ask for it before the layers run. Backward "
               "starts from this stage's output and the gradient that came back for it (the last "
               "stage: from its scaled loss); what goes back is the gradient of the stage's "
               "input.")


def _stage_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                         nn.Linear(7, 4)).double()


def _stage_cases(spec) -> str | None:
    """In every rank: one step of each case; the stage's gradients against one process."""
    cls, error = load_answer(spec, "class")
    if error:
        return error
    rank, p = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(8, 5, dtype=torch.float64, generator=gen)       # (B, 5)
    y = torch.randint(0, 4, (8,), generator=gen)                     # (B,)
    for schedule, m in _STAGE_CASES:
        where = f"{schedule.__name__} with {m} micro-batches, stage {rank} of {p}"
        model = _stage_model()
        oracle = copy.deepcopy(model)
        mine = split_sequential(model, p)[rank]
        F.cross_entropy(oracle(X), y).backward()         # one process, the whole batch
        want = [q.grad for q in split_sequential(oracle, p)[rank].parameters()]
        try:
            stage = call_answer("your class", cls, mine, rank, p)
            sched = schedule(stage, m, loss_fn=F.cross_entropy)
            args = (X,) if rank == 0 else ()
            kwargs = {"target": y} if rank == p - 1 else {}
            out = call_answer("your forward_one / backward_one (in schedule.step)", sched.step,
                              *args, **kwargs)
        except StopRank as e:
            if "send_gradient got None" in str(e):   # this rank's mistake, not a peer's
                return (f"{where}: backward_one sent None as the gradient of the stage's input: "
                        "X.grad stays None unless autograd was asked for it before the layers "
                        "ran on X.")
            return f"{where}: {e}"
        found = None
        got = [q.grad for q in mine.parameters()]
        if any(g is None for g in got):
            found = (f"{where}: the stage's parameters have no gradient after the step: did "
                     "backward_one run autograd from the output (with the gradient received)?")
        elif not all(torch.allclose(g, w) for g, w in zip(got, want)):
            ratio = torch.cat([g.flatten() for g in got]).norm() / \
                torch.cat([w.flatten() for w in want]).norm()
            found = (f"{where}: the stage's gradients differ from one process on the whole "
                     f"batch (norm ratio {ratio:.3g})"
                     + (": m times too large, is the loss multiplied by loss_scale?"
                        if abs(ratio - m) < 1e-6 and m > 1 else "."))
        elif rank == p - 1 and not torch.allclose(out, oracle(X).detach()):
            found = f"{where}: the last stage's outputs differ from one process on the whole batch."
        found = agree(found)                              # every rank stops, or none
        if found is not None:
            return found
    return None


def check_stage(cls: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Lesson 12's exercise: ``cls(submodule, stage_index, num_stages)``, a subclass of
    ``PipelineStageBase`` with ``forward_one`` and ``backward_one``.

    For each world size, that many worker processes, one stage each (a float64 MLP of five
    layers cut by ``split_sequential``), run one step of ``ScheduleGPipe`` (1 and 4
    micro-batches) and ``Schedule1F1B`` (2 and 4); every stage's gradients must equal one
    process's on the whole batch, and the last stage's output its output.

    ``cls``: your class (importable by worker processes) or ``"module:ClassName"``; None: not
    answered yet. ``world_sizes``: numbers of processes (stages) to try; ``timeout``: seconds for
    each world size (a stage that never sends fails, it does not hang).
    """
    return check_in_ranks(
        "MyStage", cls, "my_stage:MyStage", _stage_cases, (), world_sizes=world_sizes,
        timeout=timeout, hint=_STAGE_HINT,
        hang_hint=("A stage waited for a message that never came: does forward_one send its "
                   "output on (unless last), and backward_one send X.grad back (unless first)?"),
        passed=(f"every stage's gradients equal one process's on the whole batch, GPipe and "
                f"1F1B, for {list(world_sizes)} stages."),
        strict=strict, missing="write your class to a file and pass \"my_stage:MyStage\".")

