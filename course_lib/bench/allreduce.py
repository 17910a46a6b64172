"""The older name of ``python -m course_lib.bench collectives``, kept so that old commands work.

``bench allreduce`` once timed single operations behind a barrier, which measures the barrier
and the scheduler more than the all-reduce. The one way to time collectives is now
``course_lib.bench.collectives``; ``python -m course_lib.bench allreduce`` runs it on the
pipelined ring and ``dist.all_reduce`` only (what this compared), writes
``results/allreduce-MACHINE.json`` and says so; ``--repeat N`` means ``--samples N``. The names
below are re-exported from ``collectives`` for old imports.
"""
from __future__ import annotations

import argparse
import sys

from . import collectives
from .collectives import DEFAULT_SIZES, KB, MB, QUICK_SIZES, bus_bandwidth, parse_size

__all__ = ["DEFAULT_SIZES", "KB", "MB", "OPS", "QUICK_SIZES", "bus_bandwidth", "main", "measure",
           "parse_size"]

#: What ``bench allreduce`` compares: the hand-written pipelined ring against the library's.
OPS = ["ring_pipelined", "all_reduce"]


def measure(world_size: int, sizes: list[int], repeat: int = 10, warmup: int = 2,
            timeout: float = 600.0) -> list[dict]:
    """The pipelined ring against ``dist.all_reduce`` at each size, the older rows' keys.

    ``collectives.measure_collectives`` on both (``repeat`` samples, at least 2; ``warmup``
    unused: ``compare`` warms up); per size ``ring_s``, ``all_reduce_s`` (medians),
    ``ring_min_s``, ``all_reduce_min_s``, both bus bandwidths, ``speed_ratio = all_reduce time /
    ring time`` and its 95 % ``speed_ratio_interval``.
    """
    del warmup
    rows = collectives.measure_collectives(world_size, sizes, names=OPS, samples=max(2, repeat),
                               timeout=timeout)
    out = []
    for nbytes in sizes:
        ring, ref = (next(r for r in rows if r["bytes"] == nbytes and r["op"] == op)
                     for op in OPS)
        out.append({
            "world_size": world_size, "bytes": nbytes,
            "ring_s": ring["median_s"], "all_reduce_s": ref["median_s"],
            "ring_min_s": ring["min_s"], "all_reduce_min_s": ref["min_s"],
            "ring_busbw_GBps": ring["busbw_GBps"], "all_reduce_busbw_GBps": ref["busbw_GBps"],
            "speed_ratio": 1 / ring["ratio_to_baseline"],
            "speed_ratio_interval": [1 / ring["ratio_high"], 1 / ring["ratio_low"]],
        })
    return out


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench allreduce``: ``collectives --ops ring_pipelined,all_reduce``."""
    old = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    old.add_argument("--repeat")   # -> --samples N
    old.add_argument("--warmup")   # gone: compare warms up
    known, translated = old.parse_known_args(list(argv))
    if known.repeat is not None:
        translated += ["--samples", known.repeat]
    print("bench allreduce is now part of bench collectives (one way to time collectives: "
          "loops of many operations per sample, interleaved, with intervals); running "
          "`python -m course_lib.bench collectives --ops " + ",".join(OPS) + "`",
          file=sys.stderr)
    return collectives.main(translated, name="allreduce", default_ops=OPS)
