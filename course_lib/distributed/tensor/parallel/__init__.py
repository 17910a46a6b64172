"""Tensor parallelism: ``course_lib.distributed.tensor.parallel`` mirrors
``torch.distributed.tensor.parallel`` and builds, by hand, what Megatron-LM does.

- ``mappings``: the conjugate operations f and g (and the all-gather / split pair) as autograd
  functions, under Megatron's names.
- ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear`` (each with ``from_linear``),
  ``VocabParallelEmbedding`` (with ``from_embedding``).
- ``cross_entropy``: ``vocab_parallel_cross_entropy``, the loss of sharded logits.
- ``sequence``: sequence parallelism (Korthikanti et al. 2022): the g / g-bar pair along the
  sequence, ``SequenceParallelLayerNorm``, ``SequenceParallelPositionEmbedding``.
- ``accounting``: ``tensor_parallel_memory``, the bytes per rank of parameters, gradients,
  optimizer state and activations of a split GPT, counted from the code (``parameter_counts``,
  ``activation_bytes_per_layer``).
- ``transformer``: ``parallelize_mlp``, ``parallelize_attention`` and ``parallelize_gpt``, a
  ``course_lib.models.gpt`` model split by heads and by vocabulary (and, with
  ``sequence_parallel=True``, by positions between the tensor-parallel regions).

Read more: Shoeybi et al. (2019), "Megatron-LM", and notebook 14.
"""
from .accounting import activation_bytes_per_layer, parameter_counts, tensor_parallel_memory
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .sequence import (
    SEQUENCE_DIM,
    SequenceParallelLayerNorm,
    SequenceParallelPositionEmbedding,
    gather_from_sequence_parallel_region,
    linear_with_sequence_parallel_input,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .transformer import parallelize_attention, parallelize_gpt, parallelize_mlp

__all__ = ["SEQUENCE_DIM", "ColumnParallelLinear", "RowParallelLinear",
           "SequenceParallelLayerNorm", "SequenceParallelPositionEmbedding",
           "VocabParallelEmbedding", "activation_bytes_per_layer",
           "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
           "gather_from_tensor_model_parallel_region", "linear_with_sequence_parallel_input",
           "parameter_counts", "parallelize_attention", "parallelize_gpt", "parallelize_mlp",
           "reduce_from_tensor_model_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
           "scatter_to_tensor_model_parallel_region", "tensor_parallel_memory",
           "vocab_parallel_cross_entropy"]
