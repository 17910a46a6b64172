"""Argument checks and error texts of ``course_lib.distributed.tensor.parallel``."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_rank_size(group, where: str) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size), or a clear error without a group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{where} needs a process group: call dist.init_process_group first "
                           "(course_lib.distributed.launch does it in each worker).")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{where}: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group given; pass a group this rank belongs to.")
    return rank, dist.get_world_size(group)


def divisible(size: int, world: int, what: str, where: str) -> int:
    """``size // world``, or a clear error when ``world`` does not divide ``size``."""
    if size % world:
        raise ValueError(
            f"{where}: {what} = {size} is not divisible by the tensor-parallel world size "
            f"{world}, so the ranks cannot hold equal shards. Choose {what} a multiple of "
            f"{world} (pad it, as Megatron pads the vocabulary) or use a group of a size that "
            f"divides {size}.")
    return size // world


def check_linear(linear, where: str) -> None:
    """``linear`` is an ``nn.Linear`` (or has its weight and bias)."""
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"{where} expects an nn.Linear (a 2-D weight (out, in)), got "
                        f"{type(linear).__name__}.")


def check_token_range(idx: torch.Tensor, num_embeddings: int, where: str) -> None:
    """Token ids within ``[0, num_embeddings)``: out of range they would silently embed as 0."""
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where} expects integer token ids (torch.long), got {idx.dtype}.")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_embeddings):
        raise IndexError(f"{where}: token ids must lie in [0, {num_embeddings}), got ids from "
                         f"{int(idx.min())} to {int(idx.max())}; check the tokenizer's "
                         "vocabulary against the embedding's num_embeddings.")


def check_logits_targets(logits_shard: torch.Tensor, targets: torch.Tensor,
                         vocab_size: int, where: str) -> None:
    """Shapes ``(..., V/t)`` and ``(...)``, target ids within the full vocabulary."""
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"{where} expects logits_shard (..., V/t) and targets (...) with the same "
                         f"leading shape, got {tuple(logits_shard.shape)} and "
                         f"{tuple(targets.shape)}; flatten both the same way (for example "
                         "logits.flatten(0, 1) and targets.flatten()).")
    check_token_range(targets, vocab_size, where)


def check_width(x: torch.Tensor, expected: int, where: str, hint: str) -> None:
    """The last dimension of ``x`` is ``expected`` wide."""
    if x.shape[-1] != expected:
        raise ValueError(f"{where} expects inputs whose last dimension is {expected}, got shape "
                         f"{tuple(x.shape)}. {hint}")


def check_plain_embedding(embedding, where: str) -> None:
    """An ``nn.Embedding`` without the options a split by rows would silently change."""
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"{where} expects an nn.Embedding (a 2-D weight (num, dim)), got "
                        f"{type(embedding).__name__}.")
    options = {name: getattr(embedding, name, None) for name in ("padding_idx", "max_norm")}
    options["sparse"] = getattr(embedding, "sparse", False) or None
    used = {k: v for k, v in options.items() if v is not None}
    if used:
        raise ValueError(f"{where} supports plain embeddings only, got one with {used}; "
                         "build the embedding without these options.")
