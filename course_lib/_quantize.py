"""After training, smaller: size on disk and int8 linear layers (thin wrappers over torchao),
beside ``course_lib.deploy``, which re-exports them. Lesson 13.
"""
from __future__ import annotations

import copy
import io
import logging
from typing import Any

import torch
from torch import nn

__all__ = ["int8_layers", "quantize_int8", "state_dict_bytes"]


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
            ``torch.ao.quantization.quantize_dynamic``: the activations are quantized on the
            fly, one scale per row (per token, torchao's default ``PerRow()``), and the matmul
            runs in int8. False: ``Int8WeightOnlyConfig``: weights stored in int8, a float
            matmul (in eager mode the whole int8 weight is cast to float on each call and the
            scales are applied to the output).
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
