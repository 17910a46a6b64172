"""Benchmark: LeNet's seconds per epoch through the fast in-memory path vs a plain DataLoader.

Run: ``python -m course_lib.bench dataloader [--samples 12] [--batch-size 256] [--quick] [--out
PATH]`` (full runs also write ``results/dataloader-MACHINE.json``). Prints JSON. Both paths train
the same LeNet with the same step (``train_epoch``, lr 0.3 by default) in one process,
interleaved (``course_lib.timing.compare``): a timed call trains on a chunk of batches (1/16 of
an epoch by default, running on across epochs), a sample as many calls as last
``--min-sample-ms``, the paths alternating so that the machine's load hits both alike. Seconds
per epoch are a sample's seconds per batch times an epoch's batches. The result: the ratio
``fast / dataloader`` with its 95 % bootstrap interval (goal: at most 0.6 on a 2-core CPU) and
a verdict. PyTorch counterpart: none (``torch.utils.benchmark`` times one statement).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import torch

from ..config import quick_mode
from ..data import load_fashion_mnist
from ..devices import try_gpu
from ..models.lenet import init_lenet_params
from ..timing import LoadStamp, compare
from ..train import train_epoch
from .scaling import _finish, _out_option, _verdict, report_header

__all__ = ["GOAL", "compare_input_pipelines", "main"]

GOAL = 0.6  # the fast path's epoch at most 0.6 x the DataLoader's


def _forever(batches: Iterable) -> Iterator:
    """The batches of epoch after epoch (each pass a new ``iter``: a new shuffle)."""
    while True:
        yield from batches


def compare_input_pipelines(batch_size: int = 256, *, lr: float = 0.3, epochs: int = 1,
                            chunks: int = 16, samples: int | None = None,
                            min_sample_s: float | None = None, quick: bool | None = None,
                            device: torch.device | None = None,
                            stamp: LoadStamp | None = None) -> dict:
    """Train LeNet through each input path, interleaved; seconds per epoch and their ratio.

    A timed call trains on ``1 / chunks`` of an epoch's batches; ``samples`` per path (at least
    2; default ``epochs * chunks``, about ``epochs`` epochs), each looping over enough calls to
    last ``min_sample_s`` (default 0.2 s; 0.02 s on the quick slice, one batch a call). ``lr``:
    both paths' (lesson 01's 0.3); ``quick``: the quick-mode slice (default: quick mode);
    ``device``: the fast path's data and the network (default a GPU if any); ``stamp``: a
    ``wait_for_quiet`` stamp to keep.

    Returns:
        ``{"fast_s_per_epoch": [...], "dataloader_s_per_epoch": [...]`` (one estimate per
        sample, in the order taken), ``"fast_median_s_per_epoch"``, ``"fast_min_s_per_epoch"``
        (and the same for ``dataloader``), ``"ratio_fast_over_dataloader"`` (of the medians),
        ``"ratio_interval"`` (95 % bootstrap), ``"verdict"``, ``"lr"``, ``"batches_per_epoch"``,
        ``"batches_per_call"``, ``"comparison"`` (``Comparison.to_json()``, seconds per call)}``.
    """
    if samples is None:
        samples = epochs * chunks
    if samples < 2 or chunks < 1:
        raise ValueError(f"compare_input_pipelines needs samples >= 2 (a spread and an interval "
                         f"need several) and chunks >= 1, got samples={samples}, "
                         f"chunks={chunks}.")
    device = device if device is not None else try_gpu()
    quick = quick_mode() if quick is None else quick
    if min_sample_s is None:
        min_sample_s = 0.02 if quick else 0.2
    paths = {
        "fast": load_fashion_mnist(batch_size, fast=True, device=device, quick=quick, seed=0)[0],
        "dataloader": load_fashion_mnist(batch_size, fast=False, quick=quick)[0],
    }
    n_batches = len(paths["fast"])
    size = math.ceil(n_batches / chunks)  # batches per timed call
    params = {name: init_lenet_params(seed=0, device=device) for name in paths}
    streams = {name: _forever(it) for name, it in paths.items()}

    def chunk(name: str) -> Callable[[], None]:
        def train_chunk() -> None:
            train_epoch(params[name], islice(streams[name], size), lr=lr, device=device)
        return train_chunk

    timed = compare({name: chunk(name) for name in paths}, samples=samples,
                    min_sample_seconds=min_sample_s, warmup=1, calibration_calls=3,
                    baseline="dataloader", device=device, stamp=stamp)
    per_epoch = {name: [s / size * n_batches for s in timed.seconds[name]] for name in paths}
    ratio, lo, hi = timed.ratio("fast")
    out: dict = {f"{name}_s_per_epoch": per_epoch[name] for name in paths}
    for name, xs in per_epoch.items():
        out.update({f"{name}_median_s_per_epoch": statistics.median(xs),
                    f"{name}_min_s_per_epoch": min(xs)})
    out.update({"ratio_fast_over_dataloader": ratio, "ratio_interval": [lo, hi],
                "verdict": timed.verdict("fast"), "lr": lr, "batches_per_epoch": n_batches,
                "batches_per_call": size, "min_sample_s": min_sample_s,
                "comparison": timed.to_json()})
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.bench dataloader``: print the JSON comparison; 0 on success."""
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench dataloader",
                                 description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--samples", type=int, default=None, help="timed samples per path, at least 2 (default "
        "12: with warm-up and calibration, one epoch of each path)")
    add("--epochs", type=int, default=None, help="older spelling: --samples becomes epochs x 16")
    add("--min-sample-ms", type=float, default=None,
        help="the least a sample lasts (default 200; quick 20)")
    add("--batch-size", type=int, default=256)
    add("--lr", type=float, default=0.3,
        help="learning rate of both paths (default 0.3, lesson 01's baseline)")
    add("--quick", action="store_true", help="the quick-mode slice of the data")
    _out_option(ap, "dataloader")
    args = ap.parse_args(argv)
    samples = args.samples if args.samples is not None else (
        args.epochs * 16 if args.epochs is not None else 12)
    if samples < 2:
        ap.error(f"--samples must be at least 2 (a spread and an interval need several), got "
                 f"{samples}.")
    device = try_gpu()
    report = report_header("dataloader", list(argv or []), quick=args.quick)
    start = time.perf_counter()
    result = compare_input_pipelines(args.batch_size, lr=args.lr, samples=samples,
                                     min_sample_s=None if args.min_sample_ms is None
                                     else args.min_sample_ms / 1e3, quick=args.quick,
                                     device=device)
    lo, hi = result["ratio_interval"]
    report.update({"what": "LeNet epoch: in-memory batches (fast) against a plain DataLoader",
                   "method": "both paths interleaved in one process (course_lib.timing."
                             "compare); each sample a loop of chunks of batches sized from the "
                             "median of several; 95 % bootstrap interval of the time ratio",
                   "device": str(device), "batch_size": args.batch_size, "samples": samples,
                   "goal": f"fast epoch at most {GOAL} x the DataLoader's",
                   "goal_met": _verdict(lo, hi, GOAL, at_least=False), **result})
    return _finish(report, "dataloader", args.out, args.quick, start)
