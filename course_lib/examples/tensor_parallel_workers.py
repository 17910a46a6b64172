"""Worker functions that notebook 14 (tensor parallelism) hands to ``launch``.

Each runs in every rank of an initialised process group (the tensor-parallel group is the whole
world), builds the same ``course_lib.models.gpt.GPT`` from the same seed, and returns small
picklable results: the split model (``parallelize_gpt``) trained beside the whole model
(``against_one_process``) or alone on the one-process baseline's batches (``train_split``), both
optionally with the learner's own layers (``mine``); the split against torch's
``parallelize_module`` (``against_torch``); the collectives of one step, in order, with the
layer that issued each (``trace_collectives``); and the memory of one step on this rank
(``measure_memory``, beside ``tensor.parallel.accounting.tensor_parallel_memory``'s count).
"""
from __future__ import annotations

import copy
import importlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data_text import load_text, text_batch
from course_lib.distributed.env import current_device
from course_lib.distributed.pipelining import ActivationMeter
from course_lib.distributed.recording import record_collectives
from course_lib.distributed.tensor.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallelize_gpt,
)
from course_lib.models.gpt import GPT

from .workers import _gpt, _text_batches, _tokens, _torch_mesh, _torch_tp, _train_step

__all__ = ["COLLECTIVES", "against_one_process", "against_torch", "full_slice",
           "measure_memory", "trace_collectives", "train_split"]

#: the torch.distributed functions ``trace_collectives`` records
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "all_to_all", "send", "recv")


def _models(config: dict, dtype: torch.dtype, seed: int,
            mine: dict | None = None) -> tuple[GPT, GPT]:
    """(the whole model, its tensor-parallel copy), the same on every rank. With ``mine``
    (``{"folder": ..., "linears": "my_linears", "loss": "my_loss"}``) the blocks' four linears
    are the learner's ``ColumnParallelLinear`` / ``RowParallelLinear`` and the loss theirs."""
    one = _gpt(config, seed, dtype)
    tp = parallelize_gpt(copy.deepcopy(one))
    if mine:
        if mine["folder"] not in sys.path:
            sys.path.insert(0, mine["folder"])
        importlib.invalidate_caches()
        if mine.get("linears"):
            layers = importlib.import_module(mine["linears"])
            for whole, split in zip(one.blocks, tp.blocks):
                split.attn.qkv = layers.ColumnParallelLinear(copy.deepcopy(whole.attn.qkv))
                split.attn.out_proj = layers.RowParallelLinear(copy.deepcopy(whole.attn.out_proj))
                split.mlp.fc = layers.ColumnParallelLinear(copy.deepcopy(whole.mlp.fc))
                split.mlp.proj = layers.RowParallelLinear(copy.deepcopy(whole.mlp.proj))
        if mine.get("loss"):
            tp.loss_fn = importlib.import_module(mine["loss"]).vocab_parallel_cross_entropy
    return one, tp


def full_slice(tp: nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """The block of the whole model's tensor ``full`` that parameter ``name`` of the
    tensor-parallel model ``tp`` holds on this rank (all of it for a replicated parameter), in
    the module's own group (``rank``, ``world_size``), else in the whole world."""
    module_name, _, attr = name.rpartition(".")
    module = tp.get_submodule(module_name)
    rank = getattr(module, "rank", dist.get_rank())
    world = getattr(module, "world_size", dist.get_world_size())
    kind = type(module).__name__                    # the course's layers or the learner's
    if kind == RowParallelLinear.__name__ and attr == "weight":
        return full.chunk(world, dim=1)[rank]         # columns: the input features
    if kind in (ColumnParallelLinear.__name__, VocabParallelEmbedding.__name__):
        return full.chunk(world, dim=0)[rank]         # rows: output features, or vocabulary
    return full


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def against_one_process(config: dict, batch_size: int, seq_len: int, steps: int,
                        dtype: str = "float64", lr: float = 3e-3, seed: int = 0,
                        text_bytes: int | None = None, mine: dict | None = None) -> list[dict]:
    """Train the whole model and its tensor-parallel copy side by side, AdamW, same batches.

    Every rank draws the same batches of the real text (one generator, one seed). Per step:
    both losses, the largest difference between this rank's logits and the matching block of
    the whole model's, and the largest difference between any gradient shard and the matching
    slice of the whole model's gradient (relative to the largest gradient entry).
    """
    torch.set_default_dtype(torch.float32)
    tokens = load_text(max_bytes=text_bytes)
    one, tp = _models(config, getattr(torch, dtype), seed, mine)
    opt_one = torch.optim.AdamW(one.parameters(), lr=lr)
    opt_tp = torch.optim.AdamW(tp.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for step in range(steps):
        batch = text_batch(tokens, batch_size, seq_len, generator=gen)
        X, Y = (t.to(current_device()) for t in batch)
        logits, loss = one(X, Y)
        logits_tp, loss_tp = tp(X, Y)
        for opt, lo in ((opt_one, loss), (opt_tp, loss_tp)):
            opt.zero_grad()
            lo.backward()
        full = dict(one.named_parameters())
        grad_scale = max(p.grad.abs().max().item() for p in full.values())
        grad_diff = max(_largest_difference(p.grad, full_slice(tp, name, full[name].grad))
                        for name, p in tp.named_parameters())
        rows.append(dict(step=step, loss_one=loss.item(), loss_tp=loss_tp.item(),
                         logits=_largest_difference(logits_tp,
                                                    logits.chunk(world, dim=-1)[rank]),
                         grad=grad_diff / grad_scale))
        opt_one.step()
        opt_tp.step()
    return rows


def against_torch(config: dict, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """Our ``parallelize_gpt`` against torch's ``parallelize_module`` on the same float64 model.

    Torch splits each block's ``attn.qkv`` and ``mlp.fc`` with ``ColwiseParallel`` and
    ``attn.out_proj`` and ``mlp.proj`` with ``RowwiseParallel`` on a ``DeviceMesh`` of the
    whole world (the embedding, head and loss stay whole there). Returns the largest
    differences of the logits, the loss and the blocks' gradients, or torch's error.
    """
    one, ours = _models(config, torch.float64, seed)
    theirs = copy.deepcopy(one)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        _torch_tp(theirs.blocks, _torch_mesh())
        X, _ = _tokens(one.config.vocab_size, batch_size, seq_len, seed + 1, current_device())
        logits_t, loss_t = theirs(X, X)
        logits_o, loss_o = ours(X, X)
        loss_t.backward()
        loss_o.backward()
    except Exception as e:  # noqa: BLE001 - what fails is the finding, reported in words
        return {"error": f"{type(e).__name__}: {e}"}
    grads = []
    for (_, pt), (_, po) in zip(theirs.blocks.named_parameters(),
                                   ours.blocks.named_parameters()):
        grad = pt.grad.to_local() if hasattr(pt.grad, "to_local") else pt.grad
        grads.append(_largest_difference(po.grad, grad))
    return {"logits": _largest_difference(logits_o, logits_t.chunk(world, dim=-1)[rank]),
            "loss": abs(loss_o.item() - loss_t.item()), "grads": max(grads),
            "torch_param_type": type(theirs.blocks[0].mlp.fc.weight).__name__}


def trace_collectives(config: dict, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """One forward and backward of the tensor-parallel model on random tokens, traced.

    Forward hooks on every leaf layer make it the current layer while it runs; a hook on its
    output's gradient marks where its backward starts; every collective is recorded with the phase
    and layer current when it was called. Returns ``{"events": [(phase, layer, op, elements,
    bytes), ...], "layers": [(phase, layer), ...] in the order they ran, "kinds": {layer:
    "column" | "row" | "vocabulary" | "whole"}}``.
    """
    _, tp = _models(config, torch.float32, seed)
    layers: list = []
    where = ["forward", "input"]

    def before(name):
        def hook(module, args):
            where[:] = ["forward", name]
            layers.append(("forward", name))
        return hook

    def after(name):
        def hook(module, args, out):
            def grad_hook(grad):
                where[:] = ["backward", name]
                layers.append(("backward", name))
            if out.requires_grad:
                out.register_hook(grad_hook)
        return hook

    handles = []
    for name, module in tp.named_modules():
        if name and not list(module.children()):
            handles += [module.register_forward_pre_hook(before(name)),
                        module.register_forward_hook(after(name))]
    X, _ = _tokens(tp.config.vocab_size, batch_size, seq_len, seed + 1, current_device())
    loss_fn = tp.loss_fn

    def traced_loss(*args, **kwargs):
        where[:] = ["forward", "loss"]
        layers.append(("forward", "loss"))
        return loss_fn(*args, **kwargs)

    tp.loss_fn = traced_loss
    try:
        with record_collectives(COLLECTIVES, context=lambda: tuple(where)) as records:
            _, loss = tp(X, X)
            loss.backward()
        events = [(*r.context, r.name, r.elements, r.bytes) for r in records]
    finally:
        for h in handles:
            h.remove()
    kinds = {name: _kind(module) for name, module in tp.named_modules()
             if name and not list(module.children())}
    return {"events": events, "layers": layers, "kinds": kinds}


def _kind(module: nn.Module) -> str:
    kinds = ((ColumnParallelLinear, "column"), (RowParallelLinear, "row"),
             (VocabParallelEmbedding, "vocabulary"))
    return next((kind for cls, kind in kinds if isinstance(module, cls)), "whole")


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)   # each tensor's own bytes, shared storage or not


def measure_memory(config_kwargs: dict, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """One training step of the GPT on this rank, its memory measured piece by piece.

    Builds ``GPT(GPTConfig(**config_kwargs))`` and a batch of token ids and targets from ``seed``
    (the same on every rank), splits it with ``parallelize_gpt`` when the world has more than one
    rank, runs forward and loss under an ``ActivationMeter`` (parameters excluded), backward, and
    one ``AdamW`` step. Returns ``{"rank", "world_size", "param_count", "parameters", "gradients",
    "optimizer", "activations"}``, bytes but for the first three: ``activations`` those saved for
    backward still held after forward and loss (each tensor once), ``optimizer`` the tensors of
    ``optimizer.state`` (moments and ``step``) after one step.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    device = current_device() if world > 1 else torch.device("cpu")
    model = _gpt(config_kwargs, seed, device=device)
    if world > 1:
        parallelize_gpt(model)
    params = list(model.parameters())
    idx, targets = _tokens(model.config.vocab_size, batch_size, seq_len, seed + 1, device)

    with ActivationMeter(exclude=params) as meter:
        _, loss = model(idx, targets)
    activations = meter.saved_alive          # the graph (and what it saved) is still alive
    loss.backward()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"rank": rank, "world_size": world, "param_count": sum(p.numel() for p in params),
            "parameters": _nbytes(params), "gradients": _nbytes(p.grad for p in params
                                                               if p.grad is not None),
            "optimizer": _nbytes(state), "activations": int(activations)}


def train_split(config: dict, batch_size: int, seq_len: int, steps: int, lr: float = 1e-3,
                seed: int = 0, mine: dict | None = None) -> list[float]:
    """The split model trained alone, float32, AdamW(lr), on exactly the batches of the
    one-process baseline (``batch_schedule`` of the first 90 % of the text, ``seed``): its loss
    per step, the same on every rank, to set beside the baseline's."""
    _, tp = _models(config, torch.float32, seed, mine)
    opt = torch.optim.AdamW(tp.parameters(), lr=lr)
    batches = _text_batches(batch_size, seq_len, seed)
    return [_train_step(tp, opt, *(t.to(current_device()) for t in next(batches))).item()
            for _ in range(steps)]
