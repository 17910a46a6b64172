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
inputs and gradients are the same everywhere, so they need no communication. Every rank must
start from the same model (the same seed) and see the same batch.
"""
from __future__ import annotations

from functools import partial

from ....models.gpt import GPT, MLP, CausalSelfAttention
from ._checks import divisible, group_rank_size
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["parallelize_attention", "parallelize_gpt", "parallelize_mlp"]


def parallelize_mlp(mlp: MLP, *, group=None) -> MLP:
    """The Megatron MLP, in place: ``fc`` column-parallel, ``proj`` row-parallel."""
    mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group=group)        # (B, T, 4C/t)
    mlp.proj = RowParallelLinear.from_linear(mlp.proj, group=group)       # (B, T, C)
    return mlp


def parallelize_attention(attn: CausalSelfAttention, *, group=None) -> CausalSelfAttention:
    """Attention split by heads, in place: ``qkv`` column-, ``out_proj`` row-parallel."""
    _, world = group_rank_size(group, "parallelize_attention")
    n_head = attn.qkv.out_features // (3 * attn.head_dim)
    divisible(n_head, world, "n_head", "parallelize_attention")
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group=group)    # (B, T, 3C/t)
    attn.out_proj = RowParallelLinear.from_linear(attn.out_proj, group=group)   # (B, T, C)
    return attn


def parallelize_gpt(model: GPT, *, group=None) -> GPT:
    """Turn ``model`` into its tensor-parallel form on ``group``, in place, and return it.

    Afterwards ``model(idx)`` returns this rank's block of the logits, ``(B, T, V / t)``
    (classes ``r * V / t`` to ``(r + 1) * V / t``; gather them with
    ``gather_from_tensor_model_parallel_region`` to sample), and ``model(idx, targets)`` the
    loss of the full logits, equal to the one-process model's.

    Args:
        model: a ``course_lib.models.gpt.GPT``, the same on every rank of ``group``.
        group: the tensor-parallel group (default: the whole world). Its size must divide
            ``n_head`` and ``vocab_size``.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize_gpt expects a course_lib.models.gpt.GPT, got "
                        f"{type(model).__name__}; for another model write a plan of "
                        "ColumnParallelLinear / RowParallelLinear per layer.")
    _, world = group_rank_size(group, "parallelize_gpt")
    config = model.config
    divisible(config.n_head, world, "n_head", "parallelize_gpt")          # checked before any
    divisible(config.vocab_size, world, "vocab_size", "parallelize_gpt")  # layer is replaced
    model.wte = VocabParallelEmbedding.from_embedding(model.wte, group=group)
    for block in model.blocks:
        parallelize_attention(block.attn, group=group)
        parallelize_mlp(block.mlp, group=group)
    model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, group=group)   # (B, T, V/t)
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=group)
    return model

