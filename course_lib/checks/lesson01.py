"""Checkers for the exercises of lesson 01 (functional LeNet): the network, sgd, accuracy, the
arithmetic of one step, the first loss."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ._core import ExerciseResult, _short, call_or_verdict, check_function, verdict

__all__ = ["check_accuracy_fn", "check_initial_loss", "check_lenet_fn", "check_sgd_fn",
           "check_step_flops", "step_flops_counted"]


def check_lenet_fn(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(X, params)`` gives the logits of ``nn.Module`` LeNet with those weights.

    The oracle is ``course_lib.models.lenet.LeNet`` (``nn.Conv2d``, ``nn.Linear``) holding the
    same eight tensors, on random images, in float64, for batches of 1 and 5 and two seeds.
    """
    from ..models.lenet import LeNet, init_lenet_params

    g = torch.Generator().manual_seed(0)
    cases = [(torch.rand(n, 1, 28, 28, generator=g, dtype=torch.float64),
              [p.detach().double() for p in init_lenet_params(seed=seed)])
             for seed, n in ((0, 1), (1, 5))]

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
        got, failed = call_or_verdict("accuracy", strict, fn, *cases[1],
                                      after=f" on input {_short(cases[1])}. {hint}")
        if failed is not None:
            return failed
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
    name = "sgd"
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
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
        _, failed = call_or_verdict(name, strict, fn, mine, 0.1)
    if failed is not None:
        return failed
    if any(a is not b for a, b in zip(mine, passed)) or len(mine) != len(passed):
        return verdict(name, False, "your step replaced tensors in the list with new ones; "
                       "whoever else holds the parameters (a model, a training loop) would not "
                       "see the update. Change each tensor of the list itself, in place.", strict)
    if not all(torch.allclose(p.detach(), q.detach()) for p, q in zip(mine, params)):
        return verdict(name, False, "the parameters after your step differ from "
                       "torch.optim.SGD's p - lr * p.grad (did you update in place under "
                       "torch.no_grad()?)", strict)
    if any(p.grad is not None and torch.count_nonzero(p.grad) for p in mine):
        return verdict(name, False, "the step is right but the gradients were not zeroed.", strict)
    return verdict(name, True, "same parameters as torch.optim.SGD's step, gradients zeroed.",
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


@functools.lru_cache(maxsize=16)
def step_flops_counted(batch_size: int, *, backward: bool = True) -> int:
    """The FLOPs of one LeNet training step (forward, mean cross-entropy, backward) on
    ``batch_size`` images, as ``torch.utils.flop_counter.FlopCounterMode`` counts them:
    convolutions and matrix products at 2 FLOPs per multiply-add, forward and backward; biases,
    ReLUs, pooling and the loss count nothing. ``backward=False``: the forward pass alone."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from ..models.lenet import init_lenet_params, lenet

    # on the meta device: shapes only, so counting a large batch computes nothing
    params = [p.detach().to("meta").requires_grad_() for p in init_lenet_params(seed=0)]
    X = torch.zeros(batch_size, 1, 28, 28, device="meta")
    y = torch.zeros(batch_size, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(lenet(X, params), y)
        if backward:
            loss.backward()
    return int(counter.get_total_flops())


def check_step_flops(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 01: ``fn(batch_size)`` returns the FLOPs of one training step of LeNet.

    The oracle is PyTorch's own count, ``FlopCounterMode``, around a real forward and backward
    (``step_flops_counted``), for batches of 1, 3 and 256.
    """
    name = "step_flops"
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for batch in (1, 3, 256):
        got, failed = call_or_verdict(name, strict, fn, batch, after=f" for batch_size={batch}.")
        if failed is not None:
            return failed
        want = step_flops_counted(batch)
        try:
            value = float(got)
        except (TypeError, ValueError):
            return verdict(name, False, f"expected a number of FLOPs, got {got!r}.", strict)
        if value == want:
            continue
        forward = step_flops_counted(batch, backward=False)
        if batch > 1 and value == step_flops_counted(1):
            hint = "the count must grow with the batch: every image goes through the network."
        elif value in (forward, forward / 2):
            hint = ("that is the forward pass alone: the step's backward pass computes more "
                    "products than its forward.")
        elif value == 3 * forward:
            hint = ("close: does the backward pass need the gradient of the images, the first "
                    "layer's input?")
        else:
            hint = ("count, for each convolution and linear layer, one multiply-add per weight "
                    "per output value, then ask which gradients the backward pass needs for "
                    "each layer (2 FLOPs per multiply-add).")
        more = "more" if value > want else "fewer"        # the direction, never the target
        return verdict(name, False, f"for batch_size={batch} you counted {value:,.0f} FLOPs, "
                       f"{more} than PyTorch's FlopCounterMode counts. Hint: {hint}", strict)
    return verdict(name, True, "the same count as torch.utils.flop_counter.FlopCounterMode for "
                   "batches of 1, 3 and 256.", strict)
