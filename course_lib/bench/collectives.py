"""Benchmark: all-reduce time and bus bandwidth against message size, naive vs ring vs gloo/NCCL.

``python -m course_lib.bench collectives [--quick] [--world-sizes 2] [--out PATH]`` prints JSON
and writes ``results/collectives-<machine>.json``: for each world size and each message size
(4 KB to 64 MB, every factor of 4) the time of one all-reduce by

- ``naive``: reduce to rank 0 with ``p - 1`` receives, broadcast back with ``p - 1`` sends
  (``naive_allreduce`` below: lesson 02's pattern across processes; benchmark-only, the library
  has no multi-process version of it);
- ``ring``: ``course_lib.distributed.ring_allreduce`` (textbook);
- ``ring_pipelined``: ``course_lib.distributed.ring_allreduce_pipelined``;
- ``all_reduce``: ``torch.distributed.all_reduce`` (gloo on a CPU, NCCL on GPUs), the baseline.

The course's one way to time collectives: small collectives timed one at a time behind a
barrier measure the barrier and the scheduler, so each sample is a loop of many operations
(sized from the median of several single calls so that it lasts at least ``--min-sample-ms``;
at most ``--max-ops``), divided by their number, the slowest rank's time. At each size the
operations run interleaved in the same processes (``course_lib.timing.compare``: A B C D,
B C D A, ...), so a noisy machine hurts all alike; each row has the minimum, median and
quartiles of its samples, its time ratio to ``dist.all_reduce`` with a 95 % bootstrap interval,
and a verdict that names the faster one only when the interval excludes 1.

``python -m course_lib.bench allreduce`` (the older name) runs this benchmark with
``ring_pipelined`` and ``all_reduce`` only. PyTorch counterpart: none; nccl-tests'
``all_reduce_perf`` (whose "busbw" convention is used).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from ..distributed import current_device, launch, ring_allreduce, ring_allreduce_pipelined
from ..distributed.env import _pin_to_cores, _slowest
from ..timing import Comparison, compare
from .scaling import _finish, _out_option, _verdict, default_workers, report_header

__all__ = ["BASELINE", "DEFAULT_SIZES", "KB", "MB", "OPS", "QUICK_SIZES", "bus_bandwidth", "main",
           "measure_collectives", "naive_allreduce", "parse_size", "summarize_samples"]

KB, MB = 2**10, 2**20
#: Message sizes in bytes: 4 KB to 64 MB, every factor of 4.
DEFAULT_SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB]
#: A quick look (notebook quick mode): fewer and smaller messages.
QUICK_SIZES = [4 * KB, 64 * KB, 256 * KB]
#: Every ratio divides by this operation's time.
BASELINE = "all_reduce"


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"16M"`` -> 16 MiB, ``"100"`` -> 100 (bytes)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": KB, "M": MB, "G": 2**30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second each rank's link carries in a ring allreduce of ``nbytes``."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size


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


#: name -> the all-reduce timed (each sums one tensor over the ranks, in place). The rings run
#: with check=False: the cross-rank shape check is one more small all-gather per call, which
#: would be timed with the ring (every rank here holds the same shape by construction).
OPS = {"naive": naive_allreduce, "ring": functools.partial(ring_allreduce, check=False),
       "ring_pipelined": functools.partial(ring_allreduce_pipelined, check=False),
       "all_reduce": _all_reduce}


def _collectives_worker(sizes: list[int], names: list[str], samples: int, min_sample_s: float,
                        max_ops: int, calibration_calls: int) -> dict | None:
    """Runs in every rank of ``launch``; rank 0 returns {bytes: ``Comparison.to_json()``}.

    Every operation at every size is one variant of a single ``compare``: each round times them
    all, so a slow minute of the machine slows every size alike instead of one size's samples."""
    _pin_to_cores()                      # on a CPU, each rank on cores of its own
    device = current_device()
    # zeros stay zeros however often they are summed: no overflow, no denormals
    xs = {n: torch.zeros(max(1, n // 4), dtype=torch.float32, device=device) for n in sizes}
    timed = compare({f"{name}@{n}": functools.partial(OPS[name], xs[n])
                     for n in sizes for name in names},
                    samples=samples, min_sample_seconds=min_sample_s, warmup=2,
                    calibration_calls=calibration_calls, max_loops=max_ops, device=device,
                    before=dist.barrier, reduce=_slowest)
    baseline = BASELINE if BASELINE in names else names[-1]
    out: dict[int, dict] = {}
    for n in sizes:   # one Comparison per size, its rounds still those of the whole run
        key = {f"{name}@{n}": name for name in names}
        seconds = {key[k]: v for k, v in timed.seconds.items() if k in key}
        loops = {key[k]: v for k, v in timed.loops.items() if k in key}
        order = [key[k] for k in timed.order if k in key]
        out[n] = Comparison(names, baseline, seconds, loops, order, timed.confidence).to_json()
    return out if dist.get_rank() == 0 else None


def summarize_samples(seconds: list[float]) -> dict[str, float]:
    """Minimum, median, quartiles and interquartile range of per-operation times."""
    q1, q2, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
    return {"min_s": min(seconds), "median_s": statistics.median(seconds), "q1_s": q1,
            "q3_s": q3, "iqr_s": q3 - q1, "samples": len(seconds)}


def measure_collectives(world_size: int, sizes: list[int], *, names: list[str] | None = None,
                        samples: int = 41, min_sample_s: float = 0.05, max_ops: int = 2000,
                        calibration_calls: int = 5, timeout: float = 1200.0) -> list[dict]:
    """Time the operations of ``OPS`` at each size over ``world_size`` ranks, every operation
    and size interleaved round by round.

    Args:
        world_size: ranks (one per core on a CPU, one per GPU with NCCL).
        sizes: message sizes in bytes (float32 tensors of ``size // 4`` elements).
        names: which of ``OPS`` (default all; ``all_reduce`` is the baseline when among them,
            else the last; one alone is timed, its ratio 1).
        samples: timed samples per operation and size (at least 2; 10 or more for a useful
            interval). Small messages on a shared CPU are bimodal (a rank descheduled for a
            moment slows a whole sample many times over): 15 samples left the 4 KB ratios at
            about [0.3, 5], 41 samples at about [0.3, 0.45] on the 2-core machine.
        min_sample_s: each sample loops over enough operations to last about this long (sized
            from the median of ``calibration_calls`` single calls).
        max_ops: at most this many operations per sample.
        calibration_calls: single timed calls whose median sizes the loop.
        timeout: seconds for the whole launch.

    Returns:
        One row per (size, operation) with ``world_size``, ``bytes``, ``op``, ``reps``
        (operations per sample), the statistics of ``summarize_samples`` (per operation),
        ``busbw_GBps`` and ``algbw_GBps`` (from the median), ``min_busbw_GBps`` (from the
        minimum), ``baseline``, ``ratio_to_baseline`` (median time / the baseline's) with its
        interval ``ratio_low``, ``ratio_high``, ``verdict``, ``winner`` (of the whole size, or
        None), and the raw per-sample ``seconds``.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ValueError(f"measure_collectives: samples must be an integer >= 2 (a spread and an "
                         f"interval need several), got {samples!r}.")
    names = list(OPS) if names is None else list(names)
    unknown = sorted(set(names) - set(OPS))
    if unknown or not names or len(set(names)) < len(names):
        raise ValueError(f"measure_collectives: names must be distinct operations of "
                         f"{list(OPS)}, got {names}.")
    timed = launch(_collectives_worker, world_size, sizes, names, samples, min_sample_s,
                   max_ops, calibration_calls, timeout=timeout)[0]
    rows = []
    for nbytes in sizes:
        c = timed[nbytes]
        for name in names:
            v = c["variants"][name]
            stats = summarize_samples(v["seconds"])
            rows.append({"world_size": world_size, "bytes": nbytes, "op": name,
                         "reps": v["loops"], **stats,
                         "busbw_GBps": bus_bandwidth(nbytes, stats["median_s"], world_size) / 1e9,
                         "algbw_GBps": nbytes / stats["median_s"] / 1e9,
                         "min_busbw_GBps": bus_bandwidth(nbytes, stats["min_s"], world_size) / 1e9,
                         "baseline": c["baseline"],
                         "ratio_to_baseline": v["ratio_to_baseline"],
                         "ratio_low": v["ratio_low"], "ratio_high": v["ratio_high"],
                         "confidence": c["confidence"], "verdict": v["verdict"],
                         "winner": c["winner"], "seconds": v["seconds"]})
    return rows


def pipelined_ring_goal(rows: list[dict], *, from_bytes: int = 16 * MB) -> dict:
    """The pipelined ring's time over ``dist.all_reduce``'s from ``from_bytes`` up, per world
    size, with its interval and a verdict on the goal "at least 0.9 of its speed" (time ratio
    at most 1 / 0.9); what ``bench allreduce`` reported before it became part of this one."""
    goal = 1 / 0.9
    out: dict = {}
    for r in rows:
        if r["op"] != "ring_pipelined" or r["baseline"] != BASELINE or r["bytes"] < from_bytes:
            continue
        lo, hi = r["ratio_low"], r["ratio_high"]
        out.setdefault(str(r["world_size"]), {})[str(r["bytes"])] = {
            "time_ratio": r["ratio_to_baseline"], "interval": [lo, hi],
            "goal_met": _verdict(lo, hi, goal, at_least=False)}
    return out


def _default_world_sizes() -> list[int]:
    """2, 4, 8 where there are that many GPUs (or CPU cores: one worker per core)."""
    return [w for w in default_workers() if w > 1] or [2]


def main(argv: list[str], *, name: str = "collectives",
         default_ops: list[str] | None = None) -> int:
    """``python -m course_lib.bench collectives``: print the JSON, write it; 0 if it ran.

    ``name`` and ``default_ops`` serve the older name ``allreduce`` (its own results file,
    two operations)."""
    parser = argparse.ArgumentParser(prog=f"python -m course_lib.bench {name}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a quick look (seconds): 2 ranks, 3 sizes up to 256 KB, 3 samples "
                        "of 5 ms")
    parser.add_argument("--world-sizes", default=None,
                        help="comma-separated (default: 2, 4, 8 up to the GPUs or CPU cores)")
    parser.add_argument("--sizes", default=None, help="comma-separated, e.g. 4K,1M,64M")
    parser.add_argument("--ops", default=",".join(default_ops or OPS),
                        help=f"comma-separated, at least two of {', '.join(OPS)} (default: "
                        "%(default)s)")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per operation and size (default 41, quick 3; at least 2)")
    parser.add_argument("--min-sample-ms", type=float, default=None,
                        help="each sample loops for at least about this long (default 50, "
                        "quick 5)")
    parser.add_argument("--max-ops", type=int, default=2000,
                        help="at most this many operations per sample")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds for each launch (one per world size) before its workers "
                        "are stopped (default 1200)")
    _out_option(parser, name)
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 2:
        parser.error(f"--samples must be an integer >= 2 (a spread and an interval need "
                     f"several), got {args.samples}.")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if sorted(set(ops) - set(OPS)) or not ops or len(set(ops)) < len(ops):
        parser.error(f"--ops must name distinct operations of {list(OPS)} (one is timed alone), "
                     f"got {args.ops!r}.")
    sizes = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes
             else QUICK_SIZES if args.quick else DEFAULT_SIZES)
    world_sizes = ([int(w) for w in args.world_sizes.split(",")] if args.world_sizes
                   else [2] if args.quick else _default_world_sizes())
    samples = args.samples if args.samples is not None else (3 if args.quick else 41)
    min_sample_s = (args.min_sample_ms or (5 if args.quick else 50)) / 1e3
    report = report_header(name, argv, quick=args.quick)
    start = time.perf_counter()
    rows = []
    for ws in world_sizes:
        rows += measure_collectives(ws, sizes, names=ops, samples=samples,
                                    min_sample_s=min_sample_s, max_ops=args.max_ops,
                                    timeout=args.timeout)
    report.update({
        "units": "seconds per all-reduce; busbw = bytes / time * 2 (p - 1) / p (nccl-tests)",
        "method": "every operation of a size interleaved in the same processes "
                  "(course_lib.timing.compare); each sample a loop of many operations sized "
                  "from the median of several calls, the slowest rank's time; 95 % bootstrap "
                  "interval of each time ratio to dist.all_reduce",
        "sizes": sizes, "world_sizes": world_sizes, "ops": ops, "baseline": BASELINE,
        "samples": samples, "min_sample_s": min_sample_s,
        "results": rows,
        "ring_pipelined_vs_all_reduce_16MB_and_up": pipelined_ring_goal(rows),
    })
    return _finish(report, name, args.out, args.quick, start)
