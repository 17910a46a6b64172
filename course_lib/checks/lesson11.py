"""Checkers for the exercises of lesson 11 (sharded data parallelism), run in real worker
processes against one unsharded process.

Worker processes import the class by module and name, so it must live in a file (in the
notebook: ``%%writefile my_zero.py``); pass it as a class or as ``"my_zero:ZeRO1"``; None is
"not answered yet". ``steps``: optimizer or training steps; ``timeout``: seconds for each world
size (a class that hangs fails, it does not hang); ``strict``: raise ``AssertionError`` on a
wrong answer.
"""
from __future__ import annotations

import copy
import gc
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._core import ExerciseResult
from ._zero_cases import MODELS as _ZERO_MODELS
from .harness import UNANSWERED, StopRank, call_answer, check_in_ranks, describe, load_answer

__all__ = ["check_fsdp", "check_zero"]


# ---- ZeRO-1 --------------------------------------------------------------------------------------

_OPTIMIZERS = {"AdamW(lr=0.01, weight_decay=0.1)": (torch.optim.AdamW,
                                                    dict(lr=0.01, weight_decay=0.1)),
               "SGD(lr=0.05, momentum=0.9)": (torch.optim.SGD, dict(lr=0.05, momentum=0.9))}
_ZERO_HINT = ("assign each parameter to one rank (largest first, to the rank with the fewest "
              "elements so far), build optimizer_class over this rank's parameters only "
              "(self.optim), and after self.optim.step() broadcast every parameter from its "
              "owner, in the same order on every rank.")


def _zero_cases(spec, steps: int, seed: int) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, error = load_answer(spec, "class")
    if error:
        return error
    for model, build in _ZERO_MODELS.items():
        for opt_name, (opt_cls, options) in _OPTIMIZERS.items():
            where = f"world_size={world}, model {model!r}, {opt_name}, rank {rank}"
            torch.manual_seed(seed)
            net = build()
            ref = copy.deepcopy(net)
            try:
                zero = call_answer("your constructor", cls, net.parameters(), opt_cls, **options)
            except StopRank as e:
                return f"{where}: {e}"
            oracle = opt_cls(ref.parameters(), **options)
            g = torch.Generator().manual_seed(seed + 1)
            for step in range(steps):
                X, y = torch.randn(12, 7, generator=g), torch.randint(0, 3, (12,), generator=g)
                oracle.zero_grad()
                F.cross_entropy(ref(X), y).backward()
                oracle.step()
                old = [p.detach().clone() for p in net.parameters()]
                try:  # every rank gets the same (whole-batch) gradient: only the optimizer varies
                    zero.zero_grad()
                    F.cross_entropy(net(X), y).backward()
                    zero.step()
                except NotImplementedError:
                    return UNANSWERED
                except Exception as e:
                    return f"{where}, step {step}: your optimizer raised {type(e).__name__}: {e}"
                mine = torch.cat([p.detach().flatten() for p in net.parameters()])
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                agree = all(torch.equal(everyone[0], t) for t in everyone)
                for (name, p), q, p0 in zip(net.named_parameters(), ref.parameters(), old):
                    if not torch.allclose(p, q, rtol=1e-6, atol=1e-7):
                        why = (" It did not change on this rank, or the ranks no longer agree: "
                               "did each owner broadcast its updated parameters to every rank?"
                               if torch.equal(p, p0) or not agree else "")
                        return (f"{where}, after step {step}: parameter {name} is "
                                f"{describe(p)}, the unsharded optimizer gives {describe(q)}.{why}")
            # the state: each rank holds its own shard's only, the shards balanced by size
            local = getattr(zero, "optim", None)
            if not isinstance(local, torch.optim.Optimizer):
                return (f"{where}: expected your class to keep this rank's optimizer as "
                        f"self.optim (a torch.optim.Optimizer), found {type(local).__name__}.")
            ids = {id(p): i for i, p in enumerate(net.parameters())}
            held = sorted(ids[id(p)] for p in local.state if id(p) in ids)
            everyone = [None] * world
            dist.all_gather_object(everyone, held)
            trainable = [i for i, p in enumerate(net.parameters()) if p.requires_grad]
            if sorted(i for h in everyone for i in h) != trainable:
                full = [r for r, h in enumerate(everyone) if h == trainable]
                if full:
                    return (f"{where}: rank {full[0]} keeps optimizer state for every "
                            "parameter: each rank should step only the parameters it owns.")
                return (f"{where}: optimizer states over the ranks cover parameters "
                        f"{everyone}, expected each of {trainable} exactly once.")
            sizes = [sum(p.numel() for p in net.parameters() if ids[id(p)] in h)
                     for h in everyone]
            largest = max(p.numel() for p in net.parameters() if p.requires_grad)
            if max(sizes) - min(sizes) > largest:
                return (f"{where}: the ranks own {sizes} trainable elements: balance the shards "
                        f"by size (a difference of at most the largest parameter, {largest}).")
    return None


def check_zero(cls: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3, 4),
               steps: int = 3, timeout: float = 120.0, strict: bool = False) -> ExerciseResult:
    """Exercise 11.1: ``cls(params, optimizer_class, **defaults)``, a ZeRO-1 optimizer.

    For each world size, a process group of that many worker processes; each builds the same
    small model (an MLP, one with tied weights, one with a frozen layer), gives your optimizer
    and the unsharded one the same gradients for ``steps`` steps (AdamW with weight decay, SGD
    with momentum), and compares every parameter after every step. Then: your ``self.optim`` (the
    local optimizer) must hold state for this rank's parameters only, every trainable parameter
    on exactly one rank, the ranks' shares of elements balanced.
    """
    return check_in_ranks(
        "ZeRO1", cls, "my_zero:ZeRO1", _zero_cases, (steps, 3), world_sizes=world_sizes,
        timeout=timeout, hint=_ZERO_HINT,
        hang_hint="Does every rank make the same broadcasts, in the same order?",
        passed=f"equal to the unsharded optimizer for world sizes {list(world_sizes)}, "
               f"{len(_ZERO_MODELS)} models and {len(_OPTIMIZERS)} optimizers; each rank steps "
               f"only its shard.",
        missing="write your class to a file and pass it here.", strict=strict)


# ---- a simplified FSDP unit ----------------------------------------------------------------------

_FSDP_HINT = ("flatten [weight, bias] into one vector, pad it with zeros to a multiple of the "
              "world size, keep slice rank of the padded vector as self.shard; in forward "
              "all-gather, compute, and save only X and the shard for backward; in backward "
              "all-gather again, then reduce-scatter the flat gradient and divide by the world "
              "size.")
# 204 and 65 elements: 2, 3 and 4 all divide 204 (no padding) and none of them divides 65 (its
# flat vector is padded with zeros, the last rank's shard ending in them, at every world size)
_SIZES = [(16, 12), (12, 5)]


def _shard_of(linear: nn.Linear, world: int, rank: int, grad: bool = False) -> torch.Tensor:
    """Slice ``rank`` of [weight.flatten(), bias] (or their .grad) padded with zeros, a copy."""
    w, b = (linear.weight.grad, linear.bias.grad) if grad else (linear.weight, linear.bias)
    flat = torch.cat([w.detach().flatten(), b.detach()])  # (n,): n = out * in + out
    size = math.ceil(len(flat) / world)
    padded = torch.cat([flat, torch.zeros(size * world - len(flat))])
    return padded[rank * size:(rank + 1) * size].clone()


def _kept_since(before: set[int], sizes: set[int]) -> list[int]:
    """Sizes of the tensors made since ``before`` (their ids) and still alive, of a full
    weight's size. gloo's worker thread may hold a collective's output a moment after the
    collective returned: only a tensor still alive after a second (five looks) counts."""
    for _ in range(5):
        gc.collect()
        kept = [t.numel() for t in gc.get_objects() if issubclass(type(t), torch.Tensor)
                and id(t) not in before and t.numel() in sizes
                and t.untyped_storage().nbytes() > 0]
        if not kept:
            return []
        time.sleep(0.25)
    return kept


def _fsdp_cases(spec, steps: int, seed: int) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, error = load_answer(spec, "class")
    if error:
        return error
    where = f"world_size={world}, rank {rank}"
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in _SIZES]
    ref = nn.Sequential(layers[0], nn.Tanh(), layers[1])
    try:
        units = [call_answer("your constructor", cls, copy.deepcopy(layer)) for layer in layers]
    except StopRank as e:
        return f"{where}: {e}"
    ref = copy.deepcopy(ref)
    del layers
    net = nn.Sequential(units[0], nn.Tanh(), units[1])
    for unit, (a, b), layer in zip(units, _SIZES, (ref[0], ref[2])):
        n = a * b + b
        size = math.ceil(n / world)
        shard = getattr(unit, "shard", None)
        if not isinstance(shard, nn.Parameter) or shard.dim() != 1:
            return f"{where}: expected self.shard, a 1-D nn.Parameter, found {type(shard)}."
        if shard.numel() != size:
            return (f"{where}: Linear({a}, {b}) has {n} elements; each rank's shard should "
                    f"have ceil({n}/{world}) = {size} (the padded vector split evenly), yours "
                    f"has {shard.numel()}.")
        if not torch.equal(shard.detach(), _shard_of(layer, world, rank)):
            return (f"{where}: the shard of Linear({a}, {b}) should be elements "
                    f"{rank * size}:{(rank + 1) * size} of [weight.flatten(), bias] padded "
                    f"with zeros; it is {describe(shard)}.")
    sizes = {a * b + b for a, b in _SIZES} | {a * b for a, b in _SIZES}
    sizes |= {math.ceil(n / world) * world for n in sizes}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    per_rank = 3
    for step in range(steps):
        X = torch.randn(world * per_rank, 16, generator=g)
        y = torch.randint(0, 5, (world * per_rank,), generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        ref_opt.zero_grad()
        F.cross_entropy(ref(X), y).backward()
        opt.zero_grad()
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        gc.collect()
        before = {id(t) for t in gc.get_objects() if issubclass(type(t), torch.Tensor)}
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = F.cross_entropy(net(X[mine]), y[mine])
            kept = _kept_since(before, sizes)
            if any(n in sizes for n in saved) or kept:
                return (f"{where}: between forward and backward a full weight "
                        f"({sorted(set(kept) | (set(saved) & sizes))} elements) is still "
                        "held: FSDP frees the gathered parameters after forward and gathers "
                        "them again in backward (save X and the shard, not W).")
            loss.backward()
        except NotImplementedError:
            return UNANSWERED
        except Exception as e:
            return f"{where}, step {step}: forward or backward raised {type(e).__name__}: {e}"
        for unit, layer, (a, b) in zip(units, (ref[0], ref[2]), _SIZES):
            want = _shard_of(layer, world, rank, grad=True)
            got = unit.shard.grad
            if got is None or got.shape != want.shape:
                return (f"{where}, step {step}: the shard of Linear({a}, {b}) has .grad "
                        f"{None if got is None else tuple(got.shape)}, expected {len(want)} "
                        "elements.")
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                why = (f" It is {world} times too large: the sum, not the average."
                       if torch.allclose(got, want * world, rtol=1e-4, atol=1e-6) else "")
                return (f"{where}, step {step}: the gradient of Linear({a}, {b})'s shard is "
                        f"{describe(got)}, the whole-batch gradient gives {describe(want)}.{why}")
        opt.step()
        ref_opt.step()
    return None


def check_fsdp(cls: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3, 4),
               steps: int = 2, timeout: float = 120.0, strict: bool = False) -> ExerciseResult:
    """Exercise 11.2: ``cls(linear)``, one Linear layer as a simplified FSDP unit.

    For each world size, a process group of that many worker processes; each wraps
    Linear(16, 12) and Linear(12, 5) in your class (n = 204 and 65 elements: 2, 3 and 4 all
    divide 204, so it needs no padding, and none of them divides 65, so its last rank's shard
    ends in zeros), checks each ``self.shard`` (a 1-D ``nn.Parameter`` of
    ``ceil(n / world_size)`` elements: rank's slice of ``[weight.flatten(), bias]`` padded with
    zeros), trains ``steps`` SGD steps with each rank on its slice of the batch, and compares
    with one process on the whole batch: each shard's ``.grad`` must be the slice of the
    whole-batch gradient (the average over ranks). Between forward and backward, no full weight
    may stay alive (gathered, used, freed).
    """
    return check_in_ranks(
        "ShardedLinear", cls, "my_fsdp:ShardedLinear", _fsdp_cases, (steps, 5),
        world_sizes=world_sizes, timeout=timeout, hint=_FSDP_HINT,
        hang_hint="Does every rank make the same collectives (all-gather in forward and in "
                  "backward, reduce-scatter in backward)?",
        passed=f"shards, averaged gradients and {steps} training steps equal one process on "
               f"the whole batch for world sizes {list(world_sizes)}; the full weights are freed "
               "between forward and backward.",
        missing="write your class to a file and pass it here.", strict=strict)
