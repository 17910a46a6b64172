"""Lesson 01, exercises: the functional LeNet, SGD from scratch, counting correct predictions,
the arithmetic of one training step, the first loss.

Checked by ``course_lib.checks.lesson01``: ``check_lenet_fn``, ``check_sgd_fn``,
``check_accuracy_fn``, ``check_step_flops`` and ``check_initial_loss``. The names are those the
notebook's exercise cells define (``# EXERCISE: name``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["accuracy", "initial_loss_d2l", "lenet", "sgd", "step_flops"]


def lenet(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Exercise 1: the logits (B, 10) of LeNet for images X (B, 1, 28, 28)."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2)   # (B, 20, 13, 13)
    h = F.avg_pool2d(F.relu(F.conv2d(h, W2, b2)), kernel_size=2)   # (B, 50, 4, 4)
    h = F.relu(h.reshape(h.shape[0], -1) @ W3 + b3)                # (B, 128)
    return h @ W4 + b4                                             # (B, 10)


def sgd(params: list[torch.Tensor], lr: float) -> None:
    """Exercise 2: one step of minibatch SGD in place, then zero the gradients."""
    with torch.no_grad():                  # the update is not part of the graph
        for p in params:
            p -= lr * p.grad               # in place: the list's tensors are the parameters
            p.grad.zero_()


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> int:
    """Exercise 3: the number of correct predictions in logits y_hat (B, 10) for labels y (B,)."""
    return int((y_hat.argmax(dim=1) == y).sum())


def step_flops(batch_size: int) -> int:
    """Exercise 4: FLOPs of one training step (forward and backward) of LeNet on a batch."""
    # multiply-adds per image, forward: output values x weights per output, for each layer
    conv1 = 26 * 26 * 20 * (1 * 3 * 3)     # (20, 26, 26) outputs, 9 weights each
    conv2 = 9 * 9 * 50 * (20 * 5 * 5)      # (50, 9, 9) outputs, 500 weights each
    fc1, fc2 = 800 * 128, 128 * 10
    forward = conv1 + conv2 + fc1 + fc2
    # backward: the weights' gradients (as many as forward) and the inputs' gradients (as many
    # again), except the images': nothing needs the gradient of the data
    backward = 2 * forward - conv1
    return 2 * batch_size * (forward + backward)        # 2 FLOPs per multiply-add


#: Exercise 5: logits near zero give the uniform distribution over 10 classes: loss ln 10.
initial_loss_d2l = math.log(10)
