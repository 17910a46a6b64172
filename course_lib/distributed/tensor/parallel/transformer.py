"""A ``course_lib.models.gpt`` model split by tensor parallelism (Megatron-LM), layer by layer.

PyTorch counterpart: ``torch.distributed.tensor.parallel.parallelize_module`` with a plan of
``ColwiseParallel`` / ``RowwiseParallel`` per layer (see torchtitan's plan for Llama). Read more:
Shoeybi et al. (2019), figure 3, and notebook 14.

- the MLP: ``fc`` column-parallel, GELU on each rank's block, ``proj`` row-parallel: one
  all-reduce forward (after ``proj``), one backward (before ``fc``).
- attention split by heads: ``qkv`` column-parallel (its rows are laid out head by head, so
  rank r gets whole heads ``r * nh / t`` to ``(r + 1) * nh / t``), attention runs on those heads
  alone, ``out_proj`` row-parallel: again one all-reduce forward, one backward.
- the token embedding vocabulary-parallel (one all-reduce forward), the head column-parallel
  without gathering (one all-reduce backward) and the loss ``vocab_parallel_cross_entropy``
  (three all-reduces of one number per position forward).

LayerNorms, the position embedding and the row-parallel biases stay whole on every rank: their
inputs and gradients are the same everywhere, so they need no communication. With
``sequence_parallel=True`` (``sequence.py``) they work on this rank's positions instead, and
their weights' gradients are summed over the group. Every rank must
start from the same model (the same seed) and see the same batch.
"""
from __future__ import annotations

from functools import partial

from ....models.gpt import GPT, MLP, CausalSelfAttention
from ._checks import divisible, group_rank_size
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .sequence import SequenceParallelLayerNorm, SequenceParallelPositionEmbedding

__all__ = ["parallelize_attention", "parallelize_gpt", "parallelize_mlp"]


def parallelize_mlp(mlp: MLP, *, group=None, sequence_parallel: bool = False) -> MLP:
    """The Megatron MLP, in place: ``fc`` column-parallel, ``proj`` row-parallel."""
    sp = dict(group=group, sequence_parallel=sequence_parallel)
    mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, **sp)               # (B, T, 4C/t)
    mlp.proj = RowParallelLinear.from_linear(mlp.proj, **sp)              # (B, T or T/t, C)
    return mlp


def parallelize_attention(attn: CausalSelfAttention, *, group=None,
                          sequence_parallel: bool = False) -> CausalSelfAttention:
    """Attention split by heads, in place: ``qkv`` column-, ``out_proj`` row-parallel."""
    _, world = group_rank_size(group, "parallelize_attention")
    n_head = attn.qkv.out_features // (3 * attn.head_dim)
    divisible(n_head, world, "n_head", "parallelize_attention")
    sp = dict(group=group, sequence_parallel=sequence_parallel)
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, **sp)           # (B, T, 3C/t)
    attn.out_proj = RowParallelLinear.from_linear(attn.out_proj, **sp)    # (B, T or T/t, C)
    return attn


def parallelize_gpt(model: GPT, *, group=None, sequence_parallel: bool = False) -> GPT:
    """Turn ``model`` into its tensor-parallel form on ``group``, in place, and return it.

    Afterwards ``model(idx)`` returns this rank's block of the logits, ``(B, T, V / t)``
    (classes ``r * V / t`` to ``(r + 1) * V / t``; gather them with
    ``gather_from_tensor_model_parallel_region`` to sample), and ``model(idx, targets)`` the
    loss of the full logits, equal to the one-process model's.

    Args:
        model: a ``course_lib.models.gpt.GPT``, the same on every rank of ``group``.
        group: the tensor-parallel group (default: the whole world). Its size must divide
            ``n_head`` and ``vocab_size``.
        sequence_parallel: also split the LayerNorm regions along the sequence (Korthikanti
            et al. 2022; ``sequence.py``): between blocks each rank holds ``(B, T/t, C)``, the
            all-reduces become all-gathers before the column-parallel layers and
            reduce-scatters after the row-parallel ones. The group's size must divide T.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize_gpt expects a course_lib.models.gpt.GPT, got "
                        f"{type(model).__name__}; for another model write a plan of "
                        "ColumnParallelLinear / RowParallelLinear per layer.")
    _, world = group_rank_size(group, "parallelize_gpt")
    config = model.config
    divisible(config.n_head, world, "n_head", "parallelize_gpt")          # checked before any
    divisible(config.vocab_size, world, "vocab_size", "parallelize_gpt")  # layer is replaced
    sp = dict(group=group, sequence_parallel=sequence_parallel)
    model.wte = VocabParallelEmbedding.from_embedding(model.wte, **sp)
    for block in model.blocks:
        parallelize_attention(block.attn, **sp)
        parallelize_mlp(block.mlp, **sp)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, **sp)   # (B, T, V/t)
    if sequence_parallel:        # the regions between: this rank's positions, (B, T/t, C)
        model.wpe = SequenceParallelPositionEmbedding.from_embedding(model.wpe, group=group)
        for block in model.blocks:
            block.ln_1 = SequenceParallelLayerNorm.from_layer_norm(block.ln_1, group=group)
            block.ln_2 = SequenceParallelLayerNorm.from_layer_norm(block.ln_2, group=group)
        model.ln_f = SequenceParallelLayerNorm.from_layer_norm(model.ln_f, group=group)
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=group)
    return model

