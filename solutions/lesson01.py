"""Lesson 01, exercises: SGD from scratch, counting correct predictions, the plateau's loss.

Checked by ``course_lib.checks.lesson01``: ``check_sgd_fn``, ``check_accuracy_fn`` and
``check_initial_loss``. The names are those the notebook's exercise cells define
(``# EXERCISE: name``).
"""
from __future__ import annotations

import math

import torch

__all__ = ["accuracy", "initial_loss_d2l", "sgd"]


def sgd(params: list[torch.Tensor], lr: float) -> None:
    """Exercise 1: one step of minibatch SGD in place, then zero the gradients."""
    with torch.no_grad():                  # the update is not part of the graph
        for p in params:
            p -= lr * p.grad               # in place: the list's tensors are the parameters
            p.grad.zero_()


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> int:
    """Exercise 2: the number of correct predictions in logits y_hat (B, 10) for labels y (B,)."""
    return int((y_hat.argmax(dim=1) == y).sum())


#: Exercise 3: logits near zero give the uniform distribution over 10 classes: loss ln 10.
initial_loss_d2l = math.log(10)
