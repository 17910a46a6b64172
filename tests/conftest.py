import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _float32_in_full_on_gpus() -> None:
    """The oracles run on the CPU in float32 or float64; on a GPU, cuDNN's convolutions default
    to TF32 (10-bit mantissas), whose rounding after a few SGD steps exceeds float32's
    tolerances. The tests compare arithmetic, so GPU float32 stays IEEE float32 here."""
    import torch

    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):   # torch 2.9 and later
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


_float32_in_full_on_gpus()


@pytest.fixture
def no_gpus(monkeypatch):
    """Make torch report a CPU-only machine, whatever this one has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

