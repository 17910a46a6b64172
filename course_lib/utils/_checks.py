"""Argument checks and error texts of ``course_lib.utils``: each says what was expected, what
was found and what to do."""
from __future__ import annotations

import torch


def check_checkpoint_inputs(function, args) -> None:
    """``function`` callable; with grad mode on, some tensor argument requires grad."""
    if not callable(function):
        raise TypeError(f"checkpoint expects a function or module first, got "
                        f"{type(function).__name__}; call checkpoint(block, x).")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if torch.is_grad_enabled() and not any(t.requires_grad for t in tensors):
        raise ValueError(
            f"checkpoint: none of the {len(tensors)} tensor arguments requires grad, so the "
            "output would not either and the function's parameters would silently get no "
            "gradient. Pass at least one input with requires_grad=True (for a first block, "
            "x.requires_grad_()), or call the function directly under torch.no_grad().")


def tensor_outputs(outputs, where: str) -> tuple:
    """``outputs`` as a tuple of tensors, or a clear error."""
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError(f"{where}: the function must return a tensor or a tuple of tensors, got "
                        f"{[type(o).__name__ for o in outs]}; return only tensors.")
    return outs


def check_sizes(**sizes) -> None:
    """Every size a positive integer."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"activation_memory_per_layer: {name} must be a positive integer, "
                             f"got {value!r}.")
