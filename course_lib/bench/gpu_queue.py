"""Benchmark: lesson 00's GPU timing, three ways, stored for the machines that have no GPU.

Run: ``python -m course_lib.bench gpu-queue [--n 4096] [--runs 7] [--quick] [--out PATH]`` on a
machine with a CUDA GPU (full runs write ``results/gpu-queue-MACHINE.json``). Prints JSON. Ten
``(n, n)`` float32 products are timed ``runs`` times, three ways interleaved: the clock read as
the calls return (the kernels only queued), ``course_lib.timing.Timer`` (synchronizes first)
and CUDA events (in the GPU's own stream). PyTorch counterpart: ``torch.utils.benchmark.Timer``,
which synchronizes CUDA around its loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..devices import synchronize, try_gpu
from ..timing import Timer, matmul_flops
from .scaling import _finish, _out_option, report_header

__all__ = ["WAYS", "main", "stored_runs", "time_three_ways"]

WAYS = ("clock read at once", "after synchronize", "CUDA events")


def time_three_ways(device: torch.device, n: int, runs: int) -> dict[str, list[float]]:
    """Seconds of ten ``(n, n) @ (n, n)`` products on a CUDA ``device``, each of ``WAYS`` timed
    ``runs`` times, interleaved run by run (a run of each way, then the next round)."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"time_three_ways times a CUDA stream; got device {device}. On a "
                         "machine without a GPU, read the stored runs (stored_runs()).")
    B = torch.randn(n, n, device=device)

    def gpu_work():
        for _ in range(10):
            B @ B

    gpu_work()
    synchronize(device)                                     # warm-up: cuBLAS, the allocator
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(runs):
        synchronize(device)
        start = time.perf_counter()
        gpu_work()
        times["clock read at once"].append(time.perf_counter() - start)   # queued, not run
        synchronize(device)
        with Timer(device) as t:
            gpu_work()
        times["after synchronize"].append(t.elapsed)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        gpu_work()
        end.record()
        end.synchronize()                                   # wait for the GPU to reach `end`
        times["CUDA events"].append(begin.elapsed_time(end) / 1e3)   # milliseconds -> seconds
    return times


def stored_runs(results: Path | str = "results") -> list[dict]:
    """Every ``gpu-queue-*.json`` report in ``results``, newest first (empty if none)."""
    reports = [json.loads(p.read_text()) for p in Path(results).glob("gpu-queue-*.json")]
    return sorted(reports, key=lambda r: r["date"], reverse=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.bench gpu-queue``: print the JSON report; 0 on success, 2 without
    a GPU."""
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench gpu-queue",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=None, help="matrix side (default 4096; quick 1024)")
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each way (default 7)")
    ap.add_argument("--quick", action="store_true", help="a small matrix, nothing written")
    _out_option(ap, "gpu-queue")
    args = ap.parse_args(argv)
    device = try_gpu()
    if device.type != "cuda":
        print("gpu-queue needs a CUDA GPU and this machine has none: nothing to measure. The "
              "stored runs are results/gpu-queue-*.json.", file=sys.stderr)
        return 2
    if args.runs < 3:
        ap.error(f"--runs must be at least 3 (a median needs several), got {args.runs}.")
    n = args.n or (1024 if args.quick else 4096)
    report = report_header("gpu-queue", list(argv or []), quick=args.quick)
    start = time.perf_counter()
    times = time_three_ways(device, n, args.runs)
    report.update({"what": "ten (n, n) @ (n, n) float32 products on one GPU, timed three ways",
                   "device_name": torch.cuda.get_device_name(device), "n": n, "products": 10,
                   "runs": args.runs, "flops": 10 * matmul_flops(n, n, n), "seconds": times,
                   "median_s": {way: statistics.median(xs) for way, xs in times.items()}})
    return _finish(report, "gpu-queue", args.out, args.quick, start)
