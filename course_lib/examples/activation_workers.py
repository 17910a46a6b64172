"""Worker functions that notebook 15 (activation memory) runs for its tables and figures.

``precision_memory``: one training step of the GPT in one of ``MODES``, its memory measured
piece by piece, beside the ZeRO paper's 2 + 2 + 12 bytes a parameter for mixed-precision Adam
(float32 and both autocast modes keep float32 weights, the master weights: 4 + 4 + 8, and
autocast shrinks the activations; ``"bf16-weights+fp32-master"`` is the paper's setup).
``layer_memory``: the bytes one transformer layer saves for backward without, with selective and
with full recomputation (one process, or TP and TP + SP on t ranks), beside
``formula_per_layer`` (Korthikanti et al.'s count). ``with_recomputation``: a GPT that
recomputes, for timing a training step with and without it.

PyTorch counterpart: ``torch.autocast``, ``torch.amp.GradScaler``; DeepSpeed's ``FP16_Optimizer``
and Megatron-LM's ``Float16OptimizerWithFloat16Params`` keep 16-bit weights with float32 master
copies. Read more: Rajbhandari et al. (2020), "ZeRO", section 3.1; Micikevicius et al. (2018),
"Mixed Precision Training"; notebook 15.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from course_lib.amp import GradScaler
from course_lib.distributed.memory import tensor_bytes as _nbytes
from course_lib.distributed.pipelining import ActivationMeter
from course_lib.distributed.recording import record_collectives
from course_lib.distributed.tensor.parallel import parallelize_gpt
from course_lib.models.gpt import GPT, Block, GPTConfig
from course_lib.utils import (
    activation_memory_per_layer,
    checkpoint,
    saved_tensor_bytes,
    selective_recompute,
)

from .workers import _gpt, _tokens

__all__ = ["MODES", "PAPER_BYTES_PER_PARAM", "RECOMPUTE", "Recomputed", "autocast_supports",
           "formula_per_layer", "layer_memory", "peak_saved_bytes", "precision_memory",
           "with_recomputation"]

MODES = ("float32", "bf16-autocast", "fp16-autocast+scaler", "bf16-weights+fp32-master")

#: Rajbhandari et al. (2020), section 3.1: mixed-precision Adam keeps 16-bit weights (2 bytes)
#: and gradients (2), and float32 master weights, momentum and variance (4 + 4 + 4 = 12).
PAPER_BYTES_PER_PARAM = {"weights": 2, "gradients": 2, "optimizer": 12}

_AUTOCAST_DTYPE = {"bf16-autocast": torch.bfloat16, "fp16-autocast+scaler": torch.float16}


def autocast_supports(device_type: str, dtype: torch.dtype) -> tuple[bool, str]:
    """(does this torch's autocast compute a matrix product in ``dtype`` on ``device_type``?,
    what it said when it does not: its warning or error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=dtype):
                a = torch.ones(2, 2, device=device_type)
                got = (a @ a).dtype
        except (RuntimeError, ValueError, AssertionError) as e:
            return False, f"{type(e).__name__}: {e}"
    if got == dtype:
        return True, ""
    said = "; ".join(str(w.message) for w in caught) or f"the product came out in {got}"
    return False, said


class _Meter(ActivationMeter):
    """``ActivationMeter`` that also notes the saved tensors that are 16-bit copies of a weight
    (what autocast casts and linear's backward needs), by shape and value."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__(exclude=params)
        self._shapes = {}
        for p in params:
            self._shapes.setdefault(tuple(p.shape), []).append(p)
        self.weight_copies: dict[tuple, int] = {}

    def _pack(self, t: torch.Tensor):
        packed = super()._pack(t)
        if packed is not t and t.dtype in (torch.float16, torch.bfloat16):
            for seen in (t, t.mT if t.dim() == 2 else t):   # linear saves the weight's .t()
                for p in self._shapes.get(tuple(seen.shape), ()):
                    if p.dtype != t.dtype and torch.equal(p.detach().to(t.dtype), seen):
                        self.weight_copies[(t.data_ptr(), t.numel(), t.element_size())] = \
                            t.nbytes
                        return packed
        return packed


def precision_memory(config_kwargs: dict, batch_size: int, seq_len: int, mode: str, *,
                     device: str = "cpu", seed: int = 0) -> dict:
    """One training step of ``GPT(GPTConfig(**config_kwargs))`` in ``mode`` (one of ``MODES``),
    memory measured.

    Builds the model and a batch of token ids and targets from ``seed``, runs forward and loss
    under an ``ActivationMeter`` (parameters excluded; autocast with ``device``'s type),
    backward, and one ``torch.optim.Adam`` step (after the loss scaler's skipped steps, at most 10).

    Returns:
        ``{"mode", "supported", "note", "param_count", "weights", "gradients", "optimizer",
        "master_weights", "optimizer_moments", "optimizer_steps", "activations",
        "activation_weight_copies", "transient_master_gradients", "skipped_steps", "loss",
        "bytes_per_param", "counted", "paper_bytes_per_param"}``: bytes measured after the step;
        ``counted``: weights, gradients and optimizer from the parameter count and the mode's
        element sizes (what the measurement must equal exactly); ``activations``: the bytes saved
        for backward still held after forward and loss, of which ``activation_weight_copies`` are
        16-bit copies of weights; ``optimizer`` = ``master_weights`` + ``optimizer_moments``
        (Adam's step counters apart: ``optimizer_steps``). With ``supported=False`` only
        ``mode``, ``supported`` and ``note`` are filled.
    """
    if mode not in MODES:
        raise ValueError(f"precision_memory: mode must be one of {MODES}, got {mode!r}.")
    result: dict = {"mode": mode, "supported": True, "note": _NOTES[mode],
                    "paper_bytes_per_param": dict(PAPER_BYTES_PER_PARAM)}
    autocast_dtype = _AUTOCAST_DTYPE.get(mode)
    if autocast_dtype is not None:
        ok, said = autocast_supports(device, autocast_dtype)
        if not ok:
            result.update(supported=False, note=(
                f"torch {torch.__version__}: autocast on {device} does not compute in "
                f"{autocast_dtype} ({said}); nothing measured rather than a float32 run "
                "labelled 16-bit."))
            return result

    model = _gpt(config_kwargs, seed, device=device)
    master = None
    if mode == "bf16-weights+fp32-master":
        model = model.to(torch.bfloat16)
        master = [p.detach().float().clone() for p in model.parameters()]   # float32 copies
    params = list(model.parameters())
    optimizer = torch.optim.Adam(master if master is not None else params, lr=1e-3)
    scaler = GradScaler() if mode == "fp16-autocast+scaler" else None
    idx, targets = _tokens(model.config.vocab_size, batch_size, seq_len, seed + 1, device)

    skipped, transient = 0, 0
    for _ in range(10):
        optimizer.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        meter = _Meter(params)
        with meter, torch.autocast(device, dtype=autocast_dtype,
                                   enabled=autocast_dtype is not None):
            _, loss = model(idx, targets)
        activations, copies = meter.saved_alive, sum(meter.weight_copies.values())
        if scaler is not None:
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < before:      # an overflow: the step was skipped
                skipped += 1
                continue
        else:
            loss.backward()
            if master is not None:
                for m, p in zip(master, params):
                    m.grad = p.grad.float()          # the 16-bit gradient, in float32
                transient = _nbytes(m.grad for m in master)
                optimizer.step()
                with torch.no_grad():
                    for m, p in zip(master, params):
                        p.copy_(m)                   # the master weights, rounded to 16 bits
                        m.grad = None                # the float32 gradients are not kept
            else:
                optimizer.step()
        break
    else:
        raise RuntimeError(f"precision_memory({mode!r}): the loss scaler skipped {skipped} "
                           "steps in a row; the loss overflows at every scale tried.")

    state = [(k, v) for s in optimizer.state.values() for k, v in s.items()
             if isinstance(v, torch.Tensor)]
    n = sum(p.numel() for p in params)
    weights, gradients = _nbytes(params), _nbytes(p.grad for p in params)
    master_bytes = _nbytes(master or [])
    moment_bytes = _nbytes(v for k, v in state if k != "step")
    optimizer_bytes = master_bytes + moment_bytes
    element = params[0].element_size()
    counted_optimizer = n * (4 + 4 + (4 if master is not None else 0))
    result.update(
        param_count=n, weights=weights, gradients=gradients, optimizer=optimizer_bytes,
        master_weights=master_bytes, optimizer_moments=moment_bytes,
        optimizer_steps=_nbytes(v for k, v in state if k == "step"), activations=int(activations),
        activation_weight_copies=int(copies), transient_master_gradients=transient,
        skipped_steps=skipped, loss=float(loss.detach()),
        bytes_per_param={"weights": weights / n, "gradients": gradients / n,
                         "optimizer": optimizer_bytes / n,
                         "total": (weights + gradients + optimizer_bytes) / n},
        counted={"weights": n * element, "gradients": n * element,
                 "optimizer": counted_optimizer})
    if scaler is not None:
        result["loss_scale"] = scaler.get_scale()
    return result


_NOTES = {
    "float32": "float32 weights, gradients and Adam moments: 4 + 4 + 8 bytes a parameter.",
    "bf16-autocast": (
        "autocast keeps the float32 weights (the master weights) and makes 16-bit copies per "
        "operation, so the weights measure 4 bytes a parameter, not the paper's 2, and the "
        "gradients 4 (float32, like the weights): 4 + 4 + 8 = 16, the paper's total by another "
        "split; the 16-bit copies that backward needs are saved with the activations "
        "(activation_weight_copies). What autocast shrinks is the activations."),
    "fp16-autocast+scaler": (
        "as bf16-autocast, in float16, the loss scaled by course_lib.amp.GradScaler (its scale "
        "is one float32 number); float32 weights, 4 + 4 + 8 bytes a parameter."),
    "bf16-weights+fp32-master": (
        "the ZeRO paper's setup (DeepSpeed's and Megatron-LM's mixed-precision optimizers): "
        "16-bit weights (2) and gradients (2) in the model, a float32 master copy (4) and "
        "Adam's float32 momentum and variance (4 + 4) in the optimizer: 2 + 2 + 12 = 16 bytes "
        "a parameter; float32 gradients of the master copy exist only during the step "
        "(transient_master_gradients)."),
}


# ------------------------------------------------------------------------------------------------
# activation memory per layer, measured, and the paper's count beside it
# ------------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


class Recomputed(nn.Module):
    """``block(x)`` through ``course_lib.utils.checkpoint``: only ``x`` is kept for backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x)


def with_recomputation(model: GPT, recompute: str) -> GPT:
    """A deep copy of ``model`` whose blocks recompute in backward: ``"none"``, ``"selective"``
    (attention's core only) or ``"full"`` (every block, from its input)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"with_recomputation: recompute must be one of {RECOMPUTE}, got "
                         f"{recompute!r}.")
    model = copy.deepcopy(model)
    if recompute == "selective":
        selective_recompute(model)
    elif recompute == "full":
        model.blocks = nn.ModuleList(Recomputed(b) for b in model.blocks)
    return model


def _block_bytes(block: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes ``block`` saves for backward on input ``x``, for each way of recomputing."""
    params = list(block.parameters())
    out = {"none": saved_tensor_bytes(block, x)}
    selective_recompute(block)
    out["selective"] = saved_tensor_bytes(block, x)
    selective_recompute(block, enabled=False)
    out["full"] = saved_tensor_bytes(lambda y: checkpoint(block, y), x, exclude=params)
    return out


def peak_saved_bytes(config_kwargs: dict, batch_size: int, seq_len: int, n_layers: int,
                     recompute: str, seed: int = 0) -> dict[str, int]:
    """One forward and backward of ``n_layers`` GPT blocks (float32) recomputing as
    ``recompute`` says, with the saved-tensor meter on throughout, recomputations included.

    Returns ``forward`` (bytes saved for backward when forward ends), ``peak`` (the largest
    they came to, backward included) and ``kept`` / ``whole`` (what one block saves with this
    recomputation / with none, from ``_block_bytes``). The upstream gradient and the
    parameters are not counted; on a CPU this is the honest stand-in for the allocator's peak.
    """
    config = GPTConfig(**config_kwargs)
    torch.manual_seed(seed)
    blocks = [Block(config) for _ in range(n_layers)]
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch_size, seq_len, config.n_embd, generator=gen).requires_grad_()
    w = torch.randn(x.shape, generator=gen)                        # a fixed upstream gradient
    per_layer = _block_bytes(blocks[0], x)
    if recompute == "selective":
        for block in blocks:
            selective_recompute(block)
    run = [Recomputed(block) if recompute == "full" else block for block in blocks]
    params = [p for block in blocks for p in block.parameters()]
    with ActivationMeter(exclude=[*params, w]) as meter:
        y = x
        for layer in run:
            y = layer(y)                                          # (B, T, C)
        forward = meter.saved_alive
        (y * w).sum().backward()
    return {"forward": forward, "peak": meter.saved_peak, "kept": per_layer[recompute],
            "whole": per_layer["none"]}


def formula_per_layer(config_kwargs: dict, batch_size: int, seq_len: int, *, t: int = 1,
                      sequence_parallel: bool = False, recompute: str = "none",
                      bytes_per_element: int = 4) -> dict:
    """Korthikanti et al.'s bytes per layer for these sizes, and what this model should save.

    The paper counts 16-bit activations (2 bytes) and 1-byte dropout masks, with dropout after
    the attention's softmax (its mask, as^2b bytes, and output, 2as^2b) and after each residual
    branch (two masks, 2sbh). The course GPT has no dropout, runs in ``bytes_per_element`` bytes,
    and saves two things the paper leaves out: each LayerNorm's mean and 1/std (4sb elements a
    layer) and the (s, s) boolean causal mask of ``masked_fill`` (s^2 bytes, whole on every
    rank). Divisions by t follow the paper's table 2. Returns ``paper`` (the formula, 16-bit, with
    dropout), ``dropout`` (its dropout terms), ``formula`` ((paper - dropout) in
    ``bytes_per_element``: the formula for this model), ``extra`` (LayerNorm statistics and causal
    mask, where still saved) and ``expected`` (``formula + extra``: the measurement, byte for byte).
    """
    config = GPTConfig(**config_kwargs)
    s, b, h, a, e = seq_len, batch_size, config.n_embd, config.n_head, bytes_per_element
    paper = activation_memory_per_layer(s, b, h, a, t=t, sequence_parallel=sequence_parallel,
                                        recompute=recompute)
    sp = t if sequence_parallel else 1                   # what the sequence split divides
    masks, softmax_dropout = 2 * s * b * h / sp, 3 * a * s * s * b / t
    dropout = {"none": masks + softmax_dropout, "selective": masks, "full": 0}[recompute]
    stats = 4 * s * b * e / sp
    extra = {"none": stats + s * s, "selective": stats, "full": 0}[recompute]
    formula = (paper - dropout) * e / 2
    return {"paper": paper, "dropout": dropout, "formula": formula, "extra": extra,
            "expected": formula + extra}


def _ring_bytes(name: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring for a call of ``name`` whose record measured ``nbytes``
    (all-reduce of n: 2(t-1)/t n; all-gather into an output of n: (t-1)/t n; reduce-scatter into
    a block of m: (t-1) m)."""
    if name == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    if name.startswith("all_gather"):
        return (world - 1) / world * nbytes
    if name.startswith("reduce_scatter"):
        return float((world - 1) * nbytes)
    return 0.0


def layer_memory(config_kwargs: dict, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """The bytes one transformer layer saves for backward (float32, parameters excluded), for
    ``RECOMPUTE``'s three ways, on this process.

    Called in one process (no process group): ``{"t": 1, "one": {...}}``. Launched on t ranks:
    ``{"t": t, "tp": {...}, "sp": {...}}`` for block 0 of ``parallelize_gpt`` without and with
    ``sequence_parallel=True`` (fed this rank's positions), plus ``loss`` (the one-process
    model's loss on a batch and the largest gaps of the TP's and SP's losses and logits from
    it) and ``wire``: for each of ``"tp"`` and ``"sp"``, every collective of one forward and
    backward of the model (``record_collectives``) as ``(kind, elements of the activation it
    carries, bytes this rank sends in a ring)``, kind ``"all_reduce"``, ``"all_gather"`` or
    ``"reduce_scatter"``; elements are the whole (B, T, C) tensor's for all three.
    """
    one = _gpt(config_kwargs, seed, device="cpu")
    config = one.config
    x = torch.randn(batch_size, seq_len, config.n_embd, generator=torch.Generator()
                    .manual_seed(seed + 1)).requires_grad_()              # (B, T, C)
    if not dist.is_initialized():
        return {"t": 1, "one": _block_bytes(one.blocks[0], x)}
    rank, t = dist.get_rank(), dist.get_world_size()
    tp = parallelize_gpt(copy.deepcopy(one))
    sp = parallelize_gpt(copy.deepcopy(one), sequence_parallel=True)
    mine = x.detach().chunk(t, dim=1)[rank].clone().requires_grad_()    # (B, T/t, C)
    result = {"t": t, "tp": _block_bytes(tp.blocks[0], x), "sp": _block_bytes(sp.blocks[0], mine)}

    idx, targets = _tokens(config.vocab_size, batch_size, seq_len, seed + 2)
    logits, loss = one(idx, targets)
    want = logits.detach().chunk(t, dim=-1)[rank]                    # this rank's vocabulary
    result.update(loss={"one": loss.item()}, wire={})
    for name, model in (("tp", tp), ("sp", sp)):
        with record_collectives() as records:
            got_logits, got = model(idx, targets)
            got.backward()
        result["loss"][name] = abs(got.item() - loss.item())
        result["loss"][f"{name}_logits"] = float((got_logits.detach() - want).abs().max())
        kinds = [next((k for k in ("all_gather", "reduce_scatter") if r.name.startswith(k)),
                      r.name) for r in records]
        result["wire"][name] = [
            (kind, r.elements * t if kind == "reduce_scatter" else r.elements,
             _ring_bytes(r.name, r.bytes, t)) for kind, r in zip(kinds, records)]
    return result
