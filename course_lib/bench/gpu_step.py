"""Benchmark: where lesson 01's LeNet step spends its time on a GPU, stored for CPU-only machines.

Run: ``python -m course_lib.bench gpu-step [--samples 12] [--quick] [--out PATH]`` on a machine
with a CUDA GPU (full runs write ``results/gpu-step-MACHINE.json``). Prints JSON. The step is the
baseline's (``train.sgd_step``: functional LeNet, cross-entropy, backward, ``sgd`` at lr 0.3)
on batches already on the device. Two measurements:

1. **Step time against batch size** (16 to 1024), interleaved with ``timing.compare``. Were the
   step arithmetic, time would grow with the batch; where it stays flat, issuing the step's
   operations sets it.
2. **A ``torch.profiler`` trace** of ``steps`` steps at one batch size: the kernels per step,
   the GPU's busy time (the union of their intervals) and the host's time in launch calls;
   beside (1)'s step time, the share of a step the GPU is busy.

PyTorch counterpart: ``torch.profiler.profile`` itself; this reduces its trace to four numbers.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ..data import load_fashion_mnist
from ..devices import synchronize, try_gpu
from ..models.lenet import init_lenet_params, lenet
from ..timing import compare
from ..train import sgd_step
from .scaling import _finish, _out_option, report_header

__all__ = ["BATCHES", "main", "profile_step", "time_by_batch_size"]

#: The batch sizes timed (the baseline's 256 among them).
BATCHES = (16, 32, 64, 128, 256, 512, 1024)
_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _stepper(batch_size: int, device: torch.device, lr: float):
    """One baseline step on the first ``batch_size`` Fashion-MNIST training images (seed 0)."""
    params = init_lenet_params(seed=0, device=device)
    X, y = [], []
    for Xb, yb in load_fashion_mnist(256, fast=True, device=device, quick=False, seed=0)[0]:
        X.append(Xb)
        y.append(yb)
        if sum(len(t) for t in X) >= batch_size:
            break
    X, y = torch.cat(X)[:batch_size], torch.cat(y)[:batch_size]
    if len(X) != batch_size:
        raise ValueError(f"a batch of {batch_size} needs that many training images; the data "
                         f"gave {len(X)}.")
    return lambda: sgd_step(params, lr, None, lenet, X, y)


def time_by_batch_size(device: torch.device, batches=BATCHES, *, samples: int = 12,
                       min_sample_s: float = 0.1, lr: float = 0.3, baseline: int = 256) -> dict:
    """Seconds per step for each batch size, interleaved (``timing.compare``).

    Returns ``{"batches": [...], "median_s": {b: ...}, "min_s": {b: ...}, "ratio_to_baseline":
    {b: [ratio, lo, hi]}, "comparison": Comparison.to_json()}`` (keys are strings in JSON)."""
    batches = list(batches)
    if baseline not in batches:
        raise ValueError(f"time_by_batch_size: the baseline batch {baseline} must be one of "
                         f"the sizes timed, got {batches}.")
    variants = {f"batch {b}": _stepper(b, device, lr) for b in batches}
    timed = compare(variants, samples=samples, min_sample_seconds=min_sample_s, warmup=3,
                    calibration_calls=5, baseline=f"batch {baseline}", device=device)
    return {"batches": batches,
            "median_s": {b: timed.median(f"batch {b}") for b in batches},
            "min_s": {b: min(timed.seconds[f"batch {b}"]) for b in batches},
            "ratio_to_baseline": {b: list(timed.ratio(f"batch {b}")) for b in batches},
            "comparison": timed.to_json()}


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_step(device: torch.device, batch_size: int = 256, *, steps: int = 20,
                 lr: float = 0.3) -> dict:
    """A ``torch.profiler`` trace of ``steps`` steps after a warm-up, reduced per step.

    Returns ``{"steps", "batch_size", "ops_per_step"`` (host operators, nested included),
    ``"kernels_per_step"`` (GPU kernels, copies and sets; 0 on a CPU), ``"gpu_busy_s_per_step"``
    (the union of their intervals), ``"launch_s_per_step"`` (host time in launch calls),
    ``"profiled_wall_s_per_step"`` (slower than unprofiled steps)``}``."""
    step = _stepper(batch_size, device, lr)
    for _ in range(5):
        step()
    synchronize(device)
    gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        with torch.profiler.record_function("steps"):
            for _ in range(steps):
                step()
            synchronize(device)
    events = list(prof.events())
    region = next(e for e in events if e.name == "steps")
    # the GPU side of the trace: kernels, copies and sets (the "steps" label is mirrored onto
    # the GPU timeline as an annotation spanning them all: not work, left out)
    device_events = [e for e in events if e.device_type.name == "CUDA" and e.name != "steps"]
    host_ops = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("aten::")]
    launches = [e for e in events if e.name in _LAUNCH_CALLS]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in device_events])
    return {"steps": steps, "batch_size": batch_size,
            "ops_per_step": len(host_ops) / steps,
            "kernels_per_step": len(device_events) / steps,
            "kernel_names": sorted({e.name[:100] for e in device_events}),
            "gpu_busy_s_per_step": busy_us / 1e6 / steps,
            "launch_s_per_step": sum(e.time_range.elapsed_us() for e in launches) / 1e6 / steps,
            "profiled_wall_s_per_step": region.time_range.elapsed_us() / 1e6 / steps}


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.bench gpu-step``: print the JSON report; 0 on success, 2 without
    a GPU (``--cpu`` runs it on the CPU, for a look; nothing is written then)."""
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench gpu-step",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=12, help="rounds of every size (default 12)")
    ap.add_argument("--steps", type=int, default=20, help="steps in the trace (default 20)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds, nothing written")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a look; writes nothing)")
    _out_option(ap, "gpu-step", "quick and --cpu runs")
    args = ap.parse_args(argv)
    device = torch.device("cpu") if args.cpu else try_gpu()
    if device.type != "cuda" and not args.cpu:
        print("gpu-step needs a CUDA GPU and this machine has none: nothing to measure. The "
              "stored runs are results/gpu-step-*.json (--cpu runs it here for a look).",
              file=sys.stderr)
        return 2
    if args.samples < 3:
        ap.error(f"--samples must be at least 3 (a median and an interval), got {args.samples}.")
    quick = args.quick or args.cpu
    batches = (64, 256) if quick else BATCHES
    report = report_header("gpu-step", list(argv or []), quick=quick)
    start = time.perf_counter()
    times = time_by_batch_size(device, batches, samples=args.samples,
                               min_sample_s=0.02 if quick else 0.1)
    trace = profile_step(device, 256, steps=args.steps)
    report.update({
        "what": "lesson 01's LeNet step (sgd_step, lr 0.3) on batches already on the device: "
                "seconds per step against batch size, and a profiler trace at batch 256",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tf32_conv": torch.backends.cudnn.allow_tf32,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "time_by_batch_size": times,
        "trace": trace,
        "gpu_busy_share": trace["gpu_busy_s_per_step"] / times["median_s"][256],
    })
    out = args.out if args.out is not None else ("-" if args.cpu else None)
    return _finish(report, "gpu-step", out, quick, start)

if __name__ == "__main__":
    sys.exit(main())
