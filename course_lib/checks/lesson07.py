"""Checkers for the exercises of lesson 07 (DDP from scratch).

``check_average_gradients`` runs the learner's ``average_gradients(model)`` in real worker
processes (``course_lib.distributed.launch``) for several world sizes, and compares every
parameter's ``.grad`` with the oracle: one process computing the gradient of the whole global
batch. Worker processes import the function by module and name, so it must live in a file (in
the notebook: a cell starting with ``%%writefile my_ddp.py``); pass it as a function or as the
string ``"my_ddp:average_gradients"`` (imported fresh in the workers from the current folder, so
an edited file is picked up without restarting the kernel).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._core import ExerciseResult, first_failure_in_ranks, resolve, verdict, worker_spec

__all__ = ["check_average_gradients"]

_NAME = "average_gradients"
_HINT = ("all-reduce (sum) every parameter's .grad in place, then divide it by "
         "dist.get_world_size(); skip parameters whose .grad is None.")


# ------------------------------------------------------------------------------------------------
# the cases: small models whose parameter sizes do not divide by the world size
# ------------------------------------------------------------------------------------------------

class _MLP(nn.Module):
    """Linear 7 -> 5 -> 3: 35, 5, 15 and 3 elements."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 5), nn.Linear(5, 3)

    def forward(self, X):                        # (B, 7)
        return self.fc2(torch.tanh(self.fc1(X)))  # (B, 3)


class _Conv(nn.Module):
    """Conv 1 -> 3 channels 3x3 on 5x5 images, then linear 27 -> 3."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(27, 3)

    def forward(self, X):                                      # (B, 1, 5, 5)
        return self.fc(torch.relu(self.conv(X)).flatten(1))   # (B, 3, 3, 3) -> (B, 3)


def _frozen() -> nn.Module:
    """The MLP with its first layer frozen: fc1's .grad stays None."""
    net = _MLP()
    net.fc1.requires_grad_(False)
    return net


#: case name -> (model builder, shape of one example)
_MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_MLP, (7,)),
    "conv": (_Conv, (1, 5, 5)),
    "frozen fc1": (_frozen, (7,)),
}


# ------------------------------------------------------------------------------------------------
# the worker (runs in every rank)
# ------------------------------------------------------------------------------------------------

def _short(t: torch.Tensor | None) -> str:
    """A tensor in a few characters: its first values and its shape."""
    if t is None:
        return "None"
    values = ", ".join(f"{v:.4g}" for v in t.flatten()[:3].tolist())
    more = ", ..." if t.numel() > 3 else ""
    return f"[{values}{more}] of shape {tuple(t.shape)}"


def _diagnose(got: torch.Tensor, want: torch.Tensor, local: torch.Tensor, world: int) -> str:
    """What a wrong gradient looks like: the sum, the local gradient, or something else."""
    if torch.allclose(got, want * world, rtol=1e-4, atol=1e-6):
        return f" It is {world} times too large: the sum, not the average."
    if torch.allclose(got, local, rtol=1e-6, atol=1e-8):
        return (" It is this rank's own gradient, unchanged: was the result written back into "
                "p.grad (in place), and was it the gradient, not the parameter, that you "
                "averaged?")
    return ""


def _run_cases(fn: Callable | tuple[str, str, str], per_rank: int, seed: int) -> str | None:
    """Every model of ``_MODELS`` on this rank's shard; the first failure as text, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        average_gradients = resolve(fn)
    except Exception as e:  # the file is missing, or does not define the function
        return (f"could not import your function in the workers: {type(e).__name__}: {e} "
                "(did the %%writefile cell run?)")
    for case, (build, shape) in _MODELS.items():
        torch.manual_seed(seed)                    # the same initial weights on every rank
        net = build()
        oracle = copy.deepcopy(net)
        g = torch.Generator().manual_seed(seed + 1)
        X = torch.randn(world * per_rank, *shape, generator=g)        # (world * per_rank, ...)
        y = torch.randint(0, 3, (world * per_rank,), generator=g)     # the global batch
        F.cross_entropy(oracle(X), y).backward()   # one process, whole batch: the answer
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        F.cross_entropy(net(X[mine]), y[mine]).backward()             # this rank's shard
        local = {name: None if p.grad is None else p.grad.clone()
                 for name, p in net.named_parameters()}
        where = f"world_size={world}, model {case!r}, rank {rank}"
        try:
            average_gradients(net)
        except Exception as e:
            return f"{where}: your function raised {type(e).__name__}: {' '.join(str(e).split())}"
        for (name, p), q in zip(net.named_parameters(), oracle.parameters()):
            got, want = p.grad, q.grad
            if want is None or got is None:
                if got is not want:
                    return (f"{where}, parameter {name}: expected .grad {_short(want)}, "
                            f"received {_short(got)}.")
                continue
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                hint = _diagnose(got, want, local[name], world) if got.shape == want.shape else ""
                return (f"{where}, parameter {name}: expected .grad {_short(want)}, received "
                        f"{_short(got)}.{hint}")
    return None


# ------------------------------------------------------------------------------------------------
# the checker
# ------------------------------------------------------------------------------------------------

def check_average_gradients(fn: Callable | str | None, *,
                            world_sizes: tuple[int, ...] = (2, 3, 4), per_rank: int = 3,
                            timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise 07: ``fn(model)`` averages every ``p.grad`` over the ranks, in place.

    For each world size, ``launch`` starts that many processes; each builds the same small
    model (an MLP, a conv net, an MLP with a frozen layer: parameter sizes 35, 5, 15, 3, 27, ...
    that no world size divides), computes the gradient of its own shard of a global batch, calls
    ``fn(model)``, and compares every ``.grad`` with the gradient one process gets on the whole
    batch (frozen parameters must keep ``.grad`` None).

    Args:
        fn: the learner's function, importable by worker processes, or ``"module:function"``
            (imported in the workers from the current folder); None: not answered yet.
        world_sizes: numbers of processes to try.
        per_rank: examples per rank.
        timeout: seconds for each launch (a function that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.

    Returns:
        The verdict (truthy when right); the first failing case is printed.
    """
    if fn is None:
        return verdict(_NAME, None, "write average_gradients(model) to a file and pass it "
                       "here.", strict)
    spec = worker_spec(fn, "my_ddp:average_gradients")
    if isinstance(spec, str):
        return verdict(_NAME, False, spec, strict)
    failure = first_failure_in_ranks(
        _run_cases, spec, world_sizes, (per_rank, 7), timeout=timeout, hint=_HINT,
        hang_hint="Does every rank call all_reduce on the same tensors, in the same order?")
    if failure is not None:
        return verdict(_NAME, False, failure, strict)
    return verdict(_NAME, True, f"every .grad equals the whole-batch gradient for world sizes "
                   f"{list(world_sizes)} and {len(_MODELS)} models.", strict)
