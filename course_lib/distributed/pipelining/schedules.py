"""Pipeline schedules: in which order each stage runs the forwards and backwards of micro-batches.

PyTorch counterpart: ``torch.distributed.pipelining.ScheduleGPipe`` and ``Schedule1F1B`` (same
``step`` call: inputs on the first stage, ``target=`` and ``losses=`` on the last). A schedule
is an order of operations per stage, ``[("F", 0), ("F", 1), ..., ("B", 0), ...]``:

* GPipe: every forward, then every backward. Simple; a stage holds the activations of all m
  micro-batches at once.
* 1F1B: ``p - stage - 1`` warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards. The same bubble, but a stage holds at most ``p - stage`` micro-batches.

Both leave the idle fraction ("bubble") ``(p - 1) / (m + p - 1)`` when every stage takes the same
time. ``step`` checks (every step) that all ranks run one program, and before the first step
plays the orders as NCCL runs their messages (``simulate_schedule`` and ``p2p_program``, from
``_simulate``, re-exported here; the checks are in ``_checks``). Read more: Huang et al.,
"GPipe" (2019); Narayanan et al., "PipeDream" (2019) and "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (2021). Lesson 12.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._checks import Op, check_order, check_same_program, check_sizes, order_digest
from ._simulate import p2p_program, simulate_schedule
from .microbatch import split_microbatches
from .stage import PipeEvent, PipelineStage

__all__ = ["Schedule1F1B", "ScheduleGPipe", "bubble_fraction", "check_order", "gpipe_order",
           "idle_fraction", "one_f_one_b_order", "p2p_program", "simulate_schedule"]


def gpipe_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """GPipe: all forwards, then all backwards (each in micro-batch order)."""
    check_sizes("gpipe_order", num_stages, num_microbatches, stage)
    return ([("F", i) for i in range(num_microbatches)]
            + [("B", i) for i in range(num_microbatches)])


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """1F1B: warm-up forwards, then forward and backward in turn, then the last backwards."""
    check_sizes("one_f_one_b_order", num_stages, num_microbatches, stage)
    warmup = min(num_stages - stage - 1, num_microbatches)  # in flight before the first B
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < num_microbatches:                       # steady state: one F, one B
        order += [("F", forward), ("B", backward)]
        forward, backward = forward + 1, backward + 1
    order += [("B", i) for i in range(backward, num_microbatches)]  # cool-down
    return order


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Theory: the idle share of a pipeline step with equal stages, (p - 1) / (m + p - 1)."""
    check_sizes("bubble_fraction", num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def idle_fraction(events: Sequence[PipeEvent]) -> float:
    """Measured bubble: the share of stage-time not spent computing, over one step's span.

    Span: from the first op's start to the last op's end, over every stage; busy: the sum of
    each stage's op durations. ``1 - busy / (stages * span)``.
    """
    events = list(events)
    if not events:
        raise ValueError("idle_fraction expects the events of a step (PipeEvent), got none.")
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(stages) * span)


class _PipelineSchedule:
    """A schedule runs one step of micro-batches on its stage, in ``order``'s sequence.

    Args:
        stage: this rank's ``PipelineStage``.
        n_microbatches: micro-batches per step (must divide the batch).
        loss_fn: ``loss_fn(output, target)``, a mean over examples (last stage).
    """

    order: Callable[[int, int, int], list[Op]]

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable | None = None):
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__} expects n_microbatches >= 1, got "
                             f"{n_microbatches!r}.")
        if stage.is_last and loss_fn is None:
            raise ValueError(f"{type(self).__name__}: the last stage computes the loss; pass "
                             "loss_fn (for example torch.nn.functional.cross_entropy).")
        self.stage, self.n_microbatches, self.loss_fn = stage, n_microbatches, loss_fn
        self._orders: list[list[Op]] | None = None   # every stage's order, once played

    def _check_program(self) -> None:
        """Every rank runs this schedule with as many micro-batches (one small all_gather, each
        step: ``_checks.check_same_program``); and, the first time, its orders played on every
        stage as NCCL runs them, which raises for sends and receives in different orders."""
        stage, m, name = self.stage, self.n_microbatches, type(self).__name__
        p = stage.num_stages
        if self._orders is None:
            orders = [self.order(s, p, m) for s in range(p)]
            self._digest = order_digest(orders)
            check_same_program(stage, name, m, self._digest)
            try:
                simulate_schedule(lambda s, p, m: orders[s], p, m)
            except ValueError as e:
                raise ValueError(f"{name} with {m} micro-batches on {p} stages cannot run: "
                                 f"{e}") from None
            self._orders = orders
        else:
            check_same_program(stage, name, m, self._digest)

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None) -> torch.Tensor | None:
        """One training step's forwards and backwards; gradients accumulate in ``.grad``.

        Each micro-batch's loss is divided by the number of micro-batches, so the gradient is
        the one of the whole batch's mean loss (for a loss that averages over examples).

        Args:
            *args: the whole batch of inputs (first stage only).
            target: the whole batch of targets (last stage only).
            losses: a list that the last stage extends with each micro-batch's loss.

        Returns:
            The last stage's output for the whole batch (detached); None on other stages.
        """
        self._check_program()   # every rank the same program, its messages in matching orders
        stage, m = self.stage, self.n_microbatches
        if stage.is_first and len(args) != 1:
            raise ValueError("the first stage's step takes the batch of inputs: step(X).")
        if stage.is_last and target is None:
            raise ValueError("the last stage's step takes the targets: step(target=y).")
        inputs = split_microbatches(args[0], m) if stage.is_first else [None] * m
        targets = split_microbatches(target, m) if stage.is_last else [None] * m
        outputs = {}
        ops = check_order(self.order(stage.stage_index, stage.num_stages, m),
                          stage.stage_index, m)
        try:
            for kind, i in ops:
                if kind == "F":
                    Y = stage.forward_one(i, inputs[i], targets[i], self.loss_fn)
                    outputs[i] = Y.detach()
                else:
                    stage.backward_one(i, loss_scale=1.0 / m)
        finally:
            stage.wait_sends()
        if not stage.is_last:
            return None
        step_losses = stage.pop_losses()
        if losses is not None:
            losses.extend(step_losses)
        return torch.cat([outputs[i] for i in range(m)])


class ScheduleGPipe(_PipelineSchedule):
    """GPipe: every micro-batch's forward, then every backward (``gpipe_order``).

    ``ScheduleGPipe(stage, n_microbatches, loss_fn)``, as torch's (see ``_PipelineSchedule``).
    """

    order = staticmethod(gpipe_order)


class Schedule1F1B(_PipelineSchedule):
    """1F1B: warm-up forwards, then one forward one backward, then the rest (``one_f_one_b_order``).

    ``Schedule1F1B(stage, n_microbatches, loss_fn)``, as torch's (see ``_PipelineSchedule``).
    """

    order = staticmethod(one_f_one_b_order)
