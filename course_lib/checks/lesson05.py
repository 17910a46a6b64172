"""Checkers for the exercises of lesson 05 (nn.DataParallel)."""
from __future__ import annotations

import torch

from ..devices import devices
from ._core import ExerciseResult, check_answer

__all__ = ["check_bn_examples_seen", "check_module_calls"]

def check_bn_examples_seen(answer: int | None, batch: int = 7, n: int = 3, *,
                           strict: bool = False) -> ExerciseResult:
    """Exercise 05: examples a batch-norm layer's running statistics see in one train-mode
    forward of ``batch`` examples through ``DataParallel`` over n devices (replica 0's shard)."""
    seen = torch.chunk(torch.zeros(batch), n)[0].shape[0]
    return check_answer("BN examples seen", answer, seen,
                        hint="only replica 0 shares the module's buffers; torch.chunk gives its "
                        "shard.", strict=strict)


def check_module_calls(answer: int | None, batch: int = 1, n: int = 2, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 05: calls of the module by ``DataParallel(net, devices(n))`` on a batch of
    ``batch`` examples, counted with a forward hook."""
    from ..models.lenet import LeNet
    from ..parallel.data_parallel import DataParallel

    devs = devices(n, warn=False)
    net = LeNet().to(devs[0])
    calls: list[int] = []
    net.register_forward_hook(lambda module, inputs, output: calls.append(1))
    with torch.no_grad():
        DataParallel(net, devs)(torch.rand(batch, 1, 28, 28, device=devs[0]))
    return check_answer("module calls", answer, len(calls),
                        hint="scatter cannot split one example over two devices.", strict=strict)
