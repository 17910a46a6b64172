"""Model and pipeline parallelism: a model cut into stages, each on its own device or process.

PyTorch counterpart: ``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``,
``Schedule1F1B``). Lesson 12. The modules, in the order the lesson uses them:

- ``split``: ``split_sequential``, ``balance_stages`` (by parameter count or measured time),
  ``layer_costs``, ``stage_costs``, ``flatten_sequential``;
- ``model_parallel``: ``ModelParallel``, stage i on device i in one process;
- ``microbatch``: ``split_microbatches``;
- ``stage``: ``PipelineStageBase`` (a stage's messages), ``PipelineStage`` (one stage per
  process: activations forward, gradients back with point-to-point operations), ``PipeEvent``;
- ``schedules``: ``ScheduleGPipe``, ``Schedule1F1B``, their orders (``gpipe_order``,
  ``one_f_one_b_order``), ``simulate_schedule`` (plays orders as NCCL runs their messages),
  ``p2p_program`` (a stage's sends, receives and waits), ``bubble_fraction`` (theory),
  ``idle_fraction`` (measured), ``check_order``;
- ``memory``: ``ActivationMeter``, bytes saved for backward, alive and at the peak.
"""
from .memory import ActivationMeter
from .microbatch import split_microbatches
from .model_parallel import ModelParallel
from .schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    bubble_fraction,
    check_order,
    gpipe_order,
    idle_fraction,
    one_f_one_b_order,
    p2p_program,
    simulate_schedule,
)
from .split import balance_stages, flatten_sequential, layer_costs, split_sequential, stage_costs
from .stage import PipeEvent, PipelineStage, PipelineStageBase

__all__ = ["ActivationMeter", "ModelParallel", "PipeEvent", "PipelineStage", "PipelineStageBase",
           "Schedule1F1B", "ScheduleGPipe", "balance_stages", "bubble_fraction", "check_order",
           "flatten_sequential", "gpipe_order", "idle_fraction", "layer_costs",
           "one_f_one_b_order", "p2p_program", "simulate_schedule", "split_microbatches",
           "split_sequential", "stage_costs"]
