"""Training and evaluation loops: ONE epoch loop (``run_epoch``) and ONE fit loop (``fit``) that
every lesson's training uses, with the step that differs handed in as a function.

- ``train_single`` (lesson 01): a functional net, from-scratch SGD, one device.
- ``train`` with ``train_batch`` (lesson 04): several devices in one process, gradients
  allreduced by hand.
- ``train_module`` (lesson 05): an ``nn.Module`` (plain, the course's ``DataParallel`` or
  torch's) with ``torch.optim.SGD``.
- Re-exported: ``evaluate_accuracy`` (``_evaluate``), ``SeedSpread`` (``_seed_spread``: a
  result over several seeds, lesson 04), ``recalibrate_batch_norm`` ("precise BN", lesson 05).

PyTorch counterpart: the usual ``for X, y in loader: loss.backward(); opt.step()`` loop; for
several devices, what ``nn.DataParallel`` does inside. Source: d2l's "Multiple GPUs" chapters.
"""
from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._batch_norm import recalibrate_batch_norm  # noqa: F401 - public here, as before
from ._evaluate import evaluate_accuracy
from ._evaluate import use_threads as _threads
from ._seed_spread import SeedSpread  # noqa: F401 - public here, as before
from .devices import Device, as_device
from .models.lenet import lenet, sgd
from .parallel.comm import _check_independent_replicas, allreduce, replicate_params, split_batch
from .parallel.parallel_apply import parallel_apply
from .plots import TrainingPlot
from .timing import Timer

__all__ = ["accuracy", "evaluate_accuracy", "NonFiniteLoss", "fit", "recalibrate_batch_norm",
           "run_epoch", "SeedSpread", "sgd_step", "train", "train_batch", "train_epoch",
           "train_module", "train_single"]

#: A training step: ``step(X, y) -> (mean loss over the batch, number correct)``, both 0-d
#: tensors on one device; it changes the parameters (that is the step).
Step = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> int:
    """Number of correct predictions (an int, so that shards can be summed exactly)."""
    return int((y_hat.argmax(dim=1) == y).sum())


def run_epoch(step: Step, data_iter: Iterable) -> tuple[float, float]:
    """The one epoch loop: ``step(X, y)`` on every batch; returns (mean loss, accuracy).

    Loss and correct counts are summed on the step's device and read once at the end: no
    synchronization per batch (``float()`` of a GPU tensor would wait for the GPU every step).
    """
    loss_sum, correct, total, finite = None, None, 0, []
    for X, y in data_iter:
        loss, right = step(X, y)                     # 0-d tensors on the step's device
        n = y.shape[0]
        loss_sum = loss.detach() * n if loss_sum is None else loss_sum + loss.detach() * n
        correct = right if correct is None else correct + right
        finite.append(torch.isfinite(loss.detach()))  # checked once, at the end: no sync here
        total += n
    if total == 0:
        raise ValueError("run_epoch got no batches: the data iterator is empty (a batch size "
                         "larger than the data with drop_last, or an exhausted iterator?).")
    ok = torch.stack(finite)                         # (steps,) bool
    if not bool(ok.all()):
        raise NonFiniteLoss(f"step {int((~ok).nonzero()[0]) + 1} of {len(finite)} of the epoch")
    return float(loss_sum) / total, int(correct) / total


class NonFiniteLoss(FloatingPointError):
    """The training loss became inf or NaN: the weights are ruined, training cannot go on.
    Every loop of the course raises it (``run_epoch``, ``fit``, every rank of ``train_ddp`` at
    the same step); ``where`` says where it happened."""

    def __init__(self, where: str, advice: str = "lower the learning rate (or add warm-up) and "
                 "train again from the start"):
        self.where, self.advice = where, advice
        super().__init__(f"the loss was not finite (inf or nan) at {where}. The weights are now "
                         f"ruined: {advice}.")


def fit(step: Step, data_iter: Iterable, evaluate: Callable[[], float], *, num_epochs: int,
        plot: bool | None = None, title: str | None = None,
        on_epoch: Callable[[int], None] | None = None, lr: float | None = None,
        on_nonfinite: str = "raise") -> dict:
    """The one fit loop: ``num_epochs`` of ``run_epoch``, each timed, then ``evaluate()``.

    Args:
        step, data_iter: the training step and the ``(X, y)`` batches (see ``run_epoch``).
        evaluate: returns the test accuracy after an epoch (not timed).
        num_epochs, title: epochs; the plot's title.
        plot: draw the live plot (default: inside a notebook only).
        on_epoch: called with the epoch number before it starts (e.g. to set train mode).
        lr: the learning rate, named in the message when the loss stops being finite.
        on_nonfinite: "raise" (``NonFiniteLoss``) or "stop" (warn once, return the history of
            the epochs before it) when the loss becomes inf or nan.

    Returns:
        ``{"train_loss": [...], "train_acc": [...], "test_acc": [...], "epoch_time": [...]}``;
        ``epoch_time`` counts training only (every GPU synchronized), not the evaluation.
    """
    if on_nonfinite not in ("raise", "stop"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'stop', got {on_nonfinite!r}.")
    live = TrainingPlot(title=title, live=plot)
    history = {"train_loss": [], "train_acc": [], "test_acc": [], "epoch_time": []}
    try:
        for epoch in range(1, num_epochs + 1):
            if on_epoch is not None:
                on_epoch(epoch)
            try:
                with Timer() as timer:               # synchronizes every GPU
                    train_loss, train_acc = run_epoch(step, data_iter)
            except NonFiniteLoss as e:
                where = f" in epoch {epoch}" + ("" if lr is None else f" with lr={lr:g}")
                error = NonFiniteLoss(e.where + where, e.advice)
                if on_nonfinite == "raise":
                    raise error from None
                warnings.warn(f"training stopped: {error}", stacklevel=2)
                break
            test_acc = evaluate()
            for key, v in zip(history, (train_loss, train_acc, test_acc, timer.elapsed)):
                history[key].append(v)
            live.update(epoch, train_loss=train_loss, train_acc=train_acc, test_acc=test_acc)
    finally:
        live.close()
    return history


# --- one device, functional net (lesson 01) ------------------------------------------------

def sgd_step(params: list[torch.Tensor], lr: float, device: torch.device | None,
              net: Callable, X: torch.Tensor, y: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One minibatch SGD step of ``net(X, params)`` on one device: forward, mean cross-entropy,
    backward, ``sgd``. Returns the loss and the number of correct predictions as 0-d tensors on
    the device (``run_epoch`` sums them there and reads them once per epoch)."""
    if device is not None:
        X, y = X.to(device), y.to(device)
    y_hat = net(X, params)                           # (B, 10)
    loss = F.cross_entropy(y_hat, y)                 # mean over the batch
    loss.backward()
    sgd(params, lr)
    return loss.detach(), (y_hat.detach().argmax(dim=1) == y).sum()


def train_epoch(params: list[torch.Tensor], train_iter: Iterable, lr: float,
                device: Device | None = None,
                net: Callable = lenet) -> tuple[float, float]:
    """One pass of minibatch SGD over ``train_iter``; returns (mean loss, train accuracy)."""
    device = None if device is None else as_device(device)
    return run_epoch(functools.partial(sgd_step, params, lr, device, net), train_iter)


def train_single(params: list[torch.Tensor], train_iter: Iterable, test_iter: Iterable, *,
                 num_epochs: int, lr: float, device: Device | None = None,
                 net: Callable = lenet, plot: bool | None = None, title: str | None = None,
                 lr_lambda: Callable[[int], float] | None = None) -> dict:
    """Train ``net(X, params)`` with SGD on one device: the baseline every lesson compares with.

    Args:
        params: parameter tensors on ``device``, requiring grad (updated in place).
        train_iter, test_iter: iterables of ``(X, y)`` batches.
        num_epochs, lr, plot, title: epochs, learning rate, and the live plot as ``fit`` draws it.
        device: where the batches are moved (None: where ``params`` live).
        net: ``net(X, params) -> logits``; LeNet by default.
        lr_lambda: optional schedule, as ``torch.optim.lr_scheduler.LambdaLR`` takes it: step
            t (0, 1, ... over all epochs) uses ``lr * lr_lambda(t)`` (a warm-up, say).

    Returns the history of ``fit``.
    """
    device = as_device(device) if device is not None else params[0].device
    steps_done = itertools.count()

    def step(X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step_lr = lr if lr_lambda is None else lr * lr_lambda(next(steps_done))
        return sgd_step(params, step_lr, device, net, X, y)
    return fit(step, train_iter, lambda: evaluate_accuracy(_bind(net, params), test_iter, device),
               num_epochs=num_epochs, plot=plot, title=title, lr=lr)


# --- several devices in one process (lesson 04) ---------------------------------------------

def train_batch(X: torch.Tensor, y: torch.Tensor, device_params: Sequence[list[torch.Tensor]],
                devices: Sequence[Device], lr: float, *, net: Callable = lenet,
                parallel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of data-parallel SGD: exactly one SGD step on the mean loss of the whole batch.

    1. ``split_batch``: shard i of ``(X, y)`` goes to ``devices[i]`` (sizes of ``torch.chunk``).
    2. On each device (in threads when ``parallel``): forward with its replica, and backward of
       ``sum of the shard's cross-entropies / B``. These k losses add up to the mean over the
       whole batch of B, also when the shards are uneven, so the gradients add up to its
       gradient.
    3. ``allreduce`` each parameter's gradient: every replica now holds the full gradient.
    4. ``sgd`` on every replica: identical updates keep the replicas identical.

    Args:
        X, y: the whole minibatch (any device) and its labels.
        device_params: one list of parameters per device (``replicate_params(params, devices)``).
        devices: where each replica lives.
        lr: learning rate.
        net: ``net(X, params) -> logits``; LeNet by default.
        parallel: run the per-device work in threads (``parallel_apply``; default: only for
            distinct GPUs, as on a CPU the threads only share the same cores).

    Returns:
        ``(loss, correct)`` as 0-d tensors on ``devices[0]`` (no synchronization here): the mean
        cross-entropy over the whole batch before the step, and the number of correct
        predictions.
    """
    devices = [torch.device(d) for d in devices]
    if len(device_params) != len(devices):
        raise ValueError(f"train_batch got {len(device_params)} parameter replicas for "
                         f"{len(devices)} devices; use replicate_params(params, devices).")
    _check_independent_replicas(device_params, "train_batch")
    B = X.shape[0]
    X_shards, y_shards = split_batch(X, y, devices)          # shard i: (B_i, ...) on devices[i]
    k = len(X_shards)                                         # torch.chunk may use fewer devices
    for params in device_params:
        for p in params:
            p.grad = None                                     # one step: start from no gradient

    def forward_backward(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        y_hat = net(X_shards[i], device_params[i])            # (B_i, 10) on devices[i]
        loss = F.cross_entropy(y_hat, y_shards[i], reduction="sum") / B  # share of the mean
        loss.backward()
        correct = (y_hat.argmax(dim=1) == y_shards[i]).sum()
        return loss.detach(), correct

    out = parallel_apply([forward_backward] * k, list(range(k)), devices=devices[:k],
                         threads=_threads(devices[:k], parallel))
    for params in device_params:                              # a device without a shard
        for p in params:                                      # contributes a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    for grads in zip(*[[p.grad for p in params] for params in device_params]):
        allreduce(list(grads))                                # in place, on every device
    for params in device_params:
        sgd(params, lr)
    loss = sum(l.to(devices[0]) for l, _ in out)
    correct = sum(c.to(devices[0]) for _, c in out)
    return loss, correct


def train(params: list[torch.Tensor], train_iter: Iterable, test_iter: Iterable, *,
          devices: Sequence[Device], num_epochs: int, lr: float, net: Callable = lenet,
          parallel: bool | None = None, plot: bool | None = None,
          title: str | None = None) -> dict:
    """Train ``net(X, params)`` with data-parallel SGD over ``devices`` in one process.

    ``params`` is replicated onto every device; each epoch runs ``train_batch`` on every batch
    and evaluates on ``test_iter`` sharded over the devices. At the end the trained weights of
    the first replica are copied back into ``params`` (in place, like ``train_single``).

    Args:
        params: initial parameters (any device).
        train_iter, test_iter: iterables of ``(X, y)`` batches; every training batch needs at
            least ``len(devices)`` examples.
        devices: the devices to train on (e.g. ``course_lib.devices.devices(2)``).
        num_epochs, lr: epochs and learning rate (for the whole batch).
        net: ``net(X, params) -> logits``; LeNet by default.
        parallel: threads per device (``parallel_apply``; default: only for distinct GPUs).
        plot: draw the live plot (default: inside a notebook only).

    Returns:
        The history of ``fit``.
    """
    devices = [as_device(d) for d in devices]
    device_params = replicate_params(params, devices)

    def step(X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, correct = train_batch(X, y, device_params, devices, lr, net=net, parallel=parallel)
        return loss, correct

    def evaluate() -> float:
        nets = [_bind(net, p) for p in device_params]
        return evaluate_accuracy(nets, test_iter, devices, parallel=parallel)

    history = fit(step, train_iter, evaluate, num_epochs=num_epochs, plot=plot, title=title, lr=lr)
    with torch.no_grad():
        for p, q in zip(params, device_params[0]):
            p.copy_(q.to(p.device))
    return history


def _bind(net: Callable, params: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``X -> net(X, params)`` for one replica."""
    return lambda X: net(X, params)


# --- an nn.Module (lesson 05) ------------------------------------------------------------------

def train_module(net: nn.Module, train_iter: Iterable, test_iter: Iterable, *, num_epochs: int,
                 lr: float, device: Device | None = None, plot: bool | None = None,
                 title: str | None = None, lr_lambda: Callable[[int], float] | None = None) -> dict:
    """Train an ``nn.Module`` (plain, ``DataParallel`` or ``nn.DataParallel``) with SGD.

    The module-based twin of ``train_single``: cross-entropy, ``torch.optim.SGD``, train mode
    during each epoch and the test accuracy in ``eval()`` mode after it; the net is left in
    train mode.

    Args as ``train_single``'s, except ``net`` (the network, updated in place), ``device``
    (where batches are moved; for a data-parallel net ``device_ids[0]``; None: where the net's
    first parameter lives) and ``lr_lambda`` (stepped by ``LambdaLR`` after every optimizer
    step). Returns the history of ``fit``.
    """
    device = as_device(device) if device is not None else next(net.parameters()).device
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    scheduler = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    def step(X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        X, y = X.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        y_hat = net(X)                               # (B, 10) on device
        loss = F.cross_entropy(y_hat, y)             # mean over the whole batch
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        return loss.detach(), (y_hat.detach().argmax(dim=1) == y).sum()

    def evaluate() -> float:
        net.eval()
        try:
            return evaluate_accuracy(net, test_iter, device)
        finally:
            net.train()

    return fit(step, train_iter, evaluate, num_epochs=num_epochs, plot=plot, title=title,
               on_epoch=lambda epoch: net.train(), lr=lr)
