"""Benchmark: time per step against the number of workers, for each data-parallel way of the course.

``python -m course_lib.bench scaling [--quick] [--models lenet,resnet18] [--out PATH]`` prints
JSON and writes ``results/scaling-<machine>.json``. For LeNet and ResNet-18, one global batch
split over 1, 2 (4, 8 where the hardware has them) workers, it times one training step of

- ``baseline``: plain training on ONE worker, the one baseline of every speed-up, timed in the
  one-worker launch only (always run, even when ``--workers`` leaves 1 out);
- ``plain``: the bare module in one process with all k workers' cores as intra-op threads;
- ``dp_scratch`` (a): ``course_lib.train.train_batch``, one process, a thread per device;
- ``nn_dataparallel`` (b): ``torch.nn.DataParallel`` (on a CPU ``device_ids=[]``: it just
  calls the module, compare ``plain``);
- ``local``: each DDP rank's own step on its shard, no communication (the compute floor);
- ``naive`` / ``overlap`` / ``bucketed`` (c): the course's ``DistributedDataParallel``;
- ``torch`` (d): ``torch.nn.parallel.DistributedDataParallel``;
- ``NAME_nocomm`` (k >= 2): each DDP with a hook that sends nothing, so ``exposed communication
  = step(NAME) - step(NAME_nocomm)``.

One launch per worker count runs every variant interleaved (``course_lib.timing.compare``, the
slowest rank's time); each speed-up is the one baseline over the variant's median, with a
bootstrap interval, and ``speedup_table`` prints that baseline beside it. On a CPU each rank gets
``cores // max(workers)`` threads. Buckets: LeNet's capped at 0.1 MiB (so overlap can show;
torch's DDP too), ResNet-18's at 25 MiB (torch's default). The all-reduces of one step are also
timed alone (one per parameter, one per bucket). PyTorch counterpart: none (torch's DDP is the
yardstick).
"""
from __future__ import annotations

import argparse
import contextlib
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
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.func import functional_call

from ..devices import cpu_cores, cpu_threads, devices, hardware_summary, num_gpus
from ..distributed import current_device, launch
from ..distributed.env import _slowest
from ..models.lenet import LeNet, init_lenet_params, lenet
from ..models.resnet import resnet18
from ..parallel.comm import replicate_params
from ..parallel.ddp import MB, DistributedDataParallel, assign_buckets
from ..timing import (  # bootstrap_difference: public here too (lesson 10 imports it)
    bootstrap_difference,
    bootstrap_ratio,
    compare,
    load_average,
    wait_for_quiet,
)
from ..train import train_batch
from .step_comm import _all_reduce_each, _stepper

__all__ = ["BASELINE", "DDP_IMPLS", "MODELS", "SINGLE_IMPLS", "bootstrap_difference",
           "load_average", "machine_slug", "main", "measure_scaling", "overlap_reason",
           "report_header", "results_path", "rederive", "speedup_table", "write_report"]

#: The one baseline of every speed-up: plain training on one worker, timed at one worker.
BASELINE = "baseline"
#: Timed in every rank: the compute floor, our three strategies, torch's DDP.
DDP_IMPLS = ["local", "naive", "overlap", "bucketed", "torch"]
#: Timed in rank 0 alone: (a) from scratch, (b) nn.DataParallel, the bare module beside it.
SINGLE_IMPLS = ["dp_scratch", "nn_dataparallel", "plain"]
TRAIN_EXAMPLES = 60_000  # Fashion-MNIST's training set: steps per epoch = ceil(60000 / batch)
LR = 0.01


@dataclass(frozen=True)
class ModelSpec:
    """How one model is timed (full run; ``quick`` gives (global batch, samples, sample s))."""

    build: Callable[[], nn.Module]
    global_batch: int
    samples: int
    min_sample_s: float
    bucket_cap_mb: float
    quick: tuple[int, int, float]


#: LeNet: 12 samples of at least 0.3 s; buckets of 0.1 MiB (LeNet's 0.49 MiB in several).
MODELS = {"lenet": ModelSpec(LeNet, 256, 12, 0.3, 0.1, (32, 2, 0.01)),
          "resnet18": ModelSpec(resnet18, 64, 10, 0.5, 25, (8, 2, 0.01))}

# ---- the report: which machine, when, by which command ----

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


def report_header(name: str, argv: list[str], *, quick: bool,
                  max_wait_s: float | None = None) -> dict:
    """What every results file starts with: command, machine, hardware, versions, date, load.

    Waits up to 5 minutes (none for quick runs; ``COURSE_QUIET_WAIT_S`` caps it, ``make test``
    sets 0) for a quiet machine (``wait_for_quiet``), records ``load`` (``busy``: still loaded)
    and prints its message."""
    if max_wait_s is None:
        max_wait_s = 0 if quick else 300
    cap = os.environ.get("COURSE_QUIET_WAIT_S")
    if cap is not None:
        try:
            max_wait_s = min(max_wait_s, float(cap))
        except ValueError:
            raise ValueError(f"COURSE_QUIET_WAIT_S must be a number of seconds, got {cap!r}.") \
                from None
    stamp = wait_for_quiet(max_wait_s=max_wait_s)
    print(f"{name}: {stamp.message}", file=sys.stderr)
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
        "load": stamp.to_json(),
        "taken_on_busy_machine": stamp.busy,
    }


def results_path(name: str, out: str | None, quick: bool) -> Path | None:
    """Where to write: ``--out`` if given (``-``: nowhere), else ``results/NAME-MACHINE.json``
    (relative to the current folder) for full runs and nowhere for quick ones (a quick look
    must not overwrite the measurements)."""
    if out is not None:
        return None if out == "-" else Path(out)
    return None if quick else Path("results") / f"{name}-{machine_slug()}.json"


def _out_option(parser: argparse.ArgumentParser, name: str,
                quick: str = "quick runs") -> None:
    """Every benchmark's ``--out``, the argument ``results_path`` reads."""
    parser.add_argument("--out", default=None,
                        help=f"where to write the JSON (default results/{name}-MACHINE.json; "
                        f"{quick} write nothing unless given); '-' writes nothing")


def _model_names(parser: argparse.ArgumentParser, text: str, known) -> list[str]:
    """The comma-separated ``--models`` as a list; a name not in ``known`` is a usage error."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(models) - set(known))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; expected some of {list(known)}")
    return models


def write_report(report: dict, path: Path | None) -> None:
    """Write the JSON report to ``path`` (its folder created), or nothing for None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _finish(report: dict, name: str, out: str | None, quick: bool, start: float) -> int:
    """Stamp the load at the end and the wall time, print the JSON, write it; 0."""
    end = load_average()
    report["load"]["load_end"] = end[0] if end else None
    report["load_average_end"] = end
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    write_report(report, results_path(name, out, quick))
    return 0


def _verdict(low: float, high: float, goal: float, *, at_least: bool) -> str:
    if (low >= goal) if at_least else (high <= goal):
        return "met"
    if (high < goal) if at_least else (low > goal):
        return "not met"
    return "undecided: the interval contains the goal"


# ---- the workers: one launch per worker count, every variant interleaved ----

def _batch(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels: the step's time does not depend on the pixels."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 1, 28, 28, generator=g).to(device)    # (n, 1, 28, 28)
    y = torch.randint(0, 10, (n,), generator=g).to(device)   # (n,)
    return X, y


def _wrap(name: str, module: nn.Module, cap_mb: float) -> nn.Module:
    """``module`` alone (``local``), in torch's DDP, or in ours; ``*_nocomm`` sends nothing."""
    base = name.removesuffix("_nocomm")
    if base == "local":
        return module
    if base == "torch":
        net = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=cap_mb)
    else:
        net = DistributedDataParallel(module, strategy=base, bucket_cap_mb=cap_mb)
    if name.endswith("_nocomm"):
        net.register_comm_hook(None, noop_hook)  # returns the bucket, unsent
    return net


class _Functional:
    """``net(X, params)`` for an ``nn.Module`` (``functional_call``), so ``train_batch`` can run
    ResNet-18; each replica keeps its own batch-norm buffers (keyed by its first parameter)."""

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


def _scaling_worker(model: str, global_batch: int, threads: int, samples: int,
                    min_sample_s: float, warmup: int, calibration: int) -> dict | None:
    """Runs in every rank of a launch of k ranks: every variant, interleaved; rank 0 returns."""
    device, rank, k = current_device(), dist.get_rank(), dist.get_world_size()
    spec = MODELS[model]
    on_gpus = device.type == "cuda"   # a GPU per worker (NCCL); else every worker is CPU cores
    if device.type == "cpu":
        torch.set_num_threads(threads)  # a worker is `threads` cores (this process is ours)
    cores = k * threads
    torch.manual_seed(0)
    base = spec.build().to(device)
    variants: dict[str, Callable[[], None]] = {}

    def stepper(net: nn.Module, X: torch.Tensor, y: torch.Tensor,
                n_threads: int | None = None) -> Callable[[], None]:
        step = _stepper(net, X, y, LR)

        def step_with_threads() -> None:
            with cpu_threads(n_threads):
                step()
        return step if n_threads is None or device.type != "cpu" else step_with_threads

    def rank0(step: Callable[[], None]) -> Callable[[], None]:
        return step if rank == 0 else (lambda: None)  # the other ranks wait at the max

    # rank 0 alone, the whole global batch; the baseline only in the one-worker launch
    Xg, yg = _batch(global_batch, seed=0, device=device)
    if k == 1:
        variants[BASELINE] = stepper(copy.deepcopy(base), Xg, yg, threads)
    else:
        variants["plain"] = rank0(stepper(copy.deepcopy(base), Xg, yg, cores))
    devs = (devices(k, warn=False) if on_gpus else [device] * k) if rank == 0 else [device]
    if model == "lenet":
        params, fnet = init_lenet_params(seed=0, device=device), lenet
    else:
        params = [p.detach().clone() for p in base.parameters()]
        fnet = _Functional(copy.deepcopy(base))
    device_params = replicate_params(params, devs)
    parallel = None if on_gpus else k > 1

    def dp_scratch() -> None:
        with cpu_threads(cores) if device.type == "cpu" else contextlib.nullcontext():
            train_batch(Xg, yg, device_params, devs, LR, net=fnet, parallel=parallel)
    variants["dp_scratch"] = rank0(dp_scratch)
    if on_gpus or not torch.cuda.is_available():   # without GPUs it just calls the module
        wrapped = nn.DataParallel(copy.deepcopy(base),
                                  device_ids=list(range(k)) if on_gpus else None)
    else:   # CPU workers on a machine with too few GPUs: DataParallel would take the GPUs
        wrapped = copy.deepcopy(base)
    variants["nn_dataparallel"] = rank0(stepper(wrapped, Xg, yg, cores))

    # every rank, its shard
    X, y = _batch(global_batch // k, seed=1 + rank, device=device)
    ddp_names = list(DDP_IMPLS) if k > 1 else [n for n in DDP_IMPLS if n != "local"]
    if k > 1:
        ddp_names += [f"{n}_nocomm" for n in DDP_IMPLS if n != "local"]
    for name in ddp_names:
        variants[name] = stepper(_wrap(name, copy.deepcopy(base), spec.bucket_cap_mb), X, y)
    result = compare(variants, samples=samples, min_sample_seconds=min_sample_s, warmup=warmup,
                     calibration_calls=calibration, baseline=BASELINE if k == 1 else "local",
                     device=device,
                     before=dist.barrier, reduce=_slowest)

    # the all-reduces one step makes, alone: one per parameter, one per bucket
    param_bytes = [p.numel() * p.element_size() for p in base.parameters()]
    buckets = assign_buckets(list(base.parameters()), int(spec.bucket_cap_mb * MB))
    bucket_bytes = [sum(param_bytes[i] for i in b) for b in buckets]
    comm = None
    if k > 1:
        flats = {name: [torch.zeros(max(1, n // 4), device=device) for n in sizes]
                 for name, sizes in (("per_parameter_s", param_bytes),
                                     ("per_bucket_s", bucket_bytes))}
        comm = compare({name: _all_reduce_each(t) for name, t in flats.items()},
                       samples=max(5, samples // 2), min_sample_seconds=min_sample_s / 3,
                       warmup=1, calibration_calls=3,
                       device=device, before=dist.barrier, reduce=_slowest)
    if rank != 0:
        return None
    return {"comparison": result.to_json(), "comm": comm.to_json() if comm else None,
            "param_bytes": param_bytes, "bucket_bytes": bucket_bytes,
            "backend": dist.get_backend(),
            "nn_dataparallel_device_ids": list(getattr(wrapped, "device_ids", []))}


# ---- the whole run, and what is derived from it ----

def _summary(v: dict) -> dict:
    q1, q3 = v["q1_s"], v["q3_s"]
    return {"median_s": v["median_s"], "min_s": v["min_s"], "q1_s": q1, "q3_s": q3,
            "iqr_s": q3 - q1, "samples": v["samples"], "loops": v["loops"],
            "seconds": v["seconds"]}


def default_workers() -> list[int]:
    """1, 2, 4, 8 up to the GPUs (or, without two GPUs, the CPU cores: a worker per core)."""
    have = num_gpus() if num_gpus() >= 2 else cpu_cores()
    return [w for w in (1, 2, 4, 8) if w <= have]


def measure_scaling(models: list[str], *, workers: list[int] | None = None, quick: bool = False,
                    warmup: int = 1, timeout: float = 3600.0) -> dict:
    """Time every variant for each model and worker count (one launch per count); a dict.

    ``workers`` defaults to ``default_workers()``; 1 is always added (its launch times the one
    baseline). ``quick``: ``ModelSpec.quick``'s sizes; ``warmup``: untimed steps of each variant
    before calibrating; ``timeout``: seconds for each launch.
    """
    workers = sorted({1, *(workers or default_workers())})  # 1: the launch of the baseline
    gpu_workers = num_gpus() >= max(workers)   # else every worker is CPU cores (gloo)
    threads = 1 if gpu_workers else max(1, cpu_cores() // max(workers))
    out: dict = {"workers": workers, "threads_per_worker": None if gpu_workers else threads,
                 "models": {}}
    for model in models:
        spec = MODELS[model]
        batch, samples, min_s = spec.quick if quick else (spec.global_batch, spec.samples,
                                                          spec.min_sample_s)
        entry: dict = {"global_batch": batch, "samples": samples, "min_sample_s": min_s,
                       "threads_per_worker": out["threads_per_worker"],
                       "steps_per_sample": "sized per variant (loops)",
                       "bucket_cap_mb": spec.bucket_cap_mb,
                       "steps_per_epoch": math.ceil(TRAIN_EXAMPLES / batch), "by_workers": {}}
        for k in workers:
            if batch % k:
                raise ValueError(f"measure_scaling: global batch {batch} of {model} does not "
                                 f"split evenly over {k} workers.")
            r = launch(_scaling_worker, k, model, batch, threads, samples, min_s, warmup,
                       1 if quick else 3, timeout=timeout)[0]
            variants = r["comparison"]["variants"]
            step = {name: _summary(v) for name, v in variants.items()}
            if k == 1:  # at one worker the bare module and the compute floor ARE the baseline
                step["plain"] = step["local"] = step[BASELINE]
            entry["by_workers"][str(k)] = {
                "per_worker_batch": batch // k, "backend": r["backend"],
                "nn_dataparallel_device_ids": r["nn_dataparallel_device_ids"],
                "step": step, "comparison": r["comparison"],
                "comm_alone": ({name: _summary(v) for name, v in r["comm"]["variants"].items()}
                               if r["comm"] else {}),
            }
            entry["param_bytes"], entry["bucket_bytes"] = r["param_bytes"], r["bucket_bytes"]
        entry["gradient_bytes"] = sum(entry["param_bytes"])
        entry["derived"] = derive(entry)
        out["models"][model] = entry
    return out


def overlap_reason(n_buckets: int, threads_per_worker: int | None, backend: str) -> str:
    """Why backward may have hidden none of the communication, in one sentence."""
    if n_buckets <= 1:
        return ("one bucket: its all-reduce can start only when backward has produced the last "
                "gradient, so nothing is left to hide it behind")
    if backend == "gloo" and threads_per_worker == 1:
        return ("none measured (a clipped estimate, not a proof that nothing overlapped): gloo "
                "sums and copies on the CPU and each worker has one core, so that part of an "
                "all-reduce takes turns with backward, and the last bucket starts only when "
                "backward ends")
    return "the buckets became ready too late in backward to overlap with the rest of it"


def derive(entry: dict) -> dict:
    """Speed-ups over the common baseline, efficiency, epoch time, ratios to torch's DDP,
    exposed communication and overlap, each with its interval where it has one.

    - ``speedup[impl][k] = baseline / impl`` (medians), the baseline ONE measurement for every
      k: the one-worker launch's, ``baseline_s`` its median (older files' re-timed baselines
      are ignored). ``speedup_interval[impl][k]``: its 95 % bootstrap interval (paired by round
      at k = 1, else the launches resampled independently); ``efficiency = speedup / k``.
    - ``epoch_s[impl][k] = median step * steps_per_epoch`` (derived from the step, not timed).
    - ``ratio_to_torch[impl][k]`` (medians), ``paired_ratio_to_torch`` (median of the per-round
      ratios), ``ratio_to_torch_interval`` (bootstrap).
    - ``comm[impl][k]`` for k >= 2: ``exposed_s = step - step with a hook that sends nothing``
      (same wrapper, same process) with ``exposed_interval``; ``comm_s`` the same all-reduces
      alone (one per parameter for naive and overlap, one per bucket for bucketed and torch);
      ``share = exposed_s / step``; ``overlap = 1 - exposed_s / comm_s`` clipped to [0, 1];
      ``reason`` when the overlap is zero.
    """
    ks = sorted(int(k) for k in entry["by_workers"])
    if 1 not in ks:
        raise ValueError(f"derive: no one-worker launch among the worker counts {ks}; it times "
                         "the baseline of every speed-up. Run measure_scaling, which adds it.")
    impls = [n for n in entry["by_workers"][str(ks[-1])]["step"]
             if not n.endswith("_nocomm") and n != BASELINE]
    base = entry["by_workers"]["1"]["step"][BASELINE]["seconds"]  # the one baseline
    ddps = ("naive", "overlap", "bucketed", "torch")
    per_impl = ("speedup", "speedup_interval", "efficiency", "epoch_s")
    against_torch = ("ratio_to_torch", "paired_ratio_to_torch", "ratio_to_torch_interval", "comm")
    d: dict = {"baseline": BASELINE, "baseline_s": statistics.median(base), "baseline_workers": 1,
               **{key: {name: {} for name in impls} for key in per_impl},
               **{key: {name: {} for name in ddps} for key in against_torch}}
    for name in impls:
        for k in ks:
            mine = entry["by_workers"][str(k)]["step"][name]["seconds"]
            s, lo, hi = bootstrap_ratio(base, mine, paired=k == 1)  # k > 1: another launch
            d["speedup"][name][str(k)] = s
            d["speedup_interval"][name][str(k)] = [lo, hi]
            d["efficiency"][name][str(k)] = s / k
            d["epoch_s"][name][str(k)] = (entry["by_workers"][str(k)]["step"][name]["median_s"]
                                          * entry["steps_per_epoch"])
    for name in ddps:
        for k in ks:
            step = entry["by_workers"][str(k)]["step"]
            r, lo, hi = bootstrap_ratio(step[name]["seconds"], step["torch"]["seconds"])
            d["ratio_to_torch"][name][str(k)] = r
            d["ratio_to_torch_interval"][name][str(k)] = [lo, hi]
            d["paired_ratio_to_torch"][name][str(k)] = statistics.median(
                a / b for a, b in zip(step[name]["seconds"], step["torch"]["seconds"]))
            alone = entry["by_workers"][str(k)]["comm_alone"]
            if k < 2 or not alone or f"{name}_nocomm" not in step:
                continue
            comm_s = alone["per_parameter_s" if name in ("naive", "overlap")
                           else "per_bucket_s"]["median_s"]
            exposed, elo, ehi = bootstrap_difference(step[name]["seconds"],
                                                     step[f"{name}_nocomm"]["seconds"])
            overlap = min(1.0, max(0.0, 1.0 - exposed / comm_s))
            n_buckets = (len(entry["param_bytes"]) if name in ("naive", "overlap")
                         else len(entry["bucket_bytes"]))
            c = {"exposed_s": exposed, "exposed_interval": [elo, ehi], "comm_s": comm_s,
                 "share": max(0.0, exposed) / step[name]["median_s"], "overlap": overlap,
                 "buckets": n_buckets}
            if name == "naive":
                c["reason"] = "the naive strategy waits for each all-reduce by design"
            elif overlap == 0.0:
                c["reason"] = overlap_reason(n_buckets, entry.get("threads_per_worker"),
                                             entry["by_workers"][str(k)]["backend"])
            d["comm"][name][str(k)] = c
    return d


def speedup_table(run: dict, model: str, impls: list[str] | None = None) -> str:
    """The speed-up table of ``model``: for each implementation and worker count, the median
    step and ``[baseline / step = speed-up]``, the one baseline printed in every cell.

    ``run``: a run (``measure_scaling``) or a whole report, with ``derived`` filled in;
    ``impls``: the rows (default: every implementation of the largest worker count).
    """
    e = run["models"][model]
    d, ks = e["derived"], sorted(e["by_workers"], key=int)
    base_ms = d["baseline_s"] * 1e3
    impls = impls or list(d["speedup"])
    epoch = "epoch_s" in d
    lines = [f"{model}: global batch {e['global_batch']}; median ms per step [the one baseline "
             f"{base_ms:.1f} ms ({BASELINE!r}, 1 worker) / step = speed-up (95 % interval)], "
             f"efficiency = speed-up / workers"]
    lines.append(f"{'':>16}" + "".join(f"{k + ' worker(s)':>{46 if k == '1' else 56}}"
                                       for k in ks)
                 + (f"{'epoch s, ' + ks[-1] + ' workers':>20}" if epoch else ""))
    for impl in impls:
        cells = []
        for k in ks:
            ms = e["by_workers"][k]["step"][impl]["median_s"] * 1e3
            lo, hi = d["speedup_interval"][impl][k]
            sp = d["speedup"][impl][k]
            eff = "" if k == "1" else f" eff {sp / int(k):.2f}"
            cells.append(f"{ms:.1f} [{base_ms:.1f}/{ms:.1f} = {sp:.2f}x ({lo:.2f}-{hi:.2f})]"
                         + eff)
        lines.append(f"{impl:>16}" + "".join(f"{c:>{46 if k == '1' else 56}}"
                                             for k, c in zip(ks, cells))
                     + (f"{d['epoch_s'][impl][ks[-1]]:>20.1f}" if epoch else ""))
    return "\n".join(lines)


def rederive(report: dict) -> dict:
    """``report`` (a stored ``results/scaling-*.json``) with ``derived`` and ``goals`` computed
    again from its stored samples by this version's rules: one baseline, the one-worker launch's.
    Nothing is re-measured; the samples stay as they are."""
    out = copy.deepcopy(report)
    for entry in out["models"].values():
        entry["derived"] = derive(entry)
    out["goals"] = goals(out)
    return out


def goals(run: dict) -> dict:
    """Two targets, read off the run with their intervals (None where the run lacks them)."""
    g: dict = {}
    lenet_run = run["models"].get("lenet")
    if lenet_run and {"1", "2"} <= set(lenet_run["by_workers"]):
        d = lenet_run["derived"]
        g["lenet_speedup_2_vs_1"] = {n: d["speedup"][n]["2"] for n in ("bucketed", "torch")}
        g["lenet_speedup_2_vs_1_interval"] = {n: d["speedup_interval"][n]["2"]
                                              for n in ("bucketed", "torch")}
        g["lenet_speedup_2_vs_1_goal"] = 1.8
        g["lenet_speedup_2_vs_1_met"] = _verdict(*d["speedup_interval"]["bucketed"]["2"], 1.8,
                                                 at_least=True)
    k = str(max(run["workers"]))
    derived = {m: e["derived"] for m, e in run["models"].items()}
    intervals = {m: d["ratio_to_torch_interval"]["bucketed"][k] for m, d in derived.items()}
    g[f"bucketed_over_torch_at_{k}_workers"] = {m: d["ratio_to_torch"]["bucketed"][k]
                                                for m, d in derived.items()}
    g["bucketed_over_torch_interval"] = intervals
    g["bucketed_over_torch_goal"] = 1.10
    g["bucketed_over_torch_met"] = {m: _verdict(*i, 1.10, at_least=False)
                                    for m, i in intervals.items()}
    return g


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench scaling``: print the JSON, write it; 0 if it ran."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench scaling",
                                     description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true",
        help="a quick look: tiny batches, short samples, two of them")
    add("--models", default="lenet,resnet18", help=f"comma-separated, from {', '.join(MODELS)}")
    add("--workers", default=None,
        help="comma-separated worker counts (default: 1, 2, 4, 8 up to the GPUs or CPU cores)")
    add("--rederive", metavar="PATH", default=None,
        help="measure nothing: recompute the speed-ups and goals of a stored results file from "
        "its samples, print its tables, and write it back (to --out if given)")
    _out_option(parser, "scaling")
    args = parser.parse_args(argv)
    models = _model_names(parser, args.models, MODELS)
    workers = [int(w) for w in args.workers.split(",")] if args.workers else None
    if args.rederive:
        report = rederive(json.loads(Path(args.rederive).read_text()))
        for model in report["models"]:
            print(speedup_table(report, model), file=sys.stderr)
        write_report(report, Path(args.out or args.rederive) if args.out != "-" else None)
        return 0
    report = report_header("scaling", argv, quick=args.quick)
    start = time.perf_counter()
    run = measure_scaling(models, workers=workers, quick=args.quick)
    for model in run["models"]:
        print(speedup_table(run, model), file=sys.stderr)
    report.update({"goals": goals(run), **run,
                   "method": "one launch per worker count, every variant interleaved "
                             "(course_lib.timing.compare); speed-ups over the common baseline "
                             "with 95 % bootstrap intervals"})
    return _finish(report, "scaling", args.out, args.quick, start)
