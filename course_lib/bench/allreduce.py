"""Benchmark: the (pipelined) ring allreduce by hand against ``dist.all_reduce``, by message size.

``python -m course_lib.bench allreduce [--world-sizes 2,4] [--sizes 4K,...,64M] [--repeat N]``
prints JSON (and writes it to ``results/allreduce-MACHINE.json``, or ``--out``): for each world
size and message size, the median time of both, their bus bandwidth (the nccl-tests convention:
``bytes / time * 2 (p - 1) / p``, what each link carries) and ``speed_ratio = all_reduce time /
ring time`` (1.0: as fast; goal >= 0.9 from 16 MB up). Both run in the same workers, interleaved,
so a noisy machine hurts both alike. PyTorch counterpart: ``torch.distributed`` has no benchmark;
nccl-tests' ``all_reduce_perf``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ..distributed import current_device, launch, ring_allreduce_pipelined
from .scaling import load_average, report_header, results_path, write_report

__all__ = ["DEFAULT_SIZES", "QUICK_SIZES", "bus_bandwidth", "main", "measure", "parse_size"]

KB, MB = 2**10, 2**20
#: Message sizes in bytes: 4 KB to 64 MB, every factor of 4.
DEFAULT_SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB]
#: A quick look (notebook quick mode): fewer and smaller messages.
QUICK_SIZES = [4 * KB, 256 * KB, 4 * MB]


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16 MiB, ``"100"`` -> 100 (bytes)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": KB, "M": MB, "G": 2**30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second each rank's link carries in a ring allreduce of ``nbytes``."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def _time_allreduce_worker(sizes: list[int], repeat: int, warmup: int) -> tuple | None:
    """Runs in every rank of ``launch``; rank 0 returns (backend, {bytes: {op name: [s]}})."""
    device = current_device()
    # check=False: the ring's cross-rank shape check (a small all-gather) is not timed.
    ops = {"ring": lambda t: ring_allreduce_pipelined(t, check=False),
           "all_reduce": dist.all_reduce}
    times: dict[int, dict[str, list[float]]] = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)  # (n,) fp32
        times[nbytes] = {name: [] for name in ops}
        for i in range(warmup + repeat):
            for name, op in ops.items():  # interleaved: noise hits both alike
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                op(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times[nbytes][name].append(time.perf_counter() - start)
                x.fill_(1.0)  # keep the values finite
    return (dist.get_backend(), times) if dist.get_rank() == 0 else None


def measure(world_size: int, sizes: list[int], repeat: int = 10, warmup: int = 2,
            timeout: float = 600.0) -> list[dict]:
    """Median time and bus bandwidth of both allreduces for each size, ``world_size`` ranks."""
    backend, times = launch(_time_allreduce_worker, world_size, sizes, repeat, warmup,
                            timeout=timeout)[0]
    rows = []
    for nbytes in sizes:
        ring = statistics.median(times[nbytes]["ring"])
        ref = statistics.median(times[nbytes]["all_reduce"])
        rows.append({
            "world_size": world_size,
            "backend": backend,
            "bytes": nbytes,
            "ring_s": ring,
            "all_reduce_s": ref,
            "ring_busbw_GBps": bus_bandwidth(nbytes, ring, world_size) / 1e9,
            "all_reduce_busbw_GBps": bus_bandwidth(nbytes, ref, world_size) / 1e9,
            "speed_ratio": ref / ring,
        })
    return rows


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench allreduce``: print the JSON table; 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench allreduce",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    parser.add_argument("--sizes", default=",".join(f"{s // KB}K" for s in DEFAULT_SIZES),
                        help="comma-separated message sizes, e.g. 4K,1M,64M")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per size (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="where to write the JSON (default results/allreduce-MACHINE.json); "
                        "'-' writes nothing")
    args = parser.parse_args(argv)
    report = report_header("allreduce", argv, quick=False)
    start = time.perf_counter()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    for ws in (int(w) for w in args.world_sizes.split(",")):
        rows += measure(ws, sizes, repeat=args.repeat, warmup=args.warmup)
    big = {str(ws): statistics.median(r["speed_ratio"] for r in rows
                                      if r["world_size"] == ws and r["bytes"] >= 16 * MB)
           for ws in sorted({r["world_size"] for r in rows})
           if any(r["world_size"] == ws and r["bytes"] >= 16 * MB for r in rows)}
    report.update({
        "speed_ratio_median_16MB_and_up": big,  # goal: >= 0.9
        "goal": "ring at least 0.9 of dist.all_reduce's speed from 16 MB up",
        "results": rows,
        "load_average_end": load_average(),
        "wall_s": round(time.perf_counter() - start, 1),
    })
    print(json.dumps(report, indent=2))
    write_report(report, results_path("allreduce", args.out, False))
    return 0
