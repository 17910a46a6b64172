"""After training: a trained model loaded on any device, partly frozen for fine-tuning, shrunk.

PyTorch counterparts: ``torch.load(..., map_location=...)`` and ``Module.load_state_dict``;
``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` (the ``module.`` that a DDP
or DataParallel wrapper adds to every key); ``requires_grad_`` for freezing; and int8
quantization with torchao (``torchao.quantization.quantize_``), the package PyTorch now
recommends for it: ``torch.ao.quantization.quantize_dynamic`` warns that it is deprecated.
Read more: https://pytorch.org/tutorials/beginner/saving_loading_models.html,
https://docs.pytorch.org/ao/stable/ and notebook 12.

A foundation (it imports only ``course_lib.devices``): a machine that serves a model needs none
of the training recipe. The recipe's own ``load_checkpoint`` restores a whole training state to
resume; this module loads weights for inference and fine-tuning, and the quantization helpers
are thin wrappers over torchao, not a reimplementation.
"""
from __future__ import annotations

import copy
import io
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from .devices import Device, as_device, try_gpu

__all__ = [
    "WRAPPER_PREFIXES",
    "freeze_all_but",
    "int8_layers",
    "load_for_inference",
    "load_weights",
    "quantize_int8",
    "state_dict_bytes",
    "strip_prefix",
]

#: What wrappers put in front of every key: DDP and DataParallel (``module.``), torch.compile
#: (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# ------------------------------------------------------------------------------------------------
# Loading: any checkpoint, onto any device
# ------------------------------------------------------------------------------------------------

def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """A copy of ``state_dict`` with the leading ``prefix`` removed from every key that has it.

    Torch's ``consume_prefix_in_state_dict_if_present`` does the work (in place, on the copy),
    so keys without the prefix, and a ``module.`` in the middle of a key, stay as they are, and
    the ``_metadata`` that ``load_state_dict`` reads is renamed too. The tensors are not copied.
    """
    out = copy.copy(state_dict)  # an OrderedDict keeps its _metadata attribute
    if hasattr(state_dict, "_metadata"):
        out._metadata = copy.copy(state_dict._metadata)
    consume_prefix_in_state_dict_if_present(out, prefix)
    return out


def _unwrapped_keys(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` without the wrapper prefixes that EVERY key carries (``module._orig_mod.``)."""
    stripped = True
    while stripped and state:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in state):
                state, stripped = strip_prefix(state, prefix), True
    return state


def _state_dict_of(source: str | os.PathLike | Mapping, device: torch.device) -> Mapping:
    """The model's state dict from a file, a state dict, or a checkpoint holding ``"model"``."""
    if isinstance(source, str | os.PathLike):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"load_weights: no file at {source}; pass the path of a "
                                    "checkpoint written with torch.save (or the state dict "
                                    "itself).")
        # map_location: every tensor straight onto `device`, whatever device saved it (a file
        # written on cuda:3 loads on a CPU-only machine); weights_only: no arbitrary code.
        source = torch.load(source, map_location=device, weights_only=True)
    if not isinstance(source, Mapping):
        raise TypeError(f"load_weights expects a path, a state dict or a checkpoint dict, got "
                        f"{type(source).__name__}.")
    inner = source.get("model")
    return inner if isinstance(inner, Mapping) else source   # the recipe's checkpoints


def load_weights(model: nn.Module, source: str | os.PathLike | Mapping, *,
                 device: Device | None = None) -> nn.Module:
    """Load the weights of ``source`` into ``model``, on ``device``; every key must fit.

    Args:
        model: the plain (unwrapped) model, built as the checkpoint's model was.
        source: a file written by ``torch.save`` (read with ``map_location=device``), a state
            dict, or a checkpoint dict whose ``"model"`` is the state dict (the recipe's).
            Prefixes that a wrapper put on EVERY key (``module.`` from DDP or DataParallel,
            ``_orig_mod.`` from torch.compile) are removed first.
        device: where the model goes (default ``try_gpu()``).

    Returns:
        ``model``, moved to ``device``, with the weights loaded.

    Raises:
        ValueError: keys or shapes do not fit; the message lists them and what to do.
    """
    device = try_gpu() if device is None else as_device(device)
    state = _unwrapped_keys(_state_dict_of(source, device))
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        def few(names: list[str]) -> str:
            return ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4
                                           else "")
        found = [f"{len(missing)} key(s) of the model not in the checkpoint ({few(missing)})"
                 if missing else "",
                 f"{len(unexpected)} key(s) of the checkpoint not in the model "
                 f"({few(unexpected)})" if unexpected else "",
                 f"{len(shapes)} shape(s) differ ({few(shapes)})" if shapes else ""]
        raise ValueError(
            f"load_weights: the checkpoint does not fit {type(model).__name__}: "
            + "; ".join(f for f in found if f) + ". Build the model the checkpoint was "
            "trained as (same class and sizes); to take only the tensors that fit (a new "
            "head, say), use course_lib.train_ddp.load_fitting_weights.")
    model.load_state_dict(state)
    return model.to(device)


def load_for_inference(model: nn.Module, source: str | os.PathLike | Mapping, *,
                       device: Device | None = None) -> nn.Module:
    """``load_weights``, then ``eval()`` mode and no gradients: ready to predict on ``device``.

    Eval mode matters as much as the weights: dropout off, batch norm on its running
    statistics. ``requires_grad_(False)`` lets the inference keep no graph.
    """
    model = load_weights(model, source, device=device)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# Fine-tuning: train a part, keep the rest bitwise
# ------------------------------------------------------------------------------------------------

def freeze_all_but(model: nn.Module, *keep: str) -> list[str]:
    """Freeze every parameter except those of the submodules or parameters named in ``keep``.

    ``freeze_all_but(net, "fc2")`` leaves ``fc2.weight`` and ``fc2.bias`` trainable. Frozen
    parameters get no gradient, so an optimizer given only the trainable ones (or any
    optimizer: a parameter without a gradient is skipped) leaves them bitwise unchanged.

    Returns:
        The names of the parameters left trainable.
    """
    names = [name for name, _ in model.named_parameters()]

    def kept(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in keep)

    unknown = [k for k in keep if not any(n == k or n.startswith(k + ".") for n in names)]
    if not keep or unknown:
        modules = sorted({n.rpartition(".")[0] for n in names} - {""})
        raise ValueError(f"freeze_all_but expects names of {type(model).__name__}'s submodules "
                         f"or parameters to keep trainable, got {list(keep) or 'none'}"
                         f"{f' ({unknown} name nothing)' if unknown else ''}; its submodules "
                         f"with parameters: {modules}.")
    for name, p in model.named_parameters():
        p.requires_grad_(kept(name))
    return [name for name in names if kept(name)]


# ------------------------------------------------------------------------------------------------
# Deployment: size on disk, int8 quantization of the linear layers (torchao)
# ------------------------------------------------------------------------------------------------

def state_dict_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: what the model weighs on disk."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def _torchao():
    """``torchao.quantization``, imported on first use, with a clear error where it is missing.

    torchao 0.18 registers an Enum with torch's pytree at import time, and torch 2.15 logs a
    deprecation note about that call (torchao's, not the caller's: nothing to act on here);
    that one logger is quieted during the import and restored after.
    """
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        import torchao.quantization as quantization
    except ImportError as e:
        raise ImportError("quantize_int8 needs torchao, PyTorch's quantization package "
                          "(torch.ao.quantization is deprecated): pip install torchao "
                          "(make setup installs it).") from e
    finally:
        pytree_log.setLevel(level)
    return quantization


def quantize_int8(model: nn.Module, *, dynamic_activations: bool = True,
                  inplace: bool = False) -> nn.Module:
    """The model with int8 weights in every ``nn.Linear`` (torchao's ``quantize_``), in eval mode.

    Other layers (convolutions, norms) stay as they were: torchao's default filter takes linear
    layers only. Each weight row is stored as int8 with one float scale (per channel).

    Args:
        model: a trained model (not changed unless ``inplace``).
        dynamic_activations: True: ``Int8DynamicActivationInt8WeightConfig``, the successor of
            ``torch.ao.quantization.quantize_dynamic``: each batch's activations are quantized
            on the fly and the matmul runs in int8. False: ``Int8WeightOnlyConfig``: weights
            stored in int8 and dequantized for a float matmul (memory, not arithmetic).
        inplace: quantize ``model`` itself instead of a copy.
    """
    q = _torchao()
    config = (q.Int8DynamicActivationInt8WeightConfig() if dynamic_activations
              else q.Int8WeightOnlyConfig())
    if not any(isinstance(m, nn.Linear) for m in model.modules()):
        raise ValueError(f"quantize_int8 quantizes nn.Linear layers, and "
                         f"{type(model).__name__} has none.")
    net = model if inplace else copy.deepcopy(model)
    q.quantize_(net, config)
    return net.eval()


def int8_layers(model: nn.Module) -> list[str]:
    """Names of the submodules whose ``weight`` is a quantized (torchao) tensor."""
    def quantized(w: Any) -> bool:
        return isinstance(w, torch.Tensor) and type(w).__module__.startswith("torchao")

    return [name for name, m in model.named_modules() if quantized(getattr(m, "weight", None))]
