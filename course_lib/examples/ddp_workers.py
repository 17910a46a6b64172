"""Worker functions that notebook 07 (DDP from scratch) hands to ``course_lib.distributed.launch``.

Each runs in every rank of an initialised process group and returns small picklable results.
The data comes in as arguments: the same uint8 images ``X`` (N, 1, 28, 28) and labels ``y`` (N,)
on every rank; each rank takes its own shard of every global batch, as ``DistributedSampler``
would. The oracles are torch's own ``torch.nn.parallel.DistributedDataParallel`` on the same data
and one process training on the whole batch. Claims are asserted here, in the worker, so a
notebook cell that prints a result has also proved it.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.distributed.recording import record_collectives
from course_lib.models.lenet import LeNet
from course_lib.parallel.ddp import (
    DistributedDataParallel,
    allreduce_hook,
    bf16_compress_hook,
    bytes_on_wire,
)

from .workers import _max_diff

__all__ = ["accumulate_with_no_sync", "broadcast_initial_state", "compare_with_torch",
           "compression", "count_all_reduce_bytes", "timeline", "timelines"]


def _global_batch(X: torch.Tensor, y: torch.Tensor, step: int,
                  per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch number ``step`` (world * per_rank examples), float images in [0, 1]."""
    n = dist.get_world_size() * per_rank
    start = (step * n) % (len(X) - n + 1)
    return X[start:start + n].float() / 255, y[start:start + n]  # (n, 1, 28, 28), (n,)


def _shard(batch: torch.Tensor, per_rank: int) -> torch.Tensor:
    rank = dist.get_rank()
    return batch[rank * per_rank:(rank + 1) * per_rank]  # (per_rank, ...)


def _max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return _max_diff(a.parameters(), b.parameters())


def _max_grad_diff(a: nn.Module, b: nn.Module) -> float:
    return _max_diff((p.grad for p in a.parameters()), (q.grad for q in b.parameters()))


def _lenet(seed: int) -> LeNet:
    """A LeNet whose initial weights depend on ``seed`` (a different one per rank, on purpose)."""
    torch.manual_seed(seed)
    return LeNet()


def _torch_ddp(module: nn.Module, **kwargs) -> nn.Module:
    """torch's own DistributedDataParallel (imported here: its first import takes seconds)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    return TorchDDP(module, **kwargs)


def _sgd_step(net: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
              y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(net(X), y)
    loss.backward()  # DDP: when this returns, every .grad holds the average over the ranks
    opt.step()
    return loss.item()


# ---- 1. the initial broadcast -------------------------------------------------------------------

def broadcast_initial_state() -> dict[str, list[float]]:
    """Each rank builds a LeNet from its own seed; wrapping it in DDP makes them all rank 0's.
    Returns every rank's sum of all its parameters before and after wrapping (a checksum)."""
    net = _lenet(seed=dist.get_rank())           # different weights on every rank
    checksum = lambda: torch.stack([p.detach().sum() for p in net.parameters()]).sum()
    before = checksum()
    DistributedDataParallel(net)                 # broadcasts parameters and buffers from rank 0
    after = checksum()
    sums = torch.stack([before, after])          # (2,)
    everyone = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, sums)
    assert all(torch.equal(p[1], everyone[0][1]) for p in everyone), "not equal after wrapping"
    return {"before": [p[0].item() for p in everyone], "after": [p[1].item() for p in everyone]}


# ---- 2. each strategy against torch's DDP -------------------------------------------------------

def compare_with_torch(strategy: str, X: torch.Tensor, y: torch.Tensor, steps: int,
                       per_rank: int = 32, lr: float = 0.1,
                       bucket_cap_mb: float = 25) -> dict:
    """Train the same LeNet with our DDP and torch's on the same shards; parameters must match.

    Both start from a different random LeNet on every rank (their constructors broadcast rank 0's)
    and take ``steps`` SGD steps. After every step the parameters of the two are compared with
    ``torch.testing.assert_close`` (an AssertionError fails the launch).

    Returns:
        ``strategy``, ``buckets`` (how many our DDP made), ``losses`` (rank 0's, ours) and
        ``max_abs_diff`` after each step (rank 0's; the others are asserted too).
    """
    net = _lenet(seed=100 + dist.get_rank())
    ours = DistributedDataParallel(net, strategy=strategy, bucket_cap_mb=bucket_cap_mb)
    theirs = _torch_ddp(copy.deepcopy(net), bucket_cap_mb=bucket_cap_mb)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=lr)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=lr)
    losses, diffs = [], []
    for step in range(steps):
        Xg, yg = _global_batch(X, y, step, per_rank)
        Xs, ys = _shard(Xg, per_rank), _shard(yg, per_rank)   # (per_rank, 1, 28, 28), (per_rank,)
        losses.append(_sgd_step(ours, opt_ours, Xs, ys))
        _sgd_step(theirs, opt_theirs, Xs, ys)
        torch.testing.assert_close(dict(ours.module.named_parameters()),
                                   dict(theirs.module.named_parameters()))
        diffs.append(_max_abs_diff(ours.module, theirs.module))
    return {"strategy": strategy, "buckets": len(ours.reducer.buckets), "losses": losses,
            "max_abs_diff": diffs}


# ---- 3. a timeline of one backward pass ---------------------------------------------------------

def timeline(strategy: str, X: torch.Tensor, y: torch.Tensor, per_rank: int = 128,
             bucket_cap_mb: float = 0.1, steps: int = 4) -> dict:
    """When backward produces each gradient, and when each bucket's all-reduce starts and ends.

    Times come from ``time.perf_counter()`` in hooks, in seconds after ``loss.backward()`` was
    called, for the last of ``steps`` steps (the first ones warm up):

    * a post-accumulate-grad hook on every parameter, registered *before* DDP's own, records
      when that parameter's gradient is final ("grad");
    * a communication hook around ``allreduce_hook`` records when each bucket's all-reduce is
      launched ("start") and, in a callback on its future, when it completes ("end");
    * ``backward returned`` is when ``loss.backward()`` came back, after DDP's final callback
      waited for every bucket and copied the averages into ``.grad``.

    Returns:
        ``grads``: [(parameter name, t)], ``buckets``: [(index, parameter names, start, end)],
        ``backward_returned``: t, ``forward_s``: duration of the forward pass.
    """
    net = _lenet(seed=0)
    names = {id(p): name for name, p in net.named_parameters()}
    events: dict[str, list] = {"grads": [], "buckets": []}
    t0 = [0.0]  # reset before each backward

    def grad_ready(p: torch.Tensor) -> None:
        events["grads"].append((names[id(p)], time.perf_counter() - t0[0]))

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(grad_ready)  # runs before DDP's hook on p

    def timed_allreduce(state, bucket) -> torch.futures.Future:
        start = time.perf_counter() - t0[0]
        record = [bucket.index(), [names[id(p)] for p in bucket.parameters()], start, None]
        events["buckets"].append(record)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            record[3] = time.perf_counter() - t0[0]
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    ddp = DistributedDataParallel(net, strategy=strategy, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, timed_allreduce)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        Xg, yg = _global_batch(X, y, step, per_rank)
        Xs, ys = _shard(Xg, per_rank), _shard(yg, per_rank)
        events["grads"].clear()
        events["buckets"].clear()
        opt.zero_grad()
        dist.barrier()                   # both ranks start the step together
        t_forward = time.perf_counter()
        loss = F.cross_entropy(ddp(Xs), ys)
        t0[0] = time.perf_counter()
        forward_s = t0[0] - t_forward
        loss.backward()
        backward_returned = time.perf_counter() - t0[0]
        opt.step()
    assert all(end is not None for *_, end in events["buckets"]), "a bucket never completed"
    return {"strategy": strategy, "grads": list(events["grads"]),
            "buckets": [tuple(b) for b in events["buckets"]],
            "backward_returned": backward_returned, "forward_s": forward_s}


def timelines(strategies: tuple[str, ...], X: torch.Tensor, y: torch.Tensor, per_rank: int = 128,
              bucket_cap_mb: float = 0.1) -> dict[str, dict]:
    """``timeline`` for each strategy, in one launch: strategy -> its timeline."""
    return {strategy: timeline(strategy, X, y, per_rank, bucket_cap_mb) for strategy in strategies}


# ---- 4. gradient accumulation with no_sync ------------------------------------------------------

def accumulate_with_no_sync(X: torch.Tensor, y: torch.Tensor, micro: int = 16,
                            k: int = 4) -> dict:
    """k micro-batches per rank, the first k - 1 under ``no_sync()``: one big batch's gradient.

    Each rank owns k * micro examples of a global batch of world * k * micro. Each micro-batch's
    loss is divided by k, so the accumulated gradient is the mean over the rank's examples, and the
    average over ranks is the mean over the global batch: one process on the whole batch must get
    the same gradient (asserted), and so must torch's DDP with its ``no_sync`` (asserted).
    A counting communication hook records how many buckets were sent in each backward.

    Returns:
        per strategy: ``sent`` (buckets sent after each micro-batch) and ``max_abs_diff`` from the
        one-process gradient; and ``torch DDP``'s ``max_abs_diff``.
    """
    per_rank = k * micro
    Xg, yg = _global_batch(X, y, 0, per_rank)          # (world * k * micro, 1, 28, 28)
    Xs, ys = _shard(Xg, per_rank), _shard(yg, per_rank)
    base = _lenet(seed=0)

    one = copy.deepcopy(base)                           # the oracle: one process, whole batch
    F.cross_entropy(one(Xg), yg).backward()

    def accumulate(model: nn.Module, sent: list[int] | None = None) -> None:
        for i in range(k):
            Xm, ym = Xs[i * micro:(i + 1) * micro], ys[i * micro:(i + 1) * micro]
            before = calls[0]
            if i < k - 1:
                with model.no_sync():                   # forward and backward inside
                    (F.cross_entropy(model(Xm), ym) / k).backward()
            else:                                       # the last one synchronises
                (F.cross_entropy(model(Xm), ym) / k).backward()
            if sent is not None:
                sent.append(calls[0] - before)

    calls = [0]

    def counting(state, bucket) -> torch.futures.Future:
        calls[0] += 1
        return allreduce_hook(state, bucket)

    out: dict[str, dict] = {}
    for strategy in ("naive", "overlap", "bucketed"):
        ddp = DistributedDataParallel(copy.deepcopy(base), strategy=strategy)
        ddp.register_comm_hook(None, counting)
        sent: list[int] = []
        accumulate(ddp, sent)
        torch.testing.assert_close(dict((n, p.grad) for n, p in ddp.module.named_parameters()),
                                   dict((n, p.grad) for n, p in one.named_parameters()))
        out[strategy] = {"sent": sent, "max_abs_diff": _max_grad_diff(ddp.module, one)}

    theirs = _torch_ddp(copy.deepcopy(base))
    accumulate(theirs)
    torch.testing.assert_close(dict((n, p.grad) for n, p in theirs.module.named_parameters()),
                               dict((n, p.grad) for n, p in one.named_parameters()))
    out["torch DDP"] = {"max_abs_diff": _max_grad_diff(theirs.module, one)}
    return out


# ---- 5. the bf16 compression hook ---------------------------------------------------------------

@contextmanager
def count_all_reduce_bytes() -> Iterator[list[int]]:
    """The bytes of every tensor handed to ``dist.all_reduce`` inside the block, in a list filled
    as the block ends (``record_collectives``: the hooks call ``torch.distributed.all_reduce``
    by attribute, so replacing it sees what they send)."""
    sizes: list[int] = []
    with record_collectives(("all_reduce",)) as records:
        yield sizes
    sizes.extend(r.bytes for r in records)


def compression(X: torch.Tensor, y: torch.Tensor, per_rank: int = 64, steps: int = 5) -> dict:
    """Average gradients in float32 and with ``bf16_compress_hook``: bytes sent and the error.

    Two copies of one LeNet take the same steps on the same shards; before each step the bf16
    copy is reset to the float32 copy's weights, so their gradients are compared at the same
    point. Returns, for "fp32" and "bf16", ``sent_bytes`` (handed to ``dist.all_reduce`` per
    step, measured) and ``ring_bytes`` (what a ring all-reduce sends per rank for that,
    ``bytes_on_wire``); and per step ``max_abs_diff`` (largest |bf16 - fp32| gradient entry),
    ``max_abs_grad`` (largest |fp32 gradient|) and ``max_rel_diff`` (per tensor, |diff|.max() /
    |grad|.max(), the worst one).
    """
    base = _lenet(seed=0)
    fp32 = DistributedDataParallel(copy.deepcopy(base))
    bf16 = DistributedDataParallel(copy.deepcopy(base))
    bf16.register_comm_hook(None, bf16_compress_hook)
    opt = torch.optim.SGD(fp32.parameters(), lr=0.1)
    sent, diffs, grads, rel = {"fp32": [], "bf16": []}, [], [], []
    for step in range(steps):
        Xg, yg = _global_batch(X, y, step, per_rank)
        Xs, ys = _shard(Xg, per_rank), _shard(yg, per_rank)
        bf16.module.load_state_dict(fp32.module.state_dict())
        for name, model in (("fp32", fp32), ("bf16", bf16)):
            model.zero_grad()
            with count_all_reduce_bytes() as sizes:
                F.cross_entropy(model(Xs), ys).backward()
            sent[name].append(sum(sizes))
        diffs.append(_max_grad_diff(bf16.module, fp32.module))
        grads.append(max(p.grad.abs().max().item() for p in fp32.parameters()))
        rel.append(max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
                       for p, q in zip(bf16.parameters(), fp32.parameters())))
        opt.step()
    assert len(set(sent["fp32"])) == 1 and len(set(sent["bf16"])) == 1, "bytes vary by step"
    return {"fp32": {"sent_bytes": sent["fp32"][0], "ring_bytes": bytes_on_wire(fp32)},
            "bf16": {"sent_bytes": sent["bf16"][0],
                     "ring_bytes": bytes_on_wire(bf16, torch.bfloat16)},
            "max_abs_diff": diffs, "max_abs_grad": grads, "max_rel_diff": rel}
