"""Optimizers that know about several processes: ``course_lib.distributed.optim`` mirrors
``torch.distributed.optim``.

- ``ZeroRedundancyOptimizer``: ZeRO stage 1, each rank keeps and steps the optimizer state of its
  own shard of the parameters only (lesson 11).
"""
from .zero_redundancy_optimizer import ZeroRedundancyOptimizer, partition_parameters

__all__ = ["ZeroRedundancyOptimizer", "partition_parameters"]
