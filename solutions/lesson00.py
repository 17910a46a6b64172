"""Lesson 00, exercises: every GPU or the CPU; the FLOPs of a matrix product.

Checked by ``course_lib.checks.lesson00.check_try_all_gpus`` and ``check_matmul_flops``.
"""
from __future__ import annotations

import torch

__all__ = ["matmul_flops", "try_all_gpus"]


def try_all_gpus() -> list[torch.device]:
    """Every CUDA GPU this process sees, or ``[cpu]`` when there is none (never ``[]``)."""
    gpus = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return gpus or [torch.device("cpu")]


def matmul_flops(n: int, k: int, m: int) -> int:
    """``(n, k) @ (k, m)``: n*m outputs, each k multiplies and k adds."""
    return 2 * n * k * m
