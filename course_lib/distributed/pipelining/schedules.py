"""Pipeline schedules: in which order each stage runs the forwards and backwards of micro-batches.

PyTorch counterpart: ``torch.distributed.pipelining.ScheduleGPipe`` and ``Schedule1F1B`` (same
``step`` call: inputs on the first stage, ``target=`` and ``losses=`` on the last). A schedule
is an order of operations per stage, ``[("F", 0), ("F", 1), ..., ("B", 0), ...]``:

* GPipe: every forward, then every backward. Simple; a stage holds the activations of all m
  micro-batches at once.
* 1F1B: ``p - stage - 1`` warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards. The same bubble, but a stage holds at most ``p - stage`` micro-batches.

Both leave the idle fraction ("bubble") ``(p - 1) / (m + p - 1)`` when every stage takes the same
time. ``simulate_schedule`` plays any order with given op times. Read more: Huang et al.,
"GPipe" (2019); Narayanan et al., "PipeDream" (2019) and "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM" (2021). Lesson 11.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .microbatch import split_microbatches
from .stage import PipeEvent, PipelineStage

__all__ = ["Schedule1F1B", "ScheduleGPipe", "bubble_fraction", "check_order", "gpipe_order",
           "idle_fraction", "one_f_one_b_order", "simulate_schedule"]

Op = tuple[str, int]


def gpipe_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """GPipe: all forwards, then all backwards (each in micro-batch order)."""
    return ([("F", i) for i in range(num_microbatches)]
            + [("B", i) for i in range(num_microbatches)])


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """1F1B: warm-up forwards, then forward and backward in turn, then the last backwards."""
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
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def check_order(order: Sequence, stage: int, num_microbatches: int) -> list[Op]:
    """``order`` as a list of ``(kind, microbatch)``, or ValueError saying what is wrong with it.

    Every ``("F", i)`` and ``("B", i)`` for i < m exactly once, and ``B(i)`` after ``F(i)``.
    """
    ops: list[Op] = []
    for op in order:
        if (not isinstance(op, (tuple, list)) or len(op) != 2 or op[0] not in ("F", "B")
                or not isinstance(op[1], int) or not 0 <= op[1] < num_microbatches):
            raise ValueError(f"stage {stage}: expected operations (\"F\" or \"B\", micro-batch "
                             f"0 ... {num_microbatches - 1}), found {op!r}.")
        ops.append((op[0], op[1]))
    want = {(k, i) for k in "FB" for i in range(num_microbatches)}
    if len(ops) != len(set(ops)) or set(ops) != want:
        twice = sorted({op for op in ops if ops.count(op) > 1})
        missing = sorted(want - set(ops))
        raise ValueError(f"stage {stage}: every forward and backward of {num_microbatches} "
                         f"micro-batches exactly once; missing {missing}, repeated {twice}.")
    for i in range(num_microbatches):
        if ops.index(("B", i)) < ops.index(("F", i)):
            raise ValueError(f"stage {stage}: B({i}) comes before F({i}); a backward needs its "
                             "forward's activations.")
    return ops


def simulate_schedule(order: Callable[[int, int, int], Sequence], num_stages: int,
                      num_microbatches: int, *, forward_time: float = 1.0,
                      backward_time: float = 2.0, comm_time: float = 0.0) -> list[PipeEvent]:
    """Play ``order(stage, p, m)`` on every stage with fixed op times; the events it gives.

    F(i) on stage s waits for F(i) on stage s - 1 (its activation), B(i) for B(i) on stage s + 1
    (its gradient), each plus ``comm_time``; a stage runs its ops one at a time, in its order.
    Sends never block (as ``isend``). Raises ValueError for an invalid order, or when the stages
    wait on each other forever (a deadlock), naming what each stage waits for.
    """
    p, m = num_stages, num_microbatches
    orders = [check_order(order(s, p, m), s, m) for s in range(p)]
    done: dict[tuple[int, str, int], float] = {}    # (stage, kind, microbatch) -> end time
    free, nxt = [0.0] * p, [0] * p
    events: list[PipeEvent] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                dep = ((s - 1, "F", i) if kind == "F" and s > 0 else
                       (s + 1, "B", i) if kind == "B" and s < p - 1 else None)
                if dep is not None and dep not in done:
                    break
                ready = free[s] if dep is None else max(free[s], done[dep] + comm_time)
                end = ready + (forward_time if kind == "F" else backward_time)
                events.append(PipeEvent(s, kind, i, ready, end))
                done[(s, kind, i)], free[s], nxt[s] = end, end, nxt[s] + 1
                progressed = True
        if not progressed:
            waits = []
            for s in range(p):
                if nxt[s] < len(orders[s]):
                    kind, i = orders[s][nxt[s]]
                    src = s - 1 if kind == "F" else s + 1
                    waits.append(f"stage {s} waits in {kind}({i}) for {kind}({i}) of "
                                 f"stage {src}")
            raise ValueError("deadlock: " + "; ".join(waits) + ", which never comes.")
    return sorted(events, key=lambda e: (e.start, e.stage))


def idle_fraction(events: Sequence[PipeEvent]) -> float:
    """Measured bubble: the share of stage-time not spent computing, over one step's span.

    Span: from the first op's start to the last op's end, over every stage; busy: the sum of
    each stage's op durations. ``1 - busy / (stages * span)``.
    """
    stages = {e.stage for e in events}
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(stages) * span)


class _PipelineSchedule:
    """A schedule runs one step of micro-batches on its stage, in ``order``'s sequence."""

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

    Args:
        stage: this rank's ``PipelineStage``.
        n_microbatches: micro-batches per step (must divide the batch).
        loss_fn: ``loss_fn(output, target)``, a mean over examples (last stage).
    """

    order = staticmethod(gpipe_order)


class Schedule1F1B(_PipelineSchedule):
    """1F1B: warm-up forwards, then one forward one backward, then the rest (``one_f_one_b_order``).

    Args:
        stage: this rank's ``PipelineStage``.
        n_microbatches: micro-batches per step (must divide the batch).
        loss_fn: ``loss_fn(output, target)``, a mean over examples (last stage).
    """

    order = staticmethod(one_f_one_b_order)
