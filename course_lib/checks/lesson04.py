"""Checkers for the exercises of lesson 04 (training on several devices)."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..devices import cpu_threads, devices
from ._core import ExerciseResult, call_or_failure, check_answer, verdict
from .harness import as_numbers, check_cases, keeps_kernel_state

__all__ = ["check_lr_for_shard_means", "check_scaled_batch", "check_shard_mean_weights",
           "check_train_batch"]


def check_lr_for_shard_means(answer: Any, k: int = 4, lr: float = 0.5, *,
                             strict: bool = False) -> ExerciseResult:
    """Exercise 04: the learning rate that makes per-shard means (k even shards, summed by the
    allreduce) take the one-device step of learning rate ``lr``."""
    return check_answer(f"lr for {k} shard means", answer, lr / k,
                        hint=f"the allreduce adds k = {k} shard means, each about the batch "
                        "mean: k times too large a gradient.", strict=strict)


def check_shard_mean_weights(answer: Any, sizes: tuple[int, ...] = (192, 48, 16), *,
                             strict: bool = False) -> ExerciseResult:
    """Exercise 04: averaging the k shard means of a batch cut into shards of ``sizes``, how many
    times its weight in the batch mean (1/B) does an example of each shard get?

    The answer is one number per shard, B / (k * n_i); each must be within 0.5 % (three digits
    are enough; an expression such as ``256 / (3 * 192)`` is exact).
    """
    name = "weights of the shard means"
    if answer is None:
        return verdict(name, None, "replace None with your answer and run the cell again.",
                       strict)
    k, B = len(sizes), sum(sizes)
    expected = [B / (k * n) for n in sizes]
    got, problem = as_numbers(answer, k, f"one per shard of sizes {list(sizes)}")
    if problem:
        return verdict(name, False, problem, strict)
    for n, g, want in zip(sizes, got, expected):
        if not abs(g - want) <= 5e-3 * want:
            return verdict(name, False, f"got {g:.4g} for the shard of {n}. Each of the {k} shard "
                           f"means weighs its examples 1/{n}, and the average of the {k} "
                           f"means divides by {k}; the batch mean weighs every example 1/{B}.",
                           strict)
    return verdict(name, True, "well done.", strict)


def check_scaled_batch(global_batch: int | None, lr: float | None, steps: int | None, *,
                       per_device: int = 256, k: int = 8, base_lr: float = 0.9,
                       num_examples: int = 60000, strict: bool = False) -> ExerciseResult:
    """Exercise 04: global batch, linearly scaled learning rate and steps per epoch on k
    devices with ``per_device`` examples each (``base_lr`` was right for ``per_device``)."""
    answer = (None if None in (global_batch, lr, steps) else
              (global_batch, round(float(lr), 9), steps))
    want_batch = per_device * k
    expected = (want_batch, round(float(base_lr * k), 9), -(-num_examples // want_batch))
    return check_answer("batch, lr and steps", answer, expected,
                        hint="(global batch, lr, steps per epoch): the batch grows k times, the "
                        "lr with it (linear scaling, the lr to reach after a warm-up), the "
                        "steps shrink; round steps up.", strict=strict)


# ---- exercise: write train_batch -------------------------------------------------------------

_TB_NAME = "train_batch"
_TB_HINT = ("each replica must end the step with the one-device gradient of the whole batch's "
            "mean loss: ask what weight each example's loss gets on its device, what the "
            "devices must exchange, and what a device without a shard contributes; then every "
            "replica takes the same SGD step.")
#: (devices, batch size) of each case: uneven shards, more than two devices, and a batch of 5
#: over 4 devices, where torch.chunk leaves the fourth device without a shard.
_TB_CASES = ((1, 6), (2, 8), (2, 7), (3, 10), (4, 10), (4, 5))


def _tb_variant(params: list[torch.Tensor], X: torch.Tensor, y: torch.Tensor, k: int,
                lr: float, how: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One step on one device: the new parameters and the mean loss before the step. ``how``:
    the whole batch's mean loss (``"batch"``, the oracle), or a popular wrong way: the average
    of the k shard means (``"mean of means"``), or their sum (``"sum of means"``)."""
    from ..models.lenet import lenet

    ref = [p.detach().clone().requires_grad_() for p in params]
    if how == "batch":
        loss = F.cross_entropy(lenet(X, ref), y)
    else:
        chunks = list(zip(torch.chunk(X, k), torch.chunk(y, k)))
        means = sum(F.cross_entropy(lenet(Xi, ref), yi) for Xi, yi in chunks)
        loss = means / len(chunks) if how == "mean of means" else means
    loss.backward()
    with torch.no_grad():
        new = [p - lr * p.grad for p in ref]
        before = F.cross_entropy(lenet(X, params), y)
    return new, before


def _tb_short(t: torch.Tensor) -> str:
    values = ", ".join(f"{v:.6g}" for v in t.detach().flatten()[:3].tolist())
    return f"[{values}, ...]"


def _tb_case(fn: Callable, k: int, B: int, lr: float, seed: int) -> str | None:
    """Two steps of ``fn`` on k devices (two catch stale gradients), LeNet in float64 with
    weights large enough to leave the plateau at once; the first disagreement, or None."""
    from ..models.lenet import init_lenet_params, lenet
    from ..parallel.comm import replicate_params

    devs = devices(k, warn=False)
    params = [p.detach().double().requires_grad_() for p in init_lenet_params(0.1, seed=seed)]
    replicas = replicate_params(params, devs)
    shards = [len(c) for c in torch.chunk(torch.zeros(B), k)]
    where = f"{k} device(s), batch of {B} (shards {shards})"
    g = torch.Generator().manual_seed(seed + B)
    batches = [(torch.rand(B, 1, 28, 28, generator=g, dtype=torch.float64),
                torch.randint(0, 10, (B,), generator=g)) for _ in range(2)]
    for step, (X, y) in enumerate(batches, start=1):
        with torch.no_grad():
            correct = int((lenet(X, params).argmax(dim=1) == y).sum())
        previous = params
        params, before = _tb_variant(params, X, y, k, lr, "batch")
        out, error = call_or_failure(fn, X.to(devs[0]), y.to(devs[0]), replicas, devs, lr,
                                     reraise=NotImplementedError)  # the scaffold: not answered
        if error is not None:
            return f"{where}, step {step}: {error}."
        for i, replica in enumerate(replicas):
            got = [p.detach().cpu() for p in replica]
            if len(got) != len(params) or any(g.shape != w.shape for g, w in zip(got, params)):
                return (f"{where}, step {step}: replica {i} no longer holds LeNet's 8 "
                        "parameters in their shapes; update them in place (sgd does).")
            j = next((j for j, (g, w) in enumerate(zip(got, params)) if not _tb_same([g], [w])),
                     None)
            if j is not None:
                return (f"{where}, step {step}: replica {i}'s parameter {j} after the step: "
                        f"expected {_tb_short(params[j])} (one SGD step on the mean loss of "
                        f"the whole batch, on one device), received {_tb_short(got[j])}."
                        + _tb_diagnose(got, replicas, previous, (X, y, k, lr), step))
        got_loss, got_correct = out if isinstance(out, (tuple, list)) and len(out) == 2 else (
            None, None)
        if got_loss is None:
            return (f"{where}, step {step}: the parameters are right, but the function returned "
                    f"{type(out).__name__}; return (loss, correct): the mean loss of the whole "
                    "batch before the step and the number of correct predictions.")
        if abs(float(got_loss) - float(before)) > 1e-9 * max(1.0, abs(float(before))):
            return (f"{where}, step {step}: the parameters are right, but the returned loss is "
                    f"{float(got_loss):.8g}; expected {float(before):.8g}, the mean "
                    "cross-entropy of the whole batch before the step (the shards' shares "
                    "added up).")
        if int(got_correct) != correct:
            return (f"{where}, step {step}: the returned number correct is {int(got_correct)}; "
                    f"expected {correct} (correct predictions over the whole batch, before the "
                    "step).")
    return None


def _tb_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want))


def _tb_diagnose(got: list[torch.Tensor], replicas: list[list[torch.Tensor]],
                 previous: list[torch.Tensor], batch: tuple, step: int) -> str:
    """Name the popular wrong answer that ``got`` matches, if any (``batch``: X, y, k, lr)."""
    X, y, k, lr = batch
    for how, why in (("mean of means", " That is the step of the average of the shard MEANS: "
                      "right only when every shard has the same size; divide each shard's loss "
                      "sum by the whole B instead."),
                     ("sum of means", " That is the step of the SUM of the shard means: about "
                      "k times the gradient; divide each shard's loss sum by the whole B.")):
        if _tb_same(got, _tb_variant(previous, X, y, k, lr, how)[0]):
            return why
    if _tb_same(got, [w.detach() for w in previous]):
        return " The parameters did not change: was sgd called on every replica?"
    first = [p.detach().cpu() for p in replicas[0]]
    if any(not _tb_same(first, [p.detach().cpu() for p in r]) for r in replicas[1:]):
        return (" The replicas now differ from each other: was every gradient allreduced "
                "before the step, on every device?")
    if step == 2:
        return (" Step 1 was right: were step 1's gradients still in .grad when step 2's "
                "backward added to them?")
    return ""


@keeps_kernel_state
def check_train_batch(fn: Callable | None, *, lr: float = 0.5,
                      cases: tuple[tuple[int, int], ...] = _TB_CASES,
                      strict: bool = False) -> ExerciseResult:
    """Exercise 04: ``fn(X, y, device_params, devices, lr)`` is one data-parallel SGD step.

    The contract of ``course_lib.train.train_batch``: split the batch over the devices, forward
    and backward on each replica, allreduce the gradients, the same SGD step on every replica,
    and return ``(loss, correct)``. For each case (1 to 4 devices; batches of 5 to 10 that the
    device count does not always divide, one leaving a device without a shard) the checker runs
    two steps of LeNet in float64 and compares every replica with the oracle: one device taking
    one SGD step on the mean loss of the whole batch. ``fn`` uses the course's ``lenet`` (None:
    not answered yet); ``lr`` is passed to it; ``cases`` are ``(number of devices, batch size)``
    pairs; ``strict`` raises ``AssertionError`` on a wrong answer. Returns the verdict (truthy
    when right); the first failing case is printed.
    """
    # Tiny tensors: one intra-op thread is faster, and does not stall on a loaded machine. The
    # batch of 5 over 4 devices is meant to leave a device idle: no warning about it here.
    with cpu_threads(1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="split_batch", category=UserWarning)
        return check_cases(
            _TB_NAME, fn, [(k, B, lr, seed) for seed, (k, B) in enumerate(cases)], _tb_case,
            missing="define train_batch(X, y, device_params, devices, lr) and pass it here.",
            expected="a function", hint=_TB_HINT, strict=strict,
            passed=f"every replica equals one device's step on the whole batch for (devices, "
                   f"batch) in {list(cases)}, two steps each.")
