"""Data-parallel training end to end: ``python -m course_lib.train_ddp`` under any launcher.

PyTorch counterpart: the recipe of torchvision's ``references/classification/train.py`` and of
the ImageNet example (github.com/pytorch/examples, ``imagenet/main.py``), cut down to what data
parallelism itself needs. Read more: the DDP tutorial
(https://pytorch.org/tutorials/intermediate/ddp_tutorial.html), torchrun's fault-tolerance notes
(https://pytorch.org/docs/stable/elastic/run.html) and Goyal et al., "Accurate, Large Minibatch
SGD" (2017) for the learning-rate rule and the warm-up.

    torchrun --standalone --nproc-per-node=2 -m course_lib.train_ddp --epochs 10
    python -m course_lib.train_ddp --epochs 1          # no launcher: a group of one process
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29400 --nnodes=1 --nproc-per-node=2 \
        -m course_lib.train_ddp --checkpoint ck.pt --resume     # survives a killed worker

(Without that variable, torchrun's restarted workers share the rendezvous store of the killed
ones, read their stale addresses and fail to connect: pytorch/pytorch#135712.)

The same code runs under torchrun, mpirun, Slurm, ``course_lib.distributed.launch`` (call
``run(argv)`` in the workers) and as one process. What it shows, one function each:

- sharding: a ``DistributedSampler`` (``set_epoch`` every epoch) or by hand (``StridedShards``);
- identical initial weights: DDP's broadcast, or a file that rank 0 writes
  (``share_initial_weights``);
- the learning rate scaled with the global batch, warm-up, a cosine with a floor;
- a non-finite loss stops every rank together (``check_finite``: one all-reduce per step);
- exact evaluation, every test example counted once (``evaluate_exact``), against the padded
  count of a ``DistributedSampler`` (``evaluate_padded``);
- checkpoints written atomically by rank 0 with every RNG state, so that an interrupted run
  resumes bitwise where it stopped, also after torchrun restarted a killed worker.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import math
import os
import random
import signal
import sys
import tempfile
import traceback
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from .data import load_fashion_mnist
from .deploy import freeze_all_but
from .distributed import DistInfo, init_distributed_mode, reduce_value
from .models.lenet import LeNet
from .models.resnet import resnet18
from .parallel.ddp import DistributedDataParallel as CourseDDP
from .parallel.ddp import bf16_compress_hook as course_bf16_compress_hook
from .parallel.sync_batchnorm import convert_sync_batchnorm
from .timing import Timer
from .train import NonFiniteLoss

try:  # numpy's RNG goes into checkpoints only where numpy is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = [
    "EvalResult",
    "Job",
    "StridedShards",
    "build_model",
    "build_parser",
    "check_finite",
    "checkpoint_state",
    "evaluate_exact",
    "evaluate_padded",
    "head_of",
    "load_checkpoint",
    "load_data",
    "load_fitting_weights",
    "lr_factor",
    "main",
    "make_loader",
    "make_optimizer",
    "parse_args",
    "prepare",
    "progress",
    "restore",
    "rng_states",
    "run",
    "save_checkpoint",
    "set_rng_states",
    "setup",
    "share_initial_weights",
    "train_epochs",
    "train_one_epoch",
    "unwrap",
    "wrap_model",
]


# ------------------------------------------------------------------------------------------------
# Arguments and set-up
# ------------------------------------------------------------------------------------------------

def _epoch_step(text: str) -> tuple[int, int]:
    """``"2:5"`` -> (2, 5), for ``--kill-rank-at``."""
    try:
        epoch, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected EPOCH:STEP such as 2:5, got {text!r}") from None
    return epoch, step


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m course_lib.train_ddp`` (``--help`` prints it)."""
    p = argparse.ArgumentParser(prog="python -m course_lib.train_ddp",
                                description="Data-parallel training of Fashion-MNIST.")
    p.add_argument("--model", choices=["lenet", "resnet18"], default="lenet")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=0.05,
                   help="learning rate of ONE process with --batch-size examples")
    p.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear",
                   help="how the learning rate grows with the number of ranks")
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="linear warm-up when the learning rate is scaled up")
    p.add_argument("--lrf", type=float, default=0.05,
                   help="final learning rate, as a fraction of the peak (cosine floor)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=None, help="first N training examples")
    p.add_argument("--test-samples", type=int, default=None, help="first N test examples")
    p.add_argument("--sharding", choices=["sampler", "strided"], default="sampler")
    p.add_argument("--ddp", choices=["torch", "course"], default="torch")
    p.add_argument("--comm-hook", choices=["none", "bf16"], default="none",
                   help="bf16: all-reduce the gradients in bfloat16 (half the bytes)")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch")
    p.add_argument("--freeze", action="store_true", help="train only the head (last Linear)")
    p.add_argument("--weights", default=None, help="initial weights; mismatched shapes skipped")
    p.add_argument("--init-from-rank0-file", action="store_true",
                   help="identical initial weights through a file rank 0 writes")
    p.add_argument("--checkpoint", default=None, help="file written after every epoch")
    p.add_argument("--resume", action="store_true",
                   help="go on from --checkpoint if it exists (start afresh if not)")
    p.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="exit after epoch K as if interrupted (its checkpoint written)")
    p.add_argument("--logdir", default=None, help="TensorBoard scalars (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    debug = p.add_argument_group("fault injection (for the tests and the notebook)")
    debug.add_argument("--nan-at-step", type=int, default=None, metavar="K",
                       help="make the loss nan at global step K (from 1)")
    debug.add_argument("--nan-rank", type=int, default=0)
    debug.add_argument("--kill-rank-at", type=_epoch_step, default=None, metavar="EPOCH:STEP",
                       help="SIGKILL --kill-rank at that step, on torchrun's first attempt only")
    debug.add_argument("--kill-rank", type=int, default=1)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options; a wrong combination exits with a message (argparse's way)."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if (args.stop_after is not None or args.resume) and not args.checkpoint:
        p.error("--stop-after and --resume need --checkpoint PATH (where the state is kept).")
    if not 0 < args.lrf <= 1:
        p.error(f"--lrf is the final learning rate as a fraction of the peak: expected a "
                f"number in (0, 1], got {args.lrf}.")
    if args.logdir and importlib.util.find_spec("tensorboard") is None:
        p.error("--logdir needs the tensorboard package, which is not installed. Install it "
                "(pip install tensorboard) or leave out --logdir.")
    return args


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


# ------------------------------------------------------------------------------------------------
# Data: a DistributedSampler, or sharding by hand
# ------------------------------------------------------------------------------------------------

def _as_input(X: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Images as the model takes them: float in [0, 1] on ``device`` (uint8 is scaled here)."""
    X = X.to(device, non_blocking=True)
    return X.float().div_(255) if X.dtype == torch.uint8 else X


class StridedShards:
    """Sharding by hand, without a DataLoader: rank r takes examples r, r+k, r+2k, ...

    Each epoch every rank draws the same permutation (seeded with ``seed + epoch``), drops the
    last ``N % k`` examples so that every rank takes the same number of steps (a rank with one
    step more would wait forever in DDP's all-reduce), and takes its stride of what is left.

    Args:
        X: uint8 or float images (N, 1, 28, 28); y: labels (N,).
        batch_size: examples per rank per step.
        rank, world_size: this rank, and k.
        seed: the shuffle's seed (the same on every rank).
    """

    def __init__(self, X: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int,
                 world_size: int, seed: int = 0):
        if len(y) < world_size:
            raise ValueError(f"StridedShards: {len(y)} examples cannot give each of "
                             f"{world_size} ranks one; use more examples or fewer ranks.")
        self.X, self.y, self.batch_size = X, y, batch_size
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation (call it every epoch, as with a DistributedSampler)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil((len(self.y) // self.world_size) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.y), generator=g)
        usable = len(order) - len(order) % self.world_size
        mine = order[:usable][self.rank::self.world_size]                # (N // k,)
        for start in range(0, len(mine), self.batch_size):
            idx = mine[start:start + self.batch_size]
            yield self.X[idx], self.y[idx]                                # (B, 1, 28, 28), (B,)


def make_loader(X: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, info: DistInfo
                ) -> tuple[Iterable, DistributedSampler | StridedShards]:
    """This rank's training batches, and the object whose ``set_epoch`` reshuffles them."""
    if args.sharding == "strided":
        shards = StridedShards(X, y, args.batch_size, info.rank, info.world_size, args.seed)
        return shards, shards
    dataset = TensorDataset(X, y)
    # drop_last=False: the sampler pads with repeated examples so that every rank gets
    # ceil(N / k) of them, hence the same number of steps.
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                 shuffle=True, seed=args.seed, drop_last=False)
    return DataLoader(dataset, batch_size=args.batch_size, sampler=sampler), sampler


def load_data(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """(X_train, y_train, X_test, y_test): uint8 images (N, 1, 28, 28), int64 labels (N,)."""
    train_iter, test_iter = load_fashion_mnist(args.batch_size, quick=False, seed=args.seed)
    n_train, n_test = args.train_samples, args.test_samples
    return (train_iter.X[:n_train], train_iter.y[:n_train],
            test_iter.X[:n_test], test_iter.y[:n_test])


# ------------------------------------------------------------------------------------------------
# The model: built, given its initial weights, wrapped
# ------------------------------------------------------------------------------------------------

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

    ``path`` holds a state dict, or a checkpoint of this module (its ``"model"``); a
    ``module.`` prefix (a state dict saved from a DDP wrapper) is removed.

    Returns:
        (names loaded, one line per tensor skipped saying why).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    skipped = [f"{k}: file {tuple(v.shape)}, model {tuple(own[k].shape)}"
               for k, v in state.items() if k in own and k not in fitting]
    skipped += [f"{k}: not in the file" for k in own if k not in state]
    skipped += [f"{k}: not in the model" for k in state if k not in own]
    model.load_state_dict(fitting, strict=False)
    return sorted(fitting), skipped


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
        if info.backend == "nccl":  # torch's SyncBatchNorm works on CUDA with NCCL only
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


# ------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# ------------------------------------------------------------------------------------------------

def lr_factor(step: int, *, total_steps: int, warmup_steps: int, start: float,
              floor: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (from 0).

    A linear warm-up from ``start`` to 1 over ``warmup_steps``, then a cosine from 1 down to
    ``floor`` at ``total_steps``.
    """
    if step < warmup_steps:
        return start + (1 - start) * step / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def make_optimizer(model: nn.Module, args: argparse.Namespace, info: DistInfo,
                   steps_per_epoch: int):
    """SGD with momentum and weight decay, a per-step schedule, and the rule applied (text)."""
    k = info.world_size
    scale = {"linear": k, "sqrt": math.sqrt(k), "none": 1}[args.lr_scaling]
    peak = args.lr * scale
    warmup = round(args.warmup_epochs * steps_per_epoch) if scale > 1 else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=peak, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    schedule = functools.partial(lr_factor, total_steps=args.epochs * steps_per_epoch,
                                 warmup_steps=warmup, start=1 / scale, floor=args.lrf)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rule = (f"global batch {k * args.batch_size} = {k} rank(s) x {args.batch_size}; learning "
            f"rate {args.lr:g} x {scale:.3g} = {peak:.4g} ({args.lr_scaling} scaling rule: "
            f"--lr is one process's rate for --batch-size examples)")
    if warmup:
        rule += f", linear warm-up from {args.lr:g} over {warmup} step(s)"
    rule += f", cosine down to {peak * args.lrf:.3g}"
    return optimizer, scheduler, rule


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------

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
        raise NonFiniteLoss(
            f"rank(s) {bad}, {where}, learning rate {lr:.4g} (seen by rank {info.rank}; every "
            "rank stopped at this step)", advice="lower --lr (or warm up longer with "
            "--warmup-epochs), or look at the data of that step")


def _kill_if_asked(args: argparse.Namespace, info: DistInfo, epoch: int, step: int) -> None:
    """Fault injection: SIGKILL this rank at --kill-rank-at, on torchrun's first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if (args.kill_rank_at == (epoch, step) and info.rank == args.kill_rank % info.world_size
            and first_attempt):
        print(f"train_ddp: rank {info.rank} kills itself at epoch {epoch} step {step} "
              f"(--kill-rank-at)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def progress(batches: Iterable, epoch: int, info: DistInfo) -> Iterable:
    """A tqdm bar on rank 0 only, and only on a terminal (``TQDM_DISABLE=1`` turns it off)."""
    quiet = not info.is_main or os.environ.get("TQDM_DISABLE", "0") not in ("", "0")
    return tqdm(batches, desc=f"epoch {epoch}", leave=False, disable=True if quiet else None)


def train_one_epoch(model: nn.Module, batches: Iterable, optimizer, scheduler, epoch: int,
                    args: argparse.Namespace, info: DistInfo) -> float:
    """One pass over this rank's shard; returns the mean loss, averaged over the ranks."""
    model.train()
    total, steps = torch.zeros((), device=info.device), len(batches)
    for step, (X, y) in enumerate(progress(batches, epoch, info), start=1):
        _kill_if_asked(args, info, epoch, step)
        X, y = _as_input(X, info.device), y.to(info.device)          # (B, 1, 28, 28), (B,)
        loss = F.cross_entropy(model(X), y)
        global_step = scheduler.last_epoch + 1
        if global_step == args.nan_at_step and info.rank == args.nan_rank:
            loss = loss * float("nan")                                # fault injection
        lr = optimizer.param_groups[0]["lr"]
        check_finite(loss, info, f"epoch {epoch}, step {step}/{steps} (global step "
                                 f"{global_step})", lr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                                               # DDP averages gradients
        optimizer.step()
        scheduler.step()
        total += loss.detach()
    return reduce_value(total / steps).item()


# ------------------------------------------------------------------------------------------------
# Evaluation: exact, and the popular padded count
# ------------------------------------------------------------------------------------------------

class EvalResult(NamedTuple):
    """Correct predictions and examples counted, summed over the ranks."""

    correct: int
    count: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.count


@torch.no_grad()
def _count_correct(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                   device: torch.device) -> tuple[int, int]:
    """(correct, examples) of ``model`` on X, y, in batches, on this rank only."""
    correct = 0
    for start in range(0, len(y), batch_size):
        Xb = _as_input(X[start:start + batch_size], device)            # (B, 1, 28, 28)
        yb = y[start:start + batch_size].to(device)
        correct += int((model(Xb).argmax(dim=1) == yb).sum())
    return correct, len(y)


def _sum_over_ranks(correct: int, count: int, device: torch.device) -> EvalResult:
    t = torch.tensor([correct, count], dtype=torch.int64, device=device)  # integers: exact
    if dist.is_initialized():
        dist.all_reduce(t)
    return EvalResult(int(t[0]), int(t[1]))


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """The unwrapped model in eval mode, its mode restored after.

    Unwrapped: DDP's forward may communicate, and here the shards may differ in size.
    """
    module = unwrap(model)
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def evaluate_exact(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                   device: torch.device) -> EvalResult:
    """Accuracy over X, y with every example counted exactly once, whatever the world size.

    Rank r takes examples r, r+k, r+2k, ... (shards differ by at most one, no padding); the
    (correct, count) pairs are all-reduced as integers. ``.accuracy`` is the test accuracy.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    k = dist.get_world_size() if dist.is_initialized() else 1
    with _evaluating(model) as net:
        correct, count = _count_correct(net, X[rank::k], y[rank::k], batch_size, device)
    return _sum_over_ranks(correct, count, device)


def evaluate_padded(model: nn.Module, X: torch.Tensor, y: torch.Tensor, batch_size: int,
                    device: torch.device) -> EvalResult:
    """The popular, slightly wrong value: a ``DistributedSampler`` over the test set.

    The sampler pads the data with repeated examples so that every rank gets ceil(N / k):
    ``count`` is ``sampler.total_size`` (> N when k does not divide N), and the repeated
    examples are counted twice. Shown beside ``evaluate_exact`` to see by how much it errs.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    k = dist.get_world_size() if dist.is_initialized() else 1
    sampler = DistributedSampler(TensorDataset(X, y), num_replicas=k, rank=rank, shuffle=False)
    idx = torch.tensor(list(sampler))                                  # (total_size // k,)
    with _evaluating(model) as net:
        correct, count = _count_correct(net, X[idx], y[idx], batch_size, device)
    return _sum_over_ranks(correct, count, device)


# ------------------------------------------------------------------------------------------------
# Checkpoints: atomic, complete, loadable anywhere
# ------------------------------------------------------------------------------------------------

def rng_states() -> dict:
    """This process's RNG states: torch (CPU, and CUDA if any), Python's random, numpy."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:  # as plain lists, so that torch.load(weights_only=True) accepts it
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return states


def set_rng_states(states: dict) -> None:
    """Restore what ``rng_states`` saved."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and np is not None:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def checkpoint_state(model, optimizer, scheduler, epoch: int, args, info: DistInfo) -> dict:
    """Everything a bitwise resume needs (a collective: every rank's RNG goes to every rank)."""
    rngs = [None] * info.world_size
    dist.all_gather_object(rngs, rng_states())
    return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "epoch": epoch, "sampler_epoch": epoch,
            "rng": rngs, "world_size": info.world_size, "model_name": args.model}


def save_checkpoint(state: dict, path: str) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, then rename.

    ``os.replace`` within one file system is atomic: a reader (or a restarted run) sees the
    previous checkpoint or the new one, never half a file, even if this process dies mid-way.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def load_checkpoint(path: str) -> dict:
    """A checkpoint's contents, on the CPU (``map_location``): restoring puts each tensor on
    its parameter's device, whatever device wrote it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; pass the --checkpoint of an "
                                f"earlier run, or leave out --resume to start afresh.")
    return torch.load(path, map_location="cpu", weights_only=True)


def restore(state: dict, model, optimizer, scheduler, args, info: DistInfo) -> int:
    """Put a checkpoint back (weights, optimizer, schedule, RNGs); returns its epoch."""
    if state["model_name"] != args.model:
        raise ValueError(f"--resume: the checkpoint holds a {state['model_name']}, but "
                         f"--model is {args.model}; pass the same --model, or another "
                         f"--checkpoint.")
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    same_world = state["world_size"] == info.world_size
    set_rng_states(state["rng"][info.rank if same_world else 0])
    if not same_world:
        log(info, f"--resume: the checkpoint comes from {state['world_size']} rank(s), this "
                  f"run has {info.world_size}: the shards (and the result) differ from an "
                  f"uninterrupted run.")
    return state["epoch"]


# ------------------------------------------------------------------------------------------------
# The whole run
# ------------------------------------------------------------------------------------------------

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
    """Data, model, optimizer and schedule, and the checkpoint restored when resuming."""
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
    log(info, rule)
    return Job(model, optimizer, scheduler, batches, sampler, (X_test, y_test), rule, done)


def _report(epoch: int, loss: float, accuracy: float, lr: float, seconds: float,
            args: argparse.Namespace, info: DistInfo, writer) -> None:
    """One line on rank 0, and the same numbers to TensorBoard with --logdir."""
    log(info, f"epoch {epoch}/{args.epochs}: loss {loss:.4f}, test accuracy {accuracy:.4f} "
              f"(exact), lr {lr:.4g}, {seconds:.1f} s")
    if writer is not None:
        for tag, value in (("train/loss", loss), ("test/accuracy", accuracy), ("train/lr", lr)):
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
                                       epoch, args, info)
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


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, train, and return a summary; the process group is always left as found.

    Inside ``course_lib.distributed.launch`` workers the group exists and is kept; otherwise
    the group joined (or the group of one) is destroyed at the end, whatever happened.

    Returns:
        {"world_size", "global_batch", "lr", "lr_rule", "losses" (per epoch, averaged over
        ranks), "accuracies" (exact, per epoch), "epoch_times" (seconds of training per
        epoch), "test_accuracy", "resumed_from",
        "stopped_after"}.
    """
    args = parse_args(argv)
    owns_group = not dist.is_initialized()
    try:
        info = setup(args)
        return train_epochs(args, info)
    except BaseException as e:
        # The traceback keeps train_epochs()'s frames, and so the DDP model, alive: let them go
        # first, so that the group is torn down after its last user, as on success.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if owns_group and dist.is_initialized():
            gc.collect()  # DDP's hooks form reference cycles: free it before its group
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 on success, 1 when the loss stopped being finite."""
    try:
        run(argv)
    except NonFiniteLoss as e:
        print(f"train_ddp: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
