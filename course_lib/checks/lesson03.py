"""Checkers for the exercises of lesson 03 (scatter and split_batch)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._core import ExerciseResult, call_bounded, check_answer, failure, verdict

__all__ = ["check_balanced_sizes", "check_devices_used"]

def check_balanced_sizes(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 03: ``fn(B, n)`` gives n shard sizes summing to B, each B // n or B // n + 1."""
    if fn is None:
        return verdict("balanced_sizes", None, "define your function and pass it here.", strict)
    for B, n in [(5, 4), (9, 8), (17, 8), (256, 3), (7, 7), (8, 1), (250, 4)]:
        try:
            sizes = [int(s) for s in call_bounded(fn, B, n)]
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - reported, never raised
            return verdict("balanced_sizes", False, f"{failure(exc)} on B={B}, n={n}.", strict)
        ok = len(sizes) == n and sum(sizes) == B and set(sizes) <= {B // n, B // n + 1}
        if not ok:
            return verdict("balanced_sizes", False, f"balanced_sizes({B}, {n}) = {sizes}: "
                            f"expected {n} sizes, each {B // n} or {B // n + 1}, summing to {B}.",
                            strict)
    return verdict("balanced_sizes", True, "every device gets B // n or B // n + 1 examples, on "
                    "7 inputs.", strict)


def check_devices_used(B: int, n: int, answer: int | None, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 03: how many of n devices get work when ``comm.scatter`` splits a batch of B."""
    from ..parallel.comm import scatter

    used = len(scatter(torch.zeros(B), [torch.device("cpu")] * n))
    return check_answer(f"B={B} over {n} devices", answer, used,
                        hint="torch.chunk makes chunks of ceil(B / n) examples; count how many "
                        "the batch fills.", strict=strict)
