"""Checkers for the exercises of lesson 12 (model and pipeline parallelism).

``check_one_f_one_b`` asks for the 1F1B order of one stage. The learner's orders for every stage
are played together by ``simulate_schedule`` (which finds a deadlock or a backward before its
forward), then compared with ``one_f_one_b_order``; a valid order that is not 1F1B is told what
it costs: more activations in flight (GPipe's order, a warm-up too long) or a longer step (a
warm-up too short). A failure names the first step where the order differs (which kind of op
1F1B runs there, which the answer runs), never 1F1B's whole order: that would be the answer.
"""
from __future__ import annotations

from collections.abc import Callable

from ..distributed.pipelining import (
    check_order,
    gpipe_order,
    one_f_one_b_order,
    simulate_schedule,
)
from ._core import ExerciseResult, call_bounded, failure, unanswered, verdict

__all__ = ["check_one_f_one_b", "max_in_flight"]

_NAME = "one_f_one_b"
_TRY = ("Play your orders with P.simulate_schedule(one_f_one_b, p, m) and look at them with "
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
    """Where ``got`` first leaves ``want``: the step and the kind of op each runs there.

    Both passed ``check_order`` (forwards in order, backwards in order), so at the first
    difference one runs a forward and the other a backward.
    """
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
    are played together: every operation exactly once, no backward before its forward, no
    deadlock, then the order must be 1F1B's. The first failing case is printed. ``None``, or a
    function that still raises ``NotImplementedError``, is "not answered yet".
    """
    if fn is None:
        return verdict(_NAME, None, "define your function and pass it here.", strict)
    for p, m in _CASES:
        orders = []
        for stage in range(p):
            where = f"stage={stage}, num_stages={p}, num_microbatches={m}"
            try:
                got = call_bounded(fn, stage, p, m)
            except KeyboardInterrupt:
                raise
            except NotImplementedError:                 # the scaffold, not written yet
                return unanswered(_NAME, strict)
            except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
                return verdict(_NAME, False, f"{failure(exc)} for {where}.", strict)
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
    return verdict(_NAME, True, f"1F1B's order on every stage for {len(_CASES)} (stages, "
                   "micro-batches) pairs from (1, 1) to (5, 7).", strict)
