"""The command line of the recipe: ``python -m course_lib.train_ddp [options]``, ``run(argv)``.

PyTorch counterpart: the ``get_args_parser()`` / ``main(args)`` pair of torchvision's
``references/classification/train.py``. Every option is checked when it is parsed, with a
message that names it; the options that name a rank are checked once the world size is known.
Read more: notebook 08, and ``python -m course_lib.train_ddp --help``.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import sys
import traceback

import torch.distributed as dist

from ..distributed.env import _from_environment
from .checkpoints import check_checkpoint_path
from .runtime import setup
from .training import check_ranks, train_epochs

__all__ = ["build_parser", "main", "parse_args", "run"]


def _epoch_step(text: str) -> tuple[int, int]:
    """``"2:5"`` -> (2, 5), for ``--kill-rank-at`` (both from 1)."""
    try:
        epoch, step = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected EPOCH:STEP such as 2:5, got {text!r}") from None
    if epoch < 1 or step < 1:
        raise argparse.ArgumentTypeError(f"epochs and steps count from 1, got {text!r}")
    return epoch, step


def _integer(low: int):
    """An argparse type: an integer >= ``low`` (argparse names the option in its message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _number(low: float, high: float = math.inf, *, low_open: bool = False,
            high_open: bool = False):
    """An argparse type: a finite float in [low, high] (a bound excluded if ``*_open``)."""
    left, right = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
    interval = f"{left}{low:g}, {'inf' if high == math.inf else f'{high:g}'}{right}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        inside = (math.isfinite(value) and (value > low if low_open else value >= low)
                  and (value < high if high_open else value <= high))
        if not inside:
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, "
                                             f"got {text}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m course_lib.train_ddp`` (``--help`` prints it)."""
    p = argparse.ArgumentParser(prog="python -m course_lib.train_ddp",
                                description="Data-parallel training of Fashion-MNIST.")
    p.add_argument("--model", choices=["lenet", "resnet18"], default="lenet")
    p.add_argument("--epochs", type=_integer(1), default=10)
    p.add_argument("--batch-size", type=_integer(1), default=64,
                   help="examples per rank per step")
    p.add_argument("--lr", type=_number(0, low_open=True), default=0.05,
                   help="learning rate of ONE process with --batch-size examples")
    p.add_argument("--lr-scaling", choices=["linear", "sqrt", "none"], default="linear",
                   help="how the learning rate grows with the number of ranks")
    p.add_argument("--warmup-epochs", type=_number(0), default=1.0,
                   help="linear warm-up when the learning rate is scaled up")
    p.add_argument("--lrf", type=_number(0, 1, low_open=True), default=0.05,
                   help="final learning rate, as a fraction of the peak (cosine floor)")
    p.add_argument("--momentum", type=_number(0, 1, high_open=True), default=0.9)
    p.add_argument("--weight-decay", type=_number(0), default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=_integer(1), default=None,
                   help="first N training examples")
    p.add_argument("--test-samples", type=_integer(1), default=None,
                   help="first N test examples")
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
    p.add_argument("--stop-after", type=_integer(1), default=None, metavar="K",
                   help="exit after epoch K as if interrupted (its checkpoint written)")
    p.add_argument("--logdir", default=None, help="TensorBoard scalars (rank 0)")
    p.add_argument("--timeout", type=_number(0, low_open=True), default=300.0,
                   help="seconds per collective")
    debug = p.add_argument_group("fault injection (for the tests and the notebook)")
    debug.add_argument("--nan-at-step", type=_integer(1), default=None, metavar="K",
                       help="make the loss nan at global step K (from 1)")
    debug.add_argument("--nan-rank", type=_integer(0), default=0)
    debug.add_argument("--kill-rank-at", type=_epoch_step, default=None, metavar="EPOCH:STEP",
                       help="SIGKILL --kill-rank at that step, on torchrun's first attempt only")
    debug.add_argument("--kill-rank", type=_integer(0), default=1)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options; a wrong one exits with a message naming it (argparse's way).

    Checked here: every number's range (``--train-samples 0``, ``--weight-decay nan``, ...),
    the combinations, and that ``--checkpoint`` can be written, before any training. The ranks
    named by ``--nan-rank`` / ``--kill-rank`` are checked once the world size is known.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if (args.stop_after is not None or args.resume) and not args.checkpoint:
        p.error("--stop-after and --resume need --checkpoint PATH (where the state is kept).")
    if args.stop_after is not None and args.stop_after > args.epochs:
        p.error(f"--stop-after {args.stop_after} is after the last epoch (--epochs "
                f"{args.epochs}): it would never stop; pass at most {args.epochs}.")
    if args.nan_at_step is None and args.nan_rank != 0:
        p.error("--nan-rank chooses the rank of --nan-at-step; pass --nan-at-step K too.")
    if args.logdir and importlib.util.find_spec("tensorboard") is None:
        p.error("--logdir needs the tensorboard package, which is not installed. Install it "
                "(pip install tensorboard) or leave out --logdir.")
    try:
        world_size = _known_world_size()
        if world_size is not None:
            check_ranks(args, world_size)
        if args.checkpoint:
            check_checkpoint_path(args.checkpoint)
    except ValueError as e:
        p.error(str(e))
    return args


def _known_world_size() -> int | None:
    """The number of ranks this run will have, as far as it is known before joining: the
    group's (inside ``launch``), the launcher's variables, 1 without a launcher; None when
    the variables are wrong (``setup`` says how)."""
    if dist.is_initialized():
        return dist.get_world_size()
    try:
        found = _from_environment(os.environ)
    except ValueError:
        return None
    return 1 if found is None else found[2]


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, train, and return a summary; the process group is always left as found.

    Inside ``course_lib.distributed.launch`` workers the group exists and is kept; otherwise
    the group joined (or the group of one) is destroyed at the end, whatever happened.

    Returns:
        {"world_size", "global_batch", "lr", "lr_rule", "losses" (per epoch, averaged over
        ranks), "accuracies" (exact, per epoch), "epoch_times" (seconds of training per
        epoch), "test_accuracy", "resumed_from", "stopped_after"}.
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
    except FloatingPointError as e:
        from ..train import NonFiniteLoss  # only now: course_lib.train brings matplotlib

        if not isinstance(e, NonFiniteLoss):
            raise
        print(f"train_ddp: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
