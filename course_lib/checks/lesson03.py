"""Checkers for the exercises of lesson 03 (scatter and split_batch)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._core import (
    ExerciseResult,
    call_bounded,
    call_or_failure,
    call_or_verdict,
    check_answer,
    failure,
    unanswered,
    verdict,
)

__all__ = ["check_balanced_sizes", "check_devices_used", "check_scatter", "check_split_batch"]


def _int_sizes(fn: Callable, B: int, n: int) -> list[int]:
    return [int(s) for s in fn(B, n)]


def check_balanced_sizes(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 03: ``fn(B, n)`` gives n shard sizes summing to B, each B // n or B // n + 1."""
    name = "balanced_sizes"
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for B, n in [(5, 4), (9, 8), (17, 8), (256, 3), (7, 7), (8, 1), (250, 4)]:
        sizes, failed = call_or_verdict(name, strict, _int_sizes, fn, B, n,
                                        after=f" on B={B}, n={n}.")
        if failed is not None:
            return failed
        if not (len(sizes) == n and sum(sizes) == B and set(sizes) <= {B // n, B // n + 1}):
            return verdict(name, False, f"balanced_sizes({B}, {n}) = {sizes}: expected {n} "
                           f"sizes, each {B // n} or {B // n + 1}, summing to {B}.", strict)
    return verdict(name, True, "every device gets B // n or B // n + 1 examples, on 7 inputs.",
                   strict)


def check_devices_used(B: int, n: int, answer: int | None, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 03: how many of n devices get work when ``comm.scatter`` splits a batch of B."""
    from ..parallel.comm import scatter

    used = len(scatter(torch.zeros(B), [torch.device("cpu")] * n))
    return check_answer(f"B={B} over {n} devices", answer, used,
                        hint="every chunk but the last holds ceil(B / n) examples (the size "
                        "rule); count how many chunks the batch fills.", strict=strict)


# ---- the learner's scatter and split_batch ---------------------------------------------------

#: (B, n) pairs tried: sizes that n does not divide, more devices than two, fewer examples than
#: devices (for scatter only), one device. Not 9 or 17 over 8: the notebook's last exercise asks
#: how many devices those use, and a failure message prints the expected sizes.
_SCATTER_CASES = [(10, 4), (5, 4), (7, 3), (256, 3), (13, 8), (6, 6), (4, 1), (3, 5), (1, 2)]
_SPLIT_CASES = [(B, n) for B, n in _SCATTER_CASES if B >= n]


def _sizes_problem(sizes: list[int], B: int, n: int, balanced: bool) -> str | None:
    """What is wrong with these chunk sizes of a batch of B over n devices, or None."""
    if len(sizes) > n:
        return f"{len(sizes)} chunks for {n} devices"
    padded = sizes + [0] * (n - len(sizes))               # a missing chunk is an empty one
    if balanced and not set(padded) <= {B // n, B // n + 1}:
        return (f"chunk sizes {sizes}: expected {n} chunks of {B // n} or {B // n + 1} "
                f"examples, so that every device gets work")
    return None


def _chunks_problem(chunks, whole: torch.Tensor, devs: list[torch.device]) -> str | None:
    """Unless ``chunks`` put together along dim 0 are ``whole`` (each example once, in order)
    with chunk i on ``devs[i]``: what is wrong."""
    if not isinstance(chunks, (list, tuple)) or not all(isinstance(c, torch.Tensor)
                                                        for c in chunks):
        return f"expected a list of tensors, received {type(chunks).__name__}"
    for i, c in enumerate(chunks):
        if i < len(devs) and c.device != devs[i]:
            return f"chunk {i} is on {c.device}, expected on {devs[i]}"
        if c.dim() != whole.dim() or c.shape[1:] != whole.shape[1:]:
            return (f"chunk {i} has shape {tuple(c.shape)} where the batch is "
                    f"{tuple(whole.shape)}; split along dim 0 (the examples) only")
    got = torch.cat([c.cpu() for c in chunks]) if chunks else whole[:0]
    if not torch.equal(got, whole.cpu()):
        return _examples_problem(_first_example(got).long().tolist(), whole.shape[0])
    return None


def _mixed_devices(n: int) -> list[torch.device]:
    """n devices alternating 'meta' (shapes, no data: free to move to) and 'cpu': a shard on the
    wrong device shows without GPUs, where ``devices(n)`` would name the CPU n times."""
    return [torch.device("meta" if i % 2 == 0 else "cpu") for i in range(n)]


def _placement_problem(what: str, chunks, devs: list[torch.device]) -> str | None:
    """Unless chunk i of ``chunks`` is on ``devs[i]`` (at most one chunk per device): what is
    wrong. Looks at devices only, never at values (a 'meta' tensor has none)."""
    if not isinstance(chunks, (list, tuple)) or not all(isinstance(c, torch.Tensor)
                                                        for c in chunks):
        return f"expected a list of tensors for {what}, received {type(chunks).__name__}"
    if len(chunks) > len(devs):
        return f"{len(chunks)} {what} for {len(devs)} devices"
    for i, c in enumerate(chunks):
        if c.device != devs[i]:
            names = "[" + ", ".join(d.type for d in devs) + "]"
            return (f"with devices {names}, {what} {i} is on {c.device}, expected on "
                    f"devices[{i}] = {devs[i]}. The checker mixes 'cpu' and 'meta' (a device "
                    "with shapes but no data) so that a misplaced shard shows without GPUs: "
                    "move each one with .to(devices[i])")
    return None


def _examples_problem(ids: list[int], B: int) -> str:
    """What is wrong with the example numbers ``ids`` found in the chunks of a batch of B."""
    missing = sorted(set(range(B)) - set(ids))
    twice = sorted({j for j in ids if ids.count(j) > 1})
    if missing:
        return (f"example(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} are in no chunk "
                f"(every one of the {B} examples must go to some device, the short last chunk "
                "too)")
    if twice:
        return f"example(s) {twice[:8]} are in more than one chunk"
    return "the chunks put together hold every example once, but not in order"


def _example_batch(B: int, n: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.device]]:
    """X (B, 2, 3) whose example j starts with the number j, labels 100 + j, and n devices."""
    from ..devices import devices

    X = torch.arange(B * 6.0).reshape(B, 2, 3) / 6                       # X[j, 0, 0] == j
    return X, torch.arange(B) + 100, devices(n, warn=False)


def _first_example(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)[:, 0] if t.dim() > 1 else t


def check_scatter(fn: Callable | None, *, balanced: bool = False,
                  strict: bool = False) -> ExerciseResult:
    """Exercise 03: ``fn(tensor, devices)`` splits ``tensor`` along dim 0, chunk i on
    ``devices[i]``.

    The chunks put together must be the tensor: every example once, in order; at most one chunk
    per device. With ``balanced=True`` every one of the n devices must also get ``B // n`` or
    ``B // n + 1`` examples (``torch.chunk``'s sizes leave devices idle and fail). Tried on
    batches of 1 to 256 examples over 1 to 8 devices, fewer examples than devices included,
    each batch twice: on ``devices(n)`` for the values, then on a list alternating 'meta' and
    'cpu' for where each chunk lands (on a CPU-only machine ``devices(n)`` is n times the CPU).
    """
    name = getattr(fn, "__name__", "scatter")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for B, n in _SCATTER_CASES:
        X, _, devs = _example_batch(B, n)
        chunks, failed = call_or_verdict(name, strict, fn, X, devs,
                                         after=f" on a batch of {B} over {n} devices.")
        if failed is not None:
            return failed
        problem = (_chunks_problem(chunks, X, devs)
                   or _sizes_problem([c.shape[0] for c in chunks], B, n, balanced))
        if problem is None:                  # again, on devices the CPU-only list cannot tell
            chunks, error = call_or_failure(fn, X, _mixed_devices(n))
            problem = (_placement_problem("chunk", chunks, _mixed_devices(n)) if error is None
                       else f"{error} with devices alternating 'meta' and 'cpu' (move each "
                       "chunk with .to(devices[i]))")
        if problem is not None:
            return verdict(name, False, f"a batch of {B} over {n} devices: {problem}.", strict)
    kind = "balanced chunks" if balanced else "every example once, in order"
    return verdict(name, True, f"{kind}, each on its device, on {len(_SCATTER_CASES)} "
                   "batches.", strict)


#: How ``check_split_batch`` wants the batch cut: "chunk" as ``torch.chunk`` (the chunks of
#: ``nn.parallel.scatter``: ceil(B / n) examples each, fewer chunks than devices when the batch
#: runs out), "balanced" B // n or B // n + 1 on every device.
_SPLITS = ("chunk", "balanced")


def check_split_batch(fn: Callable | None, *, sizes: str = "balanced",
                      strict: bool = False) -> ExerciseResult:
    """Exercise 03: ``fn(X, y, devices)`` returns ``(X_shards, y_shards)``, shard i on
    ``devices[i]``, each example with its own label, every example once and in order.

    ``sizes="chunk"`` (the lesson's first exercise, ``split_batch``): the shards of ``torch.chunk``
    along dim 0, which ``nn.parallel.scatter`` makes on GPUs (the oracle). ``sizes="balanced"``
    (the later ``balanced_split_batch``): each of the n devices gets ``B // n`` or
    ``B // n + 1`` examples. Batches of B >= n examples (1 to 256) over 1 to 8 devices, sizes
    n does not divide and splits that leave devices idle included; each batch is split twice,
    as ``check_scatter`` does. Names the usual mistakes: a short last shard dropped, a split
    along another dim, labels cut differently from the images, a shard on the wrong device,
    ``nn.parallel.scatter`` on a CPU.
    """
    if sizes not in _SPLITS:
        raise ValueError(f"check_split_batch: sizes must be one of {_SPLITS}, got {sizes!r}.")
    name = getattr(fn, "__name__", "split_batch")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for B, n in _SPLIT_CASES:
        X, y, devs = _example_batch(B, n)
        where = f"a batch of {B} over {n} devices"
        try:
            X_shards, y_shards = call_bounded(fn, X, y, devs)
        except KeyboardInterrupt:
            raise
        except NotImplementedError:
            return unanswered(name, strict)
        except BaseException as exc:  # noqa: B036 - a verdict, never a crash
            return verdict(name, False, f"{where}: {failure(exc)} (expected (X_shards, "
                           f"y_shards)).{_scatter_hint(exc)}", strict)
        problem = (_shards_problem(X_shards, y_shards, X, y, devs, sizes)
                   or _split_placement_problem(fn, X, y, n))  # the CPU-only list cannot tell
        if problem is not None:
            return verdict(name, False, f"{where}: {problem}.", strict)
    kind = "balanced shards" if sizes == "balanced" else "torch.chunk's shards"
    return verdict(name, True, f"{kind}, each example with its label, shard i on devices[i] "
                   f"(a list mixing 'cpu' and 'meta' too), on {len(_SPLIT_CASES)} batches.",
                   strict)


def _shards_problem(X_shards, y_shards, X: torch.Tensor, y: torch.Tensor,
                    devs: list[torch.device], sizes: str) -> str | None:
    """What is wrong with ``split_batch``'s shards of (X, y) over ``devs``, or None."""
    if (isinstance(X_shards, (list, tuple)) and X_shards
            and all(isinstance(c, torch.Tensor) and c.dim() == 1 for c in X_shards)
            and not _chunks_problem(X_shards, y, devs)):
        return "returned (y_shards, X_shards): return the images' shards first"
    problem = _chunks_problem(X_shards, X, devs) or _chunks_problem(y_shards, y, devs)
    if problem is not None:
        return problem
    if len(X_shards) != len(y_shards):
        return f"{len(X_shards)} X shards but {len(y_shards)} y shards"
    for i, (Xi, yi) in enumerate(zip(X_shards, y_shards)):
        if Xi.shape[0] != yi.shape[0] or not torch.equal(
                _first_example(Xi).cpu().long() + 100, yi.cpu()):
            return (f"shard {i} holds examples {_first_example(Xi).long().tolist()} but labels "
                    f"{(yi.cpu() - 100).tolist()} (as example numbers): split X and y with the "
                    "same sizes")
    got, B, n = [c.shape[0] for c in X_shards], X.shape[0], len(devs)
    if sizes == "balanced":
        return _sizes_problem(got, B, n, balanced=True)
    want = [c.shape[0] for c in torch.chunk(torch.empty(B), n)]  # the oracle
    if got != want:
        return (f"shard sizes {got}: expected {want}, the sizes nn.parallel.scatter makes "
                "(ceil(B / n) examples each until the batch runs out, no empty shards)")
    return None


def _split_placement_problem(fn: Callable, X: torch.Tensor, y: torch.Tensor,
                             n: int) -> str | None:
    """``fn(X, y, devs)`` with devs alternating 'meta' and 'cpu': unless shard i of the images
    and of the labels is on ``devs[i]``, what is wrong."""
    devs = _mixed_devices(n)
    try:
        X_shards, y_shards = call_bounded(fn, X, y, devs)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: B036 - a verdict, never a crash
        return (f"{failure(exc)} with devices alternating 'meta' and 'cpu' (shard i must go "
                f"to devices[i] with .to(devices[i])).{_scatter_hint(exc)}")
    return (_placement_problem("X shard", X_shards, devs)
            or _placement_problem("y shard", y_shards, devs))


def _scatter_hint(exc: BaseException) -> str:
    """What to do when the learner called ``nn.parallel.scatter``, which refuses the CPU."""
    if "non cpu device" not in str(exc):
        return ""
    return (" nn.parallel.scatter accepts GPUs only: cut the tensors yourself, with a split that "
            "works on any device, and move each shard to its device.")
