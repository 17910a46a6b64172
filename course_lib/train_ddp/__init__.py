"""Data-parallel training end to end: ``python -m course_lib.train_ddp`` under any launcher.

PyTorch counterpart: the recipe of torchvision's ``references/classification/train.py`` and of
the ImageNet example (github.com/pytorch/examples, ``imagenet/main.py``), cut down to what data
parallelism itself needs. Read more: the DDP tutorial
(https://pytorch.org/tutorials/intermediate/ddp_tutorial.html), torchrun's fault-tolerance notes
(https://pytorch.org/docs/stable/elastic/run.html) and Goyal et al., "Accurate, Large Minibatch
SGD" (2017) for the learning-rate rule and the warm-up.

    torchrun --standalone --nproc-per-node=2 -m course_lib.train_ddp --epochs 10
    python -m course_lib.train_ddp --epochs 1          # no launcher: a group of one process
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --nnodes=1 --nproc-per-node=2 \\
        -m course_lib.train_ddp --checkpoint ck.pt --resume     # survives a killed worker

(Without that variable, torchrun's restarted workers share the rendezvous store of the killed
ones, read their stale addresses and fail to connect: pytorch/pytorch#135712.)

The same code runs under torchrun, mpirun, Slurm, ``course_lib.distributed.launch`` (call
``run(argv)`` in the workers) and as one process. A package, one module per concern, each
importable on its own (homework imports the pieces; nothing here imports matplotlib):

- ``sharding``: a ``DistributedSampler`` (``set_epoch`` every epoch) or by hand
  (``StridedShards``);
- ``model``: identical initial weights: DDP's broadcast, or a file that rank 0 writes
  (``share_initial_weights``); ``--weights`` loaded where shapes fit; DDP, torch's or the
  course's;
- ``schedule``: the learning rate scaled with the global batch, warm-up, a cosine with a floor;
- ``training``: a non-finite loss stops every rank together (``check_finite``: one all-reduce
  per step), the epochs, resuming;
- ``evaluation``: exact evaluation of rank 0's model, every test example counted once
  (``evaluate_exact``), against the padded count of a ``DistributedSampler``
  (``evaluate_padded``);
- ``checkpoints``: written atomically and durably by rank 0 with every RNG state, so that an
  interrupted run resumes bitwise where it stopped, also after torchrun restarted a killed
  worker;
- ``cli``: the command line (every option checked when parsed), ``run(argv)`` and ``main``;
  ``runtime``: joining the group, logging on rank 0, seeding.
"""
from .checkpoints import (
    CHECKPOINT_KEYS,
    check_checkpoint_path,
    checkpoint_state,
    load_checkpoint,
    remove_stale_temporaries,
    restore,
    rng_states,
    save_checkpoint,
    set_rng_states,
)
from .cli import build_parser, main, parse_args, run
from .evaluation import EvalResult, broadcast_buffers, evaluate_exact, evaluate_padded
from .model import (
    build_model,
    head_of,
    load_fitting_weights,
    share_initial_weights,
    unwrap,
    wrap_model,
)
from .runtime import log, seed_everything, setup
from .schedule import lr_factor, make_optimizer
from .sharding import StridedShards, load_data, make_loader
from .training import (
    Job,
    check_finite,
    check_ranks,
    prepare,
    progress,
    train_epochs,
    train_one_epoch,
)

__all__ = [
    "CHECKPOINT_KEYS",
    "EvalResult",
    "Job",
    "StridedShards",
    "broadcast_buffers",
    "build_model",
    "build_parser",
    "check_checkpoint_path",
    "check_finite",
    "check_ranks",
    "checkpoint_state",
    "evaluate_exact",
    "evaluate_padded",
    "head_of",
    "load_checkpoint",
    "load_data",
    "load_fitting_weights",
    "log",
    "lr_factor",
    "main",
    "make_loader",
    "make_optimizer",
    "parse_args",
    "prepare",
    "progress",
    "remove_stale_temporaries",
    "restore",
    "rng_states",
    "run",
    "save_checkpoint",
    "seed_everything",
    "set_rng_states",
    "setup",
    "share_initial_weights",
    "train_epochs",
    "train_one_epoch",
    "unwrap",
    "wrap_model",
]


def __getattr__(name: str):
    """``NonFiniteLoss`` (``course_lib.train``'s), importable from here as before, but imported
    only when asked for: ``course_lib.train`` brings matplotlib, which the workers never need."""
    if name == "NonFiniteLoss":
        from ..train import NonFiniteLoss

        return NonFiniteLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
