"""Training and evaluation loops, from scratch: one device first (notebook 01).

PyTorch counterpart: the usual ``for X, y in loader: loss.backward(); opt.step()`` loop.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from .bench import Timer
from .lenet import lenet, sgd
from .plots import TrainingPlot

__all__ = ["accuracy", "evaluate_accuracy", "train_epoch", "train_single"]


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> int:
    """Number of correct predictions (an int, so that shards can be summed exactly)."""
    return int((y_hat.argmax(dim=1) == y).sum())


@torch.no_grad()
def evaluate_accuracy(net: Callable[[torch.Tensor], torch.Tensor], data_iter: Iterable,
                      device: torch.device | str | None = None) -> float:
    """Accuracy of ``net`` (a function from X to logits) over ``data_iter`` on one device."""
    correct, total = 0, 0
    for X, y in data_iter:
        if device is not None:
            X, y = X.to(device), y.to(device)
        correct += accuracy(net(X), y)
        total += y.numel()
    return correct / total


def train_epoch(params: list[torch.Tensor], train_iter: Iterable, lr: float,
                device: torch.device | str | None = None,
                net: Callable = lenet) -> tuple[float, float]:
    """One pass of minibatch SGD over ``train_iter``; returns (mean loss, train accuracy)."""
    loss_sum, correct, total = torch.zeros((), device=params[0].device), 0, 0
    for X, y in train_iter:
        if device is not None:
            X, y = X.to(device), y.to(device)
        y_hat = net(X, params)                  # (B, 10)
        loss = F.cross_entropy(y_hat, y)        # mean over the batch
        loss.backward()
        sgd(params, lr)
        loss_sum += loss.detach() * y.numel()   # stays on the device: no sync per step
        correct += accuracy(y_hat.detach(), y)
        total += y.numel()
    return float(loss_sum) / total, correct / total


def train_single(params: list[torch.Tensor], train_iter: Iterable, test_iter: Iterable, *,
                 num_epochs: int, lr: float, device: torch.device | str | None = None,
                 net: Callable = lenet, plot: bool | None = None,
                 title: str | None = None) -> dict:
    """Train ``net(X, params)`` with SGD on one device: the baseline every lesson compares with.

    Args:
        params: parameter tensors on ``device``, requiring grad (updated in place).
        train_iter, test_iter: iterables of ``(X, y)`` batches.
        num_epochs, lr: epochs and learning rate.
        device: where the batches are moved (None: leave them where they are).
        net: ``net(X, params) -> logits``; LeNet by default.
        plot: draw the live plot (default: inside a notebook only).

    Returns:
        ``{"train_loss": [...], "train_acc": [...], "test_acc": [...], "epoch_time": [...]}``;
        ``epoch_time`` counts training only, not the evaluation.
    """
    device = torch.device(device) if device is not None else params[0].device
    live = TrainingPlot(title=title, live=plot)
    history = {"train_loss": [], "train_acc": [], "test_acc": [], "epoch_time": []}
    for epoch in range(1, num_epochs + 1):
        timer = Timer(device)
        with timer:
            train_loss, train_acc = train_epoch(params, train_iter, lr, device, net)
        test_acc = evaluate_accuracy(lambda X: net(X, params), test_iter, device)
        for k, v in zip(history, (train_loss, train_acc, test_acc, timer.elapsed)):
            history[k].append(v)
        live.update(epoch, train_loss=train_loss, train_acc=train_acc, test_acc=test_acc)
    live.close()
    return history
