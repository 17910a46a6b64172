"""Checkers for exercises and homework: tell the learner whether an answer is right, and why not.

Every checker takes the learner's answer (a value or a function), compares it with the course's
own computation (the oracle), prints a one-line verdict and returns True or False. An answer left
as ``None`` is reported as "not answered yet" instead of failing, so notebooks that ship with open
exercises still run top to bottom. Pass ``strict=True`` to raise ``AssertionError`` on a wrong
answer (what an autograder wants).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ExerciseResult", "check_answer", "check_function",
    "check_try_all_gpus",                                     # notebook 00
    "check_accuracy_fn", "check_sgd_fn",                      # 01
    "check_allreduce_fn", "check_ring_sends", "ring_sends",   # 02
    "check_balanced_sizes", "check_devices_used",             # 03
    "check_lr_for_shard_means", "check_scaled_batch",         # 04
    "check_bn_examples_seen", "check_module_calls",           # 05
    "check_tree_rounds", "tree_rounds", "check_elements_sent", "elements_sent",  # 06
]


class ExerciseResult:
    """The verdict of a check: truthy when correct; its repr is the message."""

    def __init__(self, name: str, ok: bool | None, message: str):
        self.name, self.ok, self.message = name, ok, message

    def __bool__(self) -> bool:
        return bool(self.ok)

    def __repr__(self) -> str:
        mark = {True: "correct", False: "not yet right", None: "not answered yet"}[self.ok]
        return f"[{self.name}] {mark}: {self.message}"

    def _ipython_display_(self) -> None:
        """Show nothing as a cell's last value: the check printed its verdict when it ran."""


def _verdict(name: str, ok: bool | None, message: str, strict: bool) -> ExerciseResult:
    result = ExerciseResult(name, ok, message)
    print(repr(result))
    if strict and not ok:
        raise AssertionError(repr(result))
    return result


def check_answer(name: str, answer: Any, expected: Any, *, hint: str = "",
                 strict: bool = False) -> ExerciseResult:
    """Compare a value (number, list, tensor) with the expected one."""
    if answer is None:
        return _verdict(name, None, "replace None with your answer and run the cell again.", strict)
    try:
        if isinstance(expected, torch.Tensor) or isinstance(answer, torch.Tensor):
            torch.testing.assert_close(torch.as_tensor(answer), torch.as_tensor(expected),
                                       check_dtype=False)
            ok = True
        elif isinstance(expected, float):
            ok = abs(float(answer) - expected) <= 1e-6 * max(1.0, abs(expected))
        else:
            ok = answer == expected
    except (AssertionError, TypeError, ValueError, RuntimeError):
        ok = False
    message = "well done." if ok else f"got {answer!r}. {hint}".strip()
    return _verdict(name, ok, message, strict)


def check_function(name: str, fn: Callable | None, oracle: Callable,
                   cases: list[tuple], *, hint: str = "", strict: bool = False) -> ExerciseResult:
    """Call ``fn(*case)`` and ``oracle(*case)`` on each case; the results must match."""
    if fn is None:
        return _verdict(name, None, "define your function and pass it here.", strict)
    for case in cases:
        want = oracle(*case)
        try:
            got = fn(*case)
        except Exception as exc:  # the learner's code raised: show what and on which input
            return _verdict(name, False, f"raised {type(exc).__name__}: {exc} on input "
                            f"{_short(case)}. {hint}".strip(), strict)
        try:
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want)
            elif isinstance(want, (list, tuple)) and want and isinstance(want[0], torch.Tensor):
                if len(got) != len(want):
                    raise AssertionError(f"expected {len(want)} tensors, got {len(got)}")
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w)
            elif got != want:
                raise AssertionError(f"expected {want!r}, got {got!r}")
        except (AssertionError, TypeError) as exc:
            return _verdict(name, False, f"on input {_short(case)}: {exc}. {hint}".strip(), strict)
    return _verdict(name, True, f"matches the course's answer on {len(cases)} inputs.", strict)


def _short(case: tuple) -> str:
    parts = [f"tensor{tuple(c.shape)}" if isinstance(c, torch.Tensor) else repr(c) for c in case]
    return "(" + ", ".join(parts) + ")"


# ---- notebook 00 -------------------------------------------------------------------------------

def check_try_all_gpus(fn: Callable[[], list] | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 00: your ``try_all_gpus`` must return every GPU, or ``[cpu]``; never ``[]``."""
    from .devices import try_all_gpus

    return check_function("try_all_gpus", fn, try_all_gpus, [()],
                          hint="On a CPU-only machine the answer is [device('cpu')], not [].",
                          strict=strict)


# ---- notebook 01 -------------------------------------------------------------------------------

def check_accuracy_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(y_hat, y)`` returns the number of correct predictions."""
    from .train import accuracy

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(n, 10, generator=g), torch.randint(0, 10, (n,), generator=g))
             for n in (1, 7, 256)]
    return check_function("accuracy", fn, lambda a, b: accuracy(a, b), cases,
                          hint="argmax over the class dimension, compare with y, count.",
                          strict=strict)


def check_sgd_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(params, lr)`` updates in place like ``course_lib.lenet.sgd``."""
    from .lenet import sgd

    if fn is None:
        return _verdict("sgd", None, "define your function and pass it here.", strict)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 4, generator=g).requires_grad_(), torch.randn(4, generator=g)
              .requires_grad_()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    mine = [p.detach().clone().requires_grad_() for p in params]
    for p, q in zip(mine, params):
        p.grad = q.grad.clone()
    sgd(params, 0.1)
    with torch.enable_grad():
        try:
            fn(mine, 0.1)
        except Exception as exc:
            return _verdict("sgd", False, f"raised {type(exc).__name__}: {exc}", strict)
    for p, q in zip(mine, params):
        if not torch.allclose(p.detach(), q.detach()):
            return _verdict("sgd", False, "the parameters after your step differ from "
                            "p - lr * p.grad (did you update in place under torch.no_grad()?)",
                            strict)
    if any(p.grad is not None and torch.count_nonzero(p.grad) for p in mine):
        return _verdict("sgd", False, "the step is right but the gradients were not zeroed.",
                        strict)
    return _verdict("sgd", True, "same parameters as the course's sgd, gradients zeroed.", strict)


def _quiet_devices(n: int) -> list:
    """``devices(n)`` without its warning about repeated devices (the checker knows)."""
    import warnings

    from .devices import devices

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return devices(n)


# ---- notebook 02 -------------------------------------------------------------------------------

def check_allreduce_fn(fn: Callable | None, *, device_counts: tuple[int, ...] = (1, 2, 4, 8),
                       strict: bool = False) -> ExerciseResult:
    """Exercise 02: ``fn(tensors)`` is an in-place allreduce for each number of devices."""
    from .comm import check_allreduce

    name = getattr(fn, "__name__", "allreduce")
    if fn is None:
        return _verdict(name, None, "define your function and pass it here.", strict)
    for n in device_counts:
        try:
            check_allreduce(fn, _quiet_devices(n))
        except Exception as exc:  # the check's AssertionError, or the learner's code raising
            return _verdict(name, False, f"with {n} device(s): {type(exc).__name__}: {exc}",
                            strict)
    return _verdict(name, True, f"every tensor holds the sum, for {list(device_counts)} "
                    "devices.", strict)


def ring_sends(numel: int, n: int) -> list[int]:
    """Elements each device sends in ``comm.ring_allreduce`` of ``numel`` elements over n."""
    from .comm import ring_chunk_bounds

    size = [end - start for start, end in ring_chunk_bounds(numel, n)]
    # step s of 2 (n - 1): device i sends chunk (i - s) mod n to its right neighbour
    return [sum(size[(i - s) % n] for s in range(2 * (n - 1))) for i in range(n)]


def check_ring_sends(sent: list[int] | None, n: int = 4, numel: int = 1000, *,
                     strict: bool = False) -> ExerciseResult:
    """Exercise 02: the elements each of ``n`` devices sends in a ring allreduce of ``numel``."""
    expected = ring_sends(numel, n)
    return check_answer("ring traffic", None if sent is None else [int(s) for s in sent],
                        expected, hint=f"each device sends 2 (n - 1) = {2 * (n - 1)} chunks of "
                        f"about numel / n = {numel / n:g} elements.", strict=strict)


# ---- notebook 03 -------------------------------------------------------------------------------

def check_balanced_sizes(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 03: ``fn(B, n)`` gives n shard sizes summing to B, each B // n or B // n + 1."""
    if fn is None:
        return _verdict("balanced_sizes", None, "define your function and pass it here.", strict)
    for B, n in [(5, 4), (9, 8), (17, 8), (256, 3), (7, 7), (8, 1), (250, 4)]:
        try:
            sizes = [int(s) for s in fn(B, n)]
        except Exception as exc:
            return _verdict("balanced_sizes", False, f"raised {type(exc).__name__}: {exc} on "
                            f"B={B}, n={n}.", strict)
        ok = len(sizes) == n and sum(sizes) == B and set(sizes) <= {B // n, B // n + 1}
        if not ok:
            return _verdict("balanced_sizes", False, f"balanced_sizes({B}, {n}) = {sizes}: "
                            f"expected {n} sizes, each {B // n} or {B // n + 1}, summing to {B}.",
                            strict)
    return _verdict("balanced_sizes", True, "every device gets B // n or B // n + 1 examples, on "
                    "7 inputs.", strict)


def check_devices_used(B: int, n: int, answer: int | None, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 03: how many of n devices get work when ``comm.scatter`` splits a batch of B."""
    from .comm import scatter

    used = len(scatter(torch.zeros(B), [torch.device("cpu")] * n))
    return check_answer(f"B={B} over {n} devices", answer, used,
                        hint="torch.chunk makes chunks of ceil(B / n) examples; count how many "
                        "the batch fills.", strict=strict)


# ---- notebook 04 -------------------------------------------------------------------------------

def check_lr_for_shard_means(answer: Any, k: int = 4, lr: float = 0.5, *,
                             strict: bool = False) -> ExerciseResult:
    """Exercise 04: the learning rate that makes per-shard means (k even shards, summed by the
    allreduce) take the one-device step of learning rate ``lr``."""
    return check_answer(f"lr for {k} shard means", answer, lr / k,
                        hint=f"the allreduce adds k = {k} shard means, each about the batch "
                        "mean: k times too large a gradient.", strict=strict)


def check_scaled_batch(global_batch: int | None, lr: float | None, steps: int | None, *,
                       per_device: int = 256, k: int = 8, base_lr: float = 0.9,
                       num_examples: int = 60000, strict: bool = False) -> ExerciseResult:
    """Exercise 04: global batch, linearly scaled learning rate and steps per epoch on k
    devices with ``per_device`` examples each (``base_lr`` was right for ``per_device``)."""
    answer = None if None in (global_batch, lr, steps) else (global_batch, float(lr), steps)
    want_batch = per_device * k
    expected = (want_batch, float(base_lr * k), -(-num_examples // want_batch))
    if answer is not None:
        answer = (answer[0], round(answer[1], 9), answer[2])
        expected = (expected[0], round(expected[1], 9), expected[2])
    return check_answer("batch, lr and steps", answer, expected,
                        hint="(global batch, lr, steps per epoch): the batch grows k times, the "
                        "lr with it (linear scaling), the steps shrink; round steps up.",
                        strict=strict)


# ---- notebook 05 -------------------------------------------------------------------------------

def check_bn_examples_seen(answer: int | None, batch: int = 7, n: int = 3, *,
                           strict: bool = False) -> ExerciseResult:
    """Exercise 05: examples a batch-norm layer's running statistics see in one train-mode
    forward of ``batch`` examples through ``DataParallel`` over n devices (replica 0's shard)."""
    seen = torch.chunk(torch.zeros(batch), n)[0].shape[0]
    return check_answer("BN examples seen", answer, seen,
                        hint="only replica 0 shares the module's buffers; torch.chunk gives its "
                        "shard.", strict=strict)


def check_module_calls(answer: int | None, batch: int = 1, n: int = 2, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 05: calls of the module by ``DataParallel(net, devices(n))`` on a batch of
    ``batch`` examples, counted with a forward hook."""
    from .data_parallel import DataParallel
    from .lenet import LeNet

    devs = _quiet_devices(n)
    net = LeNet().to(devs[0])
    calls: list[int] = []
    net.register_forward_hook(lambda module, inputs, output: calls.append(1))
    with torch.no_grad():
        DataParallel(net, devs)(torch.rand(batch, 1, 28, 28, device=devs[0]))
    return check_answer("module calls", answer, len(calls),
                        hint="scatter cannot split one example over two devices.", strict=strict)


# ---- notebook 06 -------------------------------------------------------------------------------

def tree_rounds(p: int) -> int:
    """Rounds of ``dist.tree_broadcast`` for p ranks: its loop, run without sending."""
    step, rounds = 1, 0
    while step < p:
        step, rounds = step * 2, rounds + 1
    return rounds


def check_tree_rounds(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(p)`` is the number of rounds ``tree_broadcast`` needs for p ranks."""
    return check_function("rounds", fn, tree_rounds, [(p,) for p in range(1, 17)] + [(1000,)],
                          hint="the number of ranks holding the data doubles every round.",
                          strict=strict)


def elements_sent(n: int, p: int, rank: int = 0) -> int:
    """Elements rank ``rank`` sends in ``dist.ring_allreduce`` of n elements over p ranks."""
    bounds = [i * n // p for i in range(p + 1)]  # the chunk boundaries ring_allreduce uses
    # step s of 2 (p - 1): the rank sends chunk (rank - s) mod p to its right neighbour
    return sum(bounds[(rank - s) % p + 1] - bounds[(rank - s) % p] for s in range(2 * (p - 1)))


def check_elements_sent(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(n, p, rank)`` is what that rank sends in ``dist.ring_allreduce``."""
    cases = [(n, p, r) for n, p in [(10, 2), (1000, 4), (7, 3), (2, 4), (10**6, 8)]
             for r in range(p)]
    return check_function("elements_sent", fn, elements_sent, cases,
                          hint="2 (p - 1) steps; in step s the rank sends chunk (rank - s) mod p, "
                          "chunk c spanning [c n // p, (c + 1) n // p).", strict=strict)
