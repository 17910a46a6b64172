"""``evaluate_accuracy`` (lessons 01 to 05), beside ``course_lib.train``, which re-exports it: the
test accuracy on one device, or exactly the same number with each batch scattered over several
(correct counts are ints, summed); and ``use_threads``, when several devices work in threads.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from .devices import Device
from .parallel.comm import scatter
from .parallel.parallel_apply import parallel_apply

__all__ = ["evaluate_accuracy", "use_threads"]


def use_threads(devices: Sequence[torch.device], parallel: bool | None) -> bool:
    """Threads when asked; by default only for distinct GPUs (hardware that works at once)."""
    if parallel is not None:
        return parallel
    return 1 < len(devices) == len(set(devices)) and all(d.type == "cuda" for d in devices)


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
        parallel: with a list of devices, run the shards in threads (``parallel_apply``;
            default: only for distinct GPUs).
    """
    if isinstance(device, (list, tuple)):
        return _evaluate_sharded(net, data_iter, [torch.device(d) for d in device], parallel)
    correct, total = 0, 0
    for X, y in data_iter:
        if device is not None:
            X, y = X.to(device), y.to(device)
        correct += _count_correct(net, X, y)
        total += y.numel()
    return _ratio(correct, total)


def _count_correct(net: Callable, X: torch.Tensor, y: torch.Tensor) -> int:
    """``course_lib.train.accuracy`` of ``net(X)``: the number of correct predictions, an int."""
    return int((net(X).argmax(dim=1) == y).sum())


def _ratio(correct: int, total: int) -> float:
    if not total:
        raise ValueError("evaluate_accuracy got no examples: the data iterator is empty.")
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
        X_shards, y_shards = scatter(X, devices), scatter(y, devices)
        k = len(X_shards)                                 # a short batch may use fewer devices
        correct += sum(parallel_apply([_count_correct] * k, list(zip(nets, X_shards, y_shards)),
                                      devices=devices[:k],
                                      threads=use_threads(devices[:k], parallel)))  # ints: exact
        total += y.numel()
    return _ratio(correct, total)
