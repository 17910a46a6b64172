"""``slow_link_hook`` and ``SlowLink`` (``course_lib.parallel.ddp``): the same averages as the
default hook, on the course's three strategies and on torch's DDP, against one process on the
whole batch, in float64 at 2 and 3 ranks; and the link's time: every message waits its
latency, one message at a time, in launch order."""
from __future__ import annotations

import copy
import functools
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_oracle import MLP, PER_RANK, batches, check, grads, launch_checks, shard
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib.parallel import ddp as D
from course_lib.parallel.ddp import DistributedDataParallel as DDP

LATENCY = 0.01  # s per message: well above the loopback's own time for MLP's small gradients


def _wrapped(name: str, net: torch.nn.Module, link: D.SlowLink | None) -> torch.nn.Module:
    if name == "torch":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = TorchDDP(net)
    else:
        model = DDP(net, strategy=name)
    if link is not None:
        model.register_comm_hook(link, D.slow_link_hook)
    return model


def same_averages() -> list[str]:
    """Each strategy and torch's DDP with the link: the gradients of the all-reduce hook,
    bit for bit, and those of one process on the whole batch, to rounding."""
    failures: list[str] = []
    torch.manual_seed(0)
    base = MLP().double()
    (X, y), = batches((8,), 1)
    X = X.double()
    whole = copy.deepcopy(base)
    F.cross_entropy(whole(X), y).backward()
    for name in ("naive", "overlap", "bucketed", "torch"):
        link = D.SlowLink(0.001)
        plain, slow = (_wrapped(name, copy.deepcopy(base), lk) for lk in (None, link))
        if name == "torch":  # its built-in averaging rounds otherwise: its hook, as ours
            plain.register_comm_hook(None, torch_hooks.allreduce_hook)
        for _ in range(2):  # the second step after the rebuild of the buckets
            for model in (plain, slow):
                model.zero_grad()
                F.cross_entropy(model(shard(X)), shard(y)).backward()
        link.close()
        check(failures, f"{name}: slow link vs default hook", grads(slow.module),
              grads(plain.module), rtol=0, atol=0)
        check(failures, f"{name}: slow link vs one process", grads(slow.module), grads(whole))
        if link.messages == 0:
            failures.append(f"{name}: the link carried no message")
    return failures


def link_time() -> list[str]:
    """naive sends MLP's 4 gradients after backward: backward returns at least 4 latencies
    after it started; bucketed sends 1 bucket: under 4 latencies beyond the plain step."""
    failures: list[str] = []
    torch.manual_seed(0)
    (X, y), = batches((8,), 1)
    for name, messages in (("naive", 4), ("bucketed", 1)):
        link = D.SlowLink(LATENCY)
        base = MLP()
        model, plain = _wrapped(name, base, link), _wrapped(name, copy.deepcopy(base), None)

        def backward(m) -> float:
            dist.barrier()
            start = time.perf_counter()
            F.cross_entropy(m(shard(X)), shard(y)).backward()
            return time.perf_counter() - start

        for step in range(3):   # the plain step beside it: the compute a busy machine stretches
            plain_took = backward(plain)
            sent = link.messages
            took = backward(model)
            if link.messages - sent != messages:
                failures.append(f"{name} step {step}: {link.messages - sent} messages, "
                                f"expected {messages}")
            if step > 0 and not (messages * LATENCY <= took
                                 and took - plain_took < (messages + 3) * LATENCY):
                failures.append(f"{name} step {step}: backward took {took * 1e3:.1f} ms "
                                f"({plain_took * 1e3:.1f} ms without the link) for {messages} "
                                f"messages of {LATENCY * 1e3:.0f} ms each")
        link.close()
        if link._thread.is_alive():
            failures.append(f"{name}: the link's thread outlived close()")
    return failures


CHECKS = {"same": same_averages, "time": link_time}


@functools.cache
def failures(world_size: int) -> dict[str, list[str]]:
    return launch_checks(CHECKS, world_size, timeout=120)


@pytest.mark.parametrize("world_size", [2, 3])
def test_slow_link_averages_as_the_default_hook(world_size):
    assert PER_RANK > 1
    assert not failures(world_size)["same"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_slow_link_adds_its_latency_per_message_one_at_a_time(world_size):
    assert not failures(world_size)["time"]


@pytest.mark.parametrize("latency", [-0.001, float("nan"), float("inf"), "1 ms"])
def test_slow_link_refuses_a_latency_that_is_not_seconds(latency):
    with pytest.raises(ValueError, match="latency_s must be a finite number of seconds >= 0"):
        D.SlowLink(latency)
