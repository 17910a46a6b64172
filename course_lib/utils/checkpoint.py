"""Activation recomputation: keep a block's inputs, not its activations, and run its forward
again during backward.

PyTorch counterpart: ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=True`` is this
design, an autograd function; ``use_reentrant=False`` gets the same gradients through saved-tensor
hooks). Read more: Chen et al. (2016), "Training Deep Nets with Sublinear Memory Cost";
Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
section 5 (selective recomputation); lesson 15.

- forward: run ``function`` without building a graph (nothing is saved but the inputs), after
  noting the random state;
- backward: put the random state back (so dropout draws the same mask), run ``function`` again
  on detached copies of the inputs with a graph, and backpropagate the incoming gradient
  through it: the parameters' gradients accumulate there, the inputs' gradients are returned.

Selective recomputation recomputes only attention's core (scores, softmax, weighted sum of the
values): the 5as/h part of the paper's sbh(34 + 5as/h) bytes per layer, cheap to recompute.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.gpt import CausalSelfAttention, causal_attention
from ._checks import check_checkpoint_inputs, tensor_outputs

__all__ = ["checkpoint", "selective_attention", "selective_recompute"]


class _RandomState:
    """The CPU generator's state and, only where CUDA is already in use, that of each CUDA
    device holding an input (as torch's checkpoint does: never initialise CUDA here)."""

    def __init__(self, args):
        self.cpu = torch.get_rng_state()
        self.devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor)
                               and a.device.type == "cuda"}) if torch.cuda.is_initialized() else []
        self.device_states = [torch.cuda.get_rng_state(d) for d in self.devices]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.device_states):
            torch.cuda.set_rng_state(state, device)


class _autocast:
    """Re-enter the autocast settings forward ran under: backward runs outside the caller's
    ``with torch.autocast`` (and, for CUDA tensors, on autograd's own thread)."""

    def __init__(self, settings):
        self.contexts = [torch.autocast(device, dtype=dtype, enabled=enabled)
                         for device, (enabled, dtype) in settings.items()
                         if device == "cpu" or torch.cuda.is_available()]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class CheckpointFunction(torch.autograd.Function):
    """``function(*args)`` that saves only the tensors among ``args`` for backward."""

    @staticmethod
    def forward(ctx, function, preserve_rng_state, *args):
        ctx.function, ctx.preserve_rng_state = function, preserve_rng_state
        if preserve_rng_state:
            ctx.random_state = _RandomState(args)
        ctx.autocast = {device: (torch.is_autocast_enabled(device),
                                 torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")}
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        with torch.no_grad():                    # grad mode is off here already: no graph
            outputs = function(*args)
        tensor_outputs(outputs, "checkpoint")
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():   # as torch's reentrant checkpoint refuses
            raise RuntimeError(
                "checkpoint: this recomputation runs its own backward() inside the outer one, so "
                "it works only with loss.backward() without `inputs`; it was reached through "
                "torch.autograd.grad(...) or backward(inputs=...), whose gradients it cannot "
                "return. Call loss.backward() and read .grad, or use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False).")
        saved, needs_grad = iter(ctx.saved_tensors), ctx.needs_input_grad[2:]
        inputs = [next(saved).detach().requires_grad_(need) if t else other
                  for t, other, need in zip(ctx.is_tensor, ctx.others, needs_grad)]
        devices = ctx.random_state.devices if ctx.preserve_rng_state else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                ctx.random_state.restore()       # the same dropout masks as in forward
            with torch.enable_grad(), _autocast(ctx.autocast):
                outputs = tensor_outputs(ctx.function(*inputs), "checkpoint")
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if isinstance(x, torch.Tensor) else None for x in inputs))


def checkpoint(function, *args, preserve_rng_state: bool = True):
    """``function(*args)``, keeping only ``args`` for backward and recomputing the rest there.

    Args:
        function: a module or function of ``args`` returning a tensor or a tuple of tensors;
            it must compute the same thing when run again (dropout does, given the random state).
        args: its arguments; tensors among them are saved, others kept as they are. At least one
            tensor must require grad when grad mode is on (else nothing would reach
            ``function``'s parameters).
        preserve_rng_state: restore the random state before recomputing (default), so dropout
            draws the same masks; ``False`` is faster and right only without randomness.

    Returns:
        What ``function(*args)`` returns, with gradients equal to running it directly.

    Raises:
        RuntimeError: in backward, when reached through ``torch.autograd.grad`` or
            ``backward(inputs=...)`` (as torch's ``use_reentrant=True`` does): call
            ``loss.backward()``, or use torch's ``use_reentrant=False``.
    """
    check_checkpoint_inputs(function, args)
    return CheckpointFunction.apply(function, preserve_rng_state, *args)


def selective_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``causal_attention(q, k, v)`` recomputed in backward: only q, k and v are kept, not the
    (B, nh, T, T) scores and softmax (Korthikanti et al. 2022, section 5)."""
    return checkpoint(causal_attention, q, k, v)


def selective_recompute(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make every ``CausalSelfAttention`` in ``model`` recompute its core in backward
    (``enabled=False`` puts the plain core back), in place; returns ``model``."""
    found = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not found:
        raise TypeError(f"selective_recompute: {type(model).__name__} holds no "
                        "course_lib.models.gpt.CausalSelfAttention; for another model call "
                        "selective_attention(q, k, v) in its attention's forward.")
    for attn in found:
        attn.core_attention = selective_attention if enabled else causal_attention
    return model
