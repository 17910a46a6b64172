"""Benchmark: LeNet's seconds per epoch through the fast in-memory path vs a plain DataLoader.

Run: ``python -m course_lib.bench dataloader [--epochs 1] [--batch-size 256] [--quick] [--out
PATH]`` (full runs also write ``results/dataloader-MACHINE.json``). Prints JSON. Both paths train
the same LeNet with the same loop in the same run, interleaved in chunks of batches (one chunk of
one path, then one of the other) so that a change in the machine's load hits both alike. The ratio
``fast / dataloader`` is the result (goal: at most 0.6 on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from itertools import islice

import torch

from ..data import load_fashion_mnist
from ..devices import try_gpu
from ..models.lenet import init_lenet_params
from ..timing import Timer
from ..train import train_epoch
from .scaling import load_average, report_header, results_path, write_report

__all__ = ["compare_input_pipelines", "main"]


def compare_input_pipelines(batch_size: int = 256, *, epochs: int = 1, chunks: int = 8,
                            quick: bool | None = None,
                            device: torch.device | None = None) -> dict:
    """Train LeNet for ``epochs`` epochs through each input path, interleaved in ``chunks``
    pieces per epoch; return seconds per epoch of each path and their ratio.

    Returns:
        ``{"fast_s_per_epoch": [...], "dataloader_s_per_epoch": [...],
        "ratio_fast_over_dataloader": float}``; the ratio is of the medians over epochs.
    """
    device = device if device is not None else try_gpu()
    paths = {
        "fast": load_fashion_mnist(batch_size, fast=True, device=device, quick=quick, seed=0)[0],
        "dataloader": load_fashion_mnist(batch_size, fast=False, quick=quick)[0],
    }
    params = {name: init_lenet_params(seed=0, device=device) for name in paths}
    per_epoch = {name: [] for name in paths}
    for _ in range(epochs):
        iters = {name: iter(it) for name, it in paths.items()}
        spent = dict.fromkeys(paths, 0.0)
        size = -(-len(paths["fast"]) // chunks)  # batches per chunk, rounded up
        for _ in range(chunks):
            for name, it in iters.items():  # alternate: a chunk of one path, then of the other
                with Timer(device) as t:
                    train_epoch(params[name], islice(it, size), lr=0.9, device=device)
                spent[name] += t.elapsed
        for name in paths:
            per_epoch[name].append(spent[name])
    fast = statistics.median(per_epoch["fast"])
    loader = statistics.median(per_epoch["dataloader"])
    return {"fast_s_per_epoch": per_epoch["fast"],
            "dataloader_s_per_epoch": per_epoch["dataloader"],
            "ratio_fast_over_dataloader": fast / loader}


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.bench dataloader``: print the JSON comparison; 0 on success."""
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench dataloader")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the quick-mode slice of the data")
    ap.add_argument("--out", default=None,
                    help="where to write the JSON (default results/dataloader-MACHINE.json; "
                    "quick runs write nothing unless given); '-' writes nothing")
    args = ap.parse_args(argv)
    device = try_gpu()
    report = report_header("dataloader", list(argv or []), quick=args.quick)
    start = time.perf_counter()
    result = compare_input_pipelines(args.batch_size, epochs=args.epochs, quick=args.quick,
                                     device=device)
    report.update({"what": "LeNet epoch: in-memory batches (fast) against a plain DataLoader",
                   "device": str(device), "batch_size": args.batch_size, **result,
                   "load_average_end": load_average(),
                   "wall_s": round(time.perf_counter() - start, 1)})
    print(json.dumps(report, indent=2))
    write_report(report, results_path("dataloader", args.out, args.quick))
    return 0
