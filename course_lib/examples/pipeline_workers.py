"""Worker functions that notebook 12 (model and pipeline parallelism) hands to ``launch``.

Rank i runs stage i of a model cut with ``split_sequential``. Every rank builds the whole model
from the same seed, so each can also compute the oracle itself: one process, the whole model,
the whole batch (for a model with batch norm: the same micro-batches one after the other, since
batch norm's statistics are per micro-batch). Claims are asserted here, in the workers, so a
notebook cell that prints a result has also proved it.
"""
from __future__ import annotations

import copy
import random
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib._compare import _quantile
from course_lib.distributed.env import current_device
from course_lib.distributed.pipelining import (
    ActivationMeter,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    bubble_fraction,
    flatten_sequential,
    gpipe_order,
    idle_fraction,
    one_f_one_b_order,
    split_microbatches,
    split_sequential,
)
from course_lib.models.lenet import LeNet
from course_lib.models.resnet import resnet18
from course_lib.timing import bootstrap_ratio, keep_freed_memory

from .workers import _max_diff

__all__ = ["SCHEDULES", "activation_peaks", "bubble_table", "bubbles", "busy_seconds",
           "check_pipeline", "compare_to_control", "equal_blocks", "handoff_seconds",
           "in_sequence", "lenet_sequential", "median_step", "merge_ranks", "op_seconds",
           "pipeline_timelines", "ratio_over_control", "round_order", "sequential_model",
           "step_bubbles", "step_seconds", "step_spans", "torch_pipeline_step",
           "two_rank_example"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def lenet_sequential(seed: int = 0) -> nn.Sequential:
    """LeNet (``course_lib.models.lenet.LeNet``, the same weights for a seed) as 10 layers."""
    torch.manual_seed(seed)
    net = LeNet()
    return nn.Sequential(
        net.conv1, nn.ReLU(), nn.AvgPool2d(2),   # (B, 20, 13, 13)
        net.conv2, nn.ReLU(), nn.AvgPool2d(2),   # (B, 50, 4, 4)
        nn.Flatten(), net.fc1, nn.ReLU(),        # (B, 128)
        net.fc2,                                 # (B, 10)
    )


def equal_blocks(width: int, blocks: int, seed: int = 0) -> nn.Sequential:
    """A LayerNorm(width), then ``blocks`` identical layers, each Linear(width, width) then
    ReLU (inputs (B, width); the output scores ``width`` classes): 1 + blocks layers.

    Cut with ``balance=[1 + blocks // 2, blocks // 2]``, both stages compute the same: the
    cheap LayerNorm (it has weights, so the first block's input needs a gradient, as every
    later block's does) mirrors the loss on the last stage.
    """
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(width),
                         *[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(blocks)])


def sequential_model(name: str, seed: int = 0, **sizes: int) -> nn.Sequential:
    """``"lenet"`` (10 layers), ``"resnet18"`` (flattened: 14 layers), ``"mlp"`` (7 layers, a
    small MLP for fast tests: 7 -> 9 -> 6 -> 8 -> 3, tanh between) or ``"blocks"``
    (``equal_blocks``; pass ``width=`` and ``blocks=``)."""
    if name == "blocks":
        return equal_blocks(seed=seed, **sizes)
    if sizes:
        raise ValueError(f"sequential_model: sizes {sorted(sizes)} are for 'blocks' only, "
                         f"got them with {name!r}.")
    if name == "lenet":
        return lenet_sequential(seed)
    torch.manual_seed(seed)
    if name == "resnet18":
        return flatten_sequential(resnet18())
    if name == "mlp":
        return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 6), nn.Tanh(),
                             nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    raise ValueError("sequential_model expects 'lenet', 'resnet18', 'mlp' or 'blocks', got "
                     f"{name!r}.")


def _oracle_step(model: nn.Sequential, X: torch.Tensor, y: torch.Tensor, m: int,
                 lr: float) -> torch.Tensor:
    """One process, the whole model: gradient of the batch's mean loss, then an SGD step.

    With batch norm the micro-batches run one after the other (each normalised by its own
    statistics, as in the pipeline); without, the whole batch in one go.
    """
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        outputs = []
        for Xm, ym in zip(split_microbatches(X, m), split_microbatches(y, m)):
            out = model(Xm)
            (F.cross_entropy(out, ym) / m).backward()
            outputs.append(out.detach())
        out = torch.cat(outputs)
    else:
        out = model(X)
        F.cross_entropy(out, y).backward()
        out = out.detach()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return out


def check_pipeline(cases: Sequence[tuple[str, str, int, Sequence[int] | None]],
                   data: dict[str, tuple[torch.Tensor, torch.Tensor]], lr: float = 0.1,
                   seed: int = 0, dtype: torch.dtype = torch.float64) -> list:
    """Each case ``(model, schedule, micro-batches, balance)``: one pipeline step against the
    oracle; every rank asserts its stage's gradients and updated weights (and the last stage
    the output) equal the oracle's. ``data[model]`` is the batch ``(X, y)`` for that model.
    Model and inputs in ``dtype``: float64 by default, so that the two differ by rounding on
    any device (a GPU's float32 convolutions may run in TF32, and the pipeline's micro-batches
    need not take the kernels the whole batch takes).

    Returns this rank's ``{"case", "balance", "grad_diff", "weight_diff", "output_diff",
    "loss"}`` per case (the largest |pipeline - one process| of each).
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    device = current_device()
    results = []
    for name, schedule, m, balance in cases:
        model = sequential_model(name, seed).to(device, dtype)
        oracle = copy.deepcopy(model)
        stages = split_sequential(model, p, balance=balance)
        oracle_stages = split_sequential(oracle, p, balance=[len(s) for s in stages])
        stage = PipelineStage(stages[rank], rank, p, device)
        sched = SCHEDULES[schedule](stage, m, loss_fn=F.cross_entropy)
        losses: list[torch.Tensor] = []
        Xd, yd = data[name][0].to(device, dtype), data[name][1].to(device)
        out = sched.step(Xd, target=yd, losses=losses) if p == 1 else (
            sched.step(Xd) if stage.is_first else
            sched.step(target=yd, losses=losses) if stage.is_last else sched.step())
        grads = [q.grad.clone() for q in stages[rank].parameters()]
        with torch.no_grad():
            for q in stages[rank].parameters():
                q -= lr * q.grad
        want_out = _oracle_step(oracle, Xd, yd, m, lr)
        mine, theirs = list(stages[rank].parameters()), list(oracle_stages[rank].parameters())
        want_grads = [q.grad for q in theirs]
        torch.testing.assert_close(grads, want_grads)    # the oracle: gradients ...
        torch.testing.assert_close(mine, theirs)         # ... and the weights after the step
        result = {"case": (name, schedule, m), "balance": [len(s) for s in stages],
                  "grad_diff": _max_diff(grads, want_grads), "weight_diff": _max_diff(mine, theirs)}
        if stage.is_last:
            torch.testing.assert_close(out, want_out)
            result["output_diff"] = (out - want_out).abs().max().item()
            result["loss"] = torch.stack(losses).mean().item()
        results.append(result)
    return results


def two_rank_example(X: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict:
    """The two-rank pipeline of section 4, by hand with ``dist.send`` / ``dist.recv``.

    Rank 0 holds layer 1 (flatten, linear 784 -> 128, ReLU) and sends its activation; rank 1
    holds layer 2 (linear 128 -> 10), computes the loss, and sends the activation's gradient
    back; each rank updates its own layer. Both check against one process with both layers.
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer1 = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU())
    layer2 = nn.Linear(128, 10)
    whole = copy.deepcopy(nn.Sequential(layer1, layer2))    # the oracle, in every rank
    F.cross_entropy(whole(X), y).backward()
    if rank == 0:
        h = layer1(X)                                      # (B, 128)
        dist.send(h.detach(), dst=1)                       # activation forward
        dh = torch.empty_like(h)
        dist.recv(dh, src=1)                               # its gradient comes back
        h.backward(dh)                                     # the rest of the chain rule
        mine, theirs = layer1, whole[0]
        sent = {"activation sent": list(h.shape)}
    else:
        h = torch.empty(len(X), 128)                       # shape known in advance
        dist.recv(h, src=0)
        h.requires_grad_(True)                             # we want dloss/dh
        loss = F.cross_entropy(layer2(h), y)
        loss.backward()                                    # layer2's grads and h.grad
        dist.send(h.grad, dst=0)                           # gradient backward
        mine, theirs = layer2, whole[1]
        sent = {"gradient sent": list(h.grad.shape), "loss": loss.item()}
    grads = [q.grad for q in mine.parameters()]
    want = [q.grad for q in theirs.parameters()]
    torch.testing.assert_close(grads, want)
    with torch.no_grad():
        for q in mine.parameters():
            q -= lr * q.grad
    return {"rank": rank, "params": sum(q.numel() for q in mine.parameters()),
            "grad_diff": _max_diff(grads, want), **sent}


def _run_step(sched, stage: PipelineStage, X: torch.Tensor, y: torch.Tensor) -> None:
    sched.step(*([X] if stage.is_first else []), target=y if stage.is_last else None)


def _this_ranks_stage(model: str, balance, sizes: dict | None = None
                      ) -> tuple[list, PipelineStage]:
    rank, p, device = dist.get_rank(), dist.get_world_size(), current_device()
    net = sequential_model(model, **(sizes or {})).to(device)
    stages = split_sequential(net, p, balance=balance)
    return stages, PipelineStage(stages[rank], rank, p, device)


def round_order(configs: Sequence[tuple[str, int]], i: int, seed: int = 0
                ) -> list[tuple[str, int]]:
    """The order in which round ``i`` runs ``configs`` (``(schedule, m)`` pairs): the m's in an
    order shuffled by ``random.Random(seed + i)``, and for each m its schedules back to back,
    in the order given on even rounds and reversed on odd ones. The same on every rank."""
    by_m: dict[int, list[tuple[str, int]]] = {}
    for key in configs:
        by_m.setdefault(key[1], []).append(key)
    ms = list(by_m)
    random.Random(seed + i).shuffle(ms)
    return [key for m in ms for key in (by_m[m] if i % 2 == 0 else by_m[m][::-1])]


def pipeline_timelines(X: torch.Tensor, y: torch.Tensor, microbatches: Sequence[int],
                       schedules: Sequence[str] = ("gpipe", "1f1b"), balance=None,
                       steps: int = 5, warmup: int = 2, model: str = "lenet",
                       sizes: dict | None = None) -> dict:
    """Time pipeline steps: for each schedule and micro-batch count, this rank's events.

    The configurations run interleaved, one step of each per round (``round_order``: the m's in a
    seeded shuffled order, the two schedules of one m back to back, which first alternating), so
    that what slows the machine for a while slows them all and step i of two configurations can be
    compared as a pair (``timing.bootstrap_ratio``). The first ``warmup`` rounds are not recorded;
    every step starts after a barrier. Returns ``{(schedule, m): [events of each step]}``, this
    rank's ``PipeEvent``s (``time.perf_counter`` seconds: one clock for every process of the
    machine; ``merge_ranks`` joins the ranks). ``sizes`` go to ``sequential_model``.
    """
    rank = dist.get_rank()
    keep_freed_memory()   # no page faults that depend on what ran before (as stage_costs)
    stages, stage = _this_ranks_stage(model, balance, sizes)
    configs = [(schedule, m) for schedule in schedules for m in microbatches]
    scheds = {key: SCHEDULES[key[0]](stage, key[1], loss_fn=F.cross_entropy) for key in configs}
    out: dict = {key: [] for key in configs}
    try:
        for i in range(warmup + steps):
            for key in round_order(configs, i):         # one step of each, in turn
                dist.barrier()
                stage.events, stage.record = [], i >= warmup
                _run_step(scheds[key], stage, X, y)
                stages[rank].zero_grad()
                if stage.record:
                    out[key].append(stage.events)
    finally:
        stage.record = False
    return out


def activation_peaks(X: torch.Tensor, y: torch.Tensor, microbatches: Sequence[int],
                     schedules: Sequence[str] = ("gpipe", "1f1b"), balance=None,
                     model: str = "lenet") -> dict:
    """Peak bytes of activations on this rank's stage, per (schedule, m), during one step (after a
    warm-up step): ``{(schedule, m): {"saved", "held", "cuda"}}``. ``ActivationMeter`` counts
    ``"saved"``, the tensors saved for backward, and ``"held"``, those and the buffers held for
    sends (each once); on a GPU ``"cuda"`` is ``torch.cuda.max_memory_allocated`` over the step
    minus what was allocated before it (else None).
    """
    rank = dist.get_rank()
    stages, stage = _this_ranks_stage(model, balance)
    device = stage.device
    out: dict = {}
    for schedule in schedules:
        for m in microbatches:
            sched = SCHEDULES[schedule](stage, m, loss_fn=F.cross_entropy)
            _run_step(sched, stage, X, y)                   # warm-up
            stages[rank].zero_grad(set_to_none=False)
            cuda = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            with ActivationMeter(exclude=stages[rank].parameters()) as meter:
                stage.meter = meter                         # count the buffers held for sends
                try:
                    _run_step(sched, stage, X, y)
                finally:
                    stage.meter = None
            if device.type == "cuda":
                cuda = torch.cuda.max_memory_allocated(device) - before
            stages[rank].zero_grad(set_to_none=False)
            assert meter.alive == 0, "saved activations or send buffers outlived the step"
            out[(schedule, m)] = {"saved": meter.saved_peak, "held": meter.peak, "cuda": cuda}
    return out


def step_seconds(runs: Sequence[Sequence]) -> float:
    """Median span of steps given as lists of events from every stage (first start to last end)."""
    return statistics.median(_span(run) for run in runs)


def _span(events: Sequence) -> float:
    return max(e.end for e in events) - min(e.start for e in events)


def step_spans(runs: Sequence[Sequence]) -> list[float]:
    """Each step's span, first op's start to last op's end, in seconds, in the order they ran."""
    return [_span(run) for run in runs]


def busy_seconds(runs: Sequence[Sequence], stage: int | None = None) -> float:
    """Median over steps of the time spent computing (the ops' durations summed), on one stage
    or (``None``) on all stages together."""
    return statistics.median(sum(e.end - e.start for e in run if stage in (None, e.stage))
                             for run in runs)


def step_bubbles(runs: Sequence[Sequence]) -> list[float]:
    """The measured idle fraction (``idle_fraction``) of each step, in the order they ran."""
    return [idle_fraction(run) for run in runs]


def bubbles(runs: Sequence[Sequence]) -> float:
    """Median measured idle fraction of steps given as lists of events from every stage."""
    return statistics.median(step_bubbles(runs))


def median_step(runs: Sequence[Sequence]) -> list:
    """The step whose idle fraction is the median of the steps' (the lower of the two middle
    ones for an even count): a typical step to draw, not the last or the best."""
    ranked = sorted(range(len(runs)), key=lambda i: idle_fraction(runs[i]))
    return list(runs[ranked[(len(runs) - 1) // 2]])


def op_seconds(runs: Sequence[Sequence]) -> dict[tuple[int, str], float]:
    """``{(stage, kind): median seconds}`` of every forward ("F") and backward ("B") op, over
    all micro-batches of all steps: how long each stage computes one micro-batch."""
    durations: dict[tuple[int, str], list[float]] = {}
    for run in runs:
        for e in run:
            durations.setdefault((e.stage, e.kind), []).append(e.end - e.start)
    return {key: statistics.median(d) for key, d in sorted(durations.items())}


def handoff_seconds(runs: Sequence[Sequence]) -> list[float]:
    """Measured hand-offs: from the end of an op to the start of the op of the neighbouring
    stage that waited for its result (the activation of F(i) on stage s - 1 for F(i) on stage
    s, the gradient of B(i) on stage s + 1 for B(i) on stage s), counted only when that stage
    sat idle, its previous op done before the result was. What passing one result on costs
    here: the message, and the Python around posting and receiving it."""
    lags = []
    for run in runs:
        by_op = {(e.stage, e.kind, e.microbatch): e for e in run}
        per_stage: dict[int, list] = {}
        for e in sorted(run, key=lambda e: e.start):
            per_stage.setdefault(e.stage, []).append(e)
        for events in per_stage.values():
            for k, e in enumerate(events):
                source = by_op.get((e.stage + (-1 if e.kind == "F" else 1), e.kind,
                                    e.microbatch))
                if source is None:                  # the first stage's forward, the last's B
                    continue
                ready = events[k - 1].end if k else float("-inf")
                if ready <= source.end:             # this stage waited for the result
                    lags.append(e.start - source.end)
    return lags


def merge_ranks(per_rank: Sequence[dict]) -> dict:
    """``pipeline_timelines``' results of every rank joined: ``{key: [events of each step]}``,
    each step's list holding every stage's events."""
    return {key: [[e for rank in per_rank for e in rank[key][i]]
                  for i in range(len(per_rank[0][key]))] for key in per_rank[0]}


def in_sequence(calls: Sequence[tuple]) -> list:
    """Several workers of this module in one launch (one process group, one start-up):
    ``calls`` is ``[(fn, *args), ...]``; returns this rank's result of each, in order."""
    results = []
    for fn, *args in calls:
        dist.barrier()   # every rank starts each call together
        results.append(fn(*args))
    return results


def bubble_table(runs: dict, title: str) -> dict:
    """Print, per ``(schedule, m)`` of ``runs`` (two stages, ``merge_ranks``' form): the
    theory's bubble, the measured idle share's median [min, max] over steps, the median step
    time and each stage's busy time. Returns ``{(schedule, m): median idle share}``."""
    print(title)
    print(f"{'schedule':>8} {'m':>2} {'theory':>7} {'measured: median [min, max]':>28} "
          f"{'step ms':>8} {'busy ms, stage 0 / 1':>21}")
    medians = {}
    for (schedule, m), r in runs.items():
        b = step_bubbles(r)                                 # one idle share per step
        medians[schedule, m] = statistics.median(b)
        busy = [busy_seconds(r, s) * 1e3 for s in (0, 1)]
        print(f"{schedule:>8} {m:>2} {bubble_fraction(2, m):>7.3f} "
              f"{medians[schedule, m]:>11.3f} [{min(b):.3f}, {max(b):.3f}] "
              f"{step_seconds(r) * 1e3:>11.1f} {busy[0]:>10.1f} / {busy[1]:.1f}")
    return medians


def ratio_over_control(a: Sequence[float], b: Sequence[float], a0: Sequence[float],
                       b0: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float, float]:
    """``(median(a) / median(b)) / (median(a0) / median(b0))``, a ratio over its control's, with
    a percentile bootstrap interval: ``(ratio, low, high)``. Sample i of all four lists was taken
    in round i, so rounds are resampled whole, all four together (as ``timing.bootstrap_ratio``
    does for two): the interval carries the control's own spread, and a load that slows one round
    cancels.
    """
    samples = [list(a), list(b), list(a0), list(b0)]
    n = len(samples[0])
    if n == 0 or any(len(x) != n for x in samples):
        raise ValueError(f"ratio_over_control needs four equally long, non-empty lists (one "
                         f"sample per round), got {[len(x) for x in samples]}.")

    def of(idx: Sequence[int]) -> float:
        ma, mb, ma0, mb0 = (statistics.median(x[i] for i in idx) for x in samples)
        return (ma / mb) / (ma0 / mb0)

    rng = random.Random(seed)
    boot = sorted(of([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low, high = (_quantile(boot, q) for q in (tail, 1 - tail))
    return of(range(n)), low, high


def _ratio_text(x: float) -> str:
    """A ratio to 4 decimals; one that rounds to 1 without being 1 prints as "< 1" or "> 1",
    so that a bound shown next to "below 1" or "above 1" never reads as 1."""
    text = f"{x:.4f}"
    if text == "1.0000" and x != 1:
        return "< 1" if x < 1 else "> 1"
    return text


def compare_to_control(runs: dict, microbatches: Sequence[int]) -> dict:
    """1F1B's step time over GPipe's at each m, divided by the same ratio at m = 1, the control.

    At m = 1 the two schedules run the same order: their ratio there is what this timing gives for
    no difference in the work. The ratio of ratios gets a 95% bootstrap interval, rounds resampled
    together (``ratio_over_control``); a difference is called only where it excludes 1 ("1F1B
    faster" below, "1F1B slower" above), and the line then adds 1F1B / GPipe of the median busy and
    idle time. The first m must be 1. Prints ratios to 4 decimals (a bound that would round to 1
    prints as "< 1" or "> 1"). Returns ``{m: (ratio, low, high)}``: 1F1B / GPipe at m = 1, the
    ratio over the control at every m > 1.
    """
    if microbatches[0] != 1:
        raise ValueError(f"compare_to_control needs m = 1 first (the control), got "
                         f"{list(microbatches)}.")
    if any(gpipe_order(s, 2, 1) != one_f_one_b_order(s, 2, 1) for s in (0, 1)):
        raise AssertionError("at m = 1 the two schedules should run the same order")
    spans = {key: step_spans(r) for key, r in runs.items()}
    rounds = len(spans["gpipe", 1])   # one step of each configuration per round
    out = {1: bootstrap_ratio(spans["1f1b", 1], spans["gpipe", 1])}
    control, low, high = out[1]
    print(f"control, m=1 (the same order): step time 1F1B / GPipe {_ratio_text(control)} "
          f"[{_ratio_text(low)}, {_ratio_text(high)}] (95% bootstrap interval over {rounds} "
          "rounds)")
    print("  1F1B / GPipe at m, over the control (rounds resampled together):")
    for m in microbatches[1:]:
        out[m] = r, lo, hi = ratio_over_control(spans["1f1b", m], spans["gpipe", m],
                                                spans["1f1b", 1], spans["gpipe", 1])
        verdict = (f"below 1: 1F1B faster in these {rounds} rounds" if hi < 1 else
                   f"above 1: 1F1B slower in these {rounds} rounds" if lo > 1
                   else f"includes 1: no difference measurable in these {rounds} rounds")
        where = ""
        if not lo <= 1 <= hi:   # a difference called: in the computing or in the waiting?
            (busy, idle), (busy_g, idle_g) = (_busy_and_idle(runs[s, m]) for s in ("1f1b", "gpipe"))
            where = f"; medians 1F1B / GPipe: busy {busy / busy_g:.2f}, idle {idle / idle_g:.2f}"
        print(f"  m={m}: {_ratio_text(r)} [{_ratio_text(lo)}, {_ratio_text(hi)}]: {verdict}{where}")
    return out


def _busy_and_idle(runs: Sequence[Sequence], stages: int = 2) -> tuple[float, float]:
    """Median over steps of the time all stages computed, and of the time they sat idle
    (stages x the step's span, less the busy time), in seconds."""
    busy = [sum(e.end - e.start for e in run) for run in runs]
    idle = [stages * _span(run) - b for run, b in zip(runs, busy)]
    return statistics.median(busy), statistics.median(idle)


def torch_pipeline_step(name: str, schedule: str, m: int, X: torch.Tensor, y: torch.Tensor,
                        balance: Sequence[int] | None = None, lr: float = 0.1, seed: int = 0,
                        dtype: torch.dtype = torch.float64) -> dict:
    """One step of torch's own ``torch.distributed.pipelining`` (``PipelineStage`` and
    ``ScheduleGPipe`` or ``Schedule1F1B``) on the model cut as the course cuts it, asserted
    equal to the course's ``PipelineStage`` and schedule on the same cut and to one process on
    the whole batch: this rank's gradients, and its weights after an SGD step.

    torch's schedule divides each micro-batch's gradient by m (``scale_grads=True``), so with a
    mean loss the gradient is the whole batch's mean loss, as in the course's schedules.

    Returns this rank's ``{"stage", "layers", "vs_course", "vs_one_process"}``: the largest
    |gradient difference| against each (and ``"output_diff"`` on the last stage).
    """
    from torch.distributed import pipelining as tp  # torch's own; imported here: it is slow

    rank, p, device = dist.get_rank(), dist.get_world_size(), current_device()
    model = sequential_model(name, seed).to(device, dtype)
    course, oracle = copy.deepcopy(model), copy.deepcopy(model)
    stages = split_sequential(model, p, balance=balance)
    cut = [len(s) for s in stages]
    course_stages = split_sequential(course, p, balance=cut)
    oracle_stages = split_sequential(oracle, p, balance=cut)
    Xd, yd = X.to(device, dtype), y.to(device)
    first, last = rank == 0, rank == p - 1

    # torch's: its stage infers the shapes it receives from the first micro-batch
    stage = tp.PipelineStage(stages[rank], rank, p, device)
    torch_schedule = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B}[schedule]
    sched = torch_schedule(stage, m, loss_fn=F.cross_entropy)
    out = (sched.step(Xd, target=yd) if first and last else sched.step(Xd) if first else
           sched.step(target=yd) if last else sched.step())
    dist.barrier()
    # the course's, on the same cut and the same weights
    mine = PipelineStage(course_stages[rank], rank, p, device)
    _run_step(SCHEDULES[schedule](mine, m, loss_fn=F.cross_entropy), mine, Xd, yd)
    want_out = _oracle_step(oracle, Xd, yd, m, lr)    # one process, the whole batch, SGD step

    grads = [q.grad.clone() for q in stages[rank].parameters()]
    course_grads = [q.grad for q in course_stages[rank].parameters()]
    oracle_grads = [q.grad for q in oracle_stages[rank].parameters()]
    torch.testing.assert_close(grads, course_grads)   # torch's pipeline = the course's ...
    torch.testing.assert_close(grads, oracle_grads)   # ... = one process on the whole batch
    with torch.no_grad():
        for q in stages[rank].parameters():
            q -= lr * q.grad
    torch.testing.assert_close(list(stages[rank].parameters()),
                               list(oracle_stages[rank].parameters()))   # the updated weights
    result = {"stage": rank, "layers": cut[rank], "vs_course": _max_diff(grads, course_grads),
              "vs_one_process": _max_diff(grads, oracle_grads)}
    if last:
        torch.testing.assert_close(out, want_out)
        result["output_diff"] = (out - want_out).abs().max().item()
    return result
