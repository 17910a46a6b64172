"""The recipe's model: built, given its initial weights (a file, or rank 0's), wrapped in DDP.

PyTorch counterpart: ``torch.nn.parallel.DistributedDataParallel`` (its broadcast of rank 0's
weights at construction), ``nn.SyncBatchNorm.convert_sync_batchnorm`` and DDP communication
hooks (``torch.distributed.algorithms.ddp_comm_hooks``). Read more:
https://pytorch.org/docs/stable/notes/ddp.html and notebook 08.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import uuid

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..deploy import fit_state_dict, freeze_all_but
from ..distributed import DistInfo
from ..models.lenet import LeNet
from ..models.resnet import resnet18
from ..parallel.ddp import DistributedDataParallel as CourseDDP
from ..parallel.ddp import bf16_compress_hook as course_bf16_compress_hook
from ..parallel.sync_batchnorm import convert_sync_batchnorm
from .runtime import log

__all__ = ["build_model", "head_of", "load_fitting_weights", "share_initial_weights", "unwrap",
           "wrap_model"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (its state dict has no ``module.`` prefix)."""
    if isinstance(model, nn.parallel.DistributedDataParallel | CourseDDP):
        return model.module
    return model


def head_of(model: nn.Module) -> nn.Linear:
    """The classifier: the last ``nn.Linear`` of the model."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"--freeze trains only the head, the last nn.Linear, but "
                         f"{type(model).__name__} has none.")
    return linears[-1]


def load_fitting_weights(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Load the tensors of ``path`` whose names and shapes fit ``model``; skip the others.

    ``path`` holds a state dict, or a checkpoint of this recipe (its ``"model"``). The file is
    read by ``course_lib.deploy.fit_state_dict``, the same reading as ``load_weights``: a
    wrapper's ``module.`` prefix on every key is removed (unless the model's keys carry it).

    Returns:
        (names loaded, one line per tensor skipped saying why).
    """
    fit = fit_state_dict(model, path, device="cpu", what="--weights")
    skipped = [f"{k}: file {a}, model {b}" for k, a, b in fit.mismatched]
    skipped += [f"{k}: not in the file" for k in fit.missing]
    skipped += [f"{k}: not in the model" for k in fit.unexpected]
    model.load_state_dict(fit.fitting, strict=False)
    return sorted(fit.fitting), skipped


def build_model(args: argparse.Namespace, device: torch.device, rank: int = 0) -> nn.Module:
    """The model on ``device``: ``--weights`` loaded where shapes fit, ``--freeze`` applied.

    Each rank seeds its initialisation with ``seed + rank``: the weights differ until DDP's
    broadcast (or ``share_initial_weights``) makes them equal, which is the point to see.
    """
    torch.manual_seed(args.seed + rank)
    model = LeNet() if args.model == "lenet" else resnet18(num_classes=10, in_channels=1)
    if args.weights:
        loaded, skipped = load_fitting_weights(model, args.weights)
        if rank == 0:
            print(f"--weights {args.weights}: loaded {len(loaded)} tensor(s); skipped "
                  f"{len(skipped)}" + "".join(f"\n  skipped {s}" for s in skipped), flush=True)
    if args.freeze:
        head = head_of(model)
        freeze_all_but(model, next(name for name, m in model.named_modules() if m is head))
    return model.to(device)


def share_initial_weights(model: nn.Module, info: DistInfo, folder: str) -> None:
    """Identical initial weights without DDP's broadcast: through a file that rank 0 writes.

    Rank 0 saves, barrier, every rank loads (``map_location``: its own device), barrier, rank
    0 deletes the file, also when something failed. ``folder`` must be readable by every rank
    (one machine: any folder; several: a shared file system).
    """
    name = [f"init_weights_{uuid.uuid4().hex}.pt" if info.is_main else None]
    dist.broadcast_object_list(name, src=0)  # one file name for all ranks
    path = os.path.join(folder, name[0])
    try:
        if info.is_main:
            torch.save(model.state_dict(), path)
        dist.barrier()  # the file is complete before anyone reads it
        model.load_state_dict(torch.load(path, map_location=info.device, weights_only=True))
        dist.barrier()  # everyone has read it before rank 0 deletes it
    finally:
        if info.is_main:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def wrap_model(model: nn.Module, args: argparse.Namespace, info: DistInfo) -> nn.Module:
    """``--sync-bn`` conversion, then DistributedDataParallel (torch's or the course's)."""
    if args.sync_bn:
        before = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if info.backend == "nccl":  # torch's refuses CPU tensors: NCCL means GPU ones
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:
            model = convert_sync_batchnorm(model)
        log(info, f"--sync-bn: {before} BatchNorm layer(s) now normalise over the global batch")
    if args.ddp == "course":
        ddp = CourseDDP(model)
        hook = course_bf16_compress_hook
    else:
        ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        hook = default_hooks.bf16_compress_hook
    if args.comm_hook == "bf16":
        ddp.register_comm_hook(None, hook)
        log(info, "--comm-hook bf16: gradients travel in bfloat16")
    return ddp
