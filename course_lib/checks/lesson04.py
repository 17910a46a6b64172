"""Checkers for the exercises of lesson 04 (training on several devices)."""
from __future__ import annotations

from typing import Any

from ._core import ExerciseResult, check_answer

__all__ = ["check_lr_for_shard_means", "check_scaled_batch"]

def check_lr_for_shard_means(answer: Any, k: int = 4, lr: float = 0.5, *,
                             strict: bool = False) -> ExerciseResult:
    """Exercise 04: the learning rate that makes per-shard means (k even shards, summed by the
    allreduce) take the one-device step of learning rate ``lr``."""
    return check_answer(f"lr for {k} shard means", answer, lr / k,
                        hint=f"the allreduce adds k = {k} shard means, each about the batch "
                        "mean: k times too large a gradient.", strict=strict)


def check_scaled_batch(global_batch: int | None, lr: float | None, steps: int | None, *,
                       per_device: int = 256, k: int = 8, base_lr: float = 0.9,
                       num_examples: int = 60000, strict: bool = False) -> ExerciseResult:
    """Exercise 04: global batch, linearly scaled learning rate and steps per epoch on k
    devices with ``per_device`` examples each (``base_lr`` was right for ``per_device``)."""
    answer = None if None in (global_batch, lr, steps) else (global_batch, float(lr), steps)
    want_batch = per_device * k
    expected = (want_batch, float(base_lr * k), -(-num_examples // want_batch))
    if answer is not None:
        answer = (answer[0], round(answer[1], 9), answer[2])
        expected = (expected[0], round(expected[1], 9), expected[2])
    return check_answer("batch, lr and steps", answer, expected,
                        hint="(global batch, lr, steps per epoch): the batch grows k times, the "
                        "lr with it (linear scaling), the steps shrink; round steps up.",
                        strict=strict)
