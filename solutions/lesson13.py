"""Lesson 12, exercise: a wrapped model's state dict made loadable into the plain model.

Checked by ``course_lib.checks.lesson13.check_strip_prefix``.
"""
from __future__ import annotations

__all__ = ["strip_prefix"]


def strip_prefix(state_dict: dict, prefix: str = "module.") -> dict:
    """A new dict whose keys lose ``prefix`` where they START with it; the tensors are kept.

    ``str.removeprefix`` touches only the start of a key, and only a key that has the prefix:
    ``"module.block.module.weight"`` -> ``"block.module.weight"``, ``"conv1.weight"`` unchanged.
    """
    return {key.removeprefix(prefix): value for key, value in state_dict.items()}
