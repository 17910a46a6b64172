"""What tests/test_ddp.py and tests/test_ddp_contract.py share: the oracle loop and its pieces.

Both check ``course_lib.parallel.ddp`` against torch's ``DistributedDataParallel`` (and one
process on the whole batch) the same way: one ``launch`` per world size runs many named checks,
each a worker function returning its failures as strings, read by several tests. The models and
helpers here run inside those workers (worker processes import this module by name).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import launch

PER_RANK = 3  # examples per rank and step (or micro-step)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, X):                                    # (B, 8)
        return self.fc2(torch.tanh(self.fc1(X)))            # (B, 4)


class Branchy(nn.Module):
    """``fc2`` takes part only when ``use_fc2`` is true: an unused parameter otherwise."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, X, use_fc2=True):
        h = torch.tanh(self.fc1(X))                          # (B, 8)
        if use_fc2:
            h = torch.tanh(self.fc2(h))
        return self.fc3(h)                                   # (B, 4)


def batches(shape: tuple, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank: ``steps`` of (world * PER_RANK) examples."""
    g = torch.Generator().manual_seed(seed)
    n = dist.get_world_size() * PER_RANK
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, 4, (n,), generator=g))
            for _ in range(steps)]


def shard(X: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a global batch."""
    rank = dist.get_rank()
    return X[rank * PER_RANK:(rank + 1) * PER_RANK]


def check(failures: list[str], label: str, actual, expected, **tolerance) -> None:
    """assert_close, recording a failure instead of raising (one launch, many cases)."""
    try:
        torch.testing.assert_close(actual, expected, **tolerance)
    except AssertionError as e:
        failures.append(f"rank {dist.get_rank()} of {dist.get_world_size()}, {label}: {e}")


def torch_buckets(params: list[torch.Tensor], limits: list[int],
                  order: list[int] | None = None) -> list[list[int]]:
    """torch's own assignment (``DistributedDataParallel`` and its reducer call it): the
    buckets, each a list of indices into ``params``."""
    if order is None:  # DDP's first buckets: registration order, the list reversed
        buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
        return buckets[::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), list(order))
    return buckets


def grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in net.named_parameters()}


def run_checks(checks: dict[str, Callable[[], list[str]]]) -> dict[str, list[str]]:
    """Worker: each check in turn; its failures (or the exception it raised) by name."""
    out = {}
    for name, run in checks.items():
        try:
            out[name] = run()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            out[name] = [f"rank {dist.get_rank()}: {name} raised {type(e).__name__}: {e}"]
        dist.barrier()  # a check that failed half-way must not leave a peer mid-collective
    return out


def launch_checks(checks: dict[str, Callable[[], list[str]]], world_size: int,
                  timeout: float) -> dict[str, list[str]]:
    """Every rank's failures for each check (module-level functions), in one launch."""
    per_rank = launch(run_checks, world_size, checks, timeout=timeout)
    return {name: [f for rank in per_rank for f in rank[name]] for name in checks}
