"""Pipeline schedules: in which order each stage runs the forwards and backwards of micro-batches.

PyTorch counterpart: ``torch.distributed.pipelining.ScheduleGPipe`` and ``Schedule1F1B`` (same
``step`` call: inputs on the first stage, ``target=`` and ``losses=`` on the last). A schedule
is an order of operations per stage, ``[("F", 0), ("F", 1), ..., ("B", 0), ...]``:

* GPipe: every forward, then every backward. Simple; a stage holds the activations of all m
  micro-batches at once.
* 1F1B: ``p - stage - 1`` warm-up forwards, then one forward and one backward in turn, then the
  remaining backwards. The same bubble, but a stage holds at most ``p - stage`` micro-batches.

Both leave the idle fraction ("bubble") ``(p - 1) / (m + p - 1)`` when every stage takes the same
time. ``simulate_schedule`` plays any order with given op times, with the sends and receives
that ``PipelineStage`` posts (``p2p_program``) run as NCCL runs them: in order, a send done only
when its receive is reached, the k-th send of a link paired with its k-th receive (no tags), so
that an order that would hang or swap messages on GPUs fails here. ``step`` plays its orders
so before the first step, after checking (every step) that all ranks run one program. Read more:
Huang et al., "GPipe" (2019); Narayanan et al., "PipeDream" (2019) and "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (2021). Lesson 12.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._checks import check_same_program, order_digest
from .microbatch import split_microbatches
from .stage import PipeEvent, PipelineStage

__all__ = ["Schedule1F1B", "ScheduleGPipe", "bubble_fraction", "check_order", "gpipe_order",
           "idle_fraction", "one_f_one_b_order", "p2p_program", "simulate_schedule"]

Op = tuple[str, int]


def _check_sizes(who: str, num_stages, num_microbatches, stage=None) -> None:
    """ValueError unless p >= 1, m >= 1 (integers) and, when given, 0 <= stage < p."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who} expects an integer {name} >= 1, got {value!r}.")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool)
                              or not 0 <= stage < num_stages):
        raise ValueError(f"{who} expects stage in 0 ... {num_stages - 1} (one of num_stages="
                         f"{num_stages}), got {stage!r}.")


def gpipe_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """GPipe: all forwards, then all backwards (each in micro-batch order)."""
    _check_sizes("gpipe_order", num_stages, num_microbatches, stage)
    return ([("F", i) for i in range(num_microbatches)]
            + [("B", i) for i in range(num_microbatches)])


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[Op]:
    """1F1B: warm-up forwards, then forward and backward in turn, then the last backwards."""
    _check_sizes("one_f_one_b_order", num_stages, num_microbatches, stage)
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
    _check_sizes("bubble_fraction", num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def check_order(order: Sequence, stage: int, num_microbatches: int) -> list[Op]:
    """``order`` as a list of ``(kind, microbatch)``, or ValueError saying what is wrong with it.

    Every ``("F", i)`` and ``("B", i)`` for i < m exactly once, and ``B(i)`` after ``F(i)``.
    """
    _check_sizes("check_order", 1, num_microbatches)
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


# ---- playing orders on every stage, as NCCL would run their messages --------------------------

#: a message between stages: (kind, micro-batch, part); part "shape" is micro-batch 0's header
Message = tuple[str, int, str]


def _receives(kind: str, i: int, s: int, p: int) -> list[list[tuple[str, int, Message]]]:
    """The receive batches op (kind, i) of stage s needs before it runs, in order."""
    if kind == "F" and s > 0:          # the activation: micro-batch 0's shape header first
        data = [[("recv", s - 1, ("F", i, "data"))]]
        return [[("recv", s - 1, ("F", 0, "shape"))]] + data if i == 0 else data
    if kind == "B" and s < p - 1:      # the gradient of this stage's output
        return [[("recv", s + 1, ("B", i, "data"))]]
    return []


def _sends(kind: str, i: int, s: int, p: int) -> list[tuple[str, int, Message]]:
    """What op (kind, i) of stage s sends once it has run."""
    if kind == "F" and s < p - 1:
        head = [("send", s + 1, ("F", 0, "shape"))] if i == 0 else []
        return head + [("send", s + 1, ("F", i, "data"))]
    if kind == "B" and s > 0:
        return [("send", s - 1, ("B", i, "data"))]
    return []


def p2p_program(ops: Sequence[Op], stage: int, num_stages: int, *,
                fused: bool = True) -> list[tuple]:
    """What ``PipelineStage`` does for ``ops``: ``("post", n, [(direction, peer, message)])``
    (batch n of point-to-point operations), ``("wait", n)`` and ``("compute", kind, i)``.

    ``fused=True`` is ``PipelineStage``: an op's sends wait for the next op and go out in one
    ``batch_isend_irecv`` with its receive (torch's ``Schedule1F1B`` fuses "send activation,
    receive gradient" so); with no receive to join they go alone, and are waited for (their
    buffers released) before the next batch. ``fused=False``: every send an ``isend`` of its
    own, waited for at the end of the step, every receive a blocking ``recv``.
    """
    program: list[tuple] = []
    pending: list = []      # sends of the last op, not posted yet
    alone: list[int] = []   # batches of sends posted alone, not waited for yet

    def post(batch: list) -> int:
        program.append(("post", len(program), batch))
        return program[-1][1]

    for kind, i in ops:
        receives = _receives(kind, i, stage, num_stages)
        if fused:
            program += [("wait", n) for n in alone]
            alone = []
            for k, batch in enumerate(receives):
                program.append(("wait", post((pending if k == 0 else []) + batch)))
            if pending and not receives:
                alone = [post(pending)]
            pending = []
        else:
            program += [("wait", post(batch)) for batch in receives]
        program.append(("compute", kind, i))
        if fused:
            pending = _sends(kind, i, stage, num_stages)
        else:
            alone += [post([send]) for send in _sends(kind, i, stage, num_stages)]
    program += [("wait", n) for n in alone]                # the end of the step
    if pending:
        program.append(("wait", post(pending)))
    return program


def _what(message: Message) -> str:
    kind, i, part = message
    return f"{kind}({i})'s " + ("shape" if part == "shape" else
                                "activation" if kind == "F" else "gradient")


def _describe(op: tuple[str, int, Message], stage: int) -> str:
    direction, peer, message = op
    if direction == "send":
        return f"stage {peer} to receive {_what(message)}"
    return f"{_what(message)} from stage {peer}"


def _mismatch(send: list, sender: int, recv: list, receiver: int) -> str:
    """A send and a receive that pair up on NCCL (the k-th of their link) but mean different
    messages: what each meant, and what the receiver would compute on."""
    carries, expects = _what(send[2]), _what(recv[2])
    runs = f"{recv[2][0]}({recv[2][1]})"
    return (f"messages out of order: stage {receiver}'s receive no. {recv[4] + 1} from stage "
            f"{sender} expects {expects}, but stage {sender}'s send no. {send[4] + 1} to stage "
            f"{receiver} carries {carries}. Messages between two ranks pair up in the order they "
            "are posted (NCCL has no tags; PipelineStage sends every message with tag 0 so that "
            f"gloo does the same): stage {receiver}'s {runs} would silently run on {carries}. "
            "Make every stage send in the order its neighbour receives.")


def _play(programs: list[list[tuple]], durations: list[dict[str, float]],
          comm_time: float) -> list[PipeEvent]:
    """Run every stage's program as NCCL runs point-to-point operations.

    Each stage's batches run one after another, in the order posted (one stream). An operation
    of the batch at the head of stage s completes when the head batch of its peer holds the
    matching one: a send does not finish before the peer has reached its receive. NCCL has no
    tags: the k-th send from s to r matches the k-th receive on r from s, whatever each meant
    to carry; when the two mean different messages, ValueError. A batch is done when all its
    operations are; a "wait" blocks the stage until then.
    """
    p = len(programs)
    pc, clock = [0] * p, [0.0] * p
    queue: list[list[dict]] = [[] for _ in range(p)]       # posted batches not done yet, in order
    done_at: list[dict[int, float]] = [{} for _ in range(p)]  # batch -> when it was done
    posted: dict[tuple[int, int, str], int] = {}           # (stage, peer, direction) -> count
    events: list[PipeEvent] = []

    def head(s: int) -> dict | None:
        """The batch stage s's stream is running now (with the time it started)."""
        if not queue[s]:
            return None
        batch = queue[s][0]
        if batch["start"] is None:
            batch["start"] = max(batch["posted"], max(done_at[s].values(), default=0.0))
        return batch

    progress = True
    while progress:
        progress = False
        for s in range(p):                                  # run each program until it blocks
            while pc[s] < len(programs[s]):
                action = programs[s][pc[s]]
                if action[0] == "post":        # each op: its place among the link's messages
                    ops = []
                    for direction, peer, message in action[2]:
                        place = posted.get((s, peer, direction), 0)
                        posted[s, peer, direction] = place + 1
                        ops.append([direction, peer, message, None, place])
                    queue[s].append({"n": action[1], "ops": ops, "posted": clock[s],
                                     "start": None})
                elif action[0] == "wait":
                    if action[1] not in done_at[s]:
                        break
                    clock[s] = max(clock[s], done_at[s][action[1]])
                else:
                    _, kind, i = action
                    took = durations[s][kind]                # stage s's op time
                    events.append(PipeEvent(s, kind, i, clock[s], clock[s] + took))
                    clock[s] += took
                pc[s] += 1
                progress = True
        for s in range(p):                                  # match the head batches' operations
            mine = head(s)
            for op in mine["ops"] if mine else []:
                direction, peer, message, finished, place = op
                theirs = head(peer) if finished is None else None
                want = ("recv" if direction == "send" else "send", s, place)  # the k-th: no tags
                match = next((o for o in theirs["ops"] if (o[0], o[1], o[4]) == want),
                             None) if theirs else None
                if match is not None:
                    if match[2] != message:                # NCCL would deliver it anyway
                        if direction == "send":
                            raise ValueError(_mismatch(op, s, match, peer))
                        raise ValueError(_mismatch(match, peer, op, s))
                    op[3] = match[3] = max(mine["start"], theirs["start"]) + comm_time
                    progress = True
        for s in range(p):                                  # retire the finished head batches
            while (batch := head(s)) is not None and all(op[3] is not None for op in batch["ops"]):
                done_at[s][batch["n"]] = max([batch["start"]] + [op[3] for op in batch["ops"]])
                queue[s].pop(0)
                progress = True
    if any(pc[s] < len(programs[s]) for s in range(p)):
        waits = []
        for s in range(p):
            if pc[s] == len(programs[s]):
                continue
            current = next((f"{a[1]}({a[2]})" for a in programs[s][pc[s]:] if a[0] == "compute"),
                           "the end of the step")
            blocked = [_describe(op[:3], s) for op in head(s)["ops"] if op[3] is None]
            waits.append(f"stage {s} waits in {current} for {' and '.join(blocked)}")
        raise ValueError("deadlock: " + "; ".join(waits) + ", which never comes (each stage's "
                         "operations run in order, as on NCCL).")
    return events


def simulate_schedule(order: Callable[[int, int, int], Sequence], num_stages: int,
                      num_microbatches: int, *, forward_time: float | Sequence[float] = 1.0,
                      backward_time: float | Sequence[float] = 2.0, comm_time: float = 0.0,
                      fused: bool = True) -> list[PipeEvent]:
    """Play ``order(stage, p, m)`` on every stage with fixed op times; the events it gives.

    ``forward_time`` and ``backward_time`` are one number for every stage (equal stages, the
    theory's assumption) or one per stage (stages as a measurement found them).

    Every stage runs its ops one at a time, in its order, with the point-to-point operations
    ``PipelineStage`` posts around them (``p2p_program``): F(i) on stage s needs the activation
    of F(i) on stage s - 1, B(i) the gradient of B(i) on stage s + 1, each ``comm_time`` after
    both sides reached it. Communication is modelled as NCCL runs it: a stage's operations run
    in order, a send completes only when the peer has reached the matching receive (unless
    they are in one batch), and the k-th send from one stage to another pairs with the k-th
    receive there, as NCCL pairs them (it has no tags). ``fused=False`` plays the unfused order
    instead (each send an ``isend`` of its own, each receive a blocking ``recv``), which
    deadlocks under 1F1B.

    Raises ValueError for an invalid order, when the stages wait on each other forever (a
    deadlock), naming what each stage waits for, or when a receive would get another message
    than the one it expects (sends and receives in different orders), naming both.
    """
    _check_sizes("simulate_schedule", num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    per_stage = {}
    for name, value in (("forward_time", forward_time), ("backward_time", backward_time)):
        values = list(value) if isinstance(value, Sequence) else [value] * p
        if len(values) != p:
            raise ValueError(f"simulate_schedule expects {name} to be one number or one per "
                             f"stage ({p}), got {len(values)} values: {value!r}.")
        per_stage[name] = values
    for name, values in (*per_stage.items(), ("comm_time", [comm_time])):
        for value in values:
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not 0 <= value < float("inf")):
                how = "" if name == "comm_time" else " (one number, or one per stage)"
                raise ValueError(f"simulate_schedule expects {name} to be a finite number >= 0, "
                                 f"got {value!r}{how}.")
    programs = [p2p_program(check_order(order(s, p, m), s, m), s, p, fused=fused)
                for s in range(p)]
    durations = [{"F": per_stage["forward_time"][s], "B": per_stage["backward_time"][s]}
                 for s in range(p)]
    events = _play(programs, durations, comm_time)
    return sorted(events, key=lambda e: (e.start, e.stage))


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
