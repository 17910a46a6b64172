"""Training and evaluation loops, from scratch: one device (notebook 01), then several
devices in one process (notebook 04).

PyTorch counterpart: the usual ``for X, y in loader: loss.backward(); opt.step()`` loop; for
several devices, what ``nn.DataParallel`` does inside (scatter, replicate, ``parallel_apply``
with one thread per device, reduce). Source: d2l's "Multiple GPUs" chapter (``train_batch``).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from .bench import Timer
from .comm import allreduce, replicate, scatter, split_batch
from .devices import cpu_cores
from .lenet import lenet, sgd
from .plots import TrainingPlot

__all__ = [
    "accuracy",
    "evaluate_accuracy",
    "run_on_devices",
    "train",
    "train_batch",
    "train_epoch",
    "train_single",
]

Device = torch.device | str


def accuracy(y_hat: torch.Tensor, y: torch.Tensor) -> int:
    """Number of correct predictions (an int, so that shards can be summed exactly)."""
    return int((y_hat.argmax(dim=1) == y).sum())


@torch.no_grad()
def evaluate_accuracy(net: Callable[[torch.Tensor], torch.Tensor]
                      | Sequence[Callable[[torch.Tensor], torch.Tensor]],
                      data_iter: Iterable,
                      device: Device | Sequence[Device] | None = None, *,
                      parallel: bool | None = None) -> float:
    """Accuracy of ``net`` (a function from X to logits) over ``data_iter``.

    Args:
        net: a function from X to logits; with several devices, either one such function that
            works on any of them or a list of functions, ``net[i]`` for ``device[i]`` (e.g.
            ``functools.partial(lenet, params=device_params[i])``).
        data_iter: iterable of ``(X, y)`` batches.
        device: one device (batches are moved there; None: left where they are), or a list of
            devices: each batch is then scattered over them, shard i is evaluated by ``net[i]``
            on ``device[i]`` and the correct counts (ints) are summed, so the result is exactly
            the one-device accuracy.
        parallel: with a list of devices, run the shards in threads (see ``run_on_devices``).
    """
    if isinstance(device, (list, tuple)):
        return _evaluate_sharded(net, data_iter, [torch.device(d) for d in device], parallel)
    correct, total = 0, 0
    for X, y in data_iter:
        if device is not None:
            X, y = X.to(device), y.to(device)
        correct += accuracy(net(X), y)
        total += y.numel()
    return correct / total


def _evaluate_sharded(net, data_iter: Iterable, devices: list[torch.device],
                      parallel: bool | None) -> float:
    """``evaluate_accuracy`` over several devices: scatter each batch, sum exact counts."""
    nets = list(net) if isinstance(net, (list, tuple)) else [net] * len(devices)
    if len(nets) != len(devices):
        raise ValueError(f"evaluate_accuracy got {len(nets)} nets for {len(devices)} devices; "
                         "pass one net per device, or a single net.")
    correct, total = 0, 0
    for X, y in data_iter:
        X_shards, y_shards = scatter(X, devices), scatter(y, devices)  # a short batch may use
        counts = run_on_devices(                                      # fewer devices
            lambda i, Xs=X_shards, ys=y_shards: accuracy(nets[i](Xs[i]), ys[i]),
            devices[:len(X_shards)], parallel=parallel)
        correct += sum(counts)                                        # ints: exact
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


# --- several devices in one process (notebook 04) ---------------------------------------------

def _separate(devices: Sequence[torch.device]) -> bool:
    """True when the devices are distinct GPUs: real hardware that can work at the same time."""
    return len(devices) > 1 and len(set(devices)) == len(devices) and all(
        d.type == "cuda" for d in devices)


def run_on_devices(fn: Callable[[int], object], devices: Sequence[Device], *,
                   parallel: bool | None = None) -> list:
    """``[fn(0), ..., fn(k-1)]`` for k = ``len(devices)``, one call per device.

    With ``parallel``, each call runs in its own thread, as ``nn.parallel.parallel_apply`` does
    for ``nn.DataParallel``: PyTorch releases the GIL inside its kernels, so the devices work at
    the same time. A thread for a GPU makes that GPU current; a thread for a CPU "device" limits
    itself to ``cores // k`` intra-op threads (one worker per core, not k teams fighting over
    the same cores). The first exception raised in a thread is re-raised here.

    Args:
        fn: called with the device index i.
        devices: the devices (only their number and types matter here).
        parallel: True: threads; False: a plain loop; None (default): threads only when the
            devices are distinct GPUs. On a CPU, measure before choosing (notebook 04).
    """
    devices = [torch.device(d) for d in devices]
    if parallel is None:
        parallel = _separate(devices)
    if not parallel or len(devices) <= 1:
        return [fn(i) for i in range(len(devices))]

    results: list = [None] * len(devices)
    errors: list[BaseException | None] = [None] * len(devices)
    grad_enabled = torch.is_grad_enabled()      # grad mode is per thread: pass it on
    cpu_threads = max(1, cpu_cores() // len(devices))

    def worker(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), _on(devices[i], cpu_threads):
                results[i] = fn(i)
        except BaseException as e:  # noqa: B036 - handed to the caller below
            errors[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results


@contextlib.contextmanager
def _on(device: torch.device, cpu_threads: int):
    """Inside a worker thread: make a GPU current, or cap a CPU worker's intra-op threads."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    elif device.type == "cpu":
        torch.set_num_threads(cpu_threads)      # per thread: the caller's setting is untouched
        yield
    else:
        yield


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
        device_params: one list of parameters per device (``replicate(params, devices)``).
        devices: where each replica lives.
        lr: learning rate.
        net: ``net(X, params) -> logits``; LeNet by default.
        parallel: run the per-device work in threads (see ``run_on_devices``).

    Returns:
        ``(loss, correct)`` as 0-d tensors on ``devices[0]`` (no synchronization here): the mean
        cross-entropy over the whole batch before the step, and the number of correct
        predictions.
    """
    devices = [torch.device(d) for d in devices]
    if len(device_params) != len(devices):
        raise ValueError(f"train_batch got {len(device_params)} parameter replicas for "
                         f"{len(devices)} devices; use replicate(params, devices).")
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

    out = run_on_devices(forward_backward, devices[:k], parallel=parallel)
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
        parallel: threads per device (see ``run_on_devices``; default: only for distinct GPUs).
        plot: draw the live plot (default: inside a notebook only).

    Returns:
        ``{"train_loss", "train_acc", "test_acc", "epoch_time"}`` lists, one value per epoch,
        as in ``train_single``; ``epoch_time`` counts training only.
    """
    devices = [torch.device(d) for d in devices]
    device_params = replicate(params, devices)
    live = TrainingPlot(title=title, live=plot)
    history = {"train_loss": [], "train_acc": [], "test_acc": [], "epoch_time": []}
    for epoch in range(1, num_epochs + 1):
        timer = Timer()                                       # synchronizes every GPU
        loss_sum = torch.zeros((), device=devices[0])
        correct, total = torch.zeros((), device=devices[0], dtype=torch.long), 0
        with timer:
            for X, y in train_iter:
                loss, c = train_batch(X, y, device_params, devices, lr, net=net,
                                      parallel=parallel)
                loss_sum += loss * y.shape[0]
                correct += c
                total += y.shape[0]
        nets = [_bind(net, p) for p in device_params]
        test_acc = evaluate_accuracy(nets, test_iter, devices, parallel=parallel)
        values = (float(loss_sum) / total, int(correct) / total, test_acc, timer.elapsed)
        for key, v in zip(history, values):
            history[key].append(v)
        live.update(epoch, train_loss=values[0], train_acc=values[1], test_acc=test_acc)
    live.close()
    with torch.no_grad():
        for p, q in zip(params, device_params[0]):
            p.copy_(q.to(p.device))
    return history


def _bind(net: Callable, params: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``X -> net(X, params)`` for one replica."""
    return lambda X: net(X, params)
