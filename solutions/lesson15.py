"""Lesson 15, exercises: activation memory, in three steps.

1. ``checkpoint(function, *args)``: activation recomputation as a ``torch.autograd.Function``
   that saves only its inputs, runs the function without a graph in forward and again, with
   one, in backward, after putting back the random state forward started from (so dropout draws
   the same mask), inside ``fork_rng`` (so the caller's stream is left alone)
   (``check_checkpoint``);
2. ``update_scale``: the dynamic loss scaler's update rule, torch's ``_amp_update_scale_`` on
   plain numbers: back off and reset on an overflow, grow after ``growth_interval`` good steps
   in a row (``check_scaler_update``);
3. ``enter_tp_region`` and ``leave_tp_region``: sequence parallelism's conjugate pair g / g-bar on
   ``(B, T, C)`` tensors, all-gather along the sequence forward and reduce-scatter backward, and
   the other way round (``check_sequence_parallel_block``; the notebook's ``my_sequence.py``).

In the notebook the first two are cells and the third a file; here they are one module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.distributed import compat

__all__ = ["Checkpoint", "EnterTPRegion", "LeaveTPRegion", "checkpoint", "enter_tp_region",
           "leave_tp_region", "update_scale"]


# ---- exercise 1: checkpoint --------------------------------------------------------------------

class Checkpoint(torch.autograd.Function):
    """``function(*args)`` that keeps only ``args`` for backward and recomputes the rest there."""

    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.rng_state = torch.get_rng_state()     # where dropout's draws start
        ctx.save_for_backward(*args)              # the inputs: all that is kept
        return function(*args)                    # grad mode is off here: no graph, nothing saved

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(need)
                  for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.random.fork_rng(devices=[]):   # the caller's stream comes back afterwards
            torch.set_rng_state(ctx.rng_state)    # the same dropout mask as in forward
            with torch.enable_grad():             # backward runs with grad mode off
                outputs = ctx.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(x.grad for x in inputs))  # None for function, then each input's


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in backward instead of kept."""
    return Checkpoint.apply(function, *args)


# ---- exercise 2: the loss scaler's update rule -------------------------------------------------

def update_scale(scale, growth_tracker, found_inf, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
    """(new scale, new growth tracker) after a step that overflowed (``found_inf``) or not."""
    if found_inf:
        return scale * backoff_factor, 0          # skipped step: smaller scale, count again
    good_steps = growth_tracker + 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0           # growth_interval good steps in a row: grow
    return scale, good_steps


# ---- exercise 3, my_sequence.py: all-gather and reduce-scatter along the sequence --------------

SEQ = 1   # (B, T, C): the sequence is dimension 1


def _gather(x, group):
    """(B, T/t, C) on each rank -> (B, T, C): every rank's positions, in rank order."""
    world = dist.get_world_size(group)
    parts = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)   # (t, B, T/t, C)
    compat.all_gather_into_tensor(parts.view(-1), x.contiguous().view(-1), group=group)
    return torch.cat(parts.unbind(0), dim=SEQ)


def _reduce_scatter(x, group):
    """(B, T, C) partial sums on each rank -> (B, T/t, C): their sum, this rank's positions."""
    world = dist.get_world_size(group)
    if x.shape[SEQ] % world:
        raise ValueError(f"leave_tp_region: the sequence length {x.shape[SEQ]} is not "
                         f"divisible by the group's size {world}; choose a multiple of it.")
    blocks = torch.stack(x.chunk(world, dim=SEQ))                          # (t, B, T/t, C)
    out = torch.empty_like(blocks[0])
    compat.reduce_scatter_tensor(out.view(-1), blocks.view(-1), group=group)
    return out


class EnterTPRegion(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class LeaveTPRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def enter_tp_region(x, group=None):
    """Every rank's positions joined along the sequence; the gradient reduce-scattered back."""
    return EnterTPRegion.apply(x, group)


def leave_tp_region(x, group=None):
    """The sum over ranks of this rank's positions; the gradient all-gathered back."""
    return LeaveTPRegion.apply(x, group)
