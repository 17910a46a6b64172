"""A small GPT: a decoder-only transformer that a learner reads in one sitting (lesson 14 on).

PyTorch counterpart: none in torch itself; the shape of karpathy/nanoGPT's ``model.py`` (token and
position embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a language-model
head). Read more: Vaswani et al. (2017), Radford et al. (2019), and notebook 14, where this model
is split across processes by tensor parallelism
(``course_lib.distributed.tensor.parallel.parallelize_gpt``).

Two choices make that split a swap of layers rather than a rewrite:

- the query, key and value projections are one ``nn.Linear`` whose output rows are laid out head
  by head (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, as Megatron-LM lays them out), so cutting its
  rows into t equal blocks gives each rank whole heads;
- attention and the loss read their sizes from the tensors they are given (heads from the width
  of the projection's output, the loss from ``self.loss_fn``), so the same ``forward`` runs on
  one process and on a shard of the heads.

There is no dropout: a run is a function of the seed and the data alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "MLP", "causal_attention"]


@dataclass
class GPTConfig:
    """The sizes of a ``GPT``. The default trains on 2 CPU cores in minutes.

    ``vocab_size`` 264 is the 256 byte values padded to a multiple of 24 (as Megatron pads its
    vocabulary), and ``n_head`` 12 is divisible by 2, 3 and 4: the model splits evenly over 2, 3
    or 4 ranks by vocabulary and by heads.
    """

    vocab_size: int = 264
    block_size: int = 64      # the longest sequence: number of position embeddings
    n_layer: int = 2
    n_head: int = 12
    n_embd: int = 96          # head size n_embd / n_head = 8
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head}); choose n_embd = n_head * head size.")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs), causal) v for q, k, v of shape (B, nh, T, hs)."""
    T, head_dim = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)   # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return scores.softmax(dim=-1) @ v                        # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position i sees positions 0..i only.

    ``core_attention`` (scores, softmax, weighted sum of values) is an attribute so that
    ``course_lib.utils.checkpoint.selective_recompute`` can swap in a recomputing version.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.core_attention = causal_attention
        # one projection for q, k and v, its output rows grouped by head: [q_h k_h v_h] per head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                  # (B, T, 3 * nh * hs)
        B, T, _ = qkv.shape     # the whole sequence, even when x holds a block of it (SP)
        n_head = qkv.shape[-1] // (3 * self.head_dim)      # all heads, or this rank's share
        qkv = qkv.view(B, T, n_head, 3, self.head_dim)     # (B, T, nh, 3, hs)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)               # each (B, nh, T, hs)
        y = self.core_attention(q, k, v)                   # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)   # (B, T, nh * hs)
        return self.out_proj(y)                            # (B, T, C)


class MLP(nn.Module):
    """Widen to 4C, GELU, back to C."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C)
        return self.proj(F.gelu(self.fc(x)))                 # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm, a linear head.

    ``model(idx)`` returns the logits ``(B, T, vocab_size)``; ``model(idx, targets)`` returns
    ``(logits, loss)``, the loss the mean cross-entropy over all B * T positions.
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.loss_fn = F.cross_entropy   # (N, V) logits, (N,) targets -> mean loss
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape                                     # (B, T) token ids
        if T > self.config.block_size:
            raise ValueError(f"GPT: sequence length {T} exceeds block_size "
                             f"{self.config.block_size}; cut the input to at most that.")
        pos = torch.arange(T, device=idx.device)             # (T,)
        x = self.wte(idx) + self.wpe(pos)                    # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))                  # (B, T, V)
        if targets is None:
            return logits
        loss = self.loss_fn(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
