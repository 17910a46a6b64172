"""Model parallelism in one process: stage i lives on device i, activations move between them.

PyTorch counterpart: none as a class; the PyTorch tutorial "Single-Machine Model Parallel Best
Practices" writes it by hand (``self.seq1.to('cuda:0')``, ``x.to('cuda:1')``), and autograd moves
the gradients back across devices by itself. Read more: https://pytorch.org/tutorials/
intermediate/model_parallel_tutorial.html. Lesson 12.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...devices import Device, as_device
from .split import split_sequential

__all__ = ["ModelParallel"]


class ModelParallel(nn.Module):
    """An ``nn.Sequential`` cut into stages, stage i on ``devices[i]``; one forward runs them
    one after the other, moving the activation to the next stage's device.

    Only one device works at any moment: the point is memory (each device holds its stage's
    weights and activations), not speed. The layers are moved, not copied (as ``.to`` does).
    On a CPU-only machine every "device" is the CPU: the result is the same, nothing moves.

    Args:
        model: an ``nn.Sequential``.
        devices: one device per stage (``course_lib.devices.devices(k, warn=False)``).
        balance: layer count per stage (default: ``balance_stages`` by parameter count).
    """

    def __init__(self, model: nn.Sequential, devices: Sequence[Device],
                 balance: Sequence[int] | None = None):
        super().__init__()
        devices = [as_device(d) for d in devices]
        if not devices:
            raise ValueError("ModelParallel expects one device per stage, got an empty list; "
                             "use course_lib.devices.devices(k, warn=False).")
        stages = split_sequential(model, len(devices), balance=balance)
        self.devices = devices
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, devices))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            X = stage(X.to(device))   # (B, ...) on devices[i]; autograd sends the grad back
        return X                      # on devices[-1]
