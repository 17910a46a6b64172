"""Lesson 05, exercises: DataParallel's forward as a function, and the two counting questions.

Checked by ``course_lib.checks.lesson05`` (``check_data_parallel_fn``,
``check_bn_examples_seen``, ``check_module_calls``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from course_lib.parallel import gather, parallel_apply, replicate, scatter

__all__ = ["bn_examples_seen", "data_parallel", "module_calls"]


def data_parallel(module: nn.Module, X: torch.Tensor,
                  devices: Sequence[torch.device]) -> torch.Tensor:
    """``module(X)`` computed as DataParallel does: scatter, replicate, parallel_apply, gather."""
    shards = scatter(X, devices)                          # shard i on devices[i]; maybe fewer
    replicas = replicate(module, devices[:len(shards)])   # differentiable copies
    outputs = parallel_apply(replicas, shards)            # one thread per replica
    return gather(outputs, devices[0])                    # (B, ...) on devices[0]


def bn_examples_seen(batch: int, n: int) -> int:
    """Only replica 0 updates the module's running statistics: the first torch.chunk shard."""
    return len(torch.chunk(torch.zeros(batch), n)[0])


def module_calls(batch: int, n: int) -> int:
    """One call per non-empty shard: torch.chunk makes min(batch, n) or fewer shards."""
    return len(torch.chunk(torch.zeros(batch), n))
