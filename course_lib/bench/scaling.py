"""Benchmark: time per step against the number of workers, for each data-parallel way of the course.

``python -m course_lib.bench scaling [--quick] [--models lenet,resnet18] [--out PATH]`` prints
JSON and writes ``results/scaling-<machine>.json``. For LeNet and ResNet-18, the same global
batch split over 1, 2 (and 4, 8 where the hardware has them) workers, it times one training
step (forward, backward with the gradient averaging, SGD update) of

- ``dp_scratch`` (a): ``course_lib.train.train_batch``, one process, a thread per device;
- ``nn_dataparallel`` (b): ``torch.nn.DataParallel``; on a CPU it keeps ``device_ids=[]`` and
  just calls the module, so ``plain`` (the bare module, same threads) is timed beside it;
- ``naive`` / ``overlap`` / ``bucketed`` (c): the course's ``DistributedDataParallel``;
- ``torch`` (d): ``torch.nn.parallel.DistributedDataParallel``;
- ``local``: each DDP rank's own step with no communication at all (the compute floor).

On a CPU a worker is one core: each DDP rank gets ``cores // max(workers)`` torch threads (1 on
a 2-core machine, 1 worker included), and the single-process runs get the same cores in total.
Each sample is a few steps; the implementations run interleaved, the order rotating every round,
so a noisy machine hurts them alike; the slowest rank's time is the step's time. Beside the
steps, each DDP run times the all-reduces a step makes, alone (one per parameter, and one per
25 MiB bucket), so that the share of the step spent communicating and how much of it backward
hides can be read off. PyTorch counterpart: none (torch's DDP is the yardstick).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..devices import cpu_cores, cpu_threads, devices, hardware_summary, num_gpus, synchronize
from ..distributed import current_device, launch
from ..models.lenet import LeNet, init_lenet_params, lenet
from ..models.resnet import resnet18
from ..parallel.comm import replicate_params
from ..parallel.ddp import MB, DistributedDataParallel, assign_buckets
from ..train import train_batch

__all__ = ["DDP_IMPLS", "MODELS", "SINGLE_IMPLS", "load_average", "machine_slug", "main",
           "measure_scaling", "report_header", "results_path", "write_report"]

#: Timed inside the DDP workers: the compute floor, our three strategies, torch's DDP.
DDP_IMPLS = ["local", "naive", "overlap", "bucketed", "torch"]
#: Timed in one process: (a) from scratch, (b) nn.DataParallel, and the bare module beside it.
SINGLE_IMPLS = ["dp_scratch", "nn_dataparallel", "plain"]
TRAIN_EXAMPLES = 60_000  # Fashion-MNIST's training set: steps per epoch = ceil(60000 / batch)
BUCKET_CAP_MB = 25       # the bucketed strategy's and torch's default
LR = 0.01


@dataclass(frozen=True)
class ModelSpec:
    """How one model is timed: global batch, steps per sample, samples (full and ``--quick``)."""

    build: Callable[[], nn.Module]
    global_batch: int
    steps: int
    samples: int
    quick: tuple[int, int, int]  # (global batch, steps, samples) in --quick


#: LeNet: 12 samples of 5 steps = 60 steps of batch 256 per implementation and worker count.
MODELS = {"lenet": ModelSpec(LeNet, 256, 5, 12, (32, 1, 2)),
          "resnet18": ModelSpec(resnet18, 64, 1, 6, (8, 1, 1))}


# ------------------------------------------------------------------------------------------------
# the report: which machine, when, by which command
# ------------------------------------------------------------------------------------------------

def machine_slug() -> str:
    """A short name for this hardware, for file names: ``cpu-2core-xeon``, ``gpu-1x-h200``."""
    if num_gpus():
        words = re.findall(r"[a-z0-9]+", torch.cuda.get_device_name(0).lower())
        words = [w for w in words if w not in {"nvidia", "tesla", "geforce", "amd", "radeon"}]
        return f"gpu-{num_gpus()}x-{words[0] if words else 'gpu'}"
    first = hardware_summary().splitlines()[0]  # "CPU:     Intel(R) Xeon(R) ... (2 cores usable"
    name = first.split(":", 1)[1].rsplit("(", 1)[0].lower()
    known = ("xeon", "epyc", "ryzen", "threadripper", "core", "apple", "graviton", "neoverse")
    family = next((k for k in known if k in name), None)
    if family is None:
        words = re.findall(r"[a-z][a-z0-9]+", name.replace("(r)", "").replace("(tm)", ""))
        family = words[0] if words else "cpu"
    return f"cpu-{cpu_cores()}core-{family}"


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def report_header(name: str, argv: list[str], *, quick: bool) -> dict:
    """What every results file starts with: the command, machine, hardware, versions, date."""
    return {
        "benchmark": name,
        "command": " ".join(["python -m course_lib.bench", name, *argv]),
        "machine": machine_slug(),
        "hardware": hardware_summary(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "load_average_start": load_average(),
    }


def results_path(name: str, out: str | None, quick: bool) -> Path | None:
    """Where to write: ``--out`` if given (``-``: nowhere), else ``results/NAME-MACHINE.json``
    (relative to the current folder; ``make bench`` runs in the repository root) for full
    runs and nowhere for quick ones (a quick look must not overwrite the measurements)."""
    if out == "-":
        return None
    if out is not None:
        return Path(out)
    return None if quick else Path("results") / f"{name}-{machine_slug()}.json"


def write_report(report: dict, path: Path | None) -> None:
    """Write the JSON report to ``path`` (its folder created), or nothing for None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# shared by the workers
# ------------------------------------------------------------------------------------------------

def _batch(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels: the step's time does not depend on the pixels."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 1, 28, 28, generator=g).to(device)    # (n, 1, 28, 28)
    y = torch.randint(0, 10, (n,), generator=g).to(device)   # (n,)
    return X, y


def _timed(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` calls of ``step``, synchronized at both ends."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def _rounds(steps_by_name: dict[str, Callable[[], object]], samples: int, steps: int,
            warmup: int, device: torch.device, before: Callable[[], None] = lambda: None,
            reduce: Callable[[float], float] = lambda t: t) -> dict[str, list[float]]:
    """Time every step function ``samples`` times, interleaved, the order rotating each round."""
    names = list(steps_by_name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + samples):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            before()
            t = reduce(_timed(steps_by_name[name], steps, device))
            if r >= warmup:
                times[name].append(t)
    return times


# ------------------------------------------------------------------------------------------------
# (c), (d): one process per worker
# ------------------------------------------------------------------------------------------------

def _slowest(seconds: float) -> float:
    """The largest ``seconds`` over the ranks: a step is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64, device=current_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _allreduce_time(sizes: list[int], device: torch.device, min_s: float) -> list[float]:
    """Seconds for one round of blocking all-reduces of these sizes (bytes), several samples."""
    flats = [torch.zeros(max(1, n // 4), device=device) for n in sizes]  # fp32, stay zero

    def one_round() -> None:
        for t in flats:
            dist.all_reduce(t)

    once = _slowest(_timed(one_round, 1, device))
    reps = int(min(200, max(1, math.ceil(min_s / max(once, 1e-7)))))
    samples = []
    for _ in range(5):
        dist.barrier()
        samples.append(_slowest(_timed(one_round, reps, device)))
    return samples


def _ddp_worker(model: str, per_rank: int, threads: int, samples: int, steps: int,
                warmup: int, min_comm_s: float) -> dict | None:
    """Runs in every rank of ``launch``: the DDP implementations' step times, and the comm alone."""
    device, rank, world = current_device(), dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(threads)  # a worker is `threads` cores (this process is ours)
    torch.manual_seed(0)
    base = MODELS[model].build().to(device)
    nets: dict[str, nn.Module] = {}
    for name in DDP_IMPLS:
        net = copy.deepcopy(base)
        if name == "torch":
            net = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB)
        elif name != "local":
            net = DistributedDataParallel(net, strategy=name, bucket_cap_mb=BUCKET_CAP_MB)
        nets[name] = net
    opts = {name: torch.optim.SGD(net.parameters(), lr=LR) for name, net in nets.items()}
    X, y = _batch(per_rank, seed=rank, device=device)

    def stepper(name: str) -> Callable[[], None]:
        net, opt = nets[name], opts[name]

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(net(X), y).backward()
            opt.step()
        return step

    times = _rounds({name: stepper(name) for name in DDP_IMPLS}, samples, steps, warmup, device,
                    before=dist.barrier, reduce=_slowest)
    params = list(base.parameters())
    param_bytes = [p.numel() * p.element_size() for p in params]
    bucket_bytes = [sum(param_bytes[i] for i in b)
                    for b in assign_buckets(params, int(BUCKET_CAP_MB * MB))]
    comm = {}
    if world > 1:
        comm = {"per_parameter_s": _allreduce_time(param_bytes, device, min_comm_s),
                "per_bucket_s": _allreduce_time(bucket_bytes, device, min_comm_s)}
    if rank != 0:
        return None
    return {"times": times, "comm": comm, "param_bytes": param_bytes,
            "bucket_bytes": bucket_bytes, "backend": dist.get_backend()}


# ------------------------------------------------------------------------------------------------
# (a), (b): one process, k devices
# ------------------------------------------------------------------------------------------------

class _Functional:
    """``net(X, params)`` for an ``nn.Module``, so ``train_batch`` can run ResNet-18.

    ``torch.func.functional_call`` with the replica's parameters; each replica keeps its own
    batch-norm buffers (keyed by where its first parameter lives), as a real replica would.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.names = [name for name, _ in module.named_parameters()]
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        key = params[0].data_ptr()
        if key not in self.buffers:
            self.buffers[key] = {name: b.detach().to(params[0].device, copy=True)
                                 for name, b in self.module.named_buffers()}
        state = {**dict(zip(self.names, params)), **self.buffers[key]}
        return functional_call(self.module, state, (X,))


def _single_worker(model: str, k: int, global_batch: int, threads: int, samples: int,
                   steps: int, warmup: int) -> dict:
    """Runs in a fresh process (``launch`` with one rank): (a) and (b) over k devices."""
    gpus = num_gpus()
    cores = k * threads                     # the k "workers" of this run, in cores
    if gpus == 0 and k > 1 and cpu_cores() > cores and hasattr(os, "sched_setaffinity"):
        # parallel_apply caps each device's thread at cores // k: make the cores ours exactly
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
    devs = devices(k, warn=False)
    device = devs[0]
    torch.manual_seed(0)
    X, y = _batch(global_batch, seed=0, device=device)

    # (a) from scratch: parameters replicated onto each device, train_batch's four steps
    if model == "lenet":
        params, net = init_lenet_params(seed=0, device=device), lenet
    else:
        module = MODELS[model].build().to(device)
        params = [p.detach().clone() for p in module.parameters()]
        net = _Functional(module)
    device_params = replicate_params(params, devs)
    parallel = (k > 1) if gpus == 0 else None  # threads for several CPU "devices" (each 1 core)

    def dp_scratch() -> None:
        train_batch(X, y, device_params, devs, LR, net=net, parallel=parallel)

    # (b) nn.DataParallel, and the bare module beside it
    torch.manual_seed(0)
    plain = MODELS[model].build().to(device)
    wrapped = nn.DataParallel(copy.deepcopy(plain),
                              device_ids=list(range(k)) if gpus else None)
    opts = {"nn_dataparallel": torch.optim.SGD(wrapped.parameters(), lr=LR),
            "plain": torch.optim.SGD(plain.parameters(), lr=LR)}

    def stepper(name: str, m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            opts[name].zero_grad()
            F.cross_entropy(m(X), y).backward()
            opts[name].step()
        return step

    with cpu_threads(cores if gpus == 0 else torch.get_num_threads()):
        times = _rounds({"dp_scratch": dp_scratch,
                         "nn_dataparallel": stepper("nn_dataparallel", wrapped),
                         "plain": stepper("plain", plain)}, samples, steps, warmup, device)
    return {"times": times, "nn_dataparallel_device_ids": list(wrapped.device_ids),
            "threads_in_process": cores if gpus == 0 else None}


# ------------------------------------------------------------------------------------------------
# the whole run, and what is derived from it
# ------------------------------------------------------------------------------------------------

def _summary(seconds: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "q1_s": q1,
            "q3_s": q3, "iqr_s": q3 - q1, "samples": len(seconds), "seconds": seconds}


def default_workers() -> list[int]:
    """1, 2, 4, 8 up to the GPUs (or, without two GPUs, the CPU cores: a worker per core)."""
    have = num_gpus() if num_gpus() >= 2 else cpu_cores()
    return [w for w in (1, 2, 4, 8) if w <= have]


def measure_scaling(models: list[str], *, workers: list[int] | None = None, quick: bool = False,
                    warmup: int = 1, timeout: float = 3600.0) -> dict:
    """Time every implementation for each model and worker count; a JSON-ready dict.

    Args:
        models: names from ``MODELS``.
        workers: worker counts (default ``default_workers()``).
        quick: the small batches, steps and samples of ``ModelSpec.quick``.
        warmup: untimed rounds before the samples.
        timeout: seconds for each launch.
    """
    workers = workers or default_workers()
    threads = max(1, cpu_cores() // max(workers)) if num_gpus() == 0 else 1
    out: dict = {"workers": workers, "threads_per_worker": threads if num_gpus() == 0 else None,
                 "models": {}}
    for model in models:
        spec = MODELS[model]
        batch, steps, samples = spec.quick if quick else (spec.global_batch, spec.steps,
                                                          spec.samples)
        entry: dict = {"global_batch": batch, "steps_per_sample": steps, "samples": samples,
                       "steps_per_epoch": math.ceil(TRAIN_EXAMPLES / batch),
                       "by_workers": {}}
        for k in workers:
            if batch % k:
                raise ValueError(f"measure_scaling: global batch {batch} of {model} does not "
                                 f"split evenly over {k} workers.")
            single = launch(_single_worker, 1, model, k, batch, threads, samples, steps,
                            warmup, timeout=timeout)[0]
            ddp = launch(_ddp_worker, k, model, batch // k, threads, samples, steps, warmup,
                         0.02 if quick else 0.2, timeout=timeout)[0]
            times = {**single["times"], **ddp["times"]}
            entry["by_workers"][str(k)] = {
                "per_worker_batch": batch // k,
                "backend": ddp["backend"],
                "nn_dataparallel_device_ids": single["nn_dataparallel_device_ids"],
                "step": {name: _summary(t) for name, t in times.items()},
                "comm_alone": {name: _summary(t) for name, t in ddp["comm"].items()},
            }
            entry["param_bytes"], entry["bucket_bytes"] = ddp["param_bytes"], ddp["bucket_bytes"]
        entry["gradient_bytes"] = sum(entry["param_bytes"])
        entry["derived"] = derive(entry)
        out["models"][model] = entry
    return out


def _median(entry: dict, k: int, name: str) -> float:
    return entry["by_workers"][str(k)]["step"][name]["median_s"]


def derive(entry: dict) -> dict:
    """Speed-up, efficiency, epoch time, ratio to torch's DDP, communication share and overlap.

    - ``speedup[impl][k] = median step(1 worker) / median step(k workers)`` (same global batch,
      same implementation); ``efficiency = speedup / k``.
    - ``epoch_s[impl][k] = median step * steps_per_epoch`` (derived from the step, not timed).
    - ``ratio_to_torch[impl][k]``: median step over torch's DDP's, same k, same run;
      ``paired_ratio_to_torch`` the median of the per-round ratios (steadier under load).
    - ``comm[impl][k]`` for k >= 2: ``exposed_s = median step - median local step`` (the time
      communication adds to the step); ``comm_s`` the median time of the same all-reduces alone
      (one per parameter for naive and overlap, one per 25 MiB bucket for bucketed and torch);
      ``share = exposed_s / step``; ``overlap = 1 - exposed_s / comm_s`` clipped to [0, 1]
      (the part of the communication that backward hid).
    """
    ks = sorted(int(k) for k in entry["by_workers"])
    impls = list(entry["by_workers"][str(ks[0])]["step"])
    d: dict = {"speedup": {}, "efficiency": {}, "epoch_s": {}, "ratio_to_torch": {},
               "paired_ratio_to_torch": {}, "comm": {}}
    for name in impls:
        d["speedup"][name], d["efficiency"][name], d["epoch_s"][name] = {}, {}, {}
        for k in ks:
            s = _median(entry, ks[0], name) / _median(entry, k, name) if ks[0] == 1 else None
            d["speedup"][name][str(k)] = s
            d["efficiency"][name][str(k)] = s / k if s is not None else None
            d["epoch_s"][name][str(k)] = _median(entry, k, name) * entry["steps_per_epoch"]
    for name in ("naive", "overlap", "bucketed", "torch"):
        d["ratio_to_torch"][name], d["paired_ratio_to_torch"][name] = {}, {}
        d["comm"][name] = {}
        for k in ks:
            step = entry["by_workers"][str(k)]["step"]
            d["ratio_to_torch"][name][str(k)] = step[name]["median_s"] / step["torch"]["median_s"]
            d["paired_ratio_to_torch"][name][str(k)] = statistics.median(
                a / b for a, b in zip(step[name]["seconds"], step["torch"]["seconds"]))
            alone = entry["by_workers"][str(k)]["comm_alone"]
            if k < 2 or not alone:
                continue
            comm_s = alone["per_parameter_s" if name in ("naive", "overlap")
                           else "per_bucket_s"]["median_s"]
            exposed = step[name]["median_s"] - step["local"]["median_s"]
            d["comm"][name][str(k)] = {
                "exposed_s": exposed, "comm_s": comm_s,
                "share": max(0.0, exposed) / step[name]["median_s"],
                "overlap": min(1.0, max(0.0, 1.0 - exposed / comm_s)),
            }
    return d


def goals(run: dict) -> dict:
    """The issue's two goals, read off the run (None where the run lacks the numbers)."""
    g: dict = {}
    lenet_run = run["models"].get("lenet")
    if lenet_run and {"1", "2"} <= set(lenet_run["by_workers"]):
        sp = lenet_run["derived"]["speedup"]
        g["lenet_speedup_2_vs_1"] = {name: sp[name]["2"] for name in ("bucketed", "torch")}
        g["lenet_speedup_2_vs_1_goal"] = 1.8
        g["lenet_speedup_2_vs_1_met"] = sp["bucketed"]["2"] >= 1.8
    k = str(max(run["workers"]))
    ratios = {m: e["derived"]["ratio_to_torch"]["bucketed"][k] for m, e in run["models"].items()}
    g[f"bucketed_over_torch_at_{k}_workers"] = ratios
    g["bucketed_over_torch_goal"] = 1.10
    g["bucketed_over_torch_met"] = all(r <= 1.10 for r in ratios.values())
    return g


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench scaling``: print the JSON, write it; 0 if it ran."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a quick look: tiny batches, one step per sample, two samples")
    parser.add_argument("--models", default="lenet,resnet18",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--workers", default=None,
                        help="comma-separated worker counts (default: 1, 2, 4, 8 up to the GPUs "
                        "or CPU cores)")
    parser.add_argument("--out", default=None,
                        help="where to write the JSON (default results/scaling-MACHINE.json; "
                        "quick runs write nothing unless given); '-' writes nothing")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {list(MODELS)}")
    workers = [int(w) for w in args.workers.split(",")] if args.workers else None
    report = report_header("scaling", argv, quick=args.quick)
    start = time.perf_counter()
    run = measure_scaling(models, workers=workers, quick=args.quick)
    report.update({"goals": goals(run), **run, "load_average_end": load_average(),
                   "wall_s": round(time.perf_counter() - start, 1)})
    print(json.dumps(report, indent=2))
    write_report(report, results_path("scaling", args.out, args.quick))
    return 0
