"""Checkers for the exercises of lesson 07 (DDP from scratch), in real worker processes.

Worker processes import the answer by module and name, so it must live in a file (in the
notebook: a cell starting with ``%%writefile my_ddp.py``); pass it as a function or class, or as
a string such as ``"my_ddp:average_gradients"`` (imported fresh in the workers, so an edited
file is picked up without restarting the kernel); None is "not answered yet". ``timeout``:
seconds for each world size (an answer that hangs fails, it does not hang); ``strict``: raise
``AssertionError`` on a wrong answer. Each checker returns the verdict (truthy when right) and
prints the first failing case.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.recording import record_collectives
from ..parallel.ddp import assign_buckets
from ._core import ExerciseResult, verdict
from ._ddp_cases import CASES, MLP, Frozen
from .harness import UNANSWERED, StopRank, agree, call_answer, check_in_ranks, describe, load_answer

__all__ = ["check_average_gradients", "check_ddp"]

_HINT = ("all-reduce (sum) every parameter's .grad in place, then divide it by "
         "dist.get_world_size(); skip parameters whose .grad is None.")


# ---- the cases: small models whose parameter sizes do not divide by the world size ---------------

class _Conv(nn.Module):
    """Conv 1 -> 3 channels 3x3 on 5x5 images, then linear 27 -> 3."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(27, 3)

    def forward(self, X):                                      # (B, 1, 5, 5)
        return self.fc(torch.relu(self.conv(X)).flatten(1))   # (B, 3, 3, 3) -> (B, 3)


def _unused() -> nn.Module:
    """The MLP with a layer forward never calls: its parameters require grad, their .grad
    stays None (skipping them only when ``not p.requires_grad`` is not enough)."""
    net = MLP()
    net.spare = nn.Linear(3, 2)
    return net


#: case name -> (model builder, shape of one example)
_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (7,)),             # Linear 7 -> 5 -> 3: 35, 5, 15 and 3 elements
    "conv": (_Conv, (1, 5, 5)),
    "frozen fc1": (Frozen, (7,)),   # fc1's .grad stays None
    "unused layer": (_unused, (7,)),
}


def _run_cases(fn: Callable | tuple[str, str, str], per_rank: int, seed: int) -> str | None:
    """Every model of ``_MODELS`` on this rank's shard; the first failure as text, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    average_gradients, error = load_answer(fn)
    if error:
        return error
    for case, (build, shape) in _MODELS.items():
        torch.manual_seed(seed)                    # the same initial weights on every rank
        net = build()
        oracle = copy.deepcopy(net)
        g = torch.Generator().manual_seed(seed + 1)
        X = torch.randn(world * per_rank, *shape, generator=g)        # (world * per_rank, ...)
        y = torch.randint(0, 3, (world * per_rank,), generator=g)     # the global batch
        F.cross_entropy(oracle(X), y).backward()   # one process, whole batch: the answer
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        F.cross_entropy(net(X[mine]), y[mine]).backward()             # this rank's shard
        local = {name: None if p.grad is None else p.grad.clone()
                 for name, p in net.named_parameters()}
        where = f"world_size={world}, model {case!r}, rank {rank}"
        try:
            with record_collectives() as calls:
                call_answer("your function", average_gradients, net)
        except StopRank as e:
            return f"{where}: {e}"
        if not calls and world > 1 and any(local[n] is not None for n in local):
            return (f"{where}: rank {rank} called no collective (no all_reduce, no send): the "
                    "others wait for it in theirs. Every rank must call all_reduce on every "
                    "gradient, in the same order.")
        wrong = _first_wrong_grad(net, oracle, local, world, where, "", ".",
                                  " It is this rank's own gradient, unchanged: was the result "
                                  "written back into p.grad (in place), and was it the gradient, "
                                  "not the parameter, that you averaged?")
        if wrong is not None:
            return wrong
    return None


def _first_wrong_grad(net: nn.Module, oracle: nn.Module, local: dict[str, torch.Tensor | None],
                      world: int, where: str, source: str, sum_end: str,
                      unchanged: str) -> str | None:
    """The first parameter whose ``.grad`` is not the ``oracle``'s, described (None if none); the
    sum (``sum_end`` ends its sentence) and this rank's ``local`` gradient are recognised."""
    for (name, p), q in zip(net.named_parameters(), oracle.parameters()):
        got, want = p.grad, q.grad
        if want is None or got is None:
            if got is not want:
                return (f"{where}, parameter {name}: expected .grad {describe(want)}{source}, "
                        f"received {describe(got)}.")
            continue
        # float32 sums in another order: a right answer differs by rounding only
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            hint = ""
            if got.shape == want.shape and torch.allclose(got, want * world, rtol=1e-4, atol=1e-6):
                hint = f" It is {world} times too large: the sum, not the average{sum_end}"
            elif got.shape == want.shape and torch.allclose(got, local[name], rtol=1e-6,
                                                            atol=1e-8):
                hint = unchanged
            return (f"{where}, parameter {name}: expected .grad {describe(want)}{source}, "
                    f"received {describe(got)}.{hint}")
    return None


def check_average_gradients(fn: Callable | str | None, *,
                            world_sizes: tuple[int, ...] = (2, 3, 4), per_rank: int = 3,
                            timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise 07: ``fn(model)`` averages every ``p.grad`` over the ranks, in place.

    For each world size, each worker builds the same small models (an MLP, a conv net, an MLP
    with a frozen layer, one with a layer forward never uses: parameter sizes no world size
    divides), computes the gradient of its shard of a global batch, calls ``fn(model)``, and
    compares every ``.grad`` with one process's on the whole batch (frozen and unused parameters
    keep ``.grad`` None). A rank that calls no collective is named. ``per_rank``: examples per rank.
    """
    return check_in_ranks(
        "average_gradients", fn, "my_ddp:average_gradients", _run_cases, (per_rank, 7),
        world_sizes=world_sizes, timeout=timeout, hint=_HINT,
        hang_hint="Does every rank call all_reduce on the same tensors, in the same order?",
        passed=f"every .grad equals the whole-batch gradient for world sizes "
               f"{list(world_sizes)} and {len(_MODELS)} models.",
        missing="write average_gradients(model) to a file and pass it here.", strict=strict)


# ---- check_ddp: the learner's DDP class, step by step against torch's DistributedDataParallel ----

_DDP_HINT = ("register p.register_post_accumulate_grad_hook on every parameter that requires "
             "grad (the hook receives the parameter: all-reduce p.grad), start the all-reduces "
             "in one fixed order (bucket 0, 1, 2, ... whatever order the gradients arrive in), "
             "and queue Variable._execution_engine.queue_callback at the first hook of a "
             "backward to wait for every one and divide by the world size before backward "
             "returns.")


class _AllReduceRecorder:
    """Stands in for ``dist.all_reduce`` in a worker: notes every call of a backward. The ranks
    share each size first (a small all_gather): ranks that launch in different orders get a
    clear error, not a crash of gloo."""

    def __init__(self):
        self.real = dist.all_reduce
        self.start_backward()

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        index = len(self.sizes)
        mine = torch.tensor([tensor.numel()], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        sizes = [int(t) for t in every]
        if len(set(sizes)) > 1:
            self.mismatch = (f"all-reduce number {index + 1} of this backward: the ranks sent "
                             f"tensors of {sizes} elements (rank by rank). The ranks launched "
                             f"their all-reduces in different orders (in this model the "
                             f"gradients arrive in a different order on each rank): launch in "
                             f"one fixed order, bucket index 0, 1, 2, ..., never in arrival "
                             f"order.")
            raise RuntimeError(self.mismatch)
        self.sizes.append(tensor.numel())
        self.events.append("all_reduce")
        work = self.real(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            work = _TrackedWork(work)
            self.works.append(work)
        return work

    def start_backward(self) -> None:
        self.sizes: list[int] = []
        self.works: list = []
        self.events: list[str] = []       # "grad" and "all_reduce" in the order they happened
        self.mismatch: str | None = None


class _TrackedWork:
    """An async all-reduce's work handle that notes whether anyone waited for it."""

    def __init__(self, work):
        self._work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self.waited = True   # a future handed on: waited through it (or a chained one)
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _expected_buckets(module: nn.Module, cap_bytes: int) -> list[int]:
    """Sizes (elements) of the buckets in launch order: torch's, last trainable parameter first."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [sum(params[i].numel() for i in b) for b in assign_buckets(params, cap_bytes)]


def _ddp_cases(spec, per_rank: int, steps: int, cap_mb: float | None, seed: int) -> str | None:
    """In every rank: each model of ``CASES`` wrapped by the learner's class and by torch's DDP,
    ``steps`` SGD steps; the first failure as text, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, error = load_answer(spec, "class")
    if error:
        return error
    recorder = _AllReduceRecorder()
    dist.all_reduce = recorder
    try:
        for case, build in CASES.items():
            torch.manual_seed(seed)                   # the same initial weights on every rank
            net = build()
            plain, theirs_net = copy.deepcopy(net), copy.deepcopy(net)
            kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
            where = f"world_size={world}, model {case!r}, rank {rank}"
            try:
                mine = cls(net, **kwargs)
            except NotImplementedError:
                mine = None
            except Exception as e:
                args = "module" + (f", bucket_cap_mb={cap_mb:g}" if cap_mb is not None else "")
                return (f"{where}: {getattr(cls, '__name__', 'your class')}({args}) raised "
                        f"{type(e).__name__}: {' '.join(str(e).split())}")
            theirs = nn.parallel.DistributedDataParallel(theirs_net, bucket_cap_mb=cap_mb or 25)
            if mine is None:
                return UNANSWERED
            for p in net.parameters():  # after the learner's hooks: once theirs has returned
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: recorder.events.append("grad"))
            for step in range(steps):
                # every rank goes on, or every rank stops (agree)
                failure = agree(_ddp_one_step((mine, net, plain, theirs, theirs_net), recorder,
                                              case, step, steps, where, per_rank, cap_mb, seed))
                if failure is not None:
                    return failure
    finally:
        dist.all_reduce = recorder.real
    return None


def _ddp_one_step(models: tuple, recorder: _AllReduceRecorder, case: str, step: int, steps: int,
                  where: str, per_rank: int, cap_mb: float | None, seed: int) -> str | None:
    """One SGD step of both wrappers on this rank's shard; what is wrong, or None. torch's DDP
    steps on every rank whatever the learner's class did: the ranks issue the same collectives."""
    mine, net, plain, theirs, theirs_net = models
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed + 100 * step + 1)
    X = torch.randn(world * per_rank, 7, generator=g)                # (world * per_rank, 7)
    y = torch.randint(0, 3, (world * per_rank,), generator=g)        # the global batch
    mine_x = slice(rank * per_rank, (rank + 1) * per_rank)           # this rank's shard
    at = f"{where}, step {step + 1}"
    before = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():                                            # the local gradient
        for q, p in zip(plain.parameters(), net.parameters()):
            q.copy_(p)
    F.cross_entropy(plain(X[mine_x]), y[mine_x]).backward()
    recorder.start_backward()
    try:
        F.cross_entropy(mine(X[mine_x]), y[mine_x]).backward()
        raised = None
    except NotImplementedError:
        raised = UNANSWERED
    except Exception as e:
        raised = (recorder.mismatch if recorder.mismatch is not None else
                  f"forward or backward raised {type(e).__name__}: {' '.join(str(e).split())}")
    # not waited: neither work.wait() nor work.get_future() (the work's own completion flag
    # may lag behind its future's, so it says nothing)
    running = sum(not w.waited for w in recorder.works)
    F.cross_entropy(theirs(X[mine_x]), y[mine_x]).backward()        # torch's DDP: the answer
    if raised is not None:
        return f"{at}: {raised}"
    if running:
        return (f"{at}: {running} all-reduce(s) not waited for when backward returned. "
                f"Wait for every one (work.wait()) in the end-of-backward callback, so that "
                f".grad holds the average when loss.backward() returns.")
    changed = [n for (n, p), b in zip(net.named_parameters(), before)
               if not torch.equal(p.detach(), b)]
    if changed:
        return (f"{at}: backward changed the parameter {changed[0]} itself. The "
                f"post-accumulate-grad hook receives the parameter, not its gradient: "
                f"all-reduce param.grad.")
    local = {name: q.grad for name, q in plain.named_parameters()}
    wrong = _first_wrong_grad(net, theirs_net, local, world, at, " (as torch's DDP)",
                              " (divide by the world size).",
                              " It is this rank's own gradient, unchanged: nothing was averaged "
                              "into p.grad by the time backward returned (was the all-reduce "
                              "applied to p.grad, and waited for, before backward returned?)")
    if wrong is not None:
        return wrong
    if step == 0 and case == "mlp" and "grad" in recorder.events:
        last_grad = len(recorder.events) - 1 - recorder.events[::-1].index("grad")
        if "all_reduce" not in recorder.events[:last_grad]:
            return (f"{at}: right values, but no all-reduce started before the last gradient "
                    f"was ready: nothing overlaps with backward. Start each all-reduce "
                    f"(async_op=True) from the hook as soon as it can go.")
    # the bucket sizes, in a step after the first (torch, and the course, send everything in
    # one bucket in the first step, then rebuild the buckets in arrival order) and on the
    # models whose gradients arrive in reverse registration order
    if cap_mb is not None and step == steps - 1 and case in ("mlp", "frozen fc1"):
        want_sizes = _expected_buckets(net, int(cap_mb * 1024 * 1024))
        if recorder.sizes != want_sizes:
            return (f"{at}: right values, but the all-reduces sent {recorder.sizes} elements, "
                    f"one bucket each, where buckets filled last parameter first (reverse "
                    f"registration order, frozen ones left out), each closed once it holds "
                    f"{int(cap_mb * 1024 * 1024)} bytes or more (the parameter that reaches "
                    f"the cap stays in it, as in torch's DDP), and launched bucket 0 first "
                    f"send {want_sizes}.")
    with torch.no_grad():                                            # SGD, both wrappers
        for p, q in zip(net.parameters(), theirs_net.parameters()):
            if p.grad is not None:
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
            p.grad, q.grad = None, None
    plain.zero_grad()
    return None


def check_ddp(cls: type | str | None, *, bucket_cap_mb: float | None = None,
              world_sizes: tuple[int, ...] = (2, 3, 4), per_rank: int = 3, steps: int = 3,
              timeout: float = 120.0, strict: bool = False) -> ExerciseResult:
    """Exercise 07: a DDP class whose ``.grad`` holds the average when ``backward()`` returns.

    ``cls(module)`` (or ``cls(module, bucket_cap_mb=...)``) wraps a model that starts with the
    same weights on every rank; calling it runs the model. For each world size, each worker wraps
    five small models (an MLP; one registered in another order than it runs; one with a tied
    weight; one with a frozen layer; one whose branches run in a rank-dependent order) with the
    learner's class and with torch's ``DistributedDataParallel``, takes ``steps`` SGD steps on
    its shard and after every ``loss.backward()`` compares every ``.grad`` with torch's. Also
    required: no all-reduce still running when backward returns, parameters untouched by
    backward, the same all-reduce sizes in the same order on every rank, an all-reduce started
    before the last gradient (overlap), and with ``bucket_cap_mb`` one all-reduce per bucket,
    buckets filled last parameter first, each closed once it reaches the cap.

    ``bucket_cap_mb``: judge a bucketed class with this cap (MiB, as torch counts it);
    ``per_rank``: examples per rank and step; ``steps``: SGD steps per model (a class that works
    once and not twice fails).
    """
    name = "OverlapDDP" if bucket_cap_mb is None else "BucketedDDP"
    if cls is None:
        return verdict(name, None, "write your class to a file and pass it here.", strict)
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        return verdict(name, False, f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}.", strict)
    return check_in_ranks(
        name, cls, "my_ddp:OverlapDDP", _ddp_cases, (per_rank, steps, bucket_cap_mb, 11),
        world_sizes=world_sizes, timeout=timeout, hint=_DDP_HINT,
        hang_hint="Does every rank launch the same all-reduces, and is every one waited for "
                  "(a hook waiting for a gradient that never comes, a frozen parameter?)",
        passed=f"every .grad equals torch's DDP after each of {steps} steps, for world sizes "
               f"{list(world_sizes)} and 5 models (out-of-order registration, tied and frozen "
               f"parameters, rank-dependent order).", strict=strict)
