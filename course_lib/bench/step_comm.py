"""A data-parallel step's all-reduces, timed beside the step itself, at 2 ranks (lesson 10).

``measure_step_comm(models)`` runs one launch of 2 ranks (gloo on a CPU, one worker per core)
and, for each model, times interleaved in the same processes (``course_lib.timing.compare``):

- ``local``: each rank's step on its shard, no wrapper, no communication (the compute);
- ``naive``: the course's ``DistributedDataParallel``, one all-reduce per parameter after
  backward;
- ``bucketed``: the course's DDP, one all-reduce per bucket, launched during backward;
- ``naive_nosend`` and ``bucketed_nosend``: the same wrappers with ``divide_only_hook``, a
  communication hook that does what the default one does but send. ``naive_nosend - local`` is
  what the wrapper's own work costs (copies into buckets, hooks, copies back);
  ``naive - naive_nosend`` what the all-reduces cost inside the step.

Then, in a second comparison, the very messages each strategy sent (read from its buckets after
the warm-up steps), all-reduced alone, back to back, no computation: what the alpha-beta model
predicts. Last, ``local`` steps once more, the ranks meeting at a barrier before each, as a DDP
step's collectives make them meet: each rank's duration of each step, from which
``slower_rank_wait`` gives what waiting for the slower rank costs per step. And ``bucketed``'s
calls one by one (``_call_stamps``): every rank reads the clock as each all-reduce starts and
ends and as its last gradient is accumulated, in steps and in rounds of the same messages alone,
blocks of each back to back, so that one sees which calls run during backward and which after.
Buffers are not broadcast (``broadcast_buffers=False``), so the only communication of a step is
its gradients'.
PyTorch counterpart: none (``torch.profiler`` would show the same all-reduces on a timeline).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..devices import cpu_cores, synchronize
from ..distributed import current_device, launch
from ..distributed.env import _pin_to_cores, _slowest
from ..models.lenet import LeNet
from ..models.resnet import resnet18
from ..parallel._ddp_comm_hooks import SlowLink, divide_only_hook, slow_link_hook
from ..parallel.ddp import DistributedDataParallel
from ..timing import bootstrap_median, compare  # bootstrap_median: public here too

__all__ = ["BUCKET_CAPS_MB", "STEP_MODELS", "STAMPED_MODELS", "STRATEGIES_TIMED",
           "bootstrap_median", "measure_bucket_caps", "measure_step_comm", "divide_only_hook",
           "slower_rank_wait"]

#: model -> (builder, bucket cap in MiB, global batch, global batch in quick mode). LeNet's
#: buckets are capped at 0.1 MiB so that its 0.49 MiB of gradients make several; ResNet-18 runs
#: a small batch: its 43 MiB of gradients cost the same whatever the batch.
STEP_MODELS: dict[str, tuple[Callable[[], nn.Module], float, int, int]] = {
    "lenet": (LeNet, 0.1, 256, 64), "resnet18": (resnet18, 25.0, 16, 4)}
#: The models whose bucketed calls are stamped one by one (``bucketed_calls``).
STAMPED_MODELS = ("lenet", "resnet18")
#: The course's DDP strategies timed, beside ``local`` (each also as ``<name>_nosend``).
STRATEGIES_TIMED = ["naive", "bucketed"]
#: ``bucketed``'s caps swept by ``measure_bucket_caps``, MiB: torch's default (25) in the middle;
#: ResNet-18's 42.6 MiB of gradients fit one bucket under the largest.
BUCKET_CAPS_MB = (1.0, 5.0, 25.0, 64.0)


def _stepper(net: nn.Module, X: torch.Tensor, y: torch.Tensor,
             lr: float = 0.01) -> Callable[[], None]:
    """One SGD training step of ``net`` on (X, y)."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(net(X), y).backward()
        opt.step()
    return step


def slower_rank_wait(durations: list[list[float]]) -> float:
    """Seconds per step that meeting every step costs, from each rank's step durations
    (``durations[rank][step]``, the ranks starting each step together): the mean over steps of
    the slowest rank's duration, less the slowest rank's mean duration. A DDP step waits at its
    collectives for whichever rank is slower at that step; ranks that meet only at the end of a
    loop wait once, for the rank slower over the whole loop. 0 when one rank is the slower at
    every step."""
    if len({len(d) for d in durations}) != 1 or not durations or not durations[0]:
        raise ValueError(f"slower_rank_wait needs the same number (>= 1) of steps from every "
                         f"rank, got {[len(d) for d in durations]}.")
    per_step = statistics.fmean(max(step) for step in zip(*durations))
    return per_step - max(statistics.fmean(d) for d in durations)


def _all_reduce_each(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """One blocking all-reduce of each tensor, one after another."""
    def one_round() -> None:
        for t in tensors:
            dist.all_reduce(t)
    return one_round


def _met_steps(step: Callable[[], None], steps: int, device: torch.device) -> list[list[float]]:
    """Every rank's duration of each of ``steps`` calls of ``step``, after a barrier each."""
    mine = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        synchronize(device)
        mine.append(time.perf_counter() - start)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _call_stamps(net: nn.Module, X: torch.Tensor, y: torch.Tensor,
                 tensors: list[torch.Tensor], blocks: int, device: torch.device,
                 per_block: int = 4) -> dict | None:
    """``net`` (a course DDP) steps on (X, y) and its messages (``tensors``) all-reduced alone,
    in alternating blocks of ``per_block`` steps and ``per_block`` rounds, each block after a
    barrier and back to back inside, as the timed loops run them; every rank reads the clock as
    each step (or round) begins, as each all-reduce starts and its result is ready, and as each
    gradient is made, before DDP's hook takes it (the latest kept: backward's end). On rank 0
    ``{"step" | "alone": [round][rank] -> {"begin": s, "calls": [[start, end], ...],
    "backward_end": s or None}}``, seconds from the round's earliest begin over the ranks; None
    on the other ranks."""
    mine: dict[str, list[dict]] = {"step": [], "alone": []}

    def grad_ready(grad: torch.Tensor) -> None:   # p's gradient made, before DDP's hook sees it
        mine["step"][-1]["backward_end"] = time.perf_counter()   # the last: backward's end

    def launch_stamped(t: torch.Tensor, calls: list) -> torch.futures.Future:
        start = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            synchronize(device)
            calls.append([start, time.perf_counter()])
            return fut.value()[0]
        return dist.all_reduce(t, async_op=True).get_future().then(done)

    def hook(process_group, bucket) -> torch.futures.Future:   # allreduce_hook, stamped
        return launch_stamped(bucket.buffer(), mine["step"][-1]["calls"]).then(
            lambda f: f.value().div_(dist.get_world_size()))

    def alone() -> None:
        for t in tensors:
            launch_stamped(t, mine["alone"][-1]["calls"]).wait()

    net.register_comm_hook(None, hook)
    for p in net.module.parameters():   # a tensor hook runs before accumulation, so before the
        p.register_hook(grad_ready)       # bucket holding the last gradient is launched
    step = _stepper(net, X, y)
    for _ in range(blocks + 1):           # the first block: the hook's warm-up, not kept
        for name, run in (("step", step), ("alone", alone)):
            dist.barrier()
            for _ in range(per_block):
                mine[name].append({"begin": time.perf_counter(), "calls": [],
                                   "backward_end": None})
                run()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {name: rounds[per_block:] for name, rounds in mine.items()})
    if dist.get_rank() != 0:
        return None
    out: dict[str, list] = {}
    for name in mine:
        out[name] = []
        for ranks in zip(*(e[name] for e in every)):
            zero = min(r["begin"] for r in ranks)
            out[name].append([{"begin": r["begin"] - zero,
                               "calls": [[s - zero, e - zero] for s, e in r["calls"]],
                               "backward_end": None if r["backward_end"] is None
                               else r["backward_end"] - zero} for r in ranks])
    return out


def _ready_times(net: nn.Module, X: torch.Tensor, y: torch.Tensor, steps: int,
                 device: torch.device) -> list[float]:
    """Seconds from the call of ``backward()`` to each parameter's gradient being accumulated,
    in ``net.parameters()`` order, the median over ``steps`` SGD steps (a clean ``net``)."""
    seen: list[list[float]] = [[] for _ in net.parameters()]
    start = [0.0]
    for i, p in enumerate(net.parameters()):
        p.register_post_accumulate_grad_hook(
            lambda _, i=i: seen[i].append(time.perf_counter() - start[0]))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(net(X), y)
        synchronize(device)
        start[0] = time.perf_counter()
        loss.backward()   # on a GPU the stamps are the launches: the host's view
        opt.step()
    return [statistics.median(t) for t in seen]


def _priced_link_hook(state: tuple[SlowLink, float, float], bucket) -> torch.futures.Future:
    """``slow_link_hook`` over a link whose time per message is ``latency_s`` plus its bytes at
    ``seconds_per_byte``: ``state = (link, latency_s, seconds_per_byte)``."""
    link, latency_s, per_byte = state
    buffer = bucket.buffer()
    link.latency_s = latency_s + buffer.numel() * buffer.element_size() * per_byte
    return slow_link_hook(link, bucket)


def _rank_setup(model: str, quick: bool, threads: int) -> tuple[torch.device, nn.Module,
                                                                  torch.Tensor, torch.Tensor]:
    """In a rank: pinned to its cores with ``threads`` threads on a CPU; ``model``'s network
    (the same start on every rank) and this rank's shard of its batch, on the rank's device."""
    _pin_to_cores()                      # on a CPU, each rank on cores of its own
    device, rank, k = current_device(), dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(threads)   # a worker is `threads` cores
    build, _, batch, quick_batch = STEP_MODELS[model]
    torch.manual_seed(0)
    base = build().to(device)
    g = torch.Generator().manual_seed(1 + rank)
    n = (quick_batch if quick else batch) // k
    X = torch.randn(n, 1, 28, 28, generator=g).to(device)   # (B/k, 1, 28, 28)
    y = torch.randint(0, 10, (n,), generator=g).to(device)  # (B/k,)
    return device, base, X, y


def _bucket_caps_worker(model: str, caps: list[float], link: tuple[float, float] | None,
                        link_caps: list[float], quick: bool, threads: int, samples: int,
                        min_sample_s: float) -> dict | None:
    """Runs in both ranks: ``local`` and ``bucketed`` at each cap (and over a priced link at
    each of ``link_caps``), interleaved; each cap's buckets (bytes, and when each is full from
    the local backward's gradient stamps)."""
    device, base, X, y = _rank_setup(model, quick, threads)
    rank, k = dist.get_rank(), dist.get_world_size()
    n = X.shape[0]
    nets: dict[str, nn.Module] = {"local": copy.deepcopy(base)}
    links, by_cap = [], {}
    for prefix, these in (("cap", caps), ("link cap", link_caps if link else [])):
        for cap in these:
            net = DistributedDataParallel(copy.deepcopy(base), strategy="bucketed",
                                          bucket_cap_mb=cap, broadcast_buffers=False)
            if prefix == "link cap":
                links.append(SlowLink(0.0))
                net.register_comm_hook((links[-1], *link), _priced_link_hook)
            nets[f"{prefix} {cap:g}"] = net
            by_cap.setdefault(cap, net)      # one net per cap: its buckets are the cap's
    steppers = {name: _stepper(net, X, y) for name, net in nets.items()}
    for name in nets:           # two steps each: the buckets rebuilt in arrival order
        steppers[name]()
        steppers[name]()
    ready = _ready_times(copy.deepcopy(base), X, y, max(3, samples // 2), device)
    every: list = [None] * k
    dist.all_gather_object(every, ready)     # the slower rank fills each bucket last
    ready = [max(r) for r in zip(*every)]
    buckets = {}
    for cap, ddp in by_cap.items():
        index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        buckets[cap] = {
            "bytes": [sum(b.numels) * b.parameters()[0].element_size()
                      for b in ddp.reducer.buckets],
            "ready": [max(ready[index[id(p)]] for p in b.parameters())
                      for b in ddp.reducer.buckets]}
    steps = compare(steppers, samples=samples, min_sample_seconds=min_sample_s, warmup=2,
                    calibration_calls=2, baseline="local", device=device, before=dist.barrier,
                    reduce=_slowest)
    for lk in links:
        lk.close()
    if rank != 0:
        return None
    return {"model": model, "global_batch": n * k, "caps_mb": list(caps),
            "link_caps_mb": list(link_caps) if link else [], "link": list(link) if link else None,
            "buckets": buckets, "backward_end": max(ready),
            "step": {name: v["seconds"] for name, v in steps.to_json()["variants"].items()}}


def measure_bucket_caps(model: str = "resnet18", caps: tuple[float, ...] = BUCKET_CAPS_MB, *,
                        link: tuple[float, float] | None = None,
                        link_caps: tuple[float, ...] = BUCKET_CAPS_MB, quick: bool = False,
                        samples: int = 7, min_sample_s: float = 0.2,
                        timeout: float = 600.0) -> dict:
    """Time ``model``'s ``bucketed`` step at each bucket cap against ``local``, 2 ranks; with
    ``link``, also at each of ``link_caps`` over a link with a time of its own.

    Args:
        model: a name from ``STEP_MODELS``.
        caps: bucket caps in MiB, each > 0.
        link: ``(latency_s, seconds_per_byte)``: each bucket's real all-reduce, handed back
            (``SlowLink``) once a link that carries one message at a time has spent
            ``latency_s + bytes * seconds_per_byte`` on it, a sleep in a thread that uses no
            core, as a network's own hardware does (variants ``"link cap <c>"``).
        link_caps: the caps timed over the link.
        quick: the small batch of ``STEP_MODELS``.
        samples: rounds of the comparison (each variant one sample per round).
        min_sample_s: each sample loops for at least about this long.
        timeout: seconds for the launch.

    Returns:
        ``{"model", "global_batch", "caps_mb", "link_caps_mb", "link", "step": {"local" |
        "cap <c>" | "link cap <c>": [seconds per step, ...]} (samples paired by round),
        "buckets": {cap: {"bytes": [...], "ready": [...]}} (every cap of both lists; each
        bucket in launch order: its bytes, and the seconds from the call of backward to its
        last gradient in a local step, the slower rank's, median over steps), "backward_end":
        the latest of those stamps, "threads_per_worker"}``.
    """
    if model not in STEP_MODELS:
        raise ValueError(f"measure_bucket_caps: model must be one of {list(STEP_MODELS)}, got "
                         f"{model!r}.")
    for name, these in (("caps", caps), ("link_caps", link_caps)):
        if not these or any(not isinstance(c, (int, float)) or isinstance(c, bool) or c <= 0
                            for c in these) or len(set(these)) != len(these):
            raise ValueError(f"measure_bucket_caps: {name} must be distinct numbers of MiB > 0, "
                             f"got {these!r}.")
    if link is not None and (len(link) != 2 or any(
            not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 <= x < math.inf
            for x in link)):
        raise ValueError(f"measure_bucket_caps: link must be (latency_s, seconds_per_byte), "
                         f"two finite numbers >= 0, got {link!r}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"measure_bucket_caps: samples must be an integer >= 2, got "
                         f"{samples!r}.")
    threads = max(1, cpu_cores() // 2)
    out = launch(_bucket_caps_worker, 2, model, [float(c) for c in caps],
                 None if link is None else (float(link[0]), float(link[1])),
                 [float(c) for c in link_caps], quick, threads, samples, min_sample_s,
                 timeout=timeout)[0]
    return out | {"threads_per_worker": threads}


def _step_comm_worker(models: list[str], quick: bool, threads: int, samples: int,
                      min_sample_s: float) -> dict | None:
    """Runs in both ranks: for each model, the steps, then their messages alone."""
    rank, k = dist.get_rank(), dist.get_world_size()
    out = {}
    for model in models:
        cap_mb = STEP_MODELS[model][1]
        device, base, X, y = _rank_setup(model, quick, threads)
        n = X.shape[0]
        nets = {"local": copy.deepcopy(base)}
        for name in STRATEGIES_TIMED:
            for variant in (name, name + "_nosend"):
                nets[variant] = DistributedDataParallel(copy.deepcopy(base), strategy=name,
                                                        bucket_cap_mb=cap_mb,
                                                        broadcast_buffers=False)
            nets[name + "_nosend"].register_comm_hook(None, divide_only_hook)   # all but sending

        steppers = {name: _stepper(net, X, y) for name, net in nets.items()}
        for name in STRATEGIES_TIMED:   # two steps: the buckets rebuilt in arrival order
            steppers[name]()
            steppers[name]()
        # the messages each strategy really sends: its buckets after the rebuild
        messages = {name: [sum(b.numels) * b.parameters()[0].element_size()
                           for b in nets[name].reducer.buckets] for name in STRATEGIES_TIMED}
        flats = {name: [torch.zeros(max(1, m // 4), device=device) for m in sizes]
                 for name, sizes in messages.items()}
        steps = compare(steppers, samples=samples, min_sample_seconds=min_sample_s, warmup=2,
                        calibration_calls=2, baseline="local", device=device,
                        before=dist.barrier, reduce=_slowest)
        alone = compare({name: _all_reduce_each(t) for name, t in flats.items()},
                        samples=samples, min_sample_seconds=min_sample_s, warmup=1,
                        calibration_calls=2, device=device, before=dist.barrier, reduce=_slowest)
        met = _met_steps(_stepper(nets["local"], X, y), 3 * samples, device)
        out[model] = {"global_batch": n * k, "bucket_cap_mb": cap_mb, "messages": messages,
                      "step": {name: v["seconds"]
                               for name, v in steps.to_json()["variants"].items()},
                      "alone": {name: v["seconds"]
                                for name, v in alone.to_json()["variants"].items()},
                      "local_met": met}
        if model in STAMPED_MODELS:   # every call stamped, 4 steps per block
            out[model]["bucketed_calls"] = _call_stamps(nets["bucketed"], X, y, flats["bucketed"],
                                                        max(1, samples // 2), device)
    return out if rank == 0 else None


def measure_step_comm(models: list[str], *, quick: bool = False, samples: int = 7,
                      min_sample_s: float = 0.2, timeout: float = 600.0) -> dict:
    """Time ``local``, ``naive`` and ``bucketed`` steps (each strategy also with nothing sent)
    and their all-reduces alone, 2 ranks.

    Args:
        models: names from ``STEP_MODELS``.
        quick: the small batches of ``STEP_MODELS``.
        samples: rounds of each comparison (each variant one sample per round); the met local
            steps are 3 times as many.
        min_sample_s: each sample (of steps, and of all-reduces alone) loops for at least
            about this long.
        timeout: seconds for the launch.

    Returns:
        ``{"models": {model: {"global_batch", "bucket_cap_mb", "messages": {strategy: [bytes,
        ...]}, "step": {variant: [seconds per step, ...]}, "alone": {strategy: [seconds per round of
        its all-reduces, ...]}, "local_met": [[seconds of each local step, the ranks meeting
        before each] per rank], "bucketed_calls": {"step" | "alone": [round][rank] -> {"begin":
        s, "calls": [[start, end] s, ...], "backward_end": s (None alone)}}}}}`` samples paired
        by round within ``step`` and within ``alone``; ``bucketed_calls``, for the models of
        ``STAMPED_MODELS``: ``4 * (samples // 2)`` bucketed steps (at least 4) and as many
        rounds of the same messages alone, in
        alternating blocks of 4 back to back, every rank's clock at each round's begin and at
        each all-reduce's start and end, from the round's earliest begin;
        ``"threads_per_worker"`` beside the models.
    """
    unknown = sorted(set(models) - set(STEP_MODELS))
    if unknown or not models:
        raise ValueError(f"measure_step_comm: models must be names of {list(STEP_MODELS)}, got "
                         f"{models}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"measure_step_comm: samples must be an integer >= 2, got {samples!r}.")
    threads = max(1, cpu_cores() // 2)
    out = launch(_step_comm_worker, 2, list(models), quick, threads, samples, min_sample_s,
                 timeout=timeout)[0]
    return {"threads_per_worker": threads, "models": out}
