"""Several processes: ``course_lib.distributed`` mirrors ``torch.distributed``.

Where each idea lives (the same split as torch's package):

- ``env``: join the group the launcher describes (``init_distributed_mode``), choose the backend
  once for the job (``choose_backend``), ``is_main_process``, ``reduce_value``, ``cleanup``.
- ``launch``: start workers from a notebook (``launch``; ``run_worker`` is what each runs), like
  ``torch.multiprocessing.spawn``; ``processes``: stopping them, bounded, nothing left behind.
- ``collectives``: all-reduce, broadcast and all-gather written by hand from ``isend``/``irecv``.
- ``run``: ``torchrun`` and ``mpirun`` from a notebook cell.
- ``optim``: ``ZeroRedundancyOptimizer`` (ZeRO-1); ``fsdp``: ``FullyShardedDataParallel``;
  ``memory``: bytes per rank measured (``PeakMemory``) beside the ZeRO paper's count
  (``zero_formula``) (lesson 11).
- ``device_mesh``: ``init_device_mesh`` and ``DeviceMesh``, the ranks laid out with named
  dimensions, one process group per row of each (lesson 16).

Every public name of those modules is importable from here: ``from course_lib.distributed
import launch, init_distributed_mode``.
"""
from .collectives import (
    ring_all_gather,
    ring_allreduce,
    ring_allreduce_pipelined,
    ring_chunk_bounds,
    tree_broadcast,
)
from .device_mesh import DeviceMesh, init_device_mesh
from .env import (
    BackendChoice,
    DistInfo,
    choose_backend,
    cleanup,
    current_device,
    first_host,
    init_distributed_mode,
    is_main_process,
    reduce_value,
)
from .fsdp import FullyShardedDataParallel
from .launch import LaunchTimeout, WorkerError, find_free_port, launch, run_worker
from .memory import PeakMemory, zero_formula
from .optim import ZeroRedundancyOptimizer
from .run import EXAMPLES, example_path, mpirun, run_commands, torchrun

__all__ = ["EXAMPLES", "BackendChoice", "DeviceMesh", "DistInfo", "FullyShardedDataParallel",
           "LaunchTimeout", "PeakMemory", "WorkerError", "ZeroRedundancyOptimizer",
           "choose_backend", "cleanup", "current_device", "example_path", "find_free_port",
           "first_host", "init_device_mesh", "init_distributed_mode", "is_main_process", "launch",
           "mpirun", "reduce_value", "ring_all_gather", "ring_allreduce",
           "ring_allreduce_pipelined", "ring_chunk_bounds", "run_commands", "run_worker",
           "torchrun", "tree_broadcast", "zero_formula"]
