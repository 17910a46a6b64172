"""Utilities that training code wraps around a model: ``course_lib.utils`` mirrors ``torch.utils``.

- ``checkpoint``: activation recomputation (``checkpoint``, the selective variant of
  Korthikanti et al. 2022, ``selective_attention`` and ``selective_recompute``), lesson 15.
- ``activation_memory``: the bytes saved for backward, measured (``saved_tensor_bytes``), and
  the paper's formula per layer (``activation_memory_per_layer``).
"""
from .activation_memory import activation_memory_per_layer, saved_tensor_bytes
from .checkpoint import checkpoint, selective_attention, selective_recompute

__all__ = ["activation_memory_per_layer", "checkpoint", "saved_tensor_bytes",
           "selective_attention", "selective_recompute"]
