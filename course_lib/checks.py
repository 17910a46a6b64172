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

__all__ = ["check_answer", "check_function", "check_try_all_gpus", "check_accuracy_fn",
           "check_sgd_fn", "ExerciseResult"]


class ExerciseResult:
    """The verdict of a check: truthy when correct; its repr is the message."""

    def __init__(self, name: str, ok: bool | None, message: str):
        self.name, self.ok, self.message = name, ok, message

    def __bool__(self) -> bool:
        return bool(self.ok)

    def __repr__(self) -> str:
        mark = {True: "correct", False: "not yet right", None: "not answered yet"}[self.ok]
        return f"[{self.name}] {mark}: {self.message}"


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
