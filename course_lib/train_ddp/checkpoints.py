"""Checkpoints of the recipe: atomic, durable, complete (every RNG state), loadable anywhere.

PyTorch counterpart: ``torch.save`` / ``torch.load(map_location=..., weights_only=True)`` and the
``state_dict`` of model, optimizer and scheduler; ``torch.distributed.checkpoint`` is the
sharded sequel. Read more:
https://pytorch.org/tutorials/beginner/saving_loading_models.html, torchrun's fault-tolerance
notes (https://pytorch.org/docs/stable/elastic/run.html) and notebook 09.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import tempfile

import torch
import torch.distributed as dist

from ..deploy import load_file
from ..distributed import DistInfo
from .model import unwrap
from .runtime import log, np

__all__ = ["CHECKPOINT_KEYS", "check_checkpoint_path", "checkpoint_state", "load_checkpoint",
           "remove_stale_temporaries", "restore", "rng_states", "save_checkpoint",
           "set_rng_states"]

#: What a checkpoint of this recipe holds (``checkpoint_state``).
CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "epoch", "sampler_epoch", "rng",
                   "world_size", "model_name")


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


def _temporaries(path: str) -> list[str]:
    """The temporary files ``save_checkpoint(..., path)`` writes before its rename."""
    folder, name = os.path.split(os.path.abspath(path))
    return sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp")))


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable: fsync the folder itself (POSIX; not on Windows)."""
    if os.name == "nt":  # pragma: no cover - a folder cannot be opened there
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: dict, path: str) -> None:
    """Write ``state`` to ``path`` atomically and durably.

    A temporary file in the same folder (``<name>.<random>.tmp``), fsynced, then ``os.replace``:
    within one file system the rename is atomic, so a reader (or a restarted run) sees the
    previous checkpoint or the new one, never half a file, even if this process dies mid-way.
    Then the folder is fsynced, so that the rename itself survives a power cut (a file's fsync
    does not cover its directory entry). A temporary left by a kill during the write is removed
    at the next start (``remove_stale_temporaries``).
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
    _fsync_folder(folder)  # the rename itself on disk


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporary files an interrupted ``save_checkpoint(..., path)`` left behind.

    Call it at the start of a run, on the one rank that writes checkpoints, before any save.
    Returns the paths removed.
    """
    removed = []
    for tmp in _temporaries(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
            removed.append(tmp)
    return removed


def check_checkpoint_path(path: str) -> None:
    """Raise ``ValueError`` now if a checkpoint could not be written at ``path`` later.

    Checked before training starts (not after the first epoch): ``path`` must not be a folder,
    its folder must exist or be creatable (no component of it a file), and a file must be
    creatable there (a probe file is written and removed).
    """
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"--checkpoint {path} is a folder; pass a file path such as "
                         f"{os.path.join(path, 'checkpoint.pt')}.")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write_probe_", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--checkpoint {path}: cannot write a file in {folder} "
                         f"({type(e).__name__}: {e.strerror or e}); pass a path in a folder "
                         f"you can write to.") from None


def load_checkpoint(path: str) -> dict:
    """A checkpoint's contents, on the CPU (``map_location``): restoring puts each tensor on
    its parameter's device, whatever device wrote it.

    A missing, empty or damaged file raises an error that says which (``FileNotFoundError``,
    ``ValueError``); a damaged file is never retried with ``weights_only=False``.
    """
    return load_file(path, map_location="cpu", what="--resume",
                     fix="pass the --checkpoint of an earlier run, or leave out --resume to "
                         "start afresh")


def _check_contents(state, path: str) -> None:
    """A training checkpoint of this recipe, or an error that says what the file holds."""
    if not isinstance(state, dict):
        raise ValueError(f"--resume: {path} holds a {type(state).__name__}, not a training "
                         f"checkpoint of course_lib.train_ddp; pass the --checkpoint of an "
                         f"earlier run.")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if not missing:
        return
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"--resume: {path} holds a plain state dict (model weights only, "
                         f"{len(state)} tensors), not a training checkpoint: there is no "
                         f"optimizer, schedule, epoch or RNG state to resume from. To start "
                         f"from these weights, pass --weights {path} without --resume.")
    raise ValueError(f"--resume: {path} is not a complete checkpoint of course_lib.train_ddp: "
                     f"it lacks {missing}; pass the --checkpoint of an earlier run, or leave "
                     f"out --resume to start afresh.")


def restore(state: dict, model, optimizer, scheduler, args: argparse.Namespace,
            info: DistInfo) -> int:
    """Put a checkpoint back (weights, optimizer, schedule, RNGs); returns its epoch."""
    _check_contents(state, args.checkpoint)
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
