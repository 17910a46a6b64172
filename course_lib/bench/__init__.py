"""The course's benchmarks: each prints JSON, with the hardware it ran on.

Command line: ``python -m course_lib.bench NAME [options]`` (``--list`` names them):

- ``dataloader`` (``course_lib.bench.dataloader``): LeNet's epoch through the in-memory path
  against a plain DataLoader (lesson 01).
- ``ddp`` (``course_lib.bench.ddp``): step time of the course's DDP strategies against torch's
  DDP, 2 ranks, LeNet (ResNet-18 with ``--models``) (lesson 07).
- ``scaling`` (``course_lib.bench.scaling``): step time against the number of workers for the
  from-scratch DP, ``nn.DataParallel``, the course's DDP strategies and torch's DDP, LeNet and
  ResNet-18 (lesson 10).
- ``collectives`` (``course_lib.bench.collectives``): naive, ring and ``dist.all_reduce`` time and
  bus bandwidth, 4 KB to 64 MB, loops of many operations per sample (lessons 06 and 10): the
  course's one way to time collectives. ``allreduce`` is its older name, kept for old commands
  (``course_lib.bench.allreduce``: the pipelined ring against ``dist.all_reduce`` only).
- ``gpt-baseline`` (``course_lib.bench.gpt``): the small GPT trained in one process on the real
  text: loss per step, tokens per second, held-out loss; the oracle of lesson 14 on.
- ``tp-vs-dp`` (``course_lib.bench.gpt``): a tensor-parallel against a data-parallel training
  step of that GPT, 2 ranks, the same global batch, with the all-reduces each sends (lesson 14).
- ``gpu-queue`` (``course_lib.bench.gpu_queue``): on a CUDA GPU only, matrix products timed with
  the clock read at once, after synchronizing and with CUDA events (lesson 00 reads the stored
  runs on machines without a GPU).
- ``gpu-step`` (``course_lib.bench.gpu_step``): on a CUDA GPU, lesson 01's LeNet step against
  batch size and a ``torch.profiler`` trace of it (lesson 01 reads the stored runs).

Every benchmark compares its variants with ``course_lib.timing.compare`` (interleaved in the same
processes, loops sized from the median of several calls, a bootstrap interval on each ratio, a
winner named only when its interval excludes 1) and records the command, date, hardware and the
load before and after (``course_lib.timing.wait_for_quiet``) beside its samples, medians,
minimums and intervals. ``make bench`` runs them all.

``course_lib.bench.cost_model`` fits the alpha-beta model to those measurements (lesson 10).

``step_breakdown`` (``course_lib.bench.breakdown``) times the phases of a ``DataParallel`` step;
``compare_breakdown`` compares them for several sets of devices, a step of each in turn, with
an interval on each phase's ratio (lesson 05). The timer itself is ``course_lib.timing.Timer``.
"""
from __future__ import annotations

import importlib
import sys

from .breakdown import compare_breakdown, step_breakdown

__all__ = ["BENCHMARKS", "compare_breakdown", "main", "step_breakdown"]

#: name -> "module:function" of a benchmark that takes argv and prints JSON.
BENCHMARKS: dict[str, str] = {
    "dataloader": "course_lib.bench.dataloader:main",
    "allreduce": "course_lib.bench.allreduce:main",
    "ddp": "course_lib.bench.ddp:main",
    "scaling": "course_lib.bench.scaling:main",
    "collectives": "course_lib.bench.collectives:main",
    "gpt-baseline": "course_lib.bench.gpt:main_baseline",
    "tp-vs-dp": "course_lib.bench.gpt:main_tp_vs_dp",
    "gpu-queue": "course_lib.bench.gpu_queue:main",
    "gpu-step": "course_lib.bench.gpu_step:main",
}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]``: ``python -m course_lib.bench NAME``; 0 if it ran."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "--list"}:
        print("usage: python -m course_lib.bench NAME [options]\nbenchmarks: "
              + ", ".join(sorted(BENCHMARKS)))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    module, func = BENCHMARKS[name].split(":")
    return getattr(importlib.import_module(module), func)(rest) or 0
