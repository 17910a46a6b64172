"""Checkers for the exercises of lesson 09 (surviving failures).

Worker processes import the learner's class by module and name, so it must live in a file (in
the notebook: a cell starting with ``%%writefile my_syncbn.py``). An answer left None is "not
answered yet"; ``strict``: raise ``AssertionError`` on a wrong answer. Each checker returns the
verdict (truthy when right) and prints the first failing case.
"""
from __future__ import annotations

import io
import random
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from ._core import ExerciseResult, call_bounded, failure, verdict
from .harness import UNANSWERED, agree, check_cases, check_in_ranks, load_answer

__all__ = ["check_resume", "check_syncbn"]

# ---- check_syncbn --------------------------------------------------------------------------------

_BN_HINT = ("forward: combine each channel's count, mean and centred sum of squares over the "
            "ranks (an all-gather; all-reducing [count, sum x, sum x^2] also passes here but "
            "loses precision when the mean is large against the spread), normalise with the "
            "global mean and biased variance, update running_var with the unbiased one "
            "(times n / (n - 1), n the global count); backward: all-reduce each channel's "
            "[sum dy, sum dy * xhat] and use them, divided by the global count, in dx; the "
            "weight and bias gradients stay this rank's sums (DDP combines them).")
#: world size -> examples per rank: uneven shards
_SHARDS = {2: [5, 3], 3: [5, 3, 8], 4: [5, 3, 8, 2]}
_C = 3                              # channels; inputs are (N, C, 2, 2)
_DIMS, _SHAPE = (0, 2, 3), (1, -1, 1, 1)  # the dims a channel's statistic covers; its view


def _close(a: torch.Tensor | None, b: torch.Tensor) -> bool:    # float64 throughout
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-7, atol=1e-9)


def _normalise(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, w: torch.Tensor,
               b: torch.Tensor) -> torch.Tensor:
    """w * (x - mean) / sqrt(var + eps) + b, per channel of (N, C, H, W)."""
    return ((x - mean.view(_SHAPE)) * torch.rsqrt(var.view(_SHAPE) + 1e-5) * w.view(_SHAPE)
            + b.view(_SHAPE))


def _bn_forward_hint(out: torch.Tensor, xs: list[torch.Tensor], rank: int, w, b) -> str:
    """Name the popular wrong forward that ``out`` equals, if any."""
    x = xs[rank]
    local = _normalise(x, x.mean(_DIMS), x.var(_DIMS, unbiased=False), w, b)
    means = torch.stack([t.mean(_DIMS) for t in xs])                     # (k, C)
    variances = torch.stack([t.var(_DIMS, unbiased=False) for t in xs])  # (k, C)
    squares = torch.stack([(t * t).mean(_DIMS) for t in xs])             # (k, C)
    m = means.mean(0)
    unweighted = [_normalise(x, m, variances.mean(0), w, b),
                  _normalise(x, m, squares.mean(0) - m * m, w, b)]
    whole = torch.cat(xs)
    n = whole.numel() // _C
    unbiased = _normalise(x, whole.mean(_DIMS), whole.var(_DIMS, unbiased=False) * n / (n - 1),
                          w, b)
    if _close(out, local):
        return (" It is BatchNorm on this rank's shard alone: the statistics were not "
                "combined over the ranks.")
    if any(_close(out, u) for u in unweighted):
        return (" It uses the plain mean of the ranks' means (and variances): the shards differ "
                "in size, so combine counts and sums, not means.")
    if _close(out, unbiased):
        return (" It normalises with the unbiased variance: BatchNorm normalises with the "
                "biased one (divide by n) and keeps the unbiased one only in running_var.")
    return ""


def _bn_backward_hint(dx: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, mean, var, w,
                      n_global: int) -> str:
    """Name the popular wrong input gradient that ``dx`` equals, if any."""
    invstd = torch.rsqrt(var + 1e-5).view(_SHAPE)
    xhat = (x - mean.view(_SHAPE)) * invstd
    scale = invstd * w.view(_SHAPE)
    n_local = x.numel() // _C
    constants = scale * dy
    local = [scale * (dy - (dy.sum(_DIMS) / count).view(_SHAPE)
                      - xhat * ((dy * xhat).sum(_DIMS) / count).view(_SHAPE))
             for count in (n_local, n_global)]
    if _close(dx, constants):
        return (" It treats the mean and the variance as constants: every example of the "
                "global batch moved them, so dx has two more terms.")
    if any(_close(dx, t) for t in local):
        return (" It uses this rank's sum(dy) and sum(dy * xhat) only: all-reduce them in "
                "backward, as the forward all-reduced the statistics.")
    return ""


def _syncbn_cases(spec, steps: int, seed: int) -> str | None:
    """In every rank: ``steps`` training steps of the learner's layer on uneven shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, error = load_answer(spec, "class")
    if error:
        return error
    try:
        mine = cls(_C).double().train()
        reference = nn.BatchNorm2d(_C).double().train()    # one process, the global batch
    except NotImplementedError:
        return UNANSWERED
    except Exception as e:
        return f"rank {rank}: could not build {_C} channels: {type(e).__name__}: {e}"
    sizes = _SHARDS.get(world, [(3 + 2 * r) % 7 + 2 for r in range(world)])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.rand(_C, generator=g, dtype=torch.float64) + 0.5
        b = torch.randn(_C, generator=g, dtype=torch.float64)
        for layer in (mine, reference):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    failure_text = None
    biased_var = torch.ones(_C, dtype=torch.float64)
    for step in range(steps):
        where = f"world_size={world}, shards of {sizes} examples, rank {rank}, step {step + 1}"
        xs = [torch.randn(s, _C, 2, 2, generator=g, dtype=torch.float64) * 2 + 3
              for s in sizes]                                 # (n_r, C, 2, 2) per rank
        dys = [torch.randn_like(x) for x in xs]
        for p in (mine.weight, mine.bias, reference.weight, reference.bias):
            p.grad = None
        whole = torch.cat(xs).requires_grad_()                # (N, C, 2, 2) the global batch
        want = reference(whole)
        want.backward(torch.cat(dys))
        mine_rows = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        x = xs[rank].clone().requires_grad_()
        try:
            out = mine(x)
            out.backward(dys[rank])
        except NotImplementedError:
            failure_text = UNANSWERED
        except Exception as e:
            failure_text = f"{where}: raised {type(e).__name__}: {' '.join(str(e).split())}"
        if failure_text is None:
            nan = torch.full_like(w, float("nan"))
            grads = torch.stack([nan if p.grad is None else p.grad
                                 for p in (mine.weight, mine.bias)])    # (2, C)
            dist.all_reduce(grads)                            # DDP's job: combine the ranks'
            mean, var = whole.detach().mean(_DIMS), whole.detach().var(_DIMS, unbiased=False)
            biased_var = 0.9 * biased_var + 0.1 * var    # running_var, had it kept the biased
            got, expected = out.detach(), want.detach()[mine_rows]
            if not _close(got, expected):
                failure_text = (f"{where}: the output differs from BatchNorm2d on the global "
                                f"batch (largest difference {(got - expected).abs().max():.2e})."
                                + _bn_forward_hint(got, xs, rank, w, b))
            elif not _close(x.grad, whole.grad[mine_rows]):
                hint = "" if x.grad is None else _bn_backward_hint(
                    x.grad, xs[rank], dys[rank], mean, var, w, whole.numel() // _C)
                failure_text = (f"{where}: the input gradient differs from BatchNorm2d's on "
                                f"the global batch.{hint}")
            elif not (_close(grads[0], reference.weight.grad)
                      and _close(grads[1], reference.bias.grad)):
                times = "" if not _close(grads[0], world * reference.weight.grad) else (
                    f" Summed over the ranks they are {world} times too large: leave them as "
                    f"this rank's sums (DDP averages them, as every other gradient).")
                failure_text = (f"{where}: the weight and bias gradients, summed over the "
                                f"ranks, differ from BatchNorm2d's on the global batch.{times}")
            elif not _close(mine.running_mean, reference.running_mean):
                failure_text = (f"{where}: running_mean {mine.running_mean.tolist()}, expected "
                                f"{reference.running_mean.tolist()} (momentum 0.1 towards the "
                                f"global mean).")
            elif not _close(mine.running_var, reference.running_var):
                hint = (" It moved towards the biased variance: running_var keeps the unbiased "
                        "one, var * n / (n - 1), n the global count."
                        if _close(mine.running_var, biased_var) else "")
                failure_text = (f"{where}: running_var {mine.running_var.tolist()}, expected "
                                f"{reference.running_var.tolist()}.{hint}")
        failure_text = agree(failure_text)                    # every rank stops, or none
        if failure_text is not None:
            return failure_text
    return None


def check_syncbn(cls: type | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                 steps: int = 2, timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise 09: ``cls(num_features)`` normalises over the global batch of all ranks.

    For each world size, a process group of that many worker processes, with shards of
    different sizes (5 and 3 examples; 5, 3 and 8), inputs (n_r, 3, 2, 2) in float64. Each rank
    runs the learner's layer (``.double()``, training mode, weight and bias set) on its shard,
    forward and backward, for ``steps`` steps, and compares with one ``nn.BatchNorm2d`` on the
    whole batch: this rank's rows of the output and of the input gradient, the weight and bias
    gradients summed over the ranks (as DDP combines them), and the running statistics.

    ``cls``: the learner's class, importable by worker processes, or ``"module:Class"``.
    ``steps``: training steps (the running statistics move twice); ``timeout``: seconds for each
    world size (a layer that hangs fails, it does not hang).
    """
    return check_in_ranks(
        "SyncBatchNorm", cls, "my_syncbn:SyncBatchNorm", _syncbn_cases, (steps, 3),
        world_sizes=world_sizes, timeout=timeout, hint=_BN_HINT,
        hang_hint="Does every rank call the same collectives, in the same order, in forward "
                  "and in backward?",
        passed=f"output, gradients and running statistics equal BatchNorm2d's on the global "
               f"batch, on uneven shards, for world sizes {list(world_sizes)}.",
        missing="write your SyncBatchNorm class to a file and pass it here.", strict=strict)


# ---- check_resume --------------------------------------------------------------------------------

_RESUME_HINT = ("capture: model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), "
                "the epoch, torch.get_rng_state() and random.getstate(); restore: load each "
                "back (torch.set_rng_state, random.setstate) and return the epoch.")
_N, _BATCH, _EPOCHS = 40, 5, 4


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A small classifier with dropout, SGD with momentum, a step schedule."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, start: int, end: int) -> None:
    """Epochs start .. end - 1 as rank 1 of 2 sees them: sampler, dropout, a random shift."""
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(_N, 6, generator=g), torch.randint(0, 3, (_N,), generator=g)
    sampler = DistributedSampler(range(_N), num_replicas=2, rank=1, shuffle=True, seed=3)
    model.train()
    for epoch in range(start, end):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order), _BATCH):
            batch = order[i:i + _BATCH]
            shift = random.random() * 0.1                 # Python's RNG: a data augmentation
            loss = F.cross_entropy(model(X[batch] + shift), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()


def _snapshot(model, optimizer, scheduler) -> dict:
    """Everything the rest of the run depends on, copied."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "momentum": [optimizer.state[p]["momentum_buffer"].clone()
                         for p in model.parameters() if p in optimizer.state],
            "lr": scheduler.get_last_lr(), "last_epoch": scheduler.last_epoch,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}


def _resume_hint(got: dict, want: dict, epoch: int, start) -> str:
    """Which piece of the state did not come back."""
    if start != epoch:
        return (f"restore returned {start!r}, expected {epoch} (the epochs done): the sampler's "
                f"order comes from set_epoch(epoch), so the epoch must come back too.")
    if any(not torch.equal(got["model"][k], v) for k, v in want["model"].items()):
        return "the model's weights did not come back (load model.state_dict())."
    if (len(got["momentum"]) != len(want["momentum"])
            or any(not torch.equal(a, b) for a, b in zip(got["momentum"], want["momentum"]))):
        return ("the optimizer's momentum buffers did not come back (save and load "
                "optimizer.state_dict()).")
    if got["last_epoch"] != want["last_epoch"] or got["lr"] != want["lr"]:
        return (f"the schedule did not come back: its step {got['last_epoch']} and learning "
                f"rate {got['lr']}, expected {want['last_epoch']} and {want['lr']} (save and "
                f"load scheduler.state_dict()).")
    if not torch.equal(got["torch_rng"], want["torch_rng"]):
        return ("torch's random state did not come back: dropout draws other masks (save "
                "torch.get_rng_state(), restore with torch.set_rng_state; on GPUs also "
                "torch.cuda.get_rng_state_all()).")
    if got["python_rng"] != want["python_rng"]:
        return ("Python's random state did not come back: the data augmentation draws other "
                "values (random.getstate() / random.setstate()).")
    return "the state after restore matched; what differs came later."


def _resume_failure(capture: Callable, restore: Callable, stop_at: int) -> str | None:
    """Stop after ``stop_at`` epochs, restore into fresh objects, finish; compare bitwise."""
    runs = []
    for end in (_EPOCHS, stop_at):                     # the uninterrupted run, the stopped one
        random.seed(0)
        model, optimizer, scheduler = _build(0)
        _train(model, optimizer, scheduler, 0, end)
        runs.append(_snapshot(model, optimizer, scheduler))
    reference, at_stop = runs
    where = f"stopped after epoch {stop_at} of {_EPOCHS}"
    try:
        state = call_bounded(capture, model, optimizer, scheduler, stop_at)
        buffer = io.BytesIO()
        torch.save(state, buffer)                      # as to a file: no live references
    except NotImplementedError:
        raise
    except Exception as e:
        return f"{where}: capture {failure(e)}"
    torch.manual_seed(12345)                           # a new process: other random states
    random.seed(12345)
    model, optimizer, scheduler = _build(1)            # ... and other initial weights
    try:
        buffer.seek(0)
        start = call_bounded(restore, torch.load(buffer, weights_only=False), model, optimizer,
                             scheduler)
    except NotImplementedError:
        raise
    except Exception as e:
        return f"{where}: restore {failure(e)}"
    restored = _snapshot(model, optimizer, scheduler)
    try:
        _train(model, optimizer, scheduler, int(start), _EPOCHS)
    except Exception as e:
        return f"{where}: training after restore raised {type(e).__name__}: {e}"
    end = _snapshot(model, optimizer, scheduler)
    same = (all(torch.equal(end["model"][k], v) for k, v in reference["model"].items())
            and all(torch.equal(a, b) for a, b in zip(end["momentum"], reference["momentum"])))
    if not same:
        return (f"{where}, restored into a fresh model: the end of the run is not bitwise the "
                f"uninterrupted run's: {_resume_hint(restored, at_stop, stop_at, start)}")
    return None


def check_resume(capture: Callable | None, restore: Callable | None, *,
                 stops: tuple[int, ...] = (1, 3), strict: bool = False) -> ExerciseResult:
    """Exercise 09: a checkpoint that resumes a run bitwise.

    ``capture(model, optimizer, scheduler, epoch) -> dict`` returns what to save after
    ``epoch`` epochs; ``restore(state, model, optimizer, scheduler) -> int`` puts it back into
    freshly built objects and returns the number of epochs done (the next epoch to run). The
    checker trains a small model with dropout, SGD with momentum, a step schedule, a shuffled
    ``DistributedSampler`` (with ``set_epoch``) and a random shift drawn from Python's
    ``random``; it stops after each epoch of ``stops``, saves the state (``torch.save``),
    scrambles the random states, builds new objects from another seed, restores, finishes, and
    requires the final weights and momentum buffers to be bitwise the uninterrupted run's.

    ``stops``: the epochs (of 4) after which the run is stopped.
    """
    if capture is None or restore is None:
        return verdict("resume", None, "write capture(...) and restore(...) and pass both here.",
                       strict)
    if not callable(capture) or not callable(restore):
        return verdict("resume", False, "expected two functions, capture and restore.", strict)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    try:
        return check_cases(
            "resume", capture, [(restore, stop) for stop in stops], _resume_failure, missing="",
            expected="", hint=_RESUME_HINT, strict=strict,
            passed=f"stopped after epochs {list(stops)} of {_EPOCHS} and resumed into fresh "
                   f"objects: bitwise the uninterrupted run.")
    finally:  # the notebook's own random streams, as they were
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
