"""Benchmark: all-reduce time and bus bandwidth against message size, naive vs ring vs gloo/NCCL.

``python -m course_lib.bench collectives [--quick] [--world-sizes 2] [--out PATH]`` prints JSON
and writes ``results/collectives-<machine>.json``: for each world size and each message size
(4 KB to 64 MB, every factor of 4) the time of one all-reduce by

- ``naive``: reduce to rank 0 with ``p - 1`` receives, broadcast back with ``p - 1`` sends
  (``naive_allreduce`` below: lesson 02's pattern across processes; benchmark-only, the library
  has no multi-process version of it);
- ``ring``: ``course_lib.distributed.ring_allreduce`` (textbook);
- ``ring_pipelined``: ``course_lib.distributed.ring_allreduce_pipelined``;
- ``all_reduce``: ``torch.distributed.all_reduce`` (gloo on a CPU, NCCL on GPUs).

Small collectives timed one at a time behind a barrier measure the barrier and the scheduler,
so each sample is a loop of many operations (enough for ``--min-sample-ms``, at most
``--max-ops``), divided by their number; the samples give minimum, median and interquartile
range. The operations are interleaved sample by sample, so a noisy machine hurts all alike.
PyTorch counterpart: none; nccl-tests' ``all_reduce_perf`` (whose "busbw" convention is used).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist

from ..devices import cpu_cores, num_gpus, synchronize
from ..distributed import current_device, launch, ring_allreduce, ring_allreduce_pipelined
from .allreduce import DEFAULT_SIZES, KB, bus_bandwidth, parse_size
from .scaling import load_average, report_header, results_path, write_report

__all__ = ["OPS", "main", "measure_collectives", "naive_allreduce", "summarize_samples"]


def naive_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place: everything to rank 0, the sum back from it.

    Benchmark-only (the library's naive allreduce, ``parallel.comm.allreduce``, works on a list
    of devices in one process). Rank 0 receives the ``p - 1`` other tensors one after another
    and adds each, then sends the sum to each rank in turn: ``2 (p - 1)`` whole messages through
    rank 0's link, the cost ``cost_model.naive_time`` counts.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, world):
            dist.recv(incoming, src)
            tensor.add_(incoming)
        for dst in range(1, world):
            dist.send(tensor, dst)
    else:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
    return tensor


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _ring(tensor: torch.Tensor) -> torch.Tensor:
    # check=False: the cross-rank shape check is one more small all-gather per call, which
    # would be timed with the ring (every rank here holds the same shape by construction).
    return ring_allreduce(tensor, check=False)


def _ring_pipelined(tensor: torch.Tensor) -> torch.Tensor:
    return ring_allreduce_pipelined(tensor, check=False)


#: name -> the all-reduce timed (each sums one tensor over the ranks, in place).
OPS = {"naive": naive_allreduce, "ring": _ring, "ring_pipelined": _ring_pipelined,
       "all_reduce": _all_reduce}


def _agree_max(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_loop(op, x: torch.Tensor, reps: int, device: torch.device) -> float:
    """Seconds per operation of ``reps`` back-to-back calls, the slowest rank's."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        op(x)
    synchronize(device)
    return _agree_max((time.perf_counter() - start) / reps, device)


def _collectives_worker(sizes: list[int], names: list[str], samples: int, min_sample_s: float,
                        max_ops: int) -> dict | None:
    """Runs in every rank of ``launch``; rank 0 returns {bytes: {op: {"reps", "seconds"}}}."""
    device = current_device()
    out: dict[int, dict[str, dict]] = {}
    for nbytes in sizes:
        # zeros stay zeros however often they are summed: no overflow, no denormals
        x = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)  # (n,) fp32
        reps = {}
        for name in names:  # warm up, then size the loop from one timed call
            _time_loop(OPS[name], x, 1, device)
            once = _time_loop(OPS[name], x, 1, device)
            reps[name] = int(min(max_ops, max(1, math.ceil(min_sample_s / max(once, 1e-7)))))
        out[nbytes] = {name: {"reps": reps[name], "seconds": []} for name in names}
        for s in range(samples):
            k = s % len(names)  # rotate: no operation always runs first
            for name in names[k:] + names[:k]:
                out[nbytes][name]["seconds"].append(_time_loop(OPS[name], x, reps[name], device))
        del x
    return out if dist.get_rank() == 0 else None


def summarize_samples(seconds: list[float]) -> dict[str, float]:
    """Minimum, median, quartiles and interquartile range of per-operation times."""
    q1, q2, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "q1_s": q1,
            "q3_s": q3, "iqr_s": q3 - q1, "samples": len(seconds)}


def measure_collectives(world_size: int, sizes: list[int], *, names: list[str] | None = None,
                        samples: int = 9, min_sample_s: float = 0.03, max_ops: int = 2000,
                        timeout: float = 1200.0) -> list[dict]:
    """Time every operation of ``OPS`` at each size over ``world_size`` ranks; one row per pair.

    Args:
        world_size: ranks (one per core on a CPU, one per GPU with NCCL).
        sizes: message sizes in bytes (float32 tensors of ``size // 4`` elements).
        names: which of ``OPS`` (default all).
        samples: timed samples per operation and size.
        min_sample_s: each sample loops over enough operations to last about this long.
        max_ops: at most this many operations per sample.
        timeout: seconds for the whole launch.

    Returns:
        Rows with ``world_size``, ``bytes``, ``op``, ``reps`` (operations per sample), the
        statistics of ``summarize_samples`` (per operation), ``busbw_GBps`` and ``algbw_GBps``
        (from the median), and the raw per-sample ``seconds``.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"measure_collectives: samples must be an integer >= 1, got {samples!r}.")
    names = list(OPS) if names is None else names
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        raise ValueError(f"measure_collectives: unknown operation(s) {unknown}; expected some "
                         f"of {list(OPS)}.")
    timed = launch(_collectives_worker, world_size, sizes, names, samples, min_sample_s,
                   max_ops, timeout=timeout)[0]
    rows = []
    for nbytes in sizes:
        for name in names:
            r = timed[nbytes][name]
            stats = summarize_samples(r["seconds"])
            rows.append({"world_size": world_size, "bytes": nbytes, "op": name,
                         "reps": r["reps"], **stats,
                         "busbw_GBps": bus_bandwidth(nbytes, stats["median_s"], world_size) / 1e9,
                         "algbw_GBps": nbytes / stats["median_s"] / 1e9,
                         "seconds": r["seconds"]})
    return rows


def _default_world_sizes() -> list[int]:
    """2 and 4 where there are that many GPUs (or CPU cores: one worker per core)."""
    have = num_gpus() if num_gpus() >= 2 else cpu_cores()
    return [w for w in (2, 4, 8) if w <= have] or [2]


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench collectives``: print the JSON, write it; 0 if it ran."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench collectives",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a quick look (seconds): 2 ranks, 3 sizes up to 256 KB, 3 samples")
    parser.add_argument("--world-sizes", default=None,
                        help="comma-separated (default: 2, 4, 8 up to the GPUs or CPU cores)")
    parser.add_argument("--sizes", default=None, help="comma-separated, e.g. 4K,1M,64M")
    parser.add_argument("--samples", type=int, default=None, help="samples per op (default 9)")
    parser.add_argument("--min-sample-ms", type=float, default=None,
                        help="each sample loops for about this long (default 30, quick 5)")
    parser.add_argument("--max-ops", type=int, default=2000)
    parser.add_argument("--out", default=None,
                        help="where to write the JSON (default results/collectives-MACHINE.json"
                        "; quick runs write nothing unless given); '-' writes nothing")
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 1:
        parser.error(f"--samples must be an integer >= 1, got {args.samples}.")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = [4 * KB, 64 * KB, 256 * KB] if args.quick else DEFAULT_SIZES
    world_sizes = ([int(w) for w in args.world_sizes.split(",")] if args.world_sizes
                   else [2] if args.quick else _default_world_sizes())
    samples = args.samples if args.samples is not None else (3 if args.quick else 9)
    min_sample_s = (args.min_sample_ms or (5 if args.quick else 30)) / 1e3
    report = report_header("collectives", argv, quick=args.quick)
    start = time.perf_counter()
    rows = []
    for ws in world_sizes:
        rows += measure_collectives(ws, sizes, samples=samples, min_sample_s=min_sample_s,
                                    max_ops=args.max_ops)
    report.update({
        "units": "seconds per all-reduce; busbw = bytes / time * 2 (p - 1) / p (nccl-tests)",
        "sizes": sizes, "world_sizes": world_sizes, "ops": list(OPS),
        "samples": samples, "min_sample_s": min_sample_s,
        "results": rows,
        "load_average_end": load_average(),
        "wall_s": round(time.perf_counter() - start, 1),
    })
    print(json.dumps(report, indent=2))
    write_report(report, results_path("collectives", args.out, args.quick))
    return 0

