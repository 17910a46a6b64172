"""The recipe's process set-up: join the launcher's group (or make a group of one), log on rank 0,
seed every RNG.

PyTorch counterpart: ``torch.distributed.init_process_group`` as torchrun's workers call it (the
DDP tutorial's ``setup``); nanoGPT's ``master_process`` for logging. Read more:
https://pytorch.org/tutorials/intermediate/ddp_tutorial.html and notebook 08.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.distributed as dist

from ..distributed import DistInfo, init_distributed_mode

try:  # numpy's RNG is seeded (and checkpointed) only where numpy is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["log", "seed_everything", "setup"]


def setup(args: argparse.Namespace) -> DistInfo:
    """Join the launcher's process group; without a launcher, make a group of one process.

    A group of one lets the same code (DDP, all-reduces, barriers) run unchanged.
    """
    _warn_about_shared_store()
    info = init_distributed_mode(timeout=args.timeout, verbose=False)
    if not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        info = DistInfo(0, 1, 0, backend, info.device, "none")
    log(info, f"train_ddp: {info.world_size} rank(s) started by {info.launcher}, "
              f"{info.backend} on {info.device}")
    return info


def _warn_about_shared_store() -> None:
    """Say why a group restarted by torchrun may fail to connect, before it does."""
    env = os.environ
    if (env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and env.get("RANK") == "0"
            and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        print("train_ddp: torchrun restarted the workers and shares its rendezvous store with "
              "them: the new group may read the old group's addresses and fail to connect "
              "(pytorch/pytorch#135712). Start torchrun with "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.", file=sys.stderr,
              flush=True)


def log(info: DistInfo, *message) -> None:
    """Print on rank 0 only: one line per event, not one per rank."""
    if info.is_main:
        print(*message, flush=True)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and numpy."""
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
