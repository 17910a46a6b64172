"""Checkers for exercises and homework: tell the learner whether an answer is right, and why not.

Every checker takes the learner's answer (a value or a function), compares it with the course's
own computation (the oracle), prints a one-line verdict and returns an ``ExerciseResult`` (truthy
when right). An answer left as ``None`` is reported as "not answered yet" instead of failing, so
notebooks that ship with open exercises still run top to bottom. Pass ``strict=True`` to raise
``AssertionError`` on a wrong answer (what an autograder wants).

One module per lesson (``lesson00`` ... ``lesson16``); every checker is importable from here:
``from course_lib import checks; checks.check_allreduce_fn(my_allreduce)``.
"""
from ._core import (
    CheckTimeout,
    ExerciseResult,
    call_bounded,
    check_answer,
    check_function,
    failure,
    verdict,
)
from .lesson00 import check_matmul_flops, check_time_queued, check_try_all_gpus
from .lesson01 import (
    check_accuracy_fn,
    check_initial_loss,
    check_lenet_fn,
    check_sgd_fn,
    check_step_flops,
)
from .lesson02 import (
    check_allreduce_fn,
    check_butterfly,
    check_ring_allreduce,
    check_ring_sends,
)
from .lesson03 import (
    check_balanced_sizes,
    check_devices_used,
    check_scatter,
    check_split_batch,
)
from .lesson04 import check_lr_for_shard_means, check_scaled_batch, check_train_batch
from .lesson05 import check_bn_examples_seen, check_data_parallel_fn, check_module_calls
from .lesson06 import (
    check_dist_allreduce,
    check_elements_sent,
    check_spawn_worker,
    check_tree_rounds,
)
from .lesson07 import check_average_gradients, check_ddp
from .lesson08 import check_epoch_shards, check_exact_accuracy, check_recipe_entry
from .lesson09 import check_resume, check_syncbn
from .lesson10 import (
    check_alpha_beta_fit,
    check_bus_bandwidth,
    check_comm_after_backward,
    check_overlap_of_step,
    check_predicted_comm,
    check_ring_time,
    check_slower_rank_wait,
    check_time_collective,
    time_all_reduce,
)
from .lesson11 import check_fsdp, check_zero
from .lesson12 import check_one_f_one_b, check_stage, max_in_flight
from .lesson13 import (
    check_load_matching,
    check_read_plan,
    check_reshard,
    check_sharded_resume,
    check_strip_prefix,
)
from .lesson14 import (
    check_conjugates,
    check_megatron_mlp,
    check_parallel_linears,
    check_vocab_parallel_cross_entropy,
)
from .lesson15 import check_checkpoint, check_scaler_update, check_sequence_parallel_block
from .lesson16 import check_merge, check_ring_attention, check_ring_step

__all__ = [
    "CheckTimeout", "ExerciseResult", "call_bounded", "check_answer", "check_function",
    "failure", "verdict",
    "check_matmul_flops", "check_time_queued", "check_try_all_gpus",  # lesson 00
    "check_accuracy_fn", "check_initial_loss", "check_lenet_fn", "check_sgd_fn",  # 01
    "check_step_flops",  # 01
    "check_allreduce_fn", "check_ring_sends",                 # 02
    "check_butterfly", "check_ring_allreduce",
    "check_balanced_sizes", "check_devices_used",             # 03
    "check_scatter", "check_split_batch",
    "check_lr_for_shard_means", "check_scaled_batch", "check_train_batch",  # 04
    "check_bn_examples_seen", "check_module_calls", "check_data_parallel_fn",  # 05
    "check_tree_rounds", "check_elements_sent",               # 06
    "check_spawn_worker", "check_dist_allreduce",
    "check_average_gradients", "check_ddp",                   # 07
    "check_epoch_shards", "check_exact_accuracy", "check_recipe_entry",  # 08
    "check_resume", "check_syncbn",                           # 09
    "check_alpha_beta_fit", "check_bus_bandwidth", "check_predicted_comm",  # 10
    "check_comm_after_backward", "check_overlap_of_step", "check_ring_time",
    "check_slower_rank_wait", "check_time_collective",
    "time_all_reduce",
    "check_zero", "check_fsdp",                              # 11 (sharded)
    "check_stage", "check_one_f_one_b", "max_in_flight",       # 12
    "check_load_matching", "check_read_plan", "check_reshard", "check_sharded_resume",  # 13
    "check_strip_prefix",
    "check_conjugates", "check_parallel_linears", "check_megatron_mlp",  # 14
    "check_vocab_parallel_cross_entropy",
    "check_checkpoint", "check_scaler_update", "check_sequence_parallel_block",  # 15
    "check_merge", "check_ring_attention", "check_ring_step",  # 16
]
