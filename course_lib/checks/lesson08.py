"""Checkers for the exercises of lesson 08 (the DDP training recipe).

Worker processes import the learner's function by module and name, so it must live in a file
(in the notebook: a cell starting with ``%%writefile my_eval.py``); pass it as a function or as
``"my_eval:exact_accuracy"``; None is "not answered yet". ``timeout``: seconds for each world
size (a function that hangs fails, it does not hang); ``strict``: raise ``AssertionError`` on a
wrong answer. Each checker returns the verdict (truthy when right) and prints the first failing
case.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
from collections import Counter
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from ..distributed.launch import find_free_port
from ._core import ExerciseResult, call_bounded, failure
from .harness import UNANSWERED, agree, check_cases, check_in_ranks, load_answer

__all__ = ["check_epoch_shards", "check_exact_accuracy", "check_recipe_entry"]

#: the idea, not the code (the method is the course's version, shown after the exercise)
_HINT = ("give each rank its own share of the examples, the shares together holding every "
         "example exactly once (the world size need not divide N); each rank counts how many "
         "it got right and how many it evaluated, and one collective adds those counts up "
         "over the ranks: integers add up exactly, and every rank ends with the same totals.")
#: float32's precision: a float32 answer passes, every popular wrong one differs by far more
_TOL = 1e-6


# ---- the cases: a small classifier whose inputs carry their own index ----------------------------

class _Recorder(nn.Module):
    """A linear classifier (4 features -> 3 classes; column 0 of its input (B, 5) is the
    example's index) that notes the examples it saw and counts its forwards in train mode."""

    def __init__(self, seed: int, dropout: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5) if dropout else nn.Identity()
        self.seen: list[int] = []
        self.train_mode_calls = 0

    def forward(self, X: torch.Tensor) -> torch.Tensor:    # (B, 5)
        self.seen.extend(X[:, 0].round().long().tolist())
        self.train_mode_calls += int(self.training)
        return self.linear(self.drop(X[:, 1:]))              # (B, 3)


def _case(n: int, seed: int, dropout: bool = False
          ) -> tuple[_Recorder, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model in train mode, X (n, 5), y (n,), correct (n,): what eval mode predicts right)."""
    model = _Recorder(seed, dropout)
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
    mean = ("the mean of the ranks' accuracies: the shards differ in size, so the mean weighs a "
            "small shard too much")
    own = "this rank's own accuracy: the counts were not combined over the ranks"
    known = [
        (padded.sum().item() / total, f"the padded count: DistributedSampler repeats "
         f"{total - n} example(s) to reach total_size={total}, so they are counted twice"),
        (correct.sum().item() / total, f"divided by sampler.total_size={total} instead of the "
         f"{n} examples"),
        (sum(strided) / world, mean), (sum(chunks) / world, mean),
        (strided[rank], own), (chunks[rank], own),
        (float(correct.sum().item()), "the number of correct predictions, not a fraction"),
    ]
    return next((f" That is {what}." for value, what in known if abs(got - value) <= _TOL), "")


# ---- the worker (runs in every rank) -------------------------------------------------------------

def _run_cases(fn: Callable | tuple[str, str, str], sizes: tuple[int, ...], seed: int
               ) -> str | None:
    """Every size of ``sizes`` on this rank; the first failure as text, or None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    exact_accuracy, error = load_answer(fn)
    if error:
        return error
    # the sizes, then the last size again with a model that has a Dropout layer (eval mode)
    for n, dropout in [(n, False) for n in sizes] + [(sizes[-1], True)]:
        model, X, y, correct = _case(n, seed, dropout)
        want = correct.sum().item() / n
        where = (f"world_size={world}, {n} examples, rank {rank}"
                 + (", a model with a Dropout layer" if dropout else ""))
        try:
            got = exact_accuracy(model, X.clone(), y.clone())
            got = float(got.item() if isinstance(got, torch.Tensor) else got)
        except NotImplementedError:
            return UNANSWERED
        except Exception as e:
            return f"{where}: your function raised {type(e).__name__}: {' '.join(str(e).split())}"
        if dropout and model.train_mode_calls:
            return (f"{where}: the model was evaluated in train mode ({model.train_mode_calls} "
                    f"forward(s) with model.training True), so its Dropout zeroed features at "
                    f"random and changed the predictions (accuracy {got:.6f}, expected "
                    f"{want:.6f}). Evaluate in eval mode: call model.eval() first.")
        if dropout and not model.training:
            return (f"{where}: the model arrived in train mode and was left in eval mode, so "
                    f"training would go on with its Dropout switched off. Put it back in the mode "
                    f"it arrived in once the evaluation is done.")
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


# ---- the checker ---------------------------------------------------------------------------------

def check_exact_accuracy(fn: Callable | str | None, *,
                         world_sizes: tuple[int, ...] = (2, 3, 4),
                         sizes: tuple[int, ...] = (10, 1001), timeout: float = 60.0,
                         strict: bool = False) -> ExerciseResult:
    """Exercise 08: ``fn(model, X, y)`` returns the exact accuracy of the whole set on every rank.

    For each world size, a process group of that many worker processes; each gets the same
    classifier and the same evaluation set (X (N, 5), y (N,), N in ``sizes``: not divisible by 3
    or 4, and 10 not by 4), calls ``fn(model, X, y)`` and compares the result with one process's
    accuracy on the whole set; then checks that the ranks together evaluated every example
    exactly once. A last case gives a model with a Dropout layer, in train mode: the function
    must evaluate it in eval mode and leave it in the mode it arrived in. ``sizes``:
    evaluation-set sizes to try.
    """
    return check_in_ranks(
        "exact_accuracy", fn, "my_eval:exact_accuracy", _run_cases, (tuple(sizes), 8),
        world_sizes=world_sizes, timeout=timeout, hint=_HINT,
        hang_hint="Does every rank call the same collectives, in the same order?",
        passed=f"the exact accuracy on every rank, every example counted once, for world "
               f"sizes {list(world_sizes)} and {len(sizes)} set sizes {list(sizes)}.",
        missing="write exact_accuracy(model, X, y) to a file and pass it here.", strict=strict)


# ---- check_epoch_shards: every epoch a new permutation, the same on every rank -------------------

#: the idea, not the code: the learner reads torch's sampler, as the exercise asks
_SHARDS_HINT = ("each epoch the sampler shuffles all n indices into one order that depends "
                "only on its seed and the epoch (so every rank draws the same order), makes "
                "that order long enough for every rank to get the same number of indices, and "
                "deals it out to the ranks in turn, like cards. Compare your shards with a "
                "sampler's for a small n in a cell of your own, and read its short __iter__ in "
                "torch/utils/data/distributed.py.")


class _SamplerRefused(RuntimeError):
    pass


def _refuse(sampler):
    raise _SamplerRefused("iterating a DistributedSampler is not the exercise")


def _call(fn: Callable, *args) -> list[int]:
    """The learner's shard as a list of ints; iterating a ``DistributedSampler`` is refused."""
    with mock.patch.object(DistributedSampler, "__iter__", _refuse):
        got = call_bounded(fn, *args)
    return [int(i) for i in got]


def _torch_shards(n: int, world: int, epoch: int, seed: int) -> list[list[int]]:
    """The oracle: what torch's own sampler gives every rank after ``set_epoch(epoch)``."""
    shards = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                                     seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def _mismatch(shards: list[list[int]], want: list[list[int]], n: int) -> str:
    """Why ``shards`` (equal lengths, covering range(n)) differ from torch's ``want``."""
    world = len(want)
    order = [want[j % world][j // world] for j in range(len(want[0]) * world)]  # padded perm
    mine = [shards[j % world][j // world] for j in range(len(order))]           # interleaved
    blocks = [i for s in shards for i in s]                                      # concatenated
    if blocks == order or blocks[:n] == order[:n]:
        return (" Your shards are consecutive blocks of torch's permutation: the sampler gives "
                "rank r every world_size-th index from position r, not a block.")
    if mine[:n] == order[:n]:
        return (f" The permutation and the split are right; the {len(order) - n} padding "
                f"index(es) differ: torch's are {order[n:]}, yours {mine[n:]}.")
    if sorted(order[:n]) == sorted(mine[:n]) and mine[n:] == mine[:len(mine) - n]:
        return " Your permutation is not torch's (a different generator, seed or draw)."
    return ""


def _shards_failure(fn: Callable, n: int, world: int, seed: int, epochs: int) -> str | None:
    per_epoch = []
    for epoch in range(epochs):
        shards = []
        for rank in range(world):
            where = f"n={n}, world_size={world}, epoch {epoch}, rank {rank}"
            try:
                shard = _call(fn, n, rank, world, epoch, seed)
            except NotImplementedError:
                raise
            except _SamplerRefused:
                return (f"{where}: your function iterates a torch DistributedSampler. The "
                        f"exercise is to produce its order yourself, with torch's random "
                        f"functions (try a sampler in a cell of your own to see what it gives).")
            except Exception as e:
                return f"{where}: {failure(e)}"
            if _call(fn, n, rank, world, epoch, seed) != shard:
                return (f"{where}: two calls with the same arguments gave different shards: the "
                        f"order must depend only on (seed, epoch), never on a global RNG.")
            shards.append(shard)
        where = f"n={n}, world_size={world}, epoch {epoch}"
        lengths = [len(s) for s in shards]
        want = -(-n // world)
        if len(set(lengths)) > 1 or lengths[0] != want:
            return (f"{where}: shard lengths {lengths}, expected {want} on every rank (pad: "
                    f"every rank must take the same number of steps, or one waits forever in "
                    f"an all-reduce).")
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
                    f"the epoch is not in the seed (a DistributedSampler draws a new order "
                    f"after each set_epoch(epoch)).")
    other = [_call(fn, n, r, world, 0, seed + 1) for r in range(world)]
    if other == per_epoch[0]:
        return (f"n={n}, world_size={world}: seed {seed} and seed {seed + 1} give the same "
                f"shards: the seed is ignored.")
    if n >= 10 and all(s == sorted(s) for s in per_epoch[0]):
        return f"n={n}, world_size={world}, epoch 0: every shard is in increasing order: shuffle."
    for epoch, shards in enumerate(per_epoch):
        want = _torch_shards(n, world, epoch, seed)
        for rank, (got, expected) in enumerate(zip(shards, want)):
            if got != expected:
                at = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
                return (f"n={n}, world_size={world}, epoch {epoch}, rank {rank}: position {at} "
                        f"of your shard is {got[at]}, torch's DistributedSampler(range({n}), "
                        f"num_replicas={world}, rank={rank}, shuffle=True, seed={seed}) after "
                        f"set_epoch({epoch}) gives {expected[at]} there (its shard starts "
                        f"{expected[:8]}, yours {got[:8]})."
                        f"{_mismatch(shards, want, n)}")
    return None


def check_epoch_shards(fn: Callable | None, *, sizes: tuple[int, ...] = (10, 11, 1001),
                       world_sizes: tuple[int, ...] = (2, 3, 4), epochs: int = 3,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 08: ``fn(n, rank, world_size, epoch, seed)`` returns this rank's indices.

    The oracle is torch's own ``DistributedSampler(range(n), num_replicas=world_size,
    rank=rank, shuffle=True, seed=seed)`` after ``set_epoch(epoch)``: every rank's shard of
    every epoch must equal it element by element. Before that comparison the usual mistakes
    are named: unequal shard lengths (no padding), examples in no shard (a permutation per
    rank), the same order every epoch (the epoch not in the seed), the seed ignored, no
    shuffle; after it, what differs (consecutive blocks instead of a stride, another padding,
    another permutation). Iterating a ``DistributedSampler`` inside ``fn`` is refused (its
    ``__iter__`` raises during the call). Pure: run in this process, each call under a time
    limit.

    ``sizes``: dataset sizes to try (10 and 11 are not divisible by 3 or 4, 1001 by 2, 3, 4);
    ``world_sizes``: numbers of ranks to simulate; ``epochs``: epochs per case (0, 1, ...).
    """
    return check_cases(
        "epoch_shards", fn, [(n, world) for n in sizes for world in world_sizes],
        lambda fn, n, world: _shards_failure(fn, n, world, 5, epochs),
        missing="write epoch_shard(n, rank, world_size, epoch, seed) and pass it here.",
        expected="a function", hint=_SHARDS_HINT,
        raised=lambda case, e: f"n={case[0]}, world_size={case[1]}: {failure(e)} Hint: "
                               f"{_SHARDS_HINT}",
        passed=f"every rank's shard equals torch's DistributedSampler's after set_epoch, element "
               f"by element, for sizes {list(sizes)}, world sizes {list(world_sizes)} and "
               f"{epochs} epochs.", strict=strict)


# ---- check_recipe_entry: the per-rank entry point of a DDP training script -----------------------

#: the idea, not the code (the course's version, train_ddp.run, is shown after the exercise)
_ENTRY_HINT = ("each rank joins the process group the launcher describes, reads only its own "
               "share of the data with a new shuffle every epoch (the same shuffle on every "
               "rank), trains a model whose gradients are averaged over the ranks at every "
               "step, prints on one rank only, and leaves the group before it returns.")
#: the case: 24 examples, 4 per rank per step (2 ranks: 3 steps an epoch, 3 ranks: 2), 3 epochs
_ENTRY_N, _ENTRY_B, _ENTRY_EPOCHS, _ENTRY_LR = 24, 4, 3, 0.5


class _IndexedData(torch.utils.data.Dataset):
    """``(X[i], y[i])`` for i in range(n), noting every index read (in ``seen``)."""

    def __init__(self, X: torch.Tensor, y: torch.Tensor):
        self.X, self.y, self.seen = X, y, []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.X[i], self.y[i]


def _entry_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 linear classifier (4 -> 3) and 24 examples: the same on every rank."""
    g = torch.Generator().manual_seed(8)
    model = nn.Linear(4, 3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    X = torch.randn(_ENTRY_N, 4, generator=g, dtype=torch.float64)     # (24, 4)
    y = torch.randint(0, 3, (_ENTRY_N,), generator=g)                  # (24,)
    return model, X, y


def _trained(model: nn.Module, X: torch.Tensor, y: torch.Tensor,
             steps: list[list[int]]) -> list[torch.Tensor]:
    """One process: plain SGD on the examples of each step in turn; the final parameters."""
    net = copy.deepcopy(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=_ENTRY_LR)
    for idx in steps:
        loss = F.cross_entropy(net(X[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def _global_steps(orders: list[list[list[int]]]) -> list[list[int]]:
    """The global batches: at each step, every rank's next ``_ENTRY_B`` indices, together."""
    return [[i for shard in shards for i in shard[start:start + _ENTRY_B]]
            for shards in orders                           # one epoch: every rank's shard
            for start in range(0, len(shards[0]), _ENTRY_B)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal to float64 rounding: a right answer differs by the order of a sum only."""
    return len(a) == len(b) and all(torch.allclose(x, z, rtol=1e-9, atol=1e-12)
                                    for x, z in zip(a, b))


def _judge_entry(rank: int, world: int, got: list[torch.Tensor], seen: list[int],
                 printed: str, model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> str | None:
    """What is wrong with this rank's run: data read, weights, printing."""
    where = f"world_size={world}, rank {rank}"
    E, n = _ENTRY_EPOCHS, _ENTRY_N
    share = n // world
    if len(seen) == E * n:
        return (f"{where}: this rank read all {n} examples in every epoch: each rank should "
                f"read only its own share ({share} of them), the ranks' shares together "
                f"covering the data once.")
    if len(seen) != E * share:
        return (f"{where}: this rank read {len(seen)} examples over {E} epochs, expected "
                f"{E} x {share} (its share of {n} examples on {world} ranks, every epoch).")
    epochs = [seen[e * share:(e + 1) * share] for e in range(E)]
    if all(order == epochs[0] for order in epochs):
        return (f"{where}: every epoch read the same examples in the same order "
                f"({epochs[0][:6]}...): the shuffle never changed. The sampler draws its order "
                f"from its seed and the epoch it was last told; tell it the epoch each time.")
    offset = next((o for o in (0, 1) if all(
        order == _torch_shards(n, world, e + o, 0)[rank] for e, order in enumerate(epochs))),
        None)
    if offset is None:
        want = _torch_shards(n, world, 0, 0)[rank]
        return (f"{where}: in epoch 0 this rank read {epochs[0]}; a DistributedSampler over "
                f"the dataset (shuffle on, seed 0) after set_epoch(0) gives this rank {want} "
                f"(epochs counted from 0 or from 1 are both accepted).")
    orders = [_torch_shards(n, world, e + offset, 0) for e in range(E)]
    want = _trained(model, X, y, _global_steps(orders))
    if not _same(got, want):
        alone = _trained(model, X, y, _global_steps([[shards[rank]] for shards in orders]))
        if _same(got, alone):
            return (f"{where}: the final weights are those of this rank training alone on its "
                    f"own share: the gradients were never averaged over the ranks, so the "
                    f"ranks' models drift apart.")
        gap = max((a - b).abs().max().item() for a, b in zip(got, want)) if len(got) == len(
            want) else float("nan")
        return (f"{where}: the final weights differ from one process's run on the global "
                f"batches (every rank's {_ENTRY_B} examples of each step together) by up to "
                f"{gap:.3g}; SGD at lr, cross-entropy, {_ENTRY_B} examples per rank per step.")
    lines = [line for line in printed.splitlines() if line.strip()]
    if rank > 0 and lines:
        return (f"{where}: this rank printed {len(lines)} line(s) (the first: {lines[0]!r}): "
                f"with k ranks every line would appear k times; print on rank 0 only.")
    if rank == 0 and len(lines) < E:
        return (f"{where}: rank 0 printed {len(lines)} line(s) in {E} epochs, expected at least "
                f"one line per epoch (the epoch and its loss, say).")
    return None


def _entry_cases(spec: Callable | tuple[str, str, str]) -> str | None:
    """In every rank: run the learner's ``train`` as a launcher would start it; what is wrong.
    The harness's group is left first (the learner's function joins its own on a port rank 0
    chose) and formed again after, so that every rank returns the same verdict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ports = [find_free_port(), find_free_port()] if rank == 0 else [None, None]
    dist.broadcast_object_list(ports, src=0)
    train, error = load_answer(spec)
    dist.destroy_process_group()
    model, X, y = _entry_case()
    data = _IndexedData(X, y)
    printed = io.StringIO()
    problem = error
    # the launcher's variables, as torchrun sets them; the environment is put back after
    launched = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    try:
        if problem is None:
            with mock.patch.dict(os.environ, launched), contextlib.redirect_stdout(printed):
                result = train(copy.deepcopy(model), data, _ENTRY_EPOCHS, _ENTRY_B, _ENTRY_LR)
    except NotImplementedError:
        problem = UNANSWERED
    except Exception as e:
        problem = (f"world_size={world}, rank {rank}: your function raised "
                   f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    if problem is not None:  # the ranks may not be in step: return alone, at once
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return problem
    if dist.is_initialized():
        problem = (f"world_size={world}, rank {rank}: the process group was still initialised "
                   f"when your function returned: leave it before returning (also when "
                   f"training fails, so in a finally).")
        dist.destroy_process_group()
    elif not isinstance(result, nn.Module):
        problem = (f"world_size={world}, rank {rank}: your function returned "
                   f"{type(result).__name__}, expected the trained model (an nn.Module).")
    else:
        net = getattr(result, "module", result)  # a wrapper's module is accepted too
        got = [p.detach() for p in net.parameters()]
        problem = _judge_entry(rank, world, got, data.seen, printed.getvalue(), model, X, y)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=world)
    return agree(problem)


def check_recipe_entry(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                       timeout: float = 120.0, strict: bool = False) -> ExerciseResult:
    """Exercise 08: ``fn(model, dataset, epochs, batch_size, lr)``, a DDP script's per-rank
    entry point, started in every rank as torchrun would start it.

    Each world size gets fresh ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` and no process group: ``fn`` must join the group (gloo), train a float64
    linear classifier on 24 examples (4 per rank per step, 3 epochs, plain SGD on the
    cross-entropy), print on rank 0 only, leave the group, and return the trained model. The
    dataset notes which examples each rank read: every rank must read exactly what a
    ``DistributedSampler`` with ``set_epoch`` gives it (epochs counted from 0 or from 1). Every
    rank's final weights must equal one process trained on the global batches (every rank's
    examples of a step together) to float64 rounding. The usual mistakes are named: the whole
    dataset on every rank, the same order every epoch, gradients never averaged (each rank
    alone), printing on every rank, the group left behind.

    ``fn``: from a file written with ``%%writefile my_recipe.py``; ``world_sizes``: one launch
    for all.
    """
    return check_in_ranks(
        "recipe entry point", fn, "my_recipe:train", _entry_cases, (), world_sizes=world_sizes,
        timeout=timeout, hint=_ENTRY_HINT,
        hang_hint="Does every rank join the group, and run the same number of steps?",
        passed=f"every rank read its sampler's shard of each epoch, ended with the weights of "
               f"one process on the global batches (float64), printed only on rank 0 and left "
               f"the group, for world sizes {list(world_sizes)}.",
        missing="write train(model, dataset, epochs, batch_size, lr) to a file and pass it here.",
        strict=strict)
