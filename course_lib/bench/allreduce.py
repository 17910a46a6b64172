"""The older name of ``python -m course_lib.bench collectives``, kept so that old commands work.

``bench allreduce`` once timed single operations behind a barrier, which measures the barrier
and the scheduler more than the all-reduce. The course now has one way to time collectives,
``course_lib.bench.collectives`` (loops of many operations per sample, interleaved, with
minimum, spread and intervals); ``python -m course_lib.bench allreduce`` runs it with the
pipelined ring and ``dist.all_reduce`` only (what this benchmark compared), writes
``results/allreduce-MACHINE.json`` and says so. ``--repeat N`` is read as ``--samples N``.
The names below are re-exported from ``collectives`` for old imports.
"""
from __future__ import annotations

import sys

from .collectives import DEFAULT_SIZES, KB, MB, QUICK_SIZES, bus_bandwidth, parse_size
from .collectives import main as collectives_main

__all__ = ["DEFAULT_SIZES", "KB", "MB", "OPS", "QUICK_SIZES", "bus_bandwidth", "main",
           "parse_size"]

#: What ``bench allreduce`` compares: the hand-written pipelined ring against the library's.
OPS = ["ring_pipelined", "all_reduce"]


def main(argv: list[str]) -> int:
    """``python -m course_lib.bench allreduce``: ``collectives --ops ring_pipelined,all_reduce``."""
    argv = list(argv)
    translated: list[str] = []
    i = 0
    while i < len(argv):  # --repeat N -> --samples N; --warmup N is gone (compare warms up)
        arg = argv[i]
        key, _, value = arg.partition("=")
        if key in ("--repeat", "--warmup"):
            value = value if value else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if key == "--repeat":
                translated += ["--samples", value]
            continue
        translated.append(arg)
        i += 1
    print("bench allreduce is now part of bench collectives (one way to time collectives: "
          "loops of many operations per sample, interleaved, with intervals); running "
          "`python -m course_lib.bench collectives --ops " + ",".join(OPS) + "`",
          file=sys.stderr)
    return collectives_main(translated, name="allreduce", default_ops=OPS)
