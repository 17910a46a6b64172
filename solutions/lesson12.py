"""Lesson 12, exercise: the 1F1B order of operations of one pipeline stage.

Checked by ``course_lib.checks.lesson12.check_one_f_one_b``; the course's version is
``course_lib.distributed.pipelining.one_f_one_b_order``.
"""
from __future__ import annotations

__all__ = ["one_f_one_b"]


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """``[("F", 0), ..., ("B", m - 1)]`` for stage ``stage`` of ``num_stages`` under 1F1B.

    Warm-up: the stages after this one each need a micro-batch in flight before the first
    gradient can come back, so stage s starts with p - s - 1 forwards (fewer if there are fewer
    micro-batches). Then one forward, one backward, while forwards remain; then the backwards.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, num_microbatches):
        order += [("F", i), ("B", i - warmup)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order
