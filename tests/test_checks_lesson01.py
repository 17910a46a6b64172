"""Lesson 01's exercises: the reference passes, realistic mistakes fail (oracles: the nn.Module
LeNet, torch.optim.SGD, FlopCounterMode), and the three initialisations have the variances the
lesson states."""
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.checks.lesson01 import step_flops_counted
from course_lib.models.lenet import init_lenet_params, lenet


def _variant(pool=F.avg_pool2d, last_relu=False, relu_fc1=True):
    def fn(X, params):
        W1, b1, W2, b2, W3, b3, W4, b4 = params
        h = pool(F.relu(F.conv2d(X, W1, b1)), 2)
        h = pool(F.relu(F.conv2d(h, W2, b2)), 2)
        h = h.reshape(h.shape[0], -1) @ W3 + b3
        h = F.relu(h) if relu_fc1 else h
        out = h @ W4 + b4
        return F.relu(out) if last_relu else out
    return fn


def test_lenet_checker_accepts_the_solution_and_rejects_mistakes():
    from solutions import lesson01

    assert checks.check_lenet_fn(None).ok is None
    assert checks.check_lenet_fn(lesson01.lenet).ok is True
    assert checks.check_lenet_fn(lenet).ok is True
    for wrong in (_variant(pool=F.max_pool2d), _variant(relu_fc1=False),
                  _variant(last_relu=True)):
        assert checks.check_lenet_fn(wrong).ok is False
        with pytest.raises(AssertionError):
            checks.check_lenet_fn(wrong, strict=True)

    def scaffold(X, params):
        raise NotImplementedError
    assert checks.check_lenet_fn(scaffold).ok is None


@pytest.mark.parametrize("init, weight_var", [
    ("torch", lambda fan_in: 1 / (3 * fan_in)),   # kaiming_uniform_(a=sqrt(5)), as nn.Linear
    ("he", lambda fan_in: 2 / fan_in),
    ("d2l", lambda fan_in: 1e-4),
])
def test_initialisations_have_the_stated_variances(init, weight_var):
    params = init_lenet_params(seed=0, init=init)
    for W, fan_in in zip(params[0::2], (9, 500, 800, 128)):
        assert W.var().item() == pytest.approx(weight_var(fan_in), rel=0.25)
    if init == "torch":   # the same law as torch's own layers
        conv = torch.nn.Conv2d(20, 50, 5)
        assert conv.weight.var().item() == pytest.approx(1 / (3 * 500), rel=0.1)
        assert conv.weight.abs().max().item() <= 1 / math.sqrt(500)


def test_sgd_and_accuracy_checkers_refuse_right_values_in_the_wrong_form():
    """Two wrong answers the checkers used to pass: an ``sgd`` that puts new tensors in the
    caller's list (the right values, but whoever else holds the parameters sees no update),
    and an ``accuracy`` that returns the right count as a tensor or a float, not an int."""
    from solutions import lesson01

    def rebinding_sgd(params, lr):
        for i, p in enumerate(params):
            params[i] = (p - lr * p.grad).detach().requires_grad_()
            params[i].grad = torch.zeros_like(p)

    assert checks.check_sgd_fn(lesson01.sgd).ok is True
    assert checks.check_sgd_fn(rebinding_sgd).ok is False

    assert checks.check_accuracy_fn(lesson01.accuracy).ok is True
    for wrong in (lambda y_hat, y: (y_hat.argmax(1) == y).sum(),           # a 0-d tensor
                  lambda y_hat, y: float((y_hat.argmax(1) == y).sum()),    # a float
                  lambda y_hat, y: bool((y_hat.argmax(1) == y).any())):    # a bool
        assert checks.check_accuracy_fn(wrong).ok is False
    with pytest.raises(AssertionError, match="Python int"):
        checks.check_accuracy_fn(lambda y_hat, y: (y_hat.argmax(1) == y).sum(), strict=True)

    def scaffold(y_hat, y):
        raise NotImplementedError
    assert checks.check_accuracy_fn(scaffold).ok is None


def test_step_flops_checker_accepts_the_count_and_rejects_the_usual_slips():
    """The oracle is torch's FlopCounterMode; a forward-only count, a count that forgets that
    the images need no gradient, and one that ignores the batch all fail, each with its hint."""
    from solutions import lesson01

    assert checks.check_step_flops(None).ok is None
    assert checks.check_step_flops(lesson01.step_flops).ok is True
    assert lesson01.step_flops(256) == step_flops_counted(256)   # 3.39 GFLOP
    macs = 26 * 26 * 20 * 9 + 9 * 9 * 50 * 500 + 800 * 128 + 128 * 10   # forward, per image
    slips = {
        "forward pass alone": lambda b: 2 * b * macs,
        "gradient of the images": lambda b: 2 * b * 3 * macs,
        "grow with the batch": lambda b: lesson01.step_flops(1),
        "which gradients": lambda b: lesson01.step_flops(b) + 2 * b,
    }
    for hint, wrong in slips.items():
        result = checks.check_step_flops(wrong)
        assert result.ok is False and hint in result.message, (hint, result.message)
    with pytest.raises(AssertionError):
        checks.check_step_flops(slips["grow with the batch"], strict=True)

    def scaffold(batch_size):
        raise NotImplementedError
    assert checks.check_step_flops(scaffold).ok is None
