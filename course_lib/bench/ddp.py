"""Benchmark: step time of our DistributedDataParallel strategies against torch's DDP.

``python -m course_lib.bench ddp [--quick] [--models lenet,resnet18] [--out PATH]`` prints JSON
(written to ``results/ddp-MACHINE.json``, or ``--out``; quick runs write nothing unless told):
for LeNet (256 images per rank; ResNet-18, 32, with ``--models``: by default its comparison is
``bench scaling``'s 2-worker launch), 2 ranks (gloo on a CPU), one training step of ``local``
(no communication: the compute floor), ``strategy="naive"``, ``"overlap"``, ``"bucketed"``,
``"bucketed+bf16"`` (``bf16_compress_hook``) and torch's ``DistributedDataParallel``: median,
min, quartiles, ``ratio_to_torch`` (goal: bucketed <= 1.10) with its 95 % bootstrap interval
and a verdict naming the faster only when the interval excludes 1. All interleaved in the same
workers (``course_lib.timing.compare``, the slowest rank's time), so a noisy machine hurts them
alike. ``--link-latency-ms L``: every DDP variant (bf16 left out) sends over a ``SlowLink``
adding L ms to each message, one at a time, using no core (a network's latency), and
``"bucketed_small"`` (``bucket_cap_mb=0.1``) joins them. PyTorch counterpart: none (torch's
DDP is the yardstick). Notebook 07 shows this measurement.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import current_device, launch
from ..distributed.env import _slowest
from ..models.lenet import LeNet
from ..models.resnet import resnet18
from ..parallel.ddp import (
    STRATEGIES,
    DistributedDataParallel,
    SlowLink,
    bf16_compress_hook,
    slow_link_hook,
)
from ..timing import compare
from .collectives import summarize_samples
from .scaling import _finish, _model_names, _out_option, _verdict, report_header

__all__ = ["IMPLEMENTATIONS", "MODELS", "main", "measure_step_times", "summarize"]

#: What is timed: the compute floor, our three strategies, one with bf16 on the wire, the yardstick.
IMPLEMENTATIONS = ["local", *STRATEGIES, "bucketed+bf16", "torch"]
#: model -> (builder, batch per rank, least seconds per sample, batch per rank in --quick)
MODELS = {"lenet": (LeNet, 256, 0.3, 128), "resnet18": (resnet18, 32, 0.5, 4)}
GOAL = 1.10  # bucketed's median step at most 1.10 x torch's DDP's
SAMPLES, QUICK_SAMPLES = 15, 3  # timed rounds: full run, --quick
#: Over a slow link, the bucketed strategy is also timed with buckets capped at this many MiB
#: (``"bucketed_small"``): for LeNet two buckets, the first sent during backward.
SMALL_CAP_MB = 0.1


def implementations(link_latency_s: float = 0.0) -> list[str]:
    """What is timed: ``IMPLEMENTATIONS``; over a slow link without bf16, with
    ``"bucketed_small"`` (buckets of ``SMALL_CAP_MB``) after ``"bucketed"``."""
    if not link_latency_s:
        return list(IMPLEMENTATIONS)
    names = [n for n in IMPLEMENTATIONS if n != "bucketed+bf16"]
    at = names.index("bucketed") + 1
    return names[:at] + ["bucketed_small"] + names[at:]


def _wrap(name: str, module: nn.Module, link: SlowLink | None = None) -> nn.Module:
    """``module`` in our DDP with strategy ``name``, in torch's for ``"torch"``, alone for
    ``"local"``; ``"bucketed+bf16"`` sends bfloat16; with a ``link``, the DDP sends over it."""
    if name == "local":
        return module
    if name == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(module)
    elif name == "bucketed_small":
        ddp = DistributedDataParallel(module, strategy="bucketed", bucket_cap_mb=SMALL_CAP_MB)
    else:
        ddp = DistributedDataParallel(module, strategy=name.removesuffix("+bf16"))
    if name == "bucketed+bf16":
        ddp.register_comm_hook(None, bf16_compress_hook)
    elif link is not None:
        ddp.register_comm_hook(link, slow_link_hook)
    return ddp


def _steps(net: nn.Module, X: torch.Tensor, y: torch.Tensor, k: int) -> Callable[[], None]:
    """``k`` training steps of ``net`` on the batch (X, y): what one timed call does."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def run() -> None:
        for _ in range(k):
            opt.zero_grad()
            F.cross_entropy(net(X), y).backward()
            opt.step()
    return run


def _time_steps(models: list[str], quick: bool, samples: int, steps: int | None,
                batch: int | None, warmup: int, min_sample_s: float | None = None,
                link_latency_s: float = 0.0) -> tuple[str, dict] | None:
    """Runs in every rank of ``launch``; rank 0 returns (backend, {model: comparison JSON})."""
    rank, device = dist.get_rank(), current_device()
    out: dict[str, dict] = {}
    for model in models:
        build, full_batch, least_s, quick_batch = MODELS[model]
        n = batch or (quick_batch if quick else full_batch)
        k = steps or 1
        torch.manual_seed(0)
        base = build().to(device)  # the same start in every rank and every implementation
        g = torch.Generator().manual_seed(rank)
        X = torch.randn(n, 1, 28, 28, generator=g).to(device)      # (n, 1, 28, 28) this rank's
        y = torch.randint(0, 10, (n,), generator=g).to(device)     # (n,)
        names = implementations(link_latency_s)
        links = {name: SlowLink(link_latency_s) for name in names    # each DDP its own link
                 if link_latency_s and name != "local"}
        variants = {name: _steps(_wrap(name, copy.deepcopy(base), links.get(name)), X, y, k)
                    for name in names}
        least_s = min_sample_s if min_sample_s is not None else 0.01 if quick else least_s
        # every implementation interleaved in these processes; each sample a loop of calls
        # sized from the median of 3 single calls, the slowest rank's time; barrier before each
        timed = compare(variants, samples=samples, baseline="torch", warmup=warmup,
                        min_sample_seconds=least_s, calibration_calls=3, device=device,
                        before=dist.barrier, reduce=_slowest)
        # seconds per call of k steps -> seconds per step (ratios do not change)
        per_step = {name: [s / k for s in seconds] for name, seconds in timed.seconds.items()}
        messages = {}  # over a link: what one step sends, counted in one more call
        for name, link in links.items():
            sent = link.messages
            variants[name]()
            messages[name] = (link.messages - sent) / k
        out[model] = {**dataclasses.replace(timed, seconds=per_step, _ratios={}).to_json(),
                      "steps_per_call": k, "messages_per_step": messages}
        for link in links.values():
            link.close()
        del variants
    return (dist.get_backend(), out) if rank == 0 else None


def summarize(seconds: list[float], reference: list[float]) -> dict[str, float]:
    """Median, min and interquartile range of ``seconds`` (one implementation's step times, one
    per round; the times too), and three ratios to ``reference`` (torch's, the same rounds).

    ``ratio_to_torch`` divides the medians, ``min_ratio_to_torch`` the minima;
    ``paired_ratio_to_torch`` is the median of each round's ratio, the steadiest under load.
    """
    stats = summarize_samples(seconds)
    return {**stats, "ratio_to_torch": stats["median_s"] / statistics.median(reference),
            "min_ratio_to_torch": min(seconds) / min(reference),
            "paired_ratio_to_torch": statistics.median(a / b for a, b in zip(seconds, reference)),
            "seconds": list(seconds)}


def measure_step_times(models: list[str], *, world_size: int = 2, quick: bool = False,
                       rounds: int | None = None, steps: int | None = None,
                       batch: int | None = None, warmup: int = 1,
                       min_sample_s: float | None = None, link_latency_s: float = 0.0,
                       timeout: float = 1800.0) -> dict:
    """Time every implementation on each model in one launch, interleaved; a JSON-ready dict.

    ``rounds`` (at least 2; default 15, quick 3) each time every implementation once, a sample
    being as many calls of ``steps`` steps (default 1) as last ``min_sample_s`` (default LeNet
    0.3 s, ResNet-18 0.5 s; quick 0.01 s); times are per step. ``batch``: examples per rank
    (default per model); ``warmup``: untimed calls first; ``link_latency_s > 0``: every DDP
    variant (bf16 left out) sends over a ``SlowLink`` with this latency per message.

    Returns:
        ``{"backend", "world_size", "link_latency_s", "models": {model: {"batch_per_rank",
        "steps_per_call", "rounds", "results": {impl: summarize(...) + "loops", "ratio_low",
        "ratio_high", "verdict"}, "comparison": Comparison.to_json(), "winner",
        "messages_per_step": {impl: messages over its link per step} (empty without a
        link)}}}``.
    """
    rounds = (QUICK_SAMPLES if quick else SAMPLES) if rounds is None else rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"measure_step_times: rounds must be an integer >= 2 (a spread and an "
                         f"interval need several samples), got {rounds!r}.")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"measure_step_times: unknown model(s) {unknown}; expected some of "
                         f"{list(MODELS)}.")
    if not (isinstance(link_latency_s, (int, float)) and 0 <= link_latency_s < 1):
        raise ValueError(f"measure_step_times: link_latency_s must be seconds in [0, 1), got "
                         f"{link_latency_s!r}.")
    backend, timed = launch(_time_steps, world_size, models, quick, rounds, steps, batch,
                            warmup, min_sample_s, link_latency_s, timeout=timeout)[0]
    results = {}
    for model in models:
        c = timed[model]
        v = c["variants"]
        rows = {name: {**summarize(v[name]["seconds"], v["torch"]["seconds"]),
                       **{key: v[name][key] for key in ("loops", "ratio_low", "ratio_high",
                                                        "verdict")}}
                for name in implementations(link_latency_s)}
        results[model] = {
            "batch_per_rank": batch or MODELS[model][3 if quick else 1],
            "steps_per_call": c["steps_per_call"], "rounds": rounds,
            "results": rows, "winner": c["winner"], "comparison": c,
            "messages_per_step": c["messages_per_step"],
        }
    return {"backend": backend, "world_size": world_size, "link_latency_s": link_latency_s,
            "models": results}


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench ddp``: print the JSON (and write it to --out); 0 if it ran."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench ddp",
                                     description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true",
        help="a quick look (under a minute): 3 rounds, short samples, smaller batches")
    add("--models", default="lenet", help=f"comma-separated, from {', '.join(MODELS)} (default "
        "lenet: ResNet-18's DDP strategies are timed by `bench scaling` at 2 workers)")
    add("--rounds", type=int, default=None,
        help=f"timed rounds, at least 2 (default {SAMPLES}, quick {QUICK_SAMPLES})")
    add("--steps", type=int, default=None,
        help="steps per timed call (default 1); samples are sized in calls")
    add("--min-sample-ms", type=float, default=None,
        help="the least a sample lasts (default: LeNet 300, ResNet-18 500; quick 10)")
    add("--batch", type=int, default=None,
        help="examples per rank (default: LeNet 256, ResNet-18 32; quick 128, 4)")
    add("--world-size", type=int, default=2)
    add("--link-latency-ms", type=float, default=0.0,
        help="every DDP variant sends over a SlowLink adding this latency to each message, one "
        "at a time (default 0: no link; bf16 left out)")
    add("--timeout", type=float, default=1800.0,
        help="seconds for the launch before its workers are stopped (default 1800)")
    _out_option(parser, "ddp")
    args = parser.parse_args(argv)
    models = _model_names(parser, args.models, MODELS)
    rounds = args.rounds if args.rounds is not None else QUICK_SAMPLES if args.quick else SAMPLES
    if rounds < 2:
        parser.error(f"--rounds must be at least 2 (a spread and an interval need several "
                     f"samples), got {rounds}.")
    header = report_header("ddp", argv, quick=args.quick)
    start = time.perf_counter()
    run = measure_step_times(models, world_size=args.world_size, quick=args.quick,
                             rounds=rounds, steps=args.steps, batch=args.batch,
                             min_sample_s=None if args.min_sample_ms is None
                             else args.min_sample_ms / 1e3,
                             link_latency_s=args.link_latency_ms / 1e3, timeout=args.timeout)
    by_model = {m: run["models"][m]["results"] for m in models}

    def each(value: Callable[[dict], object]) -> dict:
        """``value`` of every implementation's row, by model."""
        return {m: {name: value(r) for name, r in res.items()} for m, res in by_model.items()}
    report = {
        **header,
        "goal": f"bucketed median step at most {GOAL:.2f} x torch's DDP's",
        "method": "every implementation interleaved in the same processes "
                  "(course_lib.timing.compare); each sample a loop of steps sized from the "
                  "median of several steps, the slowest rank's time; 95 % bootstrap interval "
                  "of each time ratio to torch's DDP",
        "ratio_to_torch": each(lambda r: round(r["ratio_to_torch"], 3)),
        "ratio_to_torch_interval": each(lambda r: [round(r["ratio_low"], 3),
                                                   round(r["ratio_high"], 3)]),
        "paired_ratio_to_torch": each(lambda r: round(r["paired_ratio_to_torch"], 3)),
        "goal_met": {m: _verdict(res["bucketed"]["ratio_low"], res["bucketed"]["ratio_high"],
                                 GOAL, at_least=False) for m, res in by_model.items()},
        "rounds": rounds,
        **run,
    }
    return _finish(report, "ddp", args.out, args.quick, start)
