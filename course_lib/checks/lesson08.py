"""Checkers for the exercises of lesson 08 (the DDP training recipe).

``check_epoch_shards`` judges a learner's ``epoch_shard(n, rank, world_size, epoch, seed)``:
the indices a ``DistributedSampler`` with ``set_epoch`` gives this rank, in one process.

``check_exact_accuracy`` runs the learner's ``exact_accuracy(model, X, y)`` in real worker
processes (``course_lib.distributed.launch``) for several world sizes and evaluation-set sizes
that the world size does not divide. Every rank receives the whole set; the function must
evaluate only this rank's share, every example exactly once over all the ranks (no padding),
combine the counts with a collective, and return the accuracy of the whole set on every rank.
The oracle is one process counting the whole set. The model records which examples it saw, so
an answer that evaluates everything on every rank, or pads, is caught even when its number is
right. Worker processes import the function by module and name, so it must live in a file (in
the notebook: a cell starting with ``%%writefile my_eval.py``); pass it as a function or as the
string ``"my_eval:exact_accuracy"``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ._core import ExerciseResult, call_bounded, failure, unanswered, verdict
from ._launch import UNANSWERED, check_in_ranks, load_answer

__all__ = ["check_epoch_shards", "check_exact_accuracy"]

_NAME = "exact_accuracy"
_HINT = ("evaluate X[rank::world_size] (every example once, shards differ by at most one), "
         "all-reduce the integers (correct, count) and return correct / count.")
#: float32's precision: a float32 answer passes, every popular wrong one differs by far more
_TOL = 1e-6


# ------------------------------------------------------------------------------------------------
# the cases: a small classifier whose inputs carry their own index
# ------------------------------------------------------------------------------------------------

class _Recorder(nn.Module):
    """A linear classifier (4 features -> 3 classes) that notes which examples it saw.

    Column 0 of its input (B, 5) is the example's index in the evaluation set; columns 1-4 are
    the features.
    """

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4, 3)
        self.seen: list[int] = []

    def forward(self, X: torch.Tensor) -> torch.Tensor:    # (B, 5)
        self.seen.extend(X[:, 0].round().long().tolist())
        return self.linear(X[:, 1:])                         # (B, 3)


def _case(n: int, seed: int) -> tuple[_Recorder, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model, X (n, 5), y (n,), correct (n,) bool): the same on every rank."""
    model = _Recorder(seed)
    g = torch.Generator().manual_seed(seed + n)
    features = torch.randn(n, 4, generator=g)                            # (n, 4)
    X = torch.cat([torch.arange(n, dtype=torch.float32)[:, None], features], dim=1)  # (n, 5)
    y = torch.randint(0, 3, (n,), generator=g)                           # (n,)
    with torch.no_grad():
        correct = model.linear(features).argmax(dim=1) == y              # one process: oracle
    return model, X, y, correct


def _diagnose(got: float, correct: torch.Tensor, rank: int, world: int) -> str:
    """Name the popular wrong answer that ``got`` equals, if any."""
    n = len(correct)
    total = -(-n // world) * world                       # DistributedSampler's total_size
    padded = torch.cat([correct, correct[:total - n]])   # it repeats the first examples
    strided = [correct[r::world].double().mean().item() for r in range(world)]
    chunks = [c.double().mean().item() for c in torch.tensor_split(correct, world)]
    known = [
        (padded.sum().item() / total, f"the padded count: DistributedSampler repeats "
         f"{total - n} example(s) to reach total_size={total}, so they are counted twice"),
        (correct.sum().item() / total, f"divided by sampler.total_size={total} instead of the "
         f"{n} examples"),
        (sum(strided) / world, "the mean of the ranks' accuracies: the shards differ in size, "
         "so the mean weighs a small shard too much"),
        (sum(chunks) / world, "the mean of the ranks' accuracies: the shards differ in size, "
         "so the mean weighs a small shard too much"),
        (strided[rank], "this rank's own accuracy: the counts were not combined over the ranks"),
        (chunks[rank], "this rank's own accuracy: the counts were not combined over the ranks"),
        (float(correct.sum().item()), "the number of correct predictions, not a fraction"),
    ]
    for value, what in known:
        if abs(got - value) <= _TOL:
            return f" That is {what}."
    return ""


# ------------------------------------------------------------------------------------------------
# the worker (runs in every rank)
# ------------------------------------------------------------------------------------------------

def _run_cases(fn: Callable | tuple[str, str, str], sizes: tuple[int, ...], seed: int
               ) -> str | None:
    """Every size of ``sizes`` on this rank; the first failure as text, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    exact_accuracy, error = load_answer(fn)
    if error:
        return error
    for n in sizes:
        model, X, y, correct = _case(n, seed)
        want = correct.sum().item() / n
        where = f"world_size={world}, {n} examples, rank {rank}"
        try:
            got = exact_accuracy(model, X.clone(), y.clone())
            got = float(got.item() if isinstance(got, torch.Tensor) else got)
        except NotImplementedError:
            return UNANSWERED
        except Exception as e:
            return f"{where}: your function raised {type(e).__name__}: {' '.join(str(e).split())}"
        if abs(got - want) > _TOL:
            return (f"{where}: expected accuracy {want:.6f} ({int(correct.sum())}/{n} correct), "
                    f"received {got:.6f}.{_diagnose(got, correct, rank, world)}")
        seen: list[list[int]] = [[] for _ in range(world)]
        dist.all_gather_object(seen, model.seen)
        times = Counter(i for s in seen for i in s)
        twice = sorted(i for i, t in times.items() if t > 1)
        if twice or len(times) != n:
            missing = [i for i in range(n) if i not in times]
            how = (f"example(s) {twice[:5]} were evaluated more than once" if twice else
                   f"example(s) {missing[:5]} were never evaluated")
            return (f"{where}: the accuracy is right, but {how} ({sum(times.values())} "
                    f"evaluations over the ranks for {n} examples): each rank should evaluate "
                    f"only its own share.")
    return None


# ------------------------------------------------------------------------------------------------
# the checker
# ------------------------------------------------------------------------------------------------

def check_exact_accuracy(fn: Callable | str | None, *,
                         world_sizes: tuple[int, ...] = (2, 3, 4),
                         sizes: tuple[int, ...] = (10, 1001), timeout: float = 60.0,
                         strict: bool = False) -> ExerciseResult:
    """Exercise 08: ``fn(model, X, y)`` returns the exact accuracy of the whole set on every rank.

    For each world size, a process group of that many worker processes; each gets the same
    classifier and the same evaluation set (X (N, 5), y (N,), N in ``sizes``: not divisible by 3
    or 4, and 10 not by 4), calls ``fn(model, X, y)`` and compares the result with one process's
    accuracy on the whole set; then checks that the ranks together evaluated every example
    exactly once.

    Args:
        fn: the learner's function, importable by worker processes, or ``"module:function"``
            (imported in the workers from the current folder); None: not answered yet.
        world_sizes: numbers of processes to try.
        sizes: evaluation-set sizes to try.
        timeout: seconds for each world size (a function that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.

    Returns:
        The verdict (truthy when right); the first failing case is printed.
    """
    if fn is None:
        return verdict(_NAME, None, "write exact_accuracy(model, X, y) to a file and pass it "
                       "here.", strict)
    return check_in_ranks(
        _NAME, fn, "my_eval:exact_accuracy", _run_cases, (tuple(sizes), 8),
        world_sizes=world_sizes, timeout=timeout, hint=_HINT,
        hang_hint="Does every rank call the same collectives, in the same order?",
        passed=f"the exact accuracy on every rank, every example counted once, for world "
               f"sizes {list(world_sizes)} and {len(sizes)} set sizes {list(sizes)}.",
        strict=strict)


# ================================================================================================
# check_epoch_shards: every epoch a new permutation, the same on every rank
# ================================================================================================

_SHARDS_NAME = "epoch_shards"
_SHARDS_HINT = ("draw one permutation of range(n) from a generator seeded with seed + epoch "
                "(the same on every rank), pad it by repeating its first indices to a multiple "
                "of world_size, and take perm[rank::world_size]; or build a "
                "DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed), "
                "call set_epoch(epoch), and return list(sampler).")


def _shards_failure(fn: Callable, n: int, world: int, seed: int, epochs: int) -> str | None:
    """Every rank's shard of every epoch, as the learner's ``fn`` gives them; what is wrong."""
    per_epoch = []
    for epoch in range(epochs):
        shards = []
        for rank in range(world):
            where = f"n={n}, world_size={world}, epoch {epoch}, rank {rank}"
            try:
                got = call_bounded(fn, n, rank, world, epoch, seed)
                shard = [int(i) for i in got]
            except NotImplementedError:
                raise
            except Exception as e:
                return f"{where}: {failure(e)}"
            again = [int(i) for i in call_bounded(fn, n, rank, world, epoch, seed)]
            if again != shard:
                return (f"{where}: two calls with the same arguments gave different shards: the "
                        f"order must depend only on (seed, epoch), never on a global RNG.")
            shards.append(shard)
        where = f"n={n}, world_size={world}, epoch {epoch}"
        lengths = [len(s) for s in shards]
        want = -(-n // world)
        if len(set(lengths)) > 1 or lengths[0] != want:
            return (f"{where}: shard lengths {lengths}, expected {want} on every rank (pad by "
                    f"repeating the first indices: every rank must take the same number of "
                    f"steps, or one waits forever in an all-reduce).")
        seen = Counter(i for s in shards for i in s)
        missing = [i for i in range(n) if i not in seen]
        if missing or set(seen) - set(range(n)):
            twice = sorted(i for i, t in seen.items() if t > 1)
            return (f"{where}: example(s) {missing[:5]} in no shard, {twice[:5]} in several: "
                    f"the ranks did not split one common permutation (was it seeded with the "
                    f"rank? every rank must draw the same permutation and take its own part).")
        per_epoch.append(shards)
    for epoch in range(1, epochs):
        if per_epoch[epoch] == per_epoch[0]:
            return (f"n={n}, world_size={world}: epoch {epoch} gives exactly epoch 0's shards: "
                    f"the epoch is not in the seed (DistributedSampler: call "
                    f"set_epoch(epoch) at the start of every epoch).")
    other = [[int(i) for i in call_bounded(fn, n, r, world, 0, seed + 1)] for r in range(world)]
    if other == per_epoch[0]:
        return (f"n={n}, world_size={world}: seed {seed} and seed {seed + 1} give the same "
                f"shards: the seed is ignored.")
    if n >= 10 and all(s == sorted(s) for s in per_epoch[0]):
        return f"n={n}, world_size={world}, epoch 0: every shard is in increasing order: shuffle."
    return None


def check_epoch_shards(fn: Callable | None, *, sizes: tuple[int, ...] = (10, 11, 1001),
                       world_sizes: tuple[int, ...] = (2, 3, 4), epochs: int = 3,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 08: ``fn(n, rank, world_size, epoch, seed)`` returns this rank's indices.

    What a ``DistributedSampler`` with ``set_epoch`` gives: for each epoch, one permutation of
    ``range(n)`` shared by every rank (it depends on ``seed`` and ``epoch`` only), padded to a
    multiple of the world size, split so that every rank gets ``ceil(n / world_size)`` indices
    and every example is in some shard; a new permutation every epoch. Pure: run in this
    process, each call under a time limit.

    Args:
        fn: the learner's function; None: not answered yet.
        sizes: dataset sizes to try (10 and 11 are not divisible by 3 or 4).
        world_sizes: numbers of ranks to simulate.
        epochs: epochs per case.
        strict: raise ``AssertionError`` on a wrong answer.

    Returns:
        The verdict (truthy when right); the first failing case is printed.
    """
    if fn is None:
        return verdict(_SHARDS_NAME, None, "write epoch_shard(n, rank, world_size, epoch, seed) "
                       "and pass it here.", strict)
    if not callable(fn):
        return verdict(_SHARDS_NAME, False, f"expected a function, got {type(fn).__name__}.",
                       strict)
    for n in sizes:
        for world in world_sizes:
            try:
                problem = _shards_failure(fn, n, world, 5, epochs)
            except NotImplementedError:
                return unanswered(_SHARDS_NAME, strict)
            except Exception as e:  # a later call raised or hung
                problem = f"n={n}, world_size={world}: {failure(e)}"
            if problem is not None:
                return verdict(_SHARDS_NAME, False, f"{problem} Hint: {_SHARDS_HINT}", strict)
    return verdict(_SHARDS_NAME, True, f"one shared permutation per epoch, new each epoch, "
                   f"split into equal shards covering the data, for sizes {list(sizes)} and "
                   f"world sizes {list(world_sizes)}.", strict)
