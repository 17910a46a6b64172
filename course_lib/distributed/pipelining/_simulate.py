"""Pipeline orders played as NCCL runs their messages (``p2p_program``, ``simulate_schedule``),
kept out of ``schedules``, which re-exports both and plays its orders so before its first step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ._checks import Op, check_order, check_sizes
from .stage import PipeEvent

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


def _mismatch(send: list, sender: int, recv: list, receiver: int) -> str:
    """A send and a receive that pair up on NCCL but mean different messages."""
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
    """Run every stage's program as NCCL runs point-to-point operations: each stage's batches
    in the order posted (one stream); an operation completes when its peer's head batch holds
    the match (the k-th send from s to r pairs with the k-th receive on r: no tags)."""
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
            blocked = [f"stage {peer} to receive {_what(message)}" if direction == "send"
                       else f"{_what(message)} from stage {peer}"
                       for direction, peer, message, finished, _ in head(s)["ops"]
                       if finished is None]
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
    check_sizes("simulate_schedule", num_stages, num_microbatches)
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
