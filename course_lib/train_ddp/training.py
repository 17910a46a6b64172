"""The recipe's training loop: epochs with a shuffle per epoch, every rank stopping together on a
non-finite loss, exact evaluation, a checkpoint after each epoch, resumable.

PyTorch counterpart: the training loop of torchvision's ``references/classification/train.py``
and of the ImageNet example (github.com/pytorch/examples, ``imagenet/main.py``). Read more: the
DDP tutorial (https://pytorch.org/tutorials/intermediate/ddp_tutorial.html) and notebooks 08-09.
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from ..distributed import DistInfo, reduce_value
from ..timing import Timer
from .checkpoints import (
    checkpoint_state,
    load_checkpoint,
    remove_stale_temporaries,
    restore,
    save_checkpoint,
)
from .evaluation import evaluate_exact
from .model import build_model, share_initial_weights, wrap_model
from .runtime import log, seed_everything
from .schedule import make_optimizer
from .sharding import StridedShards, _as_input, load_data, make_loader

__all__ = ["Job", "check_finite", "check_ranks", "prepare", "progress", "train_epochs",
           "train_one_epoch"]


def _non_finite_loss(where: str, advice: str) -> Exception:
    """``course_lib.train.NonFiniteLoss``, imported when one is raised: ``course_lib.train``
    brings matplotlib with it, which no torchrun worker of the recipe needs otherwise."""
    from ..train import NonFiniteLoss

    return NonFiniteLoss(where, advice=advice)


def check_finite(loss: torch.Tensor, info: DistInfo, where: str, lr: float) -> None:
    """Raise ``course_lib.train.NonFiniteLoss`` on EVERY rank when the loss is not finite on ANY
    rank.

    One all-reduce of one flag per rank, every step: all ranks learn the same thing at the same
    step and stop together, before backward, so none is left waiting in a collective.
    """
    flags = torch.zeros(info.world_size, device=loss.device)           # (k,)
    flags[info.rank] = float(not torch.isfinite(loss.detach()).item())
    dist.all_reduce(flags)
    bad = torch.nonzero(flags).flatten().tolist()
    if bad:
        raise _non_finite_loss(
            f"rank(s) {bad}, {where}, learning rate {lr:.4g} (seen by rank {info.rank}; every "
            "rank stopped at this step)", advice="lower --lr (or warm up longer with "
            "--warmup-epochs), or look at the data of that step")


def check_ranks(args: argparse.Namespace, world_size: int) -> None:
    """Raise ``ValueError`` unless the options that name a rank (``--nan-rank``, and
    ``--kill-rank`` with ``--kill-rank-at``) name one of the ``world_size`` ranks."""
    k = world_size
    named = [("--nan-rank", args.nan_rank)]
    if args.kill_rank_at is not None:
        named.append(("--kill-rank", args.kill_rank))
    for flag, rank in named:
        if not 0 <= rank < k:
            raise ValueError(f"{flag} {rank}: rank out of range, this run has {k} rank(s) "
                             f"(0 to {k - 1}); pass one of them.")


def _kill_if_asked(args: argparse.Namespace, info: DistInfo, epoch: int, step: int) -> None:
    """Fault injection: SIGKILL this rank at --kill-rank-at, on torchrun's first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.kill_rank_at == (epoch, step) and info.rank == args.kill_rank and first_attempt:
        print(f"train_ddp: rank {info.rank} kills itself at epoch {epoch} step {step} "
              f"(--kill-rank-at)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def progress(batches: Iterable, epoch: int, info: DistInfo) -> Iterable:
    """A tqdm bar on rank 0 only, and only on a terminal (``TQDM_DISABLE=1`` turns it off)."""
    quiet = not info.is_main or os.environ.get("TQDM_DISABLE", "0") not in ("", "0")
    return tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=True if quiet else None)


def train_one_epoch(model: nn.Module, batches: Iterable, optimizer, scheduler, epoch: int,
                    args: argparse.Namespace, info: DistInfo, writer=None) -> float:
    """One pass over this rank's shard; returns the mean loss, averaged over the ranks.

    ``writer`` (a TensorBoard ``SummaryWriter``, rank 0 with ``--logdir``): ``train/lr`` is
    logged at every optimizer step (x: the global step from 1), so the warm-up shows.
    """
    model.train()
    total, steps = torch.zeros((), device=info.device), len(batches)
    for step, (X, y) in enumerate(progress(batches, epoch, info), start=1):
        _kill_if_asked(args, info, epoch, step)
        X, y = _as_input(X, info.device), y.to(info.device)          # (B, 1, 28, 28), (B,)
        loss = F.cross_entropy(model(X), y)
        global_step = scheduler.last_epoch + 1
        if global_step == args.nan_at_step and info.rank == args.nan_rank:
            loss = loss * float("nan")                                # fault injection
        lr = optimizer.param_groups[0]["lr"]                          # this step's rate
        if writer is not None:
            writer.add_scalar("train/lr", lr, global_step)
        check_finite(loss, info, f"epoch {epoch}, step {step}/{steps} (global step "
                                 f"{global_step})", lr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                                               # DDP averages gradients
        optimizer.step()
        scheduler.step()
        total += loss.detach()
    return reduce_value(total / steps).item()


def _writer(args: argparse.Namespace, info: DistInfo):
    """A TensorBoard SummaryWriter on rank 0 with --logdir, else None."""
    if not (args.logdir and info.is_main):
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(args.logdir)


@dataclass
class Job:
    """What one run trains with, built by ``prepare``."""

    model: nn.Module                      # wrapped in DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Iterable                     # this rank's training batches
    sampler: DistributedSampler | StridedShards  # set_epoch(epoch) reshuffles the batches
    test: tuple[torch.Tensor, torch.Tensor]      # X_test, y_test (the whole test set)
    rule: str                             # the global batch and learning-rate rule, in words
    done: int                             # epochs already done (from a checkpoint)


def prepare(args: argparse.Namespace, info: DistInfo) -> Job:
    """Data, model, optimizer and schedule, and the checkpoint restored when resuming.

    Rank 0 first removes what a save interrupted by a kill left (``*.tmp`` beside the
    checkpoint).
    """
    check_ranks(args, info.world_size)
    if args.checkpoint and info.is_main:
        for tmp in remove_stale_temporaries(args.checkpoint):
            log(info, f"removed {tmp}, left by a save that was interrupted")
    X, y, X_test, y_test = load_data(args)
    batches, sampler = make_loader(X, y, args, info)
    model = build_model(args, info.device, info.rank)
    if args.init_from_rank0_file:
        folder = (os.path.dirname(os.path.abspath(args.checkpoint)) if args.checkpoint
                  else tempfile.gettempdir())
        share_initial_weights(model, info, folder)
    model = wrap_model(model, args, info)  # DDP broadcasts rank 0's weights and buffers
    optimizer, scheduler, rule = make_optimizer(model, args, info, len(batches))
    done = 0
    if args.resume and os.path.isfile(args.checkpoint):
        done = restore(load_checkpoint(args.checkpoint), model, optimizer, scheduler, args, info)
        log(info, f"resuming from {args.checkpoint}: {done} epoch(s) done")
    elif args.resume:
        log(info, f"--resume: no checkpoint at {args.checkpoint} yet; starting afresh")
    if args.stop_after is not None and args.stop_after <= done:
        raise ValueError(f"--stop-after {args.stop_after}: the checkpoint already holds "
                         f"{done} epoch(s); pass a later epoch (up to --epochs {args.epochs}) "
                         f"or leave --stop-after out.")
    log(info, rule)
    return Job(model, optimizer, scheduler, batches, sampler, (X_test, y_test), rule, done)


def _report(epoch: int, loss: float, accuracy: float, lr: float, seconds: float,
            args: argparse.Namespace, info: DistInfo, writer) -> None:
    """One line on rank 0, and its loss and accuracy to TensorBoard with --logdir (the learning
    rate goes there at every step, from ``train_one_epoch``)."""
    log(info, f"epoch {epoch}/{args.epochs}: loss {loss:.4f}, test accuracy {accuracy:.4f} "
              f"(exact), lr {lr:.4g}, {seconds:.1f} s")
    if writer is not None:
        for tag, value in (("train/loss", loss), ("test/accuracy", accuracy)):  # lr: per step
            writer.add_scalar(tag, value, epoch)


def train_epochs(args: argparse.Namespace, info: DistInfo) -> dict:
    """Epochs from the last one done to ``--epochs``; a summary of the run."""
    seed_everything(args.seed + info.rank)
    job = prepare(args, info)
    summary = {"world_size": info.world_size, "global_batch": info.world_size * args.batch_size,
               "lr": args.lr, "lr_rule": job.rule, "losses": [], "accuracies": [],
               "epoch_times": [], "resumed_from": job.done or None, "stopped_after": None}
    writer = _writer(args, info)
    try:
        for epoch in range(job.done + 1, args.epochs + 1):
            job.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            with Timer(info.device) as timer:
                loss = train_one_epoch(job.model, job.batches, job.optimizer, job.scheduler,
                                       epoch, args, info, writer)
            accuracy = evaluate_exact(job.model, *job.test, 256, info.device).accuracy
            summary["losses"].append(loss)
            summary["accuracies"].append(accuracy)
            summary["epoch_times"].append(timer.elapsed)  # training only, this rank's clock
            _report(epoch, loss, accuracy, job.optimizer.param_groups[0]["lr"], timer.elapsed,
                    args, info, writer)
            if args.checkpoint:  # every rank gives its RNG states; rank 0 writes
                state = checkpoint_state(job.model, job.optimizer, job.scheduler, epoch, args,
                                         info)
                if info.is_main:
                    save_checkpoint(state, args.checkpoint)
            if epoch == args.stop_after:
                summary["stopped_after"] = epoch
                log(info, f"stopping after epoch {epoch} as asked (--stop-after); "
                          f"{args.checkpoint} holds it: run again with --resume to go on")
                break
    finally:
        if writer is not None:
            writer.close()
    summary["test_accuracy"] = (summary["accuracies"][-1] if summary["accuracies"] else
                                evaluate_exact(job.model, *job.test, 256, info.device).accuracy)
    return summary
