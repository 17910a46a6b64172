"""Checkers for the exercises of lesson 01 (functional LeNet): the network, sgd, accuracy, the
plateau."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._core import (
    ExerciseResult,
    _short,
    call_bounded,
    check_function,
    failure,
    unanswered,
    verdict,
)

__all__ = ["check_accuracy_fn", "check_initial_loss", "check_lenet_fn", "check_sgd_fn"]


def check_lenet_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(X, params)`` gives the logits of ``nn.Module`` LeNet with those weights.

    The oracle is ``course_lib.models.lenet.LeNet`` (``nn.Conv2d``, ``nn.Linear``) holding the
    same eight tensors, on random images, in float64, for batches of 1 and 5 and two seeds.
    """
    from ..models.lenet import LeNet, init_lenet_params

    g = torch.Generator().manual_seed(0)
    cases = []
    for seed, n in ((0, 1), (1, 5)):
        params = [p.detach().double() for p in init_lenet_params(seed=seed)]
        cases.append((torch.rand(n, 1, 28, 28, generator=g, dtype=torch.float64), params))

    def oracle(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return LeNet.from_params(params).double()(X)

    return check_function("lenet", fn, oracle, cases,
                          hint="conv -> ReLU -> 2x2 average pool, twice; flatten; "
                               "X @ W3 + b3 -> ReLU; X @ W4 + b4 (no ReLU on the logits).",
                          strict=strict)

def check_accuracy_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(y_hat, y)`` returns the number of correct predictions.

    The oracle is the course's ``accuracy`` (PyTorch has no accuracy function of its own). The
    count must be a Python ``int``: a 0-d tensor (``(...).sum()`` without ``int()``) is refused,
    for counts from several devices are added in Python.
    """
    from ..train import accuracy

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(n, 10, generator=g), torch.randint(0, 10, (n,), generator=g))
             for n in (1, 7, 256)]
    hint = "argmax over the class dimension, compare with y, count."
    if fn is not None:   # the type first, on one case (check_function compares values only)
        try:
            got = call_bounded(fn, *cases[1])
        except KeyboardInterrupt:
            raise
        except NotImplementedError:
            return unanswered("accuracy", strict)
        except BaseException as exc:  # noqa: B036 - reported, never raised
            return verdict("accuracy", False, f"{failure(exc)} on input {_short(cases[1])}. "
                           f"{hint}", strict)
        if not isinstance(got, int) or isinstance(got, bool):
            return verdict("accuracy", False, f"expected a Python int, got {type(got).__name__}"
                           f" ({got!r}): wrap the count in int(...).", strict)
    return check_function("accuracy", fn, lambda a, b: accuracy(a, b), cases, hint=hint,
                          strict=strict)


def check_sgd_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(params, lr)`` updates in place like ``torch.optim.SGD``, then zeroes.

    The oracle is ``torch.optim.SGD(params, lr).step()`` (no momentum, no weight decay) on a copy
    of the same random parameters and gradients, in float64.
    """
    if fn is None:
        return verdict("sgd", None, "define your function and pass it here.", strict)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(),
              torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    mine = [p.detach().clone().requires_grad_() for p in params]
    for p, q in zip(mine, params):
        p.grad = q.grad.clone()
    passed = list(mine)          # the caller's list: its tensors must change, not be replaced
    torch.optim.SGD(params, lr=0.1).step()           # the oracle: PyTorch's own step
    with torch.enable_grad():
        try:
            call_bounded(fn, mine, 0.1)
        except KeyboardInterrupt:
            raise
        except NotImplementedError:
            return unanswered("sgd", strict)
        except BaseException as exc:  # noqa: B036 - reported, never raised
            return verdict("sgd", False, failure(exc), strict)
    if any(a is not b for a, b in zip(mine, passed)) or len(mine) != len(passed):
        return verdict("sgd", False, "your step replaced tensors in the list with new ones; "
                       "whoever else holds the parameters (a model, a training loop) would not "
                       "see the update. Update each tensor in place (p -= ...) under "
                       "torch.no_grad().", strict)
    for p, q in zip(mine, params):
        if not torch.allclose(p.detach(), q.detach()):
            return verdict("sgd", False, "the parameters after your step differ from "
                            "torch.optim.SGD's p - lr * p.grad (did you update in place under "
                            "torch.no_grad()?)", strict)
    if any(p.grad is not None and torch.count_nonzero(p.grad) for p in mine):
        return verdict("sgd", False, "the step is right but the gradients were not zeroed.",
                        strict)
    return verdict("sgd", True, "same parameters as torch.optim.SGD's step, gradients zeroed.",
                   strict)


def check_initial_loss(answer: float | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: the mean cross-entropy of LeNet at d2l's initialisation (normal times 0.01).

    Judged against the loss measured on random images for three seeds (all within 1e-3 of
    ln 10 = 2.3026: the logits start near zero); an answer within 0.01 of it is right.
    """
    import torch.nn.functional as F

    from ..models.lenet import init_lenet_params, lenet

    name = "initial loss"
    if answer is None:
        return verdict(name, None, "replace None with your answer and run the cell again.",
                       strict)
    g = torch.Generator().manual_seed(0)
    X, y = torch.rand(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
    with torch.no_grad():
        losses = [float(F.cross_entropy(lenet(X, init_lenet_params(scale=0.01, seed=s)), y))
                  for s in range(3)]
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return verdict(name, False, f"expected a number, got {answer!r}.", strict)
    if all(abs(value - loss) <= 0.01 for loss in losses):
        measured = ", ".join(f"{v:.4f}" for v in losses)
        return verdict(name, True, f"the measured losses are {measured}: logits near zero, "
                       "every class equally likely.", strict)
    return verdict(name, False, f"got {value:.4g}. Hint: with logits near zero, what probability "
                   "does the softmax give the right class, and what is minus its log?", strict)
