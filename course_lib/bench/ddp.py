"""Benchmark: step time of our DistributedDataParallel strategies against torch's DDP.

``python -m course_lib.bench ddp [--quick] [--out PATH]`` prints JSON (and writes it to
``results/ddp-MACHINE.json``, or ``--out``; quick runs write nothing unless told): for LeNet (256
images per rank) and ResNet-18 (32 per rank), 2 ranks (gloo on a CPU), the time of one training
step (forward, backward with the gradient averaging, SGD step) of ``local`` (the plain module, no
communication: the compute floor), ``strategy="naive"``, ``"overlap"``, ``"bucketed"``,
``"bucketed+bf16"`` (with ``bf16_compress_hook``) and
``torch.nn.parallel.DistributedDataParallel``: median, min, interquartile range, and
``ratio_to_torch`` (median / torch's median; goal: bucketed <= 1.10). All run in the same workers,
interleaved round-robin (the order rotating every round), so a noisy machine hurts them alike.
PyTorch counterpart: none (torch's DDP is the yardstick). Notebook 07 shows this measurement.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..devices import synchronize
from ..distributed import current_device, launch
from ..models.lenet import LeNet
from ..models.resnet import resnet18
from ..parallel.ddp import STRATEGIES, DistributedDataParallel, bf16_compress_hook
from .scaling import load_average, report_header, results_path, write_report

__all__ = ["IMPLEMENTATIONS", "main", "measure_step_times", "summarize"]

#: What is timed: the compute floor, our three strategies, one with bf16 on the wire, the yardstick.
IMPLEMENTATIONS = ["local", *STRATEGIES, "bucketed+bf16", "torch"]
#: model -> (builder, batch per rank, steps per timed sample, batch per rank in --quick)
MODELS = {"lenet": (LeNet, 256, 3, 128), "resnet18": (resnet18, 32, 1, 4)}
GOAL = 1.10  # bucketed's median step at most 1.10 x torch's DDP's


def _wrap(name: str, module: nn.Module) -> nn.Module:
    """``module`` in our DDP with strategy ``name``, in torch's for ``"torch"``, alone for
    ``"local"``; ``"bucketed+bf16"`` sends bfloat16."""
    if name == "local":
        return module
    if name == "torch":
        return torch.nn.parallel.DistributedDataParallel(module)
    if name == "bucketed+bf16":
        ddp = DistributedDataParallel(module, strategy="bucketed")
        ddp.register_comm_hook(None, bf16_compress_hook)
        return ddp
    return DistributedDataParallel(module, strategy=name)


def _time_steps(models: list[str], quick: bool, rounds: int, steps: int | None,
                batch: int | None, warmup: int) -> tuple[str, dict] | None:
    """Runs in every rank of ``launch``; rank 0 returns (backend, {model: {impl: [seconds]}})."""
    rank, device = dist.get_rank(), current_device()
    times: dict[str, dict[str, list[float]]] = {}
    for model in models:
        build, full_batch, model_steps, quick_batch = MODELS[model]
        n = batch or (quick_batch if quick else full_batch)
        k_steps = steps or (1 if quick else model_steps)
        torch.manual_seed(0)
        base = build().to(device)
        nets = {name: _wrap(name, copy.deepcopy(base)) for name in IMPLEMENTATIONS}
        opts = {name: torch.optim.SGD(net.parameters(), lr=0.01) for name, net in nets.items()}
        g = torch.Generator().manual_seed(rank)
        X = torch.randn(n, 1, 28, 28, generator=g).to(device)      # (n, 1, 28, 28) this rank's
        y = torch.randint(0, 10, (n,), generator=g).to(device)     # (n,)
        times[model] = {name: [] for name in IMPLEMENTATIONS}
        for r in range(warmup + rounds):
            k = r % len(IMPLEMENTATIONS)  # rotate: no implementation always runs first
            for name in IMPLEMENTATIONS[k:] + IMPLEMENTATIONS[:k]:
                net, opt = nets[name], opts[name]
                dist.barrier()
                synchronize(device)
                start = time.perf_counter()
                for _ in range(k_steps):
                    opt.zero_grad()
                    F.cross_entropy(net(X), y).backward()
                    opt.step()
                synchronize(device)
                # the slowest rank's time is the step's time
                t = torch.tensor([(time.perf_counter() - start) / k_steps], dtype=torch.float64,
                                 device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    times[model][name].append(t.item())
        del nets, opts
    return (dist.get_backend(), times) if rank == 0 else None


def summarize(seconds: list[float], reference: list[float]) -> dict[str, float]:
    """Median, min and interquartile range of step times (and the times), three ratios to torch's.

    ``ratio_to_torch`` divides the medians; ``min_ratio_to_torch`` the minima;
    ``paired_ratio_to_torch`` is the median over rounds of the ratio within each round (both
    timed seconds apart), the steadiest of the three when other work loads the machine.

    Args:
        seconds: one implementation's step times, one per round.
        reference: torch's DDP's step times from the same rounds.
    """
    q1, _, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
    median = statistics.median(seconds)
    return {"median_s": median, "min_s": min(seconds), "iqr_s": q3 - q1,
            "ratio_to_torch": median / statistics.median(reference),
            "min_ratio_to_torch": min(seconds) / min(reference),
            "paired_ratio_to_torch": statistics.median(a / b for a, b in zip(seconds, reference)),
            "samples": len(seconds), "seconds": list(seconds)}


def measure_step_times(models: list[str], *, world_size: int = 2, quick: bool = False,
                       rounds: int = 9, steps: int | None = None, batch: int | None = None,
                       warmup: int = 1, timeout: float = 1800.0) -> dict:
    """Time every implementation on each model in one launch, interleaved; a JSON-ready dict.

    Args:
        models: names from ``MODELS``.
        world_size: ranks (2: one per core of the course's 2-core machine).
        quick: small ResNet-18 batch and one step per sample.
        rounds: timed rounds; each times every implementation once.
        steps: steps per timed sample (default per model: 3 for LeNet, 1 for ResNet-18).
        batch: examples per rank (default per model).
        warmup: untimed rounds first.
        timeout: seconds for the whole launch.
    """
    backend, times = launch(_time_steps, world_size, models, quick, rounds, steps, batch,
                            warmup, timeout=timeout)[0]
    results = {}
    for model in models:
        results[model] = {
            "batch_per_rank": batch or MODELS[model][3 if quick else 1],
            "steps_per_sample": steps or (1 if quick else MODELS[model][2]),
            "results": {name: summarize(times[model][name], times[model]["torch"])
                        for name in IMPLEMENTATIONS},
        }
    return {"backend": backend, "world_size": world_size, "models": results}


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench ddp``: print the JSON (and write it to --out); 0 if it ran."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench ddp",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a quick look (under 30 s): 2 rounds, one step each, smaller batches")
    parser.add_argument("--models", default="lenet,resnet18",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (default 9, quick 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed sample (default: LeNet 3, ResNet-18 1; quick 1)")
    parser.add_argument("--batch", type=int, default=None,
                        help="examples per rank (default: LeNet 256, ResNet-18 32; quick 128, 4)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="where to write the JSON (default results/ddp-MACHINE.json; quick "
                        "runs write nothing unless given); '-' writes nothing")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {list(MODELS)}")
    rounds = args.rounds or (2 if args.quick else 9)
    header = report_header("ddp", argv, quick=args.quick)
    start = time.perf_counter()
    run = measure_step_times(models, world_size=args.world_size, quick=args.quick,
                             rounds=rounds, steps=args.steps, batch=args.batch)
    report = {
        **header,
        "goal": f"bucketed median step at most {GOAL:.2f} x torch's DDP's",
        "ratio_to_torch": {m: {name: round(r["ratio_to_torch"], 3)
                               for name, r in run["models"][m]["results"].items()}
                           for m in models},
        "paired_ratio_to_torch": {m: {name: round(r["paired_ratio_to_torch"], 3)
                                      for name, r in run["models"][m]["results"].items()}
                                  for m in models},
        "rounds": rounds,
        **run,
        "load_average_end": load_average(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=2))
    write_report(report, results_path("ddp", args.out, args.quick))
    return 0
