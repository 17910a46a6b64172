"""Benchmark: LeNet's seconds per epoch through the fast in-memory path vs a plain DataLoader.

Run: ``python -m course_lib.bench dataloader [--epochs 2] [--batch-size 256] [--quick]``.
Prints JSON. Both paths train the same LeNet with the same loop in the same run; the ratio
``fast / dataloader`` is the result (goal: at most 0.6 on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import json

from .bench import Timer
from .data import load_fashion_mnist
from .devices import hardware_summary, try_gpu
from .lenet import init_lenet_params
from .train import train_epoch


def _epoch_times(fast: bool, epochs: int, batch_size: int, quick: bool, device) -> list[float]:
    train_iter, _ = load_fashion_mnist(batch_size, fast=fast, device=device if fast else None,
                                       quick=quick, seed=0)
    params = init_lenet_params(seed=0, device=device)
    times = []
    for _ in range(epochs):
        with Timer(device) as t:
            train_epoch(params, train_iter, lr=0.9, device=device)
        times.append(t.elapsed)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench dataloader")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the quick-mode slice of the data")
    args = ap.parse_args(argv)
    device = try_gpu()
    # Alternate the two paths so that machine noise hits both alike; median of the epochs.
    fast, loader = [], []
    for _ in range(args.epochs):
        loader += _epoch_times(False, 1, args.batch_size, args.quick, device)
        fast += _epoch_times(True, 1, args.batch_size, args.quick, device)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(json.dumps({
        "benchmark": "lenet_epoch_fast_vs_dataloader",
        "hardware": hardware_summary(),
        "device": str(device),
        "batch_size": args.batch_size,
        "quick": args.quick,
        "dataloader_s_per_epoch": loader,
        "fast_s_per_epoch": fast,
        "ratio_fast_over_dataloader": med(fast) / med(loader),
    }, indent=2))
    return 0
