"""Memory per rank of a tensor-parallel ``course_lib.models.gpt.GPT``, counted from the code.

PyTorch counterpart: none (``torch.cuda.max_memory_allocated`` measures, it does not predict).
Read more: Shoeybi et al. (2019), section 3 (what is split); Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models", section 4.1 (activations per
layer); notebook 14. ``course_lib.examples.tensor_parallel_workers.measure_memory`` measures
the same quantities on each rank of a real run, to be printed beside these.

With t ranks (``parallelize_gpt``), per rank, float32 (``bytes_per_element`` e = 4):

Parameters. Sharded (each rank holds 1/t): ``wte`` V C, per layer ``qkv`` 3C C + 3C, ``out_proj``
weight C C, ``fc`` 4C C + 4C, ``proj`` weight 4C C, ``lm_head`` V C. Replicated (whole on every
rank): ``wpe`` (block_size C), every LayerNorm (2C each: two per layer and ``ln_f``) and the
row-parallel biases of ``out_proj`` and ``proj`` (C each, added once after the all-reduce; the
linear layers' biases only with ``config.bias``). Gradients: the same bytes. AdamW:
``optimizer_states`` (2: exp_avg, exp_avg_sq) tensors the size of each parameter, plus one
4-byte ``step`` counter per parameter tensor.

Activations: the bytes autograd saves for backward in one forward of a batch (B, T) and its
loss, each tensor counted once (``course_lib.utils.saved_tensor_bytes``'s rule). Per layer, with
N = B T positions, C = n_embd, a = n_head, in elements of e bytes:

======================================  ================  =====================================
saved for backward                      elements          on each rank
======================================  ================  =====================================
``ln_1`` input (the residual stream)    N C               whole
``ln_1`` mean and 1/std                 2 N               whole
``qkv`` input (``ln_1`` output)         N C               whole
q and k, copied by the matmul's reshape 2 N C             / t (this rank's heads)
softmax output (kept by softmax and     N a T             / t
the matmul with v, once)
v, copied by the matmul's reshape       N C               / t
``out_proj`` input (heads concatenated) N C               / t
``ln_2`` input, mean and 1/std          N C + 2 N         whole
``fc`` input (``ln_2`` output)          N C               whole
GELU input (``fc`` output)              4 N C             / t
``proj`` input (GELU output)            4 N C             / t
the (T, T) causal mask of masked_fill   T^2 bytes         whole (bool, built in every layer)
======================================  ================  =====================================

so per layer ``e (4 N C + 4 N) + T^2 + e (12 N C + a N T) / t`` bytes: the LayerNorm inputs and
the inputs of ``qkv`` and ``fc`` (4 N C) are whole on every rank, everything between a
column-parallel layer and its row-parallel partner is split. The division by the scalar
sqrt(hs), the residual additions and the views save nothing.

Korthikanti et al. count sbh(10 + 24/t + 5as/(ht)) bytes per layer (``activation_memory_per_
layer``; s = T, b = B, h = C: sbh = N C) for 16-bit activations with dropout. Term by term: their
24/t is our 12 N C / t elements at 2 bytes; their 5as/(ht) is the softmax output (2 bytes) plus
the softmax dropout's mask (1) and output (2), where we keep the softmax output alone (a N T / t
elements); their 10 is the four whole inputs above (8 bytes at 2 bytes an element) plus the two
1-byte dropout masks after attention and after the MLP, which this model (no dropout) has not.
So ``(paper - 2 N C - 3 a N T / t) * e / 2`` is our count without the two terms the paper leaves
out: the LayerNorm statistics (4 N elements) and the causal mask (T^2 bytes). At t = 1 this is
the count ``tests/test_checkpoint.py`` checks for recomputation.

Outside the layers:

- embeddings: ``F.embedding`` keeps its int64 ids: the tokens (8 N bytes) at t = 1; at t > 1
  the ids shifted into this rank's block (8 N) and the boolean mask of tokens held elsewhere
  (N bytes, kept by ``masked_fill``); ``wpe`` keeps the T int64 positions (8 T).
- head: ``ln_f`` input, mean and 1/std (N C + 2 N), ``lm_head`` input (N C).
- loss, t = 1 (``F.cross_entropy`` = log_softmax + nll_loss): the log-probabilities N V, the
  int64 targets (8 N bytes) and nll_loss's one-number total weight (e bytes).
- loss, t > 1 (``vocab_parallel_cross_entropy``): the shifted logits N V/t (kept by ``gather``),
  their exponentials N V/t (kept by ``exp``), the int64 target index (8 N bytes), the boolean
  mask of targets held elsewhere (N bytes) and the summed exponentials N (kept by ``log``).

The targets are assumed to be a tensor of their own: called as ``model(idx, idx)`` the t = 1
loss's targets are the token ids already counted, and 8 N bytes fewer are saved.
"""
from __future__ import annotations

from ....models.gpt import GPTConfig
from ....utils.activation_memory import activation_memory_per_layer
from ._checks import divisible

__all__ = ["activation_bytes_per_layer", "parameter_counts", "tensor_parallel_memory"]

INDEX_BYTES = 8   # torch.long: token ids, targets, positions
MASK_BYTES = 1    # torch.bool
STEP_BYTES = 4    # AdamW's ``step``: a float32 scalar per parameter tensor (torch's default)


def _check(config, t: int, where: str, **sizes) -> None:
    if not isinstance(config, GPTConfig):
        raise TypeError(f"{where} expects a course_lib.models.gpt.GPTConfig, got "
                        f"{type(config).__name__}.")
    for name, value in {"t": t, **sizes}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
    divisible(config.n_head, t, "n_head", where)
    divisible(config.vocab_size, t, "vocab_size", where)
    if "seq_len" in sizes and sizes["seq_len"] > config.block_size:
        raise ValueError(f"{where}: seq_len {sizes['seq_len']} exceeds the model's block_size "
                         f"{config.block_size}; the model refuses longer sequences.")


def parameter_counts(config: GPTConfig, t: int = 1) -> dict[str, int]:
    """How many parameter elements ``parallelize_gpt`` splits and how many it replicates.

    Returns:
        ``sharded`` (elements of the split tensors over all ranks; each rank holds 1/t),
        ``sharded_per_rank``, ``replicated`` (whole on every rank), ``per_rank`` (what one rank
        holds), ``total`` (the one-process model's count, ``sharded + replicated``) and
        ``tensors`` (parameter tensors per rank: AdamW keeps one ``step`` for each).
    """
    _check(config, t, "parameter_counts")
    V, C, L, bias = config.vocab_size, config.n_embd, config.n_layer, int(config.bias)
    per_layer = (3 * C * C + 3 * C * bias) + C * C + (4 * C * C + 4 * C * bias) + 4 * C * C
    sharded = V * C + L * per_layer + V * C                  # wte, blocks, lm_head
    replicated = (config.block_size * C                      # wpe
                  + L * (2 * 2 * C + 2 * C * bias)           # ln_1, ln_2; out_proj, proj biases
                  + 2 * C)                                   # ln_f
    tensors = 2 + L * (4 + 4 * (1 + bias)) + 2 + 1           # wte wpe; blocks; ln_f; lm_head
    return {"sharded": sharded, "sharded_per_rank": sharded // t, "replicated": replicated,
            "per_rank": sharded // t + replicated, "total": sharded + replicated,
            "tensors": tensors}


def activation_bytes_per_layer(config: GPTConfig, t: int, batch_size: int, seq_len: int, *,
                               bytes_per_element: int = 4) -> dict[str, int]:
    """Bytes one transformer layer saves for backward on one rank (the module's table).

    Returns:
        ``split`` (divided by t: q, k, v, the softmax output, the heads' output, the GELU's
        input and output), ``whole`` (the same on every rank: the LayerNorm inputs and
        statistics, the inputs of ``qkv`` and ``fc``, the causal mask) and ``total``.
    """
    _check(config, t, "activation_bytes_per_layer", batch_size=batch_size, seq_len=seq_len,
           bytes_per_element=bytes_per_element)
    e, N, T, C, a = bytes_per_element, batch_size * seq_len, seq_len, config.n_embd, config.n_head
    whole = e * (4 * N * C + 4 * N) + MASK_BYTES * T * T
    split = e * (12 * N * C + a * N * T) // t
    return {"split": split, "whole": whole, "total": split + whole}


def tensor_parallel_memory(config: GPTConfig, t: int, batch_size: int, seq_len: int, *,
                           bytes_per_element: int = 4, optimizer_states: int = 2) -> dict:
    """Bytes one rank of a t-way tensor-parallel GPT holds, by the count of this module's
    docstring: what ``measure_memory`` (``course_lib.examples.tensor_parallel_workers``) measures.

    Args:
        config: the model's sizes.
        t: tensor-parallel ranks (1: the one-process model). Must divide ``n_head`` and
            ``vocab_size``, as ``parallelize_gpt`` requires.
        batch_size, seq_len: the batch (B, T) of one forward (T <= ``block_size``).
        bytes_per_element: of parameters, gradients, optimizer moments and float activations
            (4: float32, the model's default).
        optimizer_states: tensors the size of a parameter the optimizer keeps (AdamW: 2), plus
            one 4-byte ``step`` per parameter tensor.

    Returns:
        Bytes per rank: ``parameters``, ``gradients``, ``optimizer``, ``activations`` (split
        into ``activations_embedding``, ``activations_layers``, ``activations_head``,
        ``activations_loss``; and ``activations_per_layer``, ``activations_per_layer_split``,
        ``activations_per_layer_whole``), ``total``; the parameter counts of
        ``parameter_counts`` as ``params_sharded``, ``params_sharded_per_rank``,
        ``params_replicated``, ``params_per_rank``, ``param_tensors``; and, for comparison,
        ``paper_activations_per_layer``: Korthikanti et al.'s sbh(10 + 24/t + 5as/(ht)) (16-bit,
        with dropout; a float), from ``activation_memory_per_layer``.
    """
    _check(config, t, "tensor_parallel_memory", batch_size=batch_size, seq_len=seq_len,
           bytes_per_element=bytes_per_element)
    if not isinstance(optimizer_states, int) or isinstance(optimizer_states, bool) \
            or optimizer_states < 0:
        raise ValueError(f"tensor_parallel_memory: optimizer_states must be an integer >= 0 "
                         f"(AdamW: 2), got {optimizer_states!r}.")
    e, N, T = bytes_per_element, batch_size * seq_len, seq_len
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    params = parameter_counts(config, t)
    layer = activation_bytes_per_layer(config, t, batch_size, seq_len, bytes_per_element=e)

    ids = INDEX_BYTES * N + (MASK_BYTES * N if t > 1 else 0)       # wte's ids (and mask)
    embedding = ids + INDEX_BYTES * T                              # wpe's positions
    head = e * (2 * N * C + 2 * N)                                 # ln_f, lm_head input
    if t == 1:   # log_softmax output, targets, nll_loss's total weight
        loss = e * N * V + INDEX_BYTES * N + e
    else:        # shifted logits, their exp, target index, mask, summed exp
        loss = 2 * e * N * V // t + INDEX_BYTES * N + MASK_BYTES * N + e * N
    activations = embedding + L * layer["total"] + head + loss

    parameters = e * params["per_rank"]
    optimizer = optimizer_states * e * params["per_rank"] + STEP_BYTES * params["tensors"]
    return {
        "t": t,
        "parameters": parameters,
        "gradients": parameters,
        "optimizer": optimizer,
        "activations": activations,
        "total": 2 * parameters + optimizer + activations,
        "activations_embedding": embedding,
        "activations_layers": L * layer["total"],
        "activations_head": head,
        "activations_loss": loss,
        "activations_per_layer": layer["total"],
        "activations_per_layer_split": layer["split"],
        "activations_per_layer_whole": layer["whole"],
        "params_sharded": params["sharded"],
        "params_sharded_per_rank": params["sharded_per_rank"],
        "params_replicated": params["replicated"],
        "params_per_rank": params["per_rank"],
        "param_tensors": params["tensors"],
        "paper_activations_per_layer": activation_memory_per_layer(
            seq_len, batch_size, C, config.n_head, t=t),
    }
