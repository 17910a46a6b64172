"""Worker functions that notebook 08 (the DDP training recipe) hands to ``launch``.

Each runs in every rank of an initialised process group and returns small picklable results;
claims are asserted here, in the worker, so a notebook cell that prints a result has also proved
it. The recipe itself is ``course_lib.train_ddp``: these workers call its pieces (``run``,
``evaluate_exact``, ``share_initial_weights``, ...) and report.
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import DistInfo
from course_lib.models.lenet import LeNet
from course_lib.parallel.sync_batchnorm import SyncBatchNorm
from course_lib.train import NonFiniteLoss
from course_lib.train_ddp import (
    build_model,
    evaluate_exact,
    evaluate_padded,
    load_checkpoint,
    parse_args,
    run,
    share_initial_weights,
)

__all__ = ["evaluations", "initial_weights", "one_rank_leaves", "run_recipes",
           "stop_on_nonfinite", "sync_bn_against_global", "torch_sync_bn_on_cpu"]


def _info() -> DistInfo:
    """This rank, as ``course_lib.train_ddp`` describes it (inside a ``launch`` worker, CPU)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, rank, dist.get_backend(), torch.device("cpu"), "launch")


def _checksum(model: nn.Module) -> float:
    """The sum of all parameters: equal sums on every rank after an equal start."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


# ---- runs of the recipe ------------------------------------------------------------------------

def run_recipes(argvs: list[list[str]]) -> list[dict]:
    """``course_lib.train_ddp.run(argv)`` for each ``argv`` in turn, in one process group.

    Returns, per run, ``{"summary": run's summary, "printed": what this rank printed}``: a
    worker's stdout does not reach the notebook, so it is captured and returned.
    """
    results = []
    for argv in argvs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            summary = run(argv)
        results.append({"summary": summary, "printed": printed.getvalue()})
    return results


def stop_on_nonfinite(argv: list[str]) -> dict:
    """``run(argv)`` with a fault injected (``--nan-at-step``): every rank must stop, cleanly.

    Returns ``{"stopped": NonFiniteLoss's message, "seconds": time to stop}``; asserts that this
    rank raised ``NonFiniteLoss`` (not a timeout in a collective, not a hang).
    """
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run(argv)
    except NonFiniteLoss as e:
        return {"stopped": str(e), "seconds": time.perf_counter() - start}
    raise AssertionError(f"rank {dist.get_rank()}: the run ended without a NonFiniteLoss")


def one_rank_leaves(wait_s: float = 2.0) -> dict:
    """The seed recipe's ``sys.exit(1)`` on one rank, made bounded: the other waits, alone.

    Both ranks take one step (an all-reduce); then rank 1 leaves the loop, as a rank that saw a
    non-finite loss and called ``sys.exit(1)`` would, while rank 0 goes on into the next step's
    all-reduce, which nobody will ever join: it waits until its group's timeout (``wait_s``, here
    short; 30 min on gloo by default, 10 min on NCCL). Rank 1 stays alive meanwhile (a process that
    really exits may close its connections, which gloo reports at once). Returns what each did.
    """
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)                      # step 1: every rank takes part
    if rank != 0:
        time.sleep(wait_s + 1)                           # left the loop; never all-reduces again
        return {"rank": rank,
                "did": "left the loop after step 1 (stays alive, never all-reduces again)"}
    start = time.perf_counter()
    try:
        dist.all_reduce(t, group=group)                  # step 2: waits for rank 1
        error = None
    except RuntimeError as e:
        error = " ".join(str(e).split())
    waited = time.perf_counter() - start
    assert error is not None and waited >= 0.9 * wait_s, (error, waited)
    return {"rank": rank, "did": "waited in step 2's all-reduce", "waited_s": waited,
            "error": error}


# ---- pieces of the recipe ----------------------------------------------------------------------

def initial_weights(folder: str) -> dict:
    """Two ways to an equal start, from LeNets seeded ``seed + rank`` (different on each rank).

    1. torch's DDP broadcasts rank 0's parameters and buffers when it wraps the model;
    2. ``share_initial_weights``: rank 0 saves, barrier, every rank loads (``map_location``).

    Returns every rank's parameter checksum before and after each (asserted equal after, and
    equal to rank 0's before); ``folder`` must be empty again afterwards (the file is removed).
    """
    info = _info()
    args = parse_args(["--model", "lenet"])
    out = {}
    for way in ("broadcast", "file"):
        model = build_model(args, info.device, info.rank)        # seeded with seed + rank
        before = _checksum(model)
        if way == "broadcast":
            model = nn.parallel.DistributedDataParallel(model)   # broadcasts from rank 0
        else:
            share_initial_weights(model, info, folder)
        after = _checksum(model)
        sums = [None] * info.world_size
        dist.all_gather_object(sums, (before, after))
        assert len({b for b, _ in sums}) == info.world_size      # different before
        assert len({a for _, a in sums}) == 1 and sums[0][1] == sums[0][0]  # rank 0's after
        out[way] = sums
    dist.barrier()
    out["files_left"] = sorted(os.listdir(folder))
    return out


def evaluations(checkpoint: str, X_test: torch.Tensor, y_test: torch.Tensor,
                sizes: list[int]) -> list[dict]:
    """Exact and padded accuracy of a checkpoint's LeNet on the first n test images.

    For each n of ``sizes``: ``evaluate_exact`` (strided shards, no padding) and
    ``evaluate_padded`` (a ``DistributedSampler``: ``correct / sampler.total_size``), beside
    one process counting the whole slice (the oracle, asserted equal to the exact count).
    ``X_test`` (N, 1, 28, 28) uint8 and ``y_test`` (N,) are the test set, the same on every rank.
    """
    model = LeNet()
    model.load_state_dict(load_checkpoint(checkpoint)["model"])
    model.eval()
    cpu, rows = torch.device("cpu"), []
    for n in sizes:
        X, y = X_test[:n], y_test[:n]                             # (n, 1, 28, 28), (n,)
        exact = evaluate_exact(model, X, y, 256, cpu)
        padded = evaluate_padded(model, X, y, 256, cpu)
        if dist.get_rank() == 0:   # the oracle, once: the counts are the same on every rank
            with torch.no_grad():
                one = int((model(X.float() / 255).argmax(dim=1) == y).sum())
            assert exact == (one, n), (exact, one, n)
        rows.append({"n": n, "exact": tuple(exact), "padded": tuple(padded)})
    return rows


def sync_bn_against_global(sizes: list[int], channels: int = 4, use_torch: bool = False
                           ) -> dict:
    """SyncBatchNorm on unequal shards against one ``BatchNorm2d`` on the whole global batch.

    Every rank builds the same global batch (N = sum(sizes) images of ``channels`` x 5 x 5) and
    upstream gradient, runs its shard (``sizes[rank]`` images) forward and backward through
    SyncBatchNorm, and compares with one BatchNorm2d on the whole batch: the output, the input
    gradient, the weight and bias gradients (summed over ranks: each rank holds its shard's share;
    DDP would average instead, each rank's loss being a mean over its shard) and the running
    statistics (asserted equal); also a plain ``BatchNorm2d`` on the shard alone. ``use_torch``:
    torch's ``nn.SyncBatchNorm`` on ``cuda:rank`` (NCCL) instead of the course's. Returns the
    largest absolute difference of each quantity, and this rank's shard size.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    device = torch.device("cuda", rank) if use_torch else torch.device("cpu")
    dtype = torch.float32 if use_torch else torch.float64
    tol = {"rtol": 1e-4, "atol": 1e-5} if use_torch else {"rtol": 1e-10, "atol": 1e-10}
    torch.manual_seed(0)                     # the same global batch on every rank
    reference = nn.BatchNorm2d(channels).to(device, dtype)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 2.0)
        reference.bias.uniform_(-1.0, 1.0)
    ours = (nn.SyncBatchNorm(channels) if use_torch else SyncBatchNorm(channels)).to(device, dtype)
    ours.load_state_dict(reference.state_dict())
    plain = nn.BatchNorm2d(channels).to(device, dtype)
    plain.load_state_dict(reference.state_dict())
    X = torch.randn(sum(sizes), channels, 5, 5, device=device, dtype=dtype) * 3 + 2  # (N, C, 5, 5)
    dY = torch.randn_like(X)                                                       # upstream
    X_all = X.clone().requires_grad_()
    Y_all = reference(X_all)                                                       # (N, C, 5, 5)
    Y_all.backward(dY)
    x = X[mine].clone().requires_grad_()                                           # (n_r, C, 5, 5)
    y = ours(x)
    y.backward(dY[mine])
    grads = {}
    for name in ("weight", "bias"):
        grads[name] = getattr(ours, name).grad.clone()
        dist.all_reduce(grads[name])          # each rank holds its share; the sum is the batch's
    pairs = {"output": (y, Y_all.detach()[mine]), "input grad": (x.grad, X_all.grad[mine]),
             "weight grad": (grads["weight"], reference.weight.grad),
             "bias grad": (grads["bias"], reference.bias.grad),
             "running_mean": (ours.running_mean, reference.running_mean),
             "running_var": (ours.running_var, reference.running_var)}
    diffs = {name: (a - b).abs().max().item() for name, (a, b) in pairs.items()
             if name != "running_mean"}
    for a, b in pairs.values():
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():
        unsynced = (plain(X[mine]) - Y_all.detach()[mine]).abs().max().item()
    return {"rank": rank, "world": world, "shard": sizes[rank], "diffs": diffs,
            "plain BatchNorm output": unsynced}


def torch_sync_bn_on_cpu() -> str:
    """What ``torch.nn.SyncBatchNorm`` says to a CPU tensor once a process group exists."""
    layer = nn.SyncBatchNorm(4)
    try:
        layer(torch.randn(3, 4, 5, 5))       # training mode, a group of 2 or more: syncs
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return "no error"
