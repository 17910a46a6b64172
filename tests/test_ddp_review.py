"""course_lib.parallel.ddp where a review against torch's sources found it wrong.

1. ``static_graph=True`` with a parameter unused in every step: torch's DDP finds it in the first
   iteration whatever ``find_unused_parameters`` says; ours raised.
2. Reentrant activation checkpointing (``use_reentrant=True``): the end-of-backward callback was
   queued on the nested backward of a checkpointed segment, so the layers outside it kept their
   local gradients (or, without ``find_unused_parameters``, an error blamed unused parameters).
3. Stop and resume at 3 ranks with several buckets: the resumed run's first step summed the
   gradients in another layout (one initial bucket) than the uninterrupted run, so a + b + c in
   another order: not bitwise equal.

Oracles: torch's DDP and one process on the whole batch, in float64, at 2 and 3 ranks (one launch
per world size runs every check; see ddp_oracle.py).
"""
import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_oracle import batches, check, launch_checks, shard
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

from course_lib.parallel import ddp as D
from course_lib.parallel.ddp import DistributedDataParallel as DDP

STRATEGIES = list(D.STRATEGIES)


class NeverUsed(nn.Module):
    """``never`` takes part in no step."""

    def __init__(self):
        super().__init__()
        self.fc1, self.never, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, X):                                    # (B, 8)
        return self.fc2(torch.tanh(self.fc1(X)))            # (B, 4)


class Checkpointed(nn.Module):
    """Three layers, the ones named in ``segments`` recomputed in backward (reentrant)."""

    def __init__(self, segments: tuple[tuple[str, ...], ...]):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.segments = segments

    def _run(self, names: tuple[str, ...], h: torch.Tensor) -> torch.Tensor:
        for name in names:
            h = getattr(self, name)(h)
            h = torch.tanh(h) if name != "c" else h
        return h

    def forward(self, X):                                    # (B, 8)
        h = X
        for names in self.segments:
            if names[0].isupper():
                h = checkpoint(self._run, tuple(n.lower() for n in names), h,
                               use_reentrant=True)
            else:
                h = self._run(names, h)
        return h                                             # (B, 4)


# uppercase: inside a checkpointed segment
LAYOUTS = {
    "checkpoint_last_in_forward": (("a",), ("b",), ("C",)),   # its backward runs first
    "checkpoint_in_the_middle": (("a",), ("B",), ("c",)),
    "two_segments_only": (("A",), ("B", "C")),                # no parameter outside
}


def _float64_copies(net: nn.Module) -> tuple[nn.Module, nn.Module]:
    return copy.deepcopy(net).double(), copy.deepcopy(net).double()


def _torch_ddp(module: nn.Module, **kwargs) -> TorchDDP:
    with warnings.catch_warnings():  # torch 2.15 deprecates broadcast_buffers: beside us
        warnings.simplefilter("ignore", FutureWarning)
        return TorchDDP(module, **kwargs)


def _sgd(model: nn.Module, data, local: bool, input_grad: bool = False) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for X, y in data:
        X, y = (shard(X), shard(y)) if local else (X, y)
        X = X.double().requires_grad_(input_grad)
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()


# ------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------

def static_graph_unused() -> list[str]:
    """static_graph=True, find_unused_parameters=False, ``never`` unused in every step."""
    failures = []
    data = batches((8,), 3)
    for strategy in STRATEGIES:
        label = f"static_graph, never used, strategy={strategy}"
        torch.manual_seed(0)
        ours, theirs = _float64_copies(NeverUsed())
        one = copy.deepcopy(ours)
        ours = DDP(ours, static_graph=True, strategy=strategy)
        theirs = _torch_ddp(theirs, static_graph=True)
        try:
            _sgd(ours, data, local=True)
        except RuntimeError as e:
            failures.append(f"rank {dist.get_rank()}, {label}: raised {e}")
            continue
        _sgd(theirs, data, local=True)
        _sgd(one, data, local=False)
        check(failures, f"{label} vs torch's DDP", ours.module.state_dict(),
              theirs.module.state_dict())
        check(failures, f"{label} vs one process", ours.module.state_dict(), one.state_dict())
        grads = {n: p.grad for n, p in ours.module.named_parameters()}
        want = {n: p.grad for n, p in theirs.module.named_parameters()}
        if want["never.weight"] is not None or grads["never.weight"] is not None:
            failures.append(f"{label}: never.weight.grad should stay None, as torch's")
        check(failures, f"{label}: gradients (None for never) vs torch's", grads, want)
    return failures


def reentrant_checkpoint() -> list[str]:
    """Gradients equal one process on the whole batch, wherever the checkpointed segment is."""
    failures = []
    data = batches((8,), 2)
    for layout, segments in LAYOUTS.items():
        for strategy in STRATEGIES:
            for find_unused in (True, False):
                label = f"{layout} strategy={strategy} find_unused_parameters={find_unused}"
                torch.manual_seed(0)
                ours, one = _float64_copies(Checkpointed(segments))
                ours = DDP(ours, find_unused_parameters=find_unused, strategy=strategy)
                input_grad = layout == "two_segments_only"  # else no parameter gets a gradient
                try:
                    _sgd(ours, data, local=True, input_grad=input_grad)
                except RuntimeError as e:
                    failures.append(f"rank {dist.get_rank()}, {label}: raised {e}")
                    continue
                _sgd(one, data, local=False, input_grad=input_grad)
                check(failures, f"{label}: parameters", dict(ours.module.named_parameters()),
                      dict(one.named_parameters()))
                check(failures, f"{label}: gradients",
                      {n: p.grad for n, p in ours.module.named_parameters()},
                      {n: p.grad for n, p in one.named_parameters()})
    return failures


class Deep(nn.Module):
    """Five layers of 64 x 64 (16 KiB each): several buckets under a 20 KiB cap."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64),
                                                                    nn.Tanh())],
                                    nn.Linear(64, 4))

    def forward(self, X):                                    # (B, 64)
        return self.layers(X)                                # (B, 4)


RESUME_STEPS, STOP = 6, 3
CAP_MB = 0.01  # a bucket closes at each 64 x 64 weight: 5 buckets


def _train(net: nn.Module, data, strategy: str, checkpoint: tuple | None = None) -> tuple:
    """SGD with momentum through our DDP over ``data``, from ``checkpoint`` if given; returns
    (model state, optimizer state, number of buckets), as a checkpoint would hold them."""
    ddp = DDP(copy.deepcopy(net), bucket_cap_mb=CAP_MB, strategy=strategy)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    if checkpoint is not None:
        ddp.module.load_state_dict(checkpoint[0])
        opt.load_state_dict(checkpoint[1])
    for X, y in data:
        opt.zero_grad()
        F.cross_entropy(ddp(shard(X)), shard(y)).backward()
        opt.step()
    return (copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(opt.state_dict()),
            len(ddp.reducer.buckets))


def stop_and_resume() -> list[str]:
    """Stopped after STOP steps and resumed in a new DDP: bitwise the uninterrupted run."""
    failures, rank = [], dist.get_rank()
    data = batches((64,), RESUME_STEPS, seed=5)
    torch.manual_seed(0)
    net = Deep()
    for strategy in STRATEGIES:
        label = f"rank {rank} of {dist.get_world_size()}, strategy={strategy}"
        whole = _train(net, data, strategy)
        stopped = _train(net, data[:STOP], strategy)
        resumed = _train(net, data[STOP:], strategy, checkpoint=stopped[:2])
        if strategy == "bucketed" and whole[2] < 3:
            failures.append(f"{label}: {whole[2]} buckets; the test needs several")
        differ = [k for k in whole[0] if not torch.equal(whole[0][k], resumed[0][k])]
        if differ:
            worst = max((whole[0][k] - resumed[0][k]).abs().max().item() for k in differ)
            failures.append(f"{label}: resumed run not bitwise equal to the uninterrupted one "
                            f"in {differ} (largest difference {worst:.1e})")
        for i, state in whole[1]["state"].items():
            if not torch.equal(state["momentum_buffer"],
                               resumed[1]["state"][i]["momentum_buffer"]):
                failures.append(f"{label}: momentum buffer {i} differs after resuming")
    theirs = _torch_ddp(copy.deepcopy(net), bucket_cap_mb=CAP_MB)  # the run itself is torch's
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for X, y in data:
        opt.zero_grad()
        F.cross_entropy(theirs(shard(X)), shard(y)).backward()
        opt.step()
    check(failures, "uninterrupted run vs torch's DDP", whole[0], theirs.module.state_dict())
    return failures


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

CHECKS = {"static_graph": static_graph_unused, "checkpoint": reentrant_checkpoint,
          "resume": stop_and_resume}


@functools.cache
def failures(world_size: int) -> dict[str, list[str]]:
    """Every rank's failures for each check (one launch per world size, cached)."""
    return launch_checks(CHECKS, world_size, timeout=300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_handles_a_parameter_unused_in_every_step_as_torch(world_size):
    assert not failures(world_size)["static_graph"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_reentrant_checkpointing_averages_every_gradient(world_size):
    assert not failures(world_size)["checkpoint"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_stop_and_resume_is_bitwise_equal_with_several_buckets(world_size):
    assert not failures(world_size)["resume"]
