"""Checkers for the exercises of lesson 10 (timing plots and the alpha-beta model).

Each oracle is written apart from the library function it judges (the tests check that both
agree): the stand-in collective's own record of its calls, not ``timing.time_sample``; the
ring's schedule walked step by step and a median by sorting, not ``cost_model``'s closed
formulas; ``numpy.linalg.lstsq`` on rows scaled by ``1 / t_i``, not ``cost_model.fit_ring``; two
loops run on a clock, not ``step_comm.slower_rank_wait``. Every checker prints its verdict (the
first failing case, with the usual mistake that explains it when one does) and returns it
(truthy when right); ``strict=True`` raises ``AssertionError`` on a wrong answer.
"""
from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import current_device, launch
from ..distributed.env import _pin_to_cores
from ..distributed.recording import COLLECTIVES, record_collectives
from ._core import ExerciseResult, call_or_verdict, verdict
from .harness import StopRank, agree, call_answer, check_in_ranks, load_answer, worker_spec

__all__ = ["after_backward_by_latest_start", "check_alpha_beta_fit", "check_bus_bandwidth",
           "check_comm_after_backward", "check_predicted_comm", "check_overlap_of_step",
           "check_ring_time", "check_slower_rank_wait",
           "check_time_collective",
           "comm_by_schedule", "fit_line", "link_bytes_by_schedule", "lstsq_relative_fit",
           "median_by_sorting", "overlap_by_walking", "planned_sleep", "ring_time_by_schedule",
           "time_all_reduce", "wait_by_clocks"]

_HINT = ("the bus bandwidth is the bytes one rank's link carries in a ring, per second of the "
         "row's typical operation: count what a rank sends in the ring's steps, and compare "
         "with bytes / time.")


def link_bytes_by_schedule(n_bytes: float, p: int) -> float:
    """Bytes one rank's link sends in a ring all-reduce of ``n_bytes`` over p ranks.

    Reduce-scatter then all-gather: ``p - 1`` steps each, every rank sending one chunk of
    ``n / p`` bytes per step (real numbers, as nccl-tests counts them, whether or not p divides
    n).
    """
    steps = [n_bytes / p for _ in range(2 * (p - 1))]     # reduce-scatter, then all-gather
    return sum(steps)


def median_by_sorting(xs: list[float]) -> float:
    """The middle of the sorted values (the mean of the two middle ones for an even count)."""
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _expected(row: dict) -> float:
    """The oracle: link bytes per second of the median operation, in GB/s."""
    return link_bytes_by_schedule(row["bytes"], row["world_size"]) / median_by_sorting(
        row["seconds"]) / 1e9


def _cases() -> list[dict]:
    """Raw rows of a results file: sizes p does not divide, odd and even sample counts, outliers."""
    specs = [(2, 4096, [0.0011, 0.0009, 0.0010]),
             (3, 1000, [2.0e-4, 2.1e-4, 9.0e-4, 1.9e-4]),            # even count, an outlier
             (4, 1_048_576, [0.0040, 0.0031, 0.0052, 0.0033, 0.0035]),
             (3, 10**6 + 1, [0.0030, 0.0027, 0.0200, 0.0029, 0.0028, 0.0031]),
             (8, 64 * 2**20, [0.21, 0.20, 0.23, 0.19, 0.35]),
             (5, 999_999, [0.0100, 0.0080]),
             (2, 16 * 2**20, [0.030, 0.031, 0.029, 0.120, 0.032, 0.030, 0.028])]
    return [{"world_size": p, "bytes": n, "op": "all_reduce", "reps": 10, "seconds": list(seconds)}
            for p, n, seconds in specs]


def _named(usual: dict[str, object], got: object, otherwise: str, rel_tol: float = 1e-9,
           abs_tol: float = 1e-15) -> str:
    """"That is <why>." for the first usual mistake whose value (a number, or a tuple of them)
    ``got`` equals to the tolerances, else ``otherwise`` (the hint)."""
    def near(value) -> bool:
        pairs = zip(got, value) if isinstance(got, tuple) else [(got, value)]
        return all(math.isclose(g, v, rel_tol=rel_tol, abs_tol=abs_tol) for g, v in pairs)
    return next((f"That is {why}." for why, value in usual.items() if near(value)), otherwise)


def _diagnose(row: dict, got: float) -> str:
    """A likely mistake behind ``got``, when one of the usual ones reproduces it."""
    p, n, xs = row["world_size"], row["bytes"], row["seconds"]
    med = median_by_sorting(xs)
    factor = 2 * (p - 1) / p
    usual = {
        "the algorithm bandwidth (bytes / time): multiply by 2 (p - 1) / p": n / med / 1e9,
        "in bytes per second: divide by 1e9 for GB/s": n / med * factor,
        "in GiB/s (2**30): GB/s counts 1e9 bytes": n / med * factor / 2**30,
        "from the mean of the samples: one slow sample moves it, take the median":
            n / (sum(xs) / len(xs)) * factor / 1e9,
        "from the fastest sample: this exercise asks for the median": n / min(xs) * factor / 1e9,
        "with the factor upside down: it is 2 (p - 1) / p": n / med / factor / 1e9,
        "with the median of an even count taken as one of the two middle samples: average "
        "them": n / sorted(xs)[len(xs) // 2] * factor / 1e9,
        "with n // p (integer division): the chunks are n / p bytes": 2 * (p - 1) * (n // p)
        / med / 1e9,
        "with seconds multiplied by reps: row['seconds'] is already per operation":
            n / (med * row.get("reps", 1)) * factor / 1e9,
    }
    return _named(usual, got, _HINT, rel_tol=1e-6, abs_tol=0.0)


def check_bus_bandwidth(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(row)`` is the bus bandwidth of a raw results row, in GB/s, as nccl-tests
    defines it (its ``doc/PERFORMANCE.md``).

    Run on rows of 2, 3, 4, 5 and 8 ranks, sizes they do not divide, odd and even numbers of
    samples with outliers; each call gets its own copy of the row. Relative tolerance 1e-6.
    """
    cases = _cases()
    shown = [{k: row[k] for k in ("world_size", "bytes", "seconds")} for row in cases]
    return _check_each(
        "bus_bandwidth", fn, strict, [((row,), f"the row {s}") for row, s in zip(cases, shown)],
        _HINT,
        _one_number(_expected, _diagnose, at="for", unit=" GB/s", got_unit="", named="GB/s",
                    rel_tol=1e-6, abs_tol=0.0),
        f"matches nccl-tests' bus bandwidth on {len(cases)} rows (2 to 8 ranks).")


def _check_each(name: str, fn: Callable | None, strict: bool, cases: list, hint: str,
                problem: Callable[..., str | None], passed: str) -> ExerciseResult:
    """The checkers' shared loop: ``fn`` on a copy of each ``args`` of ``(args, shown)`` in
    ``cases``; ``problem(got, shown, *args)`` says what is wrong (None: right)."""
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for args, shown in cases:
        got, failed = call_or_verdict(name, strict, fn, *copy.deepcopy(args),
                                      after=f" on {shown}. {hint}")
        if failed is not None:
            return failed
        found = problem(got, shown, *args)
        if found is not None:
            return verdict(name, False, found, strict)
    return verdict(name, True, passed, strict)


def _one_number(want: Callable[..., float], diagnose: Callable[..., str], at: str = "on",
                unit: str = " s", got_unit: str = " s", named: str = "seconds",
                rel_tol: float = 1e-9, abs_tol: float = 1e-15) -> Callable:
    """The ``problem`` of a checker of one number (a time unless told): ``got`` against
    ``want(*args)``; ``diagnose(*args, got)`` names a usual mistake."""
    def problem(got: object, shown: str, *args) -> str | None:
        expected = want(*args)
        try:
            got = float(got)   # a 0-d tensor or numpy number is fine
        except (TypeError, ValueError):
            return (f"returned {got!r} ({type(got).__name__}) {at} {shown}; expected one "
                    f"number, in {named}.")
        if not math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol):
            return (f"{at} {shown}: expected {expected:.6g}{unit}, got {got:.6g}{got_unit}. "
                    f"{diagnose(*args, got)}")
        return None
    return problem


# ---- the alpha-beta time of a ring all-reduce ----------------------------------------------------

_RING_HINT = ("a ring all-reduce is a reduce-scatter then an all-gather, p - 1 steps each; in "
              "every step each rank sends one chunk of n / p bytes to its neighbour (all at "
              "once), and one message costs alpha + bytes * beta.")


def ring_time_by_schedule(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds of a ring all-reduce, step by step: ``2 (p - 1)`` messages of ``n / p`` bytes, one
    after another (the ranks' messages of one step travel at the same time)."""
    steps = 2 * (p - 1)                              # reduce-scatter, then all-gather
    return sum(alpha + n_bytes / p * beta for _ in range(steps))


def _ring_cases() -> list[tuple[float, int, float, float]]:
    """(n_bytes, p, alpha, beta): sizes p does not divide, one rank, alpha or beta alone."""
    return [(4096, 2, 100e-6, 0.5e-9), (10**6 + 1, 3, 30e-6, 2e-9), (64 * 2**20, 8, 5e-6, 0.02e-9),
            (1000, 5, 10e-6, 1e-9), (2**20, 4, 0.0, 1e-9), (2**20, 3, 50e-6, 0.0),
            (123_457, 7, 3e-6, 0.1e-9), (2**20, 1, 50e-6, 1e-9)]


def _ring_diagnose(n: float, p: int, alpha: float, beta: float, got: float) -> str:
    """A likely mistake behind ``got``, when one of the usual ones reproduces it."""
    usual = {
        "the reduce-scatter alone: the all-gather adds p - 1 more steps":
            (p - 1) * (alpha + n / p * beta),
        "whole messages in every step (the naive all-reduce's cost): each step sends n / p bytes":
            2 * (p - 1) * (alpha + n * beta),
        "alpha paid once: every one of the 2 (p - 1) steps is a message that pays it":
            alpha + 2 * (p - 1) / p * n * beta,
        "2 p steps: a ring of p ranks needs p - 1 steps per phase": 2 * p * (alpha + n / p * beta),
        "n / (p - 1) bytes per step: the message is cut into p chunks":
            2 * (p - 1) * (alpha + n / max(p - 1, 1) * beta),
        "n // p (integer division): the chunks are n / p bytes":
            2 * (p - 1) * (alpha + (n // p) * beta),
        "alpha and beta swapped": 2 * (p - 1) * (beta + n / p * alpha),
    }
    return _named(usual, got, _RING_HINT)


def check_ring_time(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(n_bytes, p, alpha, beta)`` is the alpha-beta time (s) of a ring all-reduce
    of ``n_bytes`` over p ranks.

    Run on 1 to 8 ranks, sizes the ranks do not divide, alpha or beta zero; relative tolerance
    1e-9 against the ring's schedule walked step by step (not asked by the lesson; for homework).
    """
    cases = _ring_cases()
    return _check_each(
        "ring_time", fn, strict, [((n, p, a, b), f"n_bytes={n}, p={p}, alpha={a:g}, beta={b:g}")
                                  for n, p, a, b in cases], _RING_HINT,
        _one_number(ring_time_by_schedule, _ring_diagnose),
        f"matches the ring's schedule on {len(cases)} cases (1 to 8 ranks).")


# ---- the alpha-beta fit --------------------------------------------------------------------------

_FIT_HINT = ("the ring's time is a straight line in n: minimise the sum over the points of "
             "((model - measured) / measured) ** 2, the error relative to each measured time "
             "(not to the model's time, not in log space), then read alpha and beta off its "
             "intercept and slope from the ring's steps and chunk size.")


def fit_line(sizes: list[float], times: list[float], weights: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the line ``a + b n`` minimising ``sum(w_i (a + b n_i - t_i) ** 2)``."""
    s0 = sum(weights)
    s1 = sum(w * n for w, n in zip(weights, sizes))
    s2 = sum(w * n * n for w, n in zip(weights, sizes))
    y0 = sum(w * t for w, t in zip(weights, times))
    y1 = sum(w * n * t for w, n, t in zip(weights, sizes, times))
    det = s0 * s2 - s1 * s1
    return (s2 * y0 - s1 * y1) / det, (s0 * y1 - s1 * y0) / det


def lstsq_relative_fit(sizes: list[float], times: list[float], p: int) -> tuple[float, float]:
    """The oracle: ``(alpha, beta)`` of the ring's line fitted by ``numpy.linalg.lstsq`` on the
    relative error. Row i of ``[1, n_i] @ [a, b] = t_i`` is divided by ``t_i``, so the squared
    residual of the scaled system is ``((a + b n_i - t_i) / t_i) ** 2``."""
    n, t = np.asarray(sizes, dtype=np.float64), np.asarray(times, dtype=np.float64)
    A = np.stack([np.ones_like(n), n], axis=1) / t[:, None]     # (points, 2)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return _alpha_beta(float(a), float(b), p)


def _alpha_beta(a: float, b: float, p: int) -> tuple[float, float]:
    return a / (2 * (p - 1)), b * p / (2 * (p - 1))


def _fit_cases() -> list[tuple[list[float], list[float], int]]:
    """(sizes, times, p): exact ring times, then noisy ones (up to 8 % slower samples, as a
    loaded machine adds), where an unweighted line follows the largest messages."""
    sizes = [4096 * 4 ** i for i in range(8)]                 # 4 KB to 64 MB
    noise = [1.00, 1.06, 1.01, 1.08, 1.00, 1.05, 1.02, 1.07]
    lines = [(2, 120e-6, 0.5e-9, False), (3, 30e-6, 2e-9, False), (8, 5e-6, 0.02e-9, False),
             (2, 140e-6, 0.48e-9, True), (4, 60e-6, 1e-9, True)]        # (p, alpha, beta, noisy)
    return [(list(sizes), [(2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta)
                           * (f if noisy else 1.0) for n, f in zip(sizes, noise)], p)
            for p, alpha, beta, noisy in lines]


def _fit_diagnose(sizes: list[float], times: list[float], p: int,
                  got: tuple[float, float]) -> str:
    """A likely mistake behind ``got``, when one of the usual ones reproduces it."""
    weighted = fit_line(sizes, times, [1 / t ** 2 for t in times])
    plain = fit_line(sizes, times, [1.0] * len(sizes))
    usual = {
        "the line's intercept and slope (a, b): alpha = a / (2 (p - 1)), beta = b p / (2 (p - 1))":
            weighted,
        "the fit of an unweighted line: it follows the largest messages, whose times are a "
        "thousand times the smallest; minimise the relative error (weights 1 / t**2 on the "
        "squares, w=1 / times in np.polyfit)": _alpha_beta(*plain, p),
        "weighted by 1 / t on the squares, not 1 / t**2": _alpha_beta(
            *fit_line(sizes, times, [1 / t for t in times]), p),
        "weighted by 1 / t**4 on the squares: np.polyfit squares its weights, pass "
        "w=1 / times": _alpha_beta(*fit_line(sizes, times, [1 / t ** 4 for t in times]), p),
        "(beta, alpha): return (alpha, beta)": _alpha_beta(*weighted, p)[::-1],
        "alpha right but beta = b / (2 (p - 1)): the ring sends 2 (p - 1) chunks of n / p bytes,"
        " so b = 2 (p - 1) / p beta": (_alpha_beta(*weighted, p)[0],
                                       weighted[1] / (2 * (p - 1))),
    }
    return _named(usual, got, _FIT_HINT, rel_tol=1e-6, abs_tol=0.0)


def check_alpha_beta_fit(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(sizes, times, p)`` returns ``(alpha, beta)`` of a ring all-reduce over p
    ranks fitted to the measured (bytes, seconds) by least squares on the error relative to
    each measured time, ``sum(((model - measured) / measured) ** 2)``.

    Run on exact ring times at 2, 3 and 8 ranks and on noisy ones at 2 and 4 ranks; each call
    gets its own copies of the lists. Relative tolerance 1e-6 against ``numpy.linalg.lstsq`` on
    the rows scaled by ``1 / t_i`` (``lstsq_relative_fit``).
    """
    cases = _fit_cases()
    return _check_each(
        "alpha_beta_fit", fn, strict, [(case, f"p={case[2]}, {len(case[0])} sizes from "
                                              f"{case[0][0]} to {case[0][-1]} bytes")
                                       for case in cases], _FIT_HINT,
        _fit_problem, f"matches the relative-error fit on {len(cases)} cases (2 to 8 ranks, exact "
                      "and noisy times).")


def _fit_problem(got: object, shown: str, sizes: list[float], times: list[float],
                 p: int) -> str | None:
    want = lstsq_relative_fit(sizes, times, p)
    try:
        got = tuple(float(x) for x in got)
    except (TypeError, ValueError):
        got = None
    if got is None or len(got) != 2:
        return (f"on {shown} returned something other than two numbers (alpha, beta); return a "
                "tuple (alpha, beta) in seconds and seconds per byte.")
    if not all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want)):
        return (f"on {shown}: expected alpha = {want[0]:.6g} s, beta = {want[1]:.6g} s/byte, "
                f"got alpha = {got[0]:.6g}, beta = {got[1]:.6g}. "
                f"{_fit_diagnose(sizes, times, p, got)}")
    return None


# ---- the predicted all-reduce time of a step -----------------------------------------------------

_COMM_HINT = ("a step sends each message (a bucket, or a parameter's gradient) in an all-reduce "
              "of its own, one after another: add up one ring all-reduce per message, each with "
              "its own 2 (p - 1) steps of alpha + n / p * beta.")


def comm_by_schedule(message_bytes: list[float], p: int, alpha: float, beta: float) -> float:
    """Seconds of a step's all-reduces, message by message: every message's ring schedule
    walked in turn (the oracle of ``check_predicted_comm``)."""
    return sum((ring_time_by_schedule(n, p, alpha, beta) for n in message_bytes), 0.0)


def _comm_cases() -> list[tuple[list[float], int, float, float]]:
    """(message_bytes, p, alpha, beta): LeNet- and ResNet-like buckets, one message, none, p=1."""
    lenet = [600, 24, 9600, 64, 192000, 480, 40320, 336]
    resnet = [9_468_000, 25_270_000, 8_730_000]
    return [(lenet, 3, 300e-6, 0.7e-9), (resnet, 4, 50e-6, 1e-9), (lenet, 2, 300e-6, 0.7e-9),
            ([2**20] * 5, 8, 5e-6, 0.02e-9), ([123_457], 3, 30e-6, 2e-9), ([], 4, 10e-6, 1e-9),
            (resnet, 1, 50e-6, 1e-9), (lenet + resnet, 5, 20e-6, 0.3e-9)]


def _comm_diagnose(msgs: list[float], p: int, alpha: float, beta: float, got: float) -> str:
    """A likely mistake behind ``got``, when one of the usual ones reproduces it."""
    total = sum(msgs)
    ring = ring_time_by_schedule
    usual = {
        "one all-reduce of all the bytes: each message is an all-reduce of its own and pays "
        "its own latency": ring(total, p, alpha, beta) if msgs else 0.0,
        "alpha paid once per message: each of a ring's 2 (p - 1) steps is a message that pays "
        "it": sum(alpha + 2 * (p - 1) / p * n * beta for n in msgs) if p > 1 else 0.0,
        "the 2-rank formula, 2 alpha + n beta, whatever p: the ring's cost depends on p":
            sum(2 * alpha + n * beta for n in msgs),
        "the largest message only: every message is sent": ring(max(msgs), p, alpha, beta)
        if msgs else 0.0,
        "whole messages in every ring step: each step sends n / p bytes":
            sum(2 * (p - 1) * (alpha + n * beta) for n in msgs),
    }
    return _named(usual, got, _COMM_HINT)


def check_predicted_comm(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(message_bytes, p, alpha, beta)`` is the alpha-beta model's time (s) of a
    step's all-reduces: one ring all-reduce per message, one after another.

    Run on lists of 0 to 11 messages at 1 to 8 ranks; each call gets its own copy of the list.
    Relative tolerance 1e-9 against every message's ring schedule walked step by step.
    """
    cases = _comm_cases()

    def shown(msgs, p, alpha, beta):
        what = (f"message_bytes={msgs}" if len(msgs) < 6
                else f"{len(msgs)} messages of {sum(msgs)} bytes in all")
        return f"{what}, p={p}, alpha={alpha:g}, beta={beta:g}"

    return _check_each(
        "predicted_comm", fn, strict, [(case, shown(*case)) for case in cases], _COMM_HINT,
        _one_number(comm_by_schedule, _comm_diagnose),
        f"matches every message's ring schedule on {len(cases)} steps (0 to 11 messages, 1 to "
        "8 ranks).")


# ---- the wait for the slower rank ----------------------------------------------------------------

_WAIT_HINT = ("run both loops in your head: meeting at every step, each step ends when its "
              "slowest rank does; meeting once, the loop ends when the rank slowest over all "
              "the steps does. The wait is the difference between the two loops' times, per step.")


def wait_by_clocks(durations: list[list[float]]) -> float:
    """The oracle of ``check_slower_rank_wait``: one clock per rank, run through the steps
    twice. Meeting at every step, all clocks jump to the latest after each step; meeting once,
    each clock runs alone and the loop ends at the latest. Seconds per step between the two."""
    steps = len(durations[0])
    met = [0.0] * len(durations)
    for step in range(steps):
        met = [t + d[step] for t, d in zip(met, durations)]
        met = [max(met)] * len(met)             # everyone waits for the latest
    alone = [sum(d) for d in durations]         # nobody waits until the end
    return (met[0] - max(alone)) / steps


def _wait_cases() -> list[list[list[float]]]:
    """durations[rank][step]; ranks and steps differ in number, so a swap does not go unnoticed."""
    return [[[1.0, 1.0], [2.0, 3.0]],
            [[1.0, 3.0], [3.0, 1.0]],
            [[3.0, 1.0, 1.0], [1.0, 3.0, 1.0], [1.0, 1.0, 3.0]],
            [[0.10, 0.12, 0.09, 0.15, 0.11], [0.13, 0.10, 0.10, 0.11, 0.14],
             [0.11, 0.11, 0.16, 0.10, 0.10]],
            [[0.21, 0.20, 0.24, 0.19, 0.22, 0.20, 0.25],
             [0.20, 0.26, 0.20, 0.21, 0.20, 0.23, 0.20],
             [0.22, 0.21, 0.21, 0.27, 0.20, 0.20, 0.21],
             [0.20, 0.20, 0.22, 0.20, 0.28, 0.21, 0.20]]]


def _wait_diagnose(durations: list[list[float]], got: float) -> str:
    """The usual mistakes, each computed on the case."""
    steps, ranks = len(durations[0]), len(durations)
    per_step = statistics.fmean(max(step) for step in zip(*durations))
    average_rank = statistics.fmean(statistics.fmean(d) for d in durations)
    usual = {
        "the mean over the steps of the slowest rank's time, with nothing taken away: the "
        "step's time, not what meeting adds to it": per_step,
        "the steps' slowest time less the average rank's mean time: meeting once, the loop "
        "still waits at its end for the rank slowest over the whole loop": per_step - average_rank,
        "the wait over the whole loop: divide by the number of steps": (
            per_step - max(statistics.fmean(d) for d in durations)) * steps,
        "computed with ranks and steps swapped: durations[rank][step] lists each rank's steps":
            wait_by_clocks([list(c) for c in zip(*durations)]) if steps > 1 and ranks > 1
            else math.nan,
    }
    return _named(usual, got, _WAIT_HINT, abs_tol=1e-12)


def check_slower_rank_wait(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(durations)``, with ``durations[rank][step]`` each rank's seconds for each
    step (the ranks starting the loop together), is the seconds per step that meeting at every
    step costs over meeting once at the end of the loop.

    Run on 2 to 4 ranks and 2 to 7 steps; each call gets its own copy of the lists. Tolerance
    1e-9 relative against two loops run on a clock (``wait_by_clocks``).
    """
    cases = _wait_cases()
    return _check_each(
        "slower_rank_wait", fn, strict,
        [((c,), f"durations={c}" if len(c[0]) < 4 else
          f"{len(c)} ranks x {len(c[0])} steps, durations={c}") for c in cases], _WAIT_HINT,
        _one_number(wait_by_clocks, _wait_diagnose),
        f"matches two loops run on a clock on {len(cases)} cases (2 to 4 ranks, 2 to 7 steps).")


# ---- reading one stamped step: how much of the calls ran during backward -----------------------

_OVERLAP_HINT = ("draw the calls as bars on a time line with a mark at backward's end: the share "
                 "is the bars' length left of the mark over their whole length (cut a bar that "
                 "crosses it), the tail the time from the mark to the bars' rightmost end.")


def overlap_by_walking(calls: list[tuple[float, float]],
                       backward_end: float) -> tuple[float, float]:
    """The oracle of ``check_overlap_of_step``: each call's time cut at backward's end into a
    part before and a part after, then the share of the parts before; the tail is the latest
    end past the mark (0 when none is past it)."""
    before = after = 0.0
    tail = 0.0
    for start, end in calls:
        cut = min(max(backward_end, start), end)   # where the call meets the mark, if it does
        before += cut - start
        after += end - cut
        tail = max(tail, end - backward_end)
    return before / (before + after), tail


def _overlap_cases() -> list[tuple[list[tuple[float, float]], float]]:
    """(calls, backward_end) in ms: one straddling call, all before, all after, calls that
    overlap each other, a later launch finishing first."""
    return [([(1.0, 4.0), (2.0, 7.0), (6.0, 8.0)], 5.0),
            ([(2.0, 5.0), (6.0, 9.0)], 8.0),
            ([(1.0, 2.0), (3.0, 4.0)], 10.0),
            ([(10.0, 12.0)], 9.0),
            ([(4.0, 10.0)], 6.0),
            ([(1.0, 9.0), (6.0, 7.0)], 5.0)]


def _overlap_problem(got: object, shown: str, calls, backward_end) -> str | None:
    want = overlap_by_walking(calls, backward_end)
    try:
        share, tail = (float(x) for x in got)
    except (TypeError, ValueError):
        return (f"returned {got!r} on {shown}; expected two numbers, (share, tail): the share "
                "of the calls' time before backward's end and the seconds after it.")
    if all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12) for g, w in zip((share, tail), want)):
        return None
    busy = sum(e - s for s, e in calls)
    usual = {
        "the share of the calls that started before backward's end, counted by call: weigh "
        "each by its time": (sum(s < backward_end for s, _ in calls) / len(calls), want[1]),
        "a call that crosses backward's end counted wholly before it: cut it at the mark":
            (sum(e - s for s, e in calls if s < backward_end) / busy, want[1]),
        "a call that crosses backward's end counted wholly after it: cut it at the mark":
            (sum(e - s for s, e in calls if e <= backward_end) / busy, want[1]),
        "the tail measured from the last call's start: it runs to the last result":
            (want[0], max(0.0, max(s for s, _ in calls) - backward_end)),
        "a negative tail: when every result came before backward's end, the tail is 0":
            (want[0], max(e for _, e in calls) - backward_end),
        "the tail to the last call launched: the last result can come from an earlier call":
            (want[0], max(0.0, calls[-1][1] - backward_end)),
    }
    why = _named(usual, (share, tail), _OVERLAP_HINT)
    return (f"on {shown}: expected (share, tail) = ({want[0]:.6g}, {want[1]:.6g}), got "
            f"({share:.6g}, {tail:.6g}). {why}")


def check_overlap_of_step(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(calls, backward_end)``, one rank's stamped step (each all-reduce's (start,
    end) in launch order, and backward's end), is ``(share, tail)``: the share of the calls'
    summed time before backward's end, a straddling call cut there, and the time from
    backward's end to the last result (0 when none is after it). Six cases in milliseconds,
    against ``overlap_by_walking``."""
    cases = _overlap_cases()
    return _check_each(
        "overlap_of_step", fn, strict,
        [((calls, end), f"calls={calls}, backward_end={end}") for calls, end in cases],
        _OVERLAP_HINT, _overlap_problem,
        f"matches the time line on {len(cases)} steps (calls crossing backward's end, all before "
        "it, all after it, calls overlapping each other, a later launch finishing first).")


# ---- the model of a bucketed step's tail ---------------------------------------------------------

_TAIL_HINT = ("draw the calls as bars on one line: bucket i's bar starts when the bucket is full "
              "or when the bar before it ends, whichever is later, and is as long as its ring "
              "all-reduce; the answer is from the latest ready time (backward's end) to the "
              "last bar's end.")


def after_backward_by_latest_start(ready: list[float], sizes: list[float], p: int, alpha: float,
                                   beta: float) -> float:
    """The oracle of ``check_comm_after_backward``, without walking the calls: the last call
    ends at ``max over j of (ready[j] + the ring times of calls j, j + 1, ..., last)`` (the
    calls after the last idle moment of the line run back to back), less the latest ready."""
    times = [ring_time_by_schedule(n, p, alpha, beta) for n in sizes]
    return max(ready[j] + sum(times[j:]) for j in range(len(ready))) - max(ready)


def _tail_cases() -> list[tuple[list[float], list[float], int, float, float]]:
    """(ready in s, sizes in bytes, p, alpha, beta): calls that keep up with backward, calls
    that queue, a later bucket full first, one bucket, 3 and 4 ranks."""
    return [([1e-3, 2e-3, 3e-3], [4e5, 4e5, 4e5], 2, 50e-6, 1e-9),
            ([1e-3, 1.2e-3, 1.4e-3], [9e5, 9e5, 4e5], 2, 50e-6, 1e-9),
            ([3e-3, 1e-3, 2e-3], [2e6, 1e6, 5e5], 3, 20e-6, 1e-9),
            ([5e-3], [4.4e7], 2, 100e-6, 1e-9),
            ([2e-3, 9e-3, 10e-3, 30e-3], [9.5e6, 9.5e6, 6e6, 1e6], 4, 30e-6, 0.5e-9),
            ([1e-3, 4e-3], [1e7, 2e6], 3, 10e-6, 1e-9)]


def _tail_diagnose(ready, sizes, p, alpha, beta, got: float) -> str:
    """A likely mistake behind ``got``, when one of the usual ones reproduces it."""
    times = [ring_time_by_schedule(n, p, alpha, beta) for n in sizes]
    want = after_backward_by_latest_start(ready, sizes, p, alpha, beta)
    usual = {
        "each call starting when its bucket is full, beside the one before: a group's calls "
        "run one at a time, in launch order": max(r + t for r, t in zip(ready, times))
        - max(ready),
        "every call after backward's end, one after another: a call starts as soon as its "
        "bucket is full and the call before it is done": sum(times),
        "the last call alone: earlier calls may still be running when it is launched":
            times[-1],
        "the time of the last call's end counted from backward's start: subtract backward's "
        "end, the latest ready time": want + max(ready),
        "counted from the last bucket's ready time: backward ends at the latest one, and a "
        "bucket launched last need not be the last full": want + max(ready) - ready[-1],
    }
    return _named(usual, got, _TAIL_HINT)


def check_comm_after_backward(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(ready, sizes, p, alpha, beta)``, buckets in launch order (each full
    ``ready[i]`` s into backward, ``sizes[i]`` bytes), is the seconds from backward's end (the
    latest ready) to the end of the last ring all-reduce, the calls one at a time in order,
    each starting once its bucket is full and the previous call is done. Six cases, relative
    tolerance 1e-9, against ``after_backward_by_latest_start``."""
    cases = _tail_cases()
    return _check_each(
        "comm_after_backward", fn, strict,
        [(case, f"ready={case[0]}, sizes={case[1]}, p={case[2]}, alpha={case[3]:g}, "
                f"beta={case[4]:g}") for case in cases], _TAIL_HINT,
        _one_number(after_backward_by_latest_start, _tail_diagnose),
        f"matches the calls' time line on {len(cases)} steps (calls keeping up with backward, "
        "calls queueing, a later bucket full first, one bucket, 2 to 4 ranks).")


# ---- the benchmark loop of a collective, in real processes ---------------------------------------

_TIME_HINT = ("each item of the list above the exercise is one part of the loop; the message "
              "above says what yours does differently.")
#: The check's plan: untimed calls, samples, calls per sample.
_WARMUP, _SAMPLES, _LOOPS = 2, 5, 3
#: What the stand-in collective sleeps (s): each warm-up call (a cold start), a call on a fast
#: rank, a call on the sample's slow rank, and once more on every rank at the start of the
#: stalled sample (a noisy moment of the machine).
_COLD_S, _FAST_S, _SLOW_S, _STALL_S = 0.010, 0.004, 0.008, 0.150
#: sample -> the rank that is slow in it (at most one sample per rank, so that each rank's own
#: median is a fast time while the slowest rank's median is a slow one), and the stalled sample
_SLOW_RANK, _STALLED = {0: 0, 2: 1}, 1
#: The answer is timed around each sample's calls, so it may only exceed their span (the clock
#: and the reduction add microseconds); these bound it around that span.
_TIME_LOW, _TIME_HIGH = 0.97, 1.2


def planned_sleep(call: int, rank: int) -> float:
    """Seconds the stand-in collective sleeps at its ``call``-th call (0-based) on ``rank``."""
    if call < _WARMUP:
        return _COLD_S
    sample, position = divmod(call - _WARMUP, _LOOPS)
    seconds = _SLOW_S if _SLOW_RANK.get(sample) == rank else _FAST_S
    if sample == _STALLED and position == 0:
        seconds += _STALL_S
    return seconds


class _StandIn:
    """What the learner's function times: a call sleeps as ``planned_sleep`` says (no collective
    inside: a fast rank does not wait for the slow one) and notes when it started and ended."""

    def __init__(self, rank: int):
        self.rank, self.calls, self.starts, self.ends = rank, 0, [], []

    def __call__(self) -> None:
        self.starts.append(time.perf_counter())
        time.sleep(planned_sleep(self.calls, self.rank))
        self.calls += 1
        self.ends.append(time.perf_counter())


def _calls_problem(calls: int) -> str | None:
    """What is wrong with the number of calls op received (None: warmup + samples x loops)."""
    want = _WARMUP + _SAMPLES * _LOOPS
    if calls == want:
        return None
    usual = {
        _SAMPLES * _LOOPS: "no warm-up: call op `warmup` times, untimed, before the first "
                           "sample (first calls are slow: a cold cache, a first connection)",
        _WARMUP + _SAMPLES: "one call per sample: each sample times `loops` calls",
        _WARMUP + _LOOPS: "one sample: time `samples` of them",
        _WARMUP * _SAMPLES + _SAMPLES * _LOOPS: "a warm-up before every sample: warm up once, "
                                                "before the first",
    }
    why = (f"That is {usual[calls]}." if calls in usual
           else "Call op exactly warmup + samples x loops times.")
    return (f"warmup={_WARMUP}, samples={_SAMPLES}, loops={_LOOPS}: op was called {calls} "
            f"times, expected {want} ({_WARMUP} untimed, then {_SAMPLES} samples of {_LOOPS}). "
            f"{why}")


def _order_problem(records: list) -> str | None:
    """A barrier missing before a sample, or a collective between two timed calls."""
    timed = range(_WARMUP + 1, _WARMUP + _SAMPLES * _LOOPS)
    inside = [r for r in records if r.context in timed and (r.context - _WARMUP) % _LOOPS]
    if inside:
        r = inside[0]
        sample = (r.context - _WARMUP) // _LOOPS
        return (f"dist.{r.name} was called between two timed calls of op (sample {sample}, after "
                f"call {(r.context - _WARMUP) % _LOOPS} of {_LOOPS}): it is timed with them. Only "
                "op may run while the clock runs; the barrier comes before the clock starts, "
                "the all-reduce after it stops.")
    barriers = {r.context for r in records if r.name in ("barrier", "monitored_barrier")}
    missing = [s for s in range(_SAMPLES) if _WARMUP + s * _LOOPS not in barriers]
    if missing:
        where = ("at all" if len(missing) == _SAMPLES
                 else "before sample" + ("s " if len(missing) > 1 else " ")
                 + ", ".join(map(str, missing)))
        return (f"no dist.barrier() {where}: call it before each sample's clock starts, after "
                "the previous sample (or the warm-up), so that every rank starts the sample "
                "together.")
    return None


def _per_call(starts: list[float], ends: list[float]) -> list[float]:
    """Seconds per call of each sample: its first call's start to its last call's end, over the
    calls (a right loop's clock brackets that span, and a moment the machine took the core)."""
    first = [_WARMUP + s * _LOOPS for s in range(_SAMPLES)]
    return [(ends[i + _LOOPS - 1] - starts[i]) / _LOOPS for i in first]


def _slowest_median(per_rank: list[list[float]]) -> float:
    """The median over the samples of the slowest rank's time per call: the right answer."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


def _value_problem(got: float, rank: int, per_rank: list[list[float]]) -> str | None:
    """``got`` against the slowest rank's median time per call; a usual mistake when nearer."""
    world = len(per_rank)
    by_sample = list(zip(*per_rank))                             # (samples, ranks)
    slowest = [max(ts) for ts in by_sample]
    want = _slowest_median(per_rank)
    fast = ("a fast rank's time (this rank's own, the fastest rank's, or the largest of the "
            "ranks' medians): a collective ends when its slowest rank does; take the slowest "
            "rank's time of each sample (all-reduce it with op=dist.ReduceOp.MAX), then the "
            "median over the samples")
    usual = [
        ("the mean of the samples: one stalled sample pulls it up; take the median",
         statistics.fmean(slowest)),
        (fast, statistics.median(per_rank[rank])),
        (fast, statistics.median(min(ts) for ts in by_sample)),
        (fast, max(statistics.median(ts) for ts in per_rank)),
        ("the sum over the ranks: dist.all_reduce sums unless told otherwise; pass "
         "op=dist.ReduceOp.MAX", statistics.median(sum(ts) for ts in by_sample)),
        ("the average over the ranks: the slowest rank's time is asked (op=dist.ReduceOp.MAX)",
         statistics.median(sum(ts) / world for ts in by_sample)),
        ("the time of a whole sample: divide it by `loops` for the time per call",
         want * _LOOPS),
        ("in milliseconds: return seconds", want * 1e3),
    ]
    if got > 0:
        why, value = min(usual, key=lambda u: abs(math.log(got / u[1])))
        if abs(math.log(got / value)) < abs(math.log(got / want)):
            return (f"rank {rank} returned {got * 1e3:.2f} ms per call; the slowest rank's median "
                    f"was {want * 1e3:.2f} ms. That is {why}.")
        if _TIME_LOW <= got / want <= _TIME_HIGH:
            return None
    return (f"rank {rank} returned {got:.6g} s per call; the slowest rank's median was "
            f"{want:.6g} s (from the start of each sample's first call to the end of its last; "
            f"yours may exceed that by the clock's microseconds).")


def _time_collective_cases(spec) -> str | None:
    """One rank of ``check_time_collective``: calls, collectives, the same number on every rank,
    and that number against the stand-in's times."""
    fn, error = load_answer(spec)
    if error:
        return error
    rank, world = dist.get_rank(), dist.get_world_size()
    op = _StandIn(rank)
    names = COLLECTIVES + (("monitored_barrier",) if hasattr(dist, "monitored_barrier") else ())
    try:
        with record_collectives(names, context=lambda: op.calls) as records:
            got = call_answer("your function", fn, op, _WARMUP, _SAMPLES, _LOOPS)
    except StopRank as e:  # the learner's error, said in words (peers stop too)
        return f"world_size={world}, rank {rank}: {e}"
    try:
        got = float(got)                                     # a 0-d tensor or numpy number
    except (TypeError, ValueError):
        got = None
    where = f"world_size={world}: "
    problem = (f"rank {rank} returned {got!r}; expected one number, the seconds per call."
               if got is None else _calls_problem(op.calls) or _order_problem(records))
    problem = agree(None if problem is None else where + problem)
    if problem is not None:
        return problem
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (got, _per_call(op.starts, op.ends)))
    gots, per_rank = [g for g, _ in gathered], [ts for _, ts in gathered]
    if not all(math.isclose(g, gots[0], rel_tol=1e-9) for g in gots):
        returned = ", ".join(f"rank {r} {g * 1e3:.2f} ms" for r, g in enumerate(gots))
        want = _slowest_median(per_rank)
        own = all(g > 0 and abs(math.log(g / statistics.median(ts))) < abs(math.log(g / want))
                  for g, ts in zip(gots, per_rank))      # nearer its own than the slowest's
        why = ("each rank returned its own time: a collective ends when its slowest rank "
               "does; all-reduce each sample's time with op=dist.ReduceOp.MAX" if own else
               "every rank must return the same number: dist.all_reduce gives every rank the "
               "result (dist.reduce gives it to one rank only)")
        return f"{where}different numbers on different ranks ({returned}): {why}."
    problem = _value_problem(got, rank, per_rank)
    return None if problem is None else where + problem


def check_time_collective(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                          timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(op, warmup, samples, loops)``, called on every rank, is the benchmark loop
    of a collective: ``op()`` ``warmup`` times untimed; then for each sample a barrier,
    ``loops`` timed calls, the seconds per call, the slowest rank's (an all-reduce with MAX);
    the median over the samples, the same number on every rank.

    ``op`` is a stand-in that sleeps a few milliseconds per call (``planned_sleep``) and times
    itself: the warm-up calls are slow, one rank is slower than the others in some samples (no
    collective inside: the others do not wait for it), one sample stalls on every rank. Judged
    in one launch of 2 and 3 gloo ranks against the slowest rank's median of the samples' spans
    (as the calls noted them): the number of calls, a ``dist.barrier`` before each sample and no
    collective between two timed calls (judged by where they are called: a missing barrier
    changes the times too little to tell), the same number on every rank, and the number
    itself, the usual mistakes named (the mean, one rank's own time, the sum over the ranks, a
    whole sample's time). GPU synchronization is not judged: on a CPU it changes nothing.
    ``fn``: importable by worker processes, or ``"module:function"``; None: not answered yet.
    """
    return check_in_ranks(
        "time_collective", fn, "my_timing:time_collective", _time_collective_cases, (),
        world_sizes=world_sizes, timeout=timeout, hint=_TIME_HINT,
        hang_hint="Does every rank make the same collective calls (the barrier, the "
                  "all-reduce) the same number of times?",
        passed=f"the slowest rank's median time per call, the same on every rank, for world "
               f"sizes {list(world_sizes)} ({_WARMUP} warm-up calls, {_SAMPLES} samples of "
               f"{_LOOPS} calls).",
        missing="write time_collective(op, warmup, samples, loops) to a file and pass it here.",
        strict=strict)


def _time_all_reduce_worker(spec, sizes: list[int], loops: list[int], warmup: int,
                            samples: int) -> dict[int, float] | str | None:
    """One rank of ``time_all_reduce``; rank 0 returns {bytes: seconds per call}, or an error."""
    fn, error = load_answer(spec)
    if error:
        return error
    _pin_to_cores()                      # as the course's benchmark of the same all-reduce
    out = {}
    for nbytes, n_loops in zip(sizes, loops):
        x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=current_device())
        out[nbytes] = float(fn(functools.partial(dist.all_reduce, x), warmup, samples, n_loops))
    return out if dist.get_rank() == 0 else None


def time_all_reduce(fn: Callable | str, sizes: list[int], loops: list[int], *,
                    world_size: int = 2, warmup: int = 2, samples: int = 9,
                    timeout: float = 300.0) -> dict[int, float]:
    """The learner's benchmark loop (``check_time_collective``'s ``fn``) on a real collective:
    ``dist.all_reduce`` of float32 zeros of each size in ``sizes`` (bytes), ``loops[i]`` calls
    per sample, over ``world_size`` ranks (gloo on a CPU, NCCL with a GPU per rank). Returns
    {bytes: the seconds per call ``fn`` returned on rank 0}. Raises ValueError when ``fn`` is
    neither a function workers can import nor ``"module:function"``, or ``sizes`` and ``loops``
    differ in length or hold a non-positive number; RuntimeError when the workers could not
    import ``fn``.
    """
    spec = worker_spec(fn, "my_timing:time_collective")
    if isinstance(spec, str):
        raise ValueError(f"time_all_reduce: {spec}")
    if len(sizes) != len(loops) or min([*sizes, *loops], default=0) < 1:
        raise ValueError(f"time_all_reduce needs one positive loop count per positive size, got "
                         f"sizes {list(sizes)} and loops {list(loops)}.")
    result = launch(_time_all_reduce_worker, world_size, spec, list(sizes), list(loops), warmup,
                    samples, timeout=timeout)[0]
    if isinstance(result, str):
        raise RuntimeError(f"time_all_reduce: {result}")
    return result
