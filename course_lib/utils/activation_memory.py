"""Activation memory: the bytes autograd keeps for backward, measured, beside the formula.

PyTorch counterpart: ``torch.autograd.graph.saved_tensors_hooks`` (the measurement is
``course_lib.distributed.pipelining.memory.ActivationMeter``'s, reused); on a GPU,
``torch.cuda.max_memory_allocated``. Read more: Korthikanti et al. (2022), section 4, and
lesson 15.

The paper counts, per transformer layer, sequence s, batch b, width h, heads a, in 16-bit
activations with 1-byte dropout masks: sbh(34 + 5as/h) bytes; with tensor parallelism over t
ranks sbh(10 + 24/t + 5as/(ht)); with sequence parallelism too sbh/t (34 + 5as/h); selective
recomputation drops the 5as/h term; full recomputation keeps the layer's input, 2sbh.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..distributed.pipelining.memory import ActivationMeter
from ._checks import check_sizes

__all__ = ["activation_memory_per_layer", "saved_tensor_bytes"]

RECOMPUTE = ("none", "selective", "full")


def saved_tensor_bytes(function, *args, exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of the tensors ``function(*args)`` leaves saved for backward (each storage
    once; parameters of ``function`` when it is a module, and ``exclude``, not counted)."""
    params = list(function.parameters()) if isinstance(function, nn.Module) else []
    with ActivationMeter(exclude=[*params, *exclude]) as meter:
        out = function(*args)
        held = meter.saved_alive
    del out
    return held


def activation_memory_per_layer(s: int, b: int, h: int, a: int, *, t: int = 1,
                                sequence_parallel: bool = False,
                                recompute: str = "none") -> float:
    """Korthikanti et al.'s bytes of activations per layer and per rank (their table 2).

    Args:
        s, b, h, a: sequence length, micro-batch size, hidden size, attention heads.
        t: tensor-parallel size.
        sequence_parallel: LayerNorm and dropout regions split along the sequence too.
        recompute: ``"none"``, ``"selective"`` (attention's core) or ``"full"``.
    """
    check_sizes(s=s, b=b, h=h, a=a, t=t)
    if recompute not in RECOMPUTE:
        raise ValueError(f"activation_memory_per_layer: recompute must be one of {RECOMPUTE}, "
                         f"got {recompute!r}.")
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    core = 0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + core)
    return s * b * h * (10 + 24 / t + core / t)
