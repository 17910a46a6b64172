"""One process, several devices: ``course_lib.parallel`` mirrors ``torch.nn.parallel``.

Where each idea lives (the same files as in ``torch/nn/parallel/``):

- ``comm``: tensors between devices (lessons 02-03): ``get_params``, ``replicate_params``,
  ``broadcast``, ``scatter``, ``gather``, ``split_batch``, and three allreduces (``allreduce``,
  ``ring_allreduce``, ``ps_allreduce``) over a list of tensors, one per device.
- ``replicate``, ``scatter_gather``, ``parallel_apply``, ``data_parallel``: the four parts of
  ``DataParallel`` and the class itself (lesson 05).
- ``ddp``: ``DistributedDataParallel`` from scratch, one process per device, with its buckets
  and communication hooks (lesson 07); it is built on ``course_lib.distributed``'s processes,
  as torch's DDP is on ``torch.distributed``.
- ``sync_batchnorm``: ``SyncBatchNorm`` from scratch (batch statistics over every rank, also on
  gloo and the CPU, where torch's refuses) and ``convert_sync_batchnorm`` (lesson 08).

Names that look alike differ in meaning, and the path says which: ``replicate_params`` copies a
list of tensors, ``replicate`` a module (as torch's); ``comm.gather`` joins tensors,
``scatter_gather.gather`` a module's outputs; ``comm.ring_allreduce`` sums a list of tensors in
one process, ``course_lib.distributed.ring_allreduce`` one tensor per rank across processes.
"""
from .comm import (
    allreduce,
    broadcast,
    check_allreduce,
    get_params,
    ps_allreduce,
    replicate_params,
    ring_allreduce,
    scatter,
    split_batch,
)
from .data_parallel import DataParallel
from .ddp import DistributedDataParallel
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter_kwargs
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, global_batch_stats

__all__ = ["DataParallel", "DistributedDataParallel", "SyncBatchNorm", "allreduce", "broadcast",
           "check_allreduce", "convert_sync_batchnorm", "gather", "get_params",
           "global_batch_stats", "parallel_apply", "ps_allreduce", "replicate", "replicate_params",
           "ring_allreduce", "scatter", "scatter_kwargs", "split_batch"]
