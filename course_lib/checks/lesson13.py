"""Checkers for the exercises of lesson 13 (after training); each docstring says what it tries,
and each prints its verdict (the first failing case) and returns it, truthy when right.

``check_load_matching`` (exercise 1): ``load_matching(model, state_dict)`` loads the tensors of
a checkpoint that name a key of the model, whatever wrapper prefixes they carry (DDP's
``module.``, torch.compile's ``_orig_mod.``, nested, mixed), reports the rest, and refuses a
shape that differs before anything is copied. Oracle: ``course_lib.deploy.load_matching``,
itself tested against torch's ``consume_prefix_in_state_dict_if_present`` and
``load_state_dict(strict=False)``.

``check_read_plan`` (exercise 2): ``read_plan(pieces, world_size)``, the rows of each saved
piece that each rank of a new ``fully_shard`` layout reads. Oracle:
``course_lib.deploy.read_plan``, itself tested against DCP's own planner
(``create_read_items_for_chunk_list``) in tests/test_checks_lesson13.py.

``check_sharded_resume`` (exercise 3): ``save_sharded(model, optimizer, path)`` and
``resume_sharded(model, optimizer, path)``, a ``fully_shard`` model and its Adam saved with DCP
on 2 ranks and resumed on 3. Oracle: ``course_lib.deploy.save_sharded`` / ``resume_sharded``
and a run that never stopped.

Kept for learners' copies of earlier versions: ``check_reshard``, ``reshard(shards,
world_size)`` (N ranks' ``fully_shard`` shards laid out for M; oracle
``course_lib.deploy.reshard``, tested against DCP's load in tests/test_checkpoint_layouts.py),
and ``check_strip_prefix``, ``strip_prefix(state_dict, prefix="module.")`` (oracle: torch's
``consume_prefix_in_state_dict_if_present``; the result must load strictly into the plain
model).
"""
from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..deploy import (
    WRAPPER_PREFIXES,
    fit_state_dict,
    load_matching,
    read_plan,
    reshard,
    shard_rows,
    strip_prefix,
)
from ..deploy import resume_sharded as _course_resume
from ..deploy import save_sharded as _course_save
from ..models.lenet import LeNet
from ._core import ExerciseResult, call_bounded, call_or_verdict, failure, refused, verdict
from .harness import (
    UNANSWERED,
    StopRank,
    check_answers_in_ranks,
    check_cases,
    keeps_kernel_state,
    load_answers,
    run_in_step,
)

__all__ = ["check_load_matching", "check_read_plan", "check_reshard", "check_sharded_resume",
           "check_strip_prefix"]

_NAME = "strip_prefix"
_HINT = ("remove the prefix only at the START of a key, and only from keys that have it; a "
         "'module.' in the middle of a key is part of the model's own names.")


class _Residual(nn.Module):
    """``x + module(x)``: a submodule that is really called ``module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X + self.module(X)


class _Tagger(nn.Module):
    """A small model whose names trip the usual shortcuts: ``embed``, ``linear`` (letters of
    "module."), ``block.module`` (a ``module.`` inside a key), batch-norm buffers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = _Residual(nn.Linear(8, 8))
        self.norm = nn.BatchNorm1d(8)
        self.linear = nn.Linear(8, 3)

    def forward(self, X: torch.Tensor) -> torch.Tensor:             # (B, 6)
        return self.linear(self.norm(self.block(self.embed(X))))    # (B, 3)


def _cases() -> list[tuple[str, nn.Module, dict, str, torch.Tensor]]:
    """(what, plain model, state dict to strip, prefix, an input for the outputs)."""
    torch.manual_seed(12)
    lenet, tagger = LeNet(), _Tagger()
    with torch.no_grad():
        tagger.train()(torch.randn(16, 6))   # running statistics that differ from the defaults
    tagger.eval()
    compiled = {"_orig_mod." + k: v for k, v in tagger.state_dict().items()}
    wrapped = {m: nn.DataParallel(m).state_dict() for m in (lenet, tagger)}
    lenet.cpu(), tagger.cpu()   # with one GPU, DataParallel's constructor moved them there
    return [
        ("LeNet saved from nn.DataParallel (keys 'module.conv1.weight', ...)", lenet,
         wrapped[lenet], "module.", torch.rand(3, 1, 28, 28)),
        ("a model with layers named embed, block.module, norm, linear, saved from "
         "nn.DataParallel", tagger, wrapped[tagger], "module.", torch.randn(5, 6)),
        ("LeNet saved without a wrapper (no key has the prefix)", lenet, lenet.state_dict(),
         "module.", torch.rand(2, 1, 28, 28)),
        ("the same small model saved from torch.compile (prefix '_orig_mod.')", tagger,
         compiled, "_orig_mod.", torch.randn(4, 6)),
    ]


def _compare(got: object, want: Mapping, given: Mapping, prefix: str, model: nn.Module,
             X: torch.Tensor) -> str | None:
    """What is wrong with ``got`` against ``want`` (the oracle's dict) and loaded into a plain
    ``model``, or None."""
    if not isinstance(got, Mapping):
        return f"expected a dict of tensors, received {type(got).__name__}"
    renamed = {k.removeprefix(prefix): k for k in given}   # oracle key -> where it came from
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing or extra:
        wrong = extra[0] if extra else "(no such key)"
        example = (f"expected key {missing[0]!r} (from {renamed[missing[0]]!r})" if missing
                   else "every expected key is there")
        return (f"{example}; received keys such as {wrong!r} ({len(missing)} expected key(s) "
                f"missing, {len(extra)} unexpected)")
    for k in want:
        if not isinstance(got[k], torch.Tensor) or not torch.equal(got[k], want[k]):
            return f"the value under {k!r} is not the tensor of {renamed[k]!r}"
    plain = type(model)()
    try:
        plain.load_state_dict(got)
    except RuntimeError as e:
        return f"load_state_dict refused it: {' '.join(str(e).split())[:200]}"
    with torch.no_grad():
        if not torch.equal(plain.eval()(X), model.eval()(X)):
            return "the loaded model's outputs differ from the saved model's"
    return None


@keeps_kernel_state
def check_strip_prefix(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 12: ``fn(state_dict, prefix)`` returns the state dict without the prefix.

    Four real state dicts: LeNet and a small model with tricky names (``embed``,
    ``block.module.weight``, ``linear``, batch-norm buffers) saved from ``nn.DataParallel``
    (``module.``), LeNet saved plain (nothing to strip), and the small model's keys as
    torch.compile writes them (``_orig_mod.``). The answer's keys and tensors must equal
    torch's ``consume_prefix_in_state_dict_if_present``'s, and it must load (strictly) into the
    plain model and give its outputs. Returning None after changing ``state_dict`` in place
    (as torch's function does) is accepted too.
    """
    if fn is None:
        return verdict(_NAME, None, "define strip_prefix(state_dict, prefix='module.') and "
                       "pass it here.", strict)
    cases = _cases()
    for what, model, given, prefix, X in cases:
        want = strip_prefix(given, prefix)           # the oracle: torch's function
        mine = type(given)(given)                    # the learner may change it in place
        try:
            got = call_bounded(fn, mine, prefix)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
            return verdict(_NAME, False, f"{failure(exc)} on {what}. {_HINT}", strict)
        wrong = _compare(mine if got is None else got, want, given, prefix, model, X)
        if wrong is not None:
            hint = f" {_HINT}" if wrong.startswith("expected key") else ""
            return verdict(_NAME, False, f"on {what}, prefix {prefix!r}: {wrong}.{hint}", strict)
    return verdict(_NAME, True, f"every key right on {len(cases)} state dicts (two wrappers, a "
                   "plain model, a 'module' inside the names), and each loads into its model.",
                   strict)


# ---- load_matching: the lesson's exercise -------------------------------------------------------

_LM_NAME = "load_matching"
_LM_HINT = ("match each key of the file on its own. Wrappers put their prefixes only at the "
            "START of a key, possibly several, nested; a key the model already has is the "
            "model's own name, even one that starts with 'module.'. Decide every key and check "
            "every shape before the model is touched.")


def _holder() -> nn.Module:
    """A model whose own first submodule is called ``module``: keys ``module.weight``, ..."""
    return _Residual(nn.Linear(4, 4))


class _NewHead(nn.Module):
    """LeNet's body with a new 2-class head named ``head`` (fine-tuning): no ``fc2``."""

    def __init__(self):
        super().__init__()
        lenet = LeNet()
        self.conv1, self.conv2, self.fc1 = lenet.conv1, lenet.conv2, lenet.fc1
        self.head = nn.Linear(128, 2)


def _two_class() -> nn.Module:
    """LeNet with its head rebuilt for 2 classes under the same name: ``fc2`` (2, 128)."""
    net = LeNet()
    net.fc2 = nn.Linear(128, 2)
    return net


def _trained(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` seeded with ``seed``, batch-norm statistics moved off their defaults."""
    torch.manual_seed(seed)
    net = build()
    if isinstance(net, _Tagger):
        with torch.no_grad():
            net.train()(torch.randn(16, 6))
    return net.eval()


def _lm_cases() -> list[tuple[str, Callable[[], nn.Module], dict]]:
    """(what, how to build the model to load into, the file's state dict)."""
    lenet, tagger, holder = _trained(LeNet, 1), _trained(_Tagger, 2), _trained(_holder, 3)
    ddp_body = {("module." + k if k.startswith("conv") else k): v
                for k, v in lenet.state_dict().items()}
    return [
        ("LeNet saved from DDP (keys 'module.conv1.weight', ...)", LeNet,
         nn.DataParallel(lenet).state_dict()),
        ("a model with layers named embed, block.module, norm, linear, saved without a "
         "wrapper (a 'module.' inside a key is a real name)", _Tagger, tagger.state_dict()),
        ("the same model saved from DDP around torch.compile (keys 'module._orig_mod.*')",
         _Tagger, nn.DataParallel(torch.compile(tagger)).state_dict()),
        ("the same model saved from torch.compile around DDP (keys '_orig_mod.module.*')",
         _Tagger, torch.compile(nn.DataParallel(tagger)).state_dict()),
        ("a model whose own first submodule is called 'module', saved without a wrapper "
         "(keys 'module.weight', 'module.bias')", _holder, holder.state_dict()),
        ("the same model saved from DDP (keys 'module.module.weight', ...)", _holder,
         nn.DataParallel(holder).state_dict()),
        ("LeNet whose convolutions were saved from DDP and linear layers plainly (mixed "
         "prefixes in one file)", LeNet, ddp_body),
        ("fine-tuning: LeNet's body with a new head named 'head', from a LeNet saved from DDP "
         "(fc2 is not in the model, head is not in the file)", _NewHead,
         nn.DataParallel(lenet).state_dict()),
        ("fine-tuning: LeNet with fc2 rebuilt for 2 classes, from a 10-class LeNet saved from "
         "DDP (fc2's shapes differ: refuse, and change nothing)", _two_class,
         nn.DataParallel(lenet).state_dict()),
    ]


def _bare(key: str) -> str:
    """``key`` less every wrapper prefix at its start."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def _keys_pair(got: object) -> tuple[list, list] | None:
    """``(missing_keys, unexpected_keys)`` from a pair or from torch's named result."""
    if hasattr(got, "missing_keys") and hasattr(got, "unexpected_keys"):
        got = (got.missing_keys, got.unexpected_keys)
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(
            isinstance(part, (list, tuple, set)) for part in got):
        return list(got[0]), list(got[1])
    return None


def _lm_case(fn: Callable, what: str, build: Callable[[], nn.Module], given: dict
             ) -> str | None:
    """What is wrong with ``fn`` on one case, or None. The oracle loads a twin model."""
    oracle = _trained(build, 7)
    model = _trained(build, 7)                       # the same start as the oracle's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mine = type(given)(given)                        # the learner's copy; ``given`` is kept
    if hasattr(given, "_metadata"):
        mine._metadata = given._metadata
    keys_before = list(mine)
    try:
        want = load_matching(oracle, given)
    except ValueError as e:
        want = e
    try:
        got = call_bounded(fn, model, mine)
    except (KeyboardInterrupt, NotImplementedError):
        raise
    except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
        if not isinstance(want, ValueError) or not isinstance(exc, ValueError | RuntimeError):
            return f"on {what}: {failure(exc)}."
        named = [k for k, _, _ in fit_state_dict(oracle, given).mismatched]
        if not any(k in str(exc) for k in named):
            return (f"on {what}: the error raised does not name the key whose shape differs "
                    f"({named[0]!r}): {' '.join(str(exc).split())[:160]}.")
        got = exc
    if list(mine) != keys_before:
        return f"on {what}: the state dict passed in was changed (its keys renamed or removed)."
    after = model.state_dict()
    if isinstance(want, ValueError):
        if not isinstance(got, BaseException):
            return (f"on {what}: no error; a tensor whose shape differs from the model's must "
                    "be refused with an error that names its key.")
        changed = [k for k in after if not torch.equal(after[k], before[k])]
        if changed:
            return (f"on {what}: the error came after {changed[0]!r} was already copied "
                    f"({len(changed)} tensor(s) changed): check every shape first, and copy "
                    "nothing when one differs.")
        return None
    pair = _keys_pair(got)
    if pair is None:
        return (f"on {what}: expected (missing_keys, unexpected_keys), two lists, received "
                f"{type(got).__name__}.")
    missing, unexpected = pair
    if sorted(missing) != sorted(want.missing_keys):
        return (f"on {what}: missing_keys should be {sorted(want.missing_keys)} (the model's "
                f"keys left as they were), received {sorted(missing)}.")
    if sorted(map(_bare, unexpected)) != sorted(map(_bare, want.unexpected_keys)):
        return (f"on {what}: unexpected_keys should be {sorted(want.unexpected_keys)} (the "
                f"file's keys that name no key of the model), received {sorted(unexpected)}.")
    for k, v in oracle.state_dict().items():
        if not torch.equal(after[k], v):
            loaded = k not in want.missing_keys
            return (f"on {what}: {k!r} " + ("was not loaded from the file." if loaded else
                    "should have kept its value (the file has no tensor for it)."))
    return None


@keeps_kernel_state
def check_load_matching(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 1: ``fn(model, state_dict)`` loads what matches and reports the rest.

    Nine real state dicts, each loaded into a freshly built model: saved from DDP
    (``module.``); a model with a ``module.`` inside its names, saved plainly; the same saved
    from DDP around torch.compile (``module._orig_mod.``) and from torch.compile around DDP
    (``_orig_mod.module.``); a model whose own first submodule is ``module``, saved plainly and
    from DDP; convolutions from DDP and linear layers plain in one file; a new head under a
    new name (partial: missing and unexpected keys reported); a new head under the old name
    with another shape (an error naming the key, and the model unchanged). The model's tensors
    and the returned ``(missing_keys, unexpected_keys)`` must equal
    ``course_lib.deploy.load_matching``'s; the dict passed in must not be changed.
    """
    missing = "define load_matching(model, state_dict) and pass it here."
    if (refusal := refused(_LM_NAME, fn, missing, strict)) is not None:
        return refusal                               # before the cases are built
    cases = _lm_cases()
    return check_cases(
        _LM_NAME, fn, cases, _lm_case, missing=missing, expected="a function", hint=_LM_HINT,
        passed=f"right on {len(cases)} checkpoints: DDP's and torch.compile's prefixes alone, "
               "nested both ways and mixed; a 'module' that is a real name; a new head "
               "reported, a resized head refused before any copy.", strict=strict)


# ---- reshard: N ranks' shards onto M ranks ------------------------------------------------------

_RS_NAME = "reshard"
_RS_HINT = ("the saving ranks' shards, in rank order, hold each tensor's rows in order. Loading "
            "rank r must end up with rows r * c up to (not including) min((r + 1) * c, rows), "
            "c = ceil(rows / world_size), and a (0, ...) tensor when r * c >= rows: work out "
            "where those rows are among the saved shards.")
#: (ranks that saved, ranks that load): more and fewer, one, and sizes where chunk runs short.
_RS_LAYOUTS = ((2, 3), (3, 2), (2, 1), (1, 4), (4, 3), (3, 4))


def _rs_state() -> dict[str, torch.Tensor]:
    # rows 7, 5, 2 and 1: uneven on 2, 3 and 4 ranks, and fewer rows than ranks
    g = torch.Generator().manual_seed(13)
    return {"fc1.weight": torch.randn(7, 3, dtype=torch.float64, generator=g),
            "fc1.bias": torch.randn(7, dtype=torch.float64, generator=g),
            "fc2.weight": torch.randn(5, 7, dtype=torch.float64, generator=g),
            "head.weight": torch.randn(2, 5, dtype=torch.float64, generator=g),
            "head.bias": torch.randn(1, dtype=torch.float64, generator=g)}


def _rs_problem(fn: Callable, n: int, m: int, state: dict) -> str | None:
    """What is wrong with ``fn`` on ``state`` saved by ``n`` ranks, loaded by ``m``, or None."""
    saved = [{k: shard_rows(v, n)[r] for k, v in state.items()} for r in range(n)]
    given = [{k: v.clone() for k, v in s.items()} for s in saved]
    got, want = call_bounded(fn, given, m), reshard(saved, m)
    where = f"{n} rank(s) saved, {m} load"
    if not isinstance(got, list | tuple) or len(got) != m:
        return (f"{where}: expected a list of {m} state dicts, one per loading rank, got "
                f"{type(got).__name__}" + (f" of {len(got)}." if hasattr(got, "__len__") else "."))
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        if not isinstance(mine, Mapping) or list(mine) != list(theirs):
            return f"{where}: rank {rank}'s keys should be {list(theirs)}."
        for key, t in theirs.items():
            a = mine[key]
            if not isinstance(a, torch.Tensor) or a.shape != t.shape:
                shape = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                return (f"{where}: rank {rank}'s {key!r} should have shape {tuple(t.shape)}, "
                        f"got {shape}.")
            if not torch.equal(a, t):
                return f"{where}: rank {rank}'s {key!r} has the right shape, not the right rows."
    if any(not torch.equal(a[k], b[k]) for a, b in zip(given, saved) for k in a):
        return f"{where}: the shards passed in were changed."
    return None


@keeps_kernel_state
def check_reshard(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise: ``fn(shards, world_size)`` lays N ranks' dim-0 shards out for M ranks.

    A state dict of float64 tensors with 7, 5, 2 and 1 rows is split as ``fully_shard`` splits
    it on N ranks; ``fn`` must return, for M ranks, exactly the shards of
    ``course_lib.deploy.reshard`` (shapes, empty ones included, and values), for
    (N, M) in (2, 3), (3, 2), (2, 1), (1, 4), (4, 3), (3, 4). The shards passed in must be left
    as they were.
    """
    state = _rs_state()
    return check_cases(
        _RS_NAME, fn, [(n, m, state) for n, m in _RS_LAYOUTS], _rs_problem,
        missing="define reshard(shards, world_size) and pass it here.", expected="a function",
        hint=_RS_HINT, raised=lambda case, exc: (f"{failure(exc)} with {case[0]} saving and "
                                                 f"{case[1]} loading rank(s). Hint: {_RS_HINT}"),
        passed=f"right on {len(_RS_LAYOUTS)} layouts (more ranks and fewer, one, and ranks left "
               "with no rows): every shard's shape and values.", strict=strict)


# ---- read_plan: which saved rows each rank of a new layout reads (the lesson's exercise 2) ------

_RP_NAME = "read_plan"
_RP_HINT = ("a new rank reads, from a saved piece, exactly the rows that both hold: where two "
            "ranges of rows overlap. Find the rows the new rank holds first (fully_shard's "
            "split, as torch.chunk makes it), then count the overlap from the piece's own "
            "first row.")


def _pieces(lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive pieces with these lengths."""
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(offsets, lengths))


#: (what, saved pieces, new world size): uneven splits, 3 ranks, more ranks than rows, empty
#: ranks on either side, and pieces that fully_shard did not make.
_RP_CASES = (
    ("7 rows saved by 2 ranks (4 + 3), loaded on 3", _pieces((4, 3)), 3),
    ("7 rows saved by 3 ranks (3 + 3 + 1), loaded on 2", _pieces((3, 3, 1)), 2),
    ("4 rows saved by 2 ranks (2 + 2), loaded on 3 (the last new rank holds none)",
     _pieces((2, 2)), 3),
    ("4 rows saved by 3 ranks (2 + 2 + an empty piece), loaded on 2", _pieces((2, 2, 0)), 2),
    ("5 rows saved by 4 ranks (2 + 2 + 1 + an empty piece), loaded on 3", _pieces((2, 2, 1, 0)),
     3),
    ("2 rows saved by 1 rank, loaded on 4 (more ranks than rows)", _pieces((2,)), 4),
    ("7 rows saved by 2 ranks, loaded on 1 (the whole tensor)", _pieces((4, 3)), 1),
    ("7 rows saved by another layout (1 + 5 + 1), loaded on 3", _pieces((1, 5, 1)), 3),
    ("9 rows saved by 3 ranks (3 + 3 + 3), loaded on 3 (the same layout)", _pieces((3, 3, 3)),
     3),
)


def _rp_normal(got: object, world_size: int) -> list[list[tuple[int, int, int]]] | str:
    """``got`` as lists of int triples, or what is wrong with its form."""
    if not isinstance(got, list | tuple) or len(got) != world_size:
        n = f" of {len(got)}" if isinstance(got, list | tuple) else ""
        return (f"expected a list of {world_size} lists, one per new rank, received "
                f"{type(got).__name__}{n}")
    out = []
    for rank, reads in enumerate(got):
        try:
            out.append([tuple(int(x) for x in read) for read in reads])
        except (TypeError, ValueError):
            return (f"new rank {rank}'s entry should be a list of (piece, start, stop), "
                    f"received {reads!r}")
        if any(len(read) != 3 for read in out[-1]):
            return f"new rank {rank}'s reads should be (piece, start, stop) triples: {reads!r}"
    return out


@keeps_kernel_state
def check_read_plan(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 2: ``fn(pieces, world_size)``: what each new rank reads from the saved pieces.

    ``pieces`` lists a tensor's saved pieces as ``(offset, length)`` along dim 0; the answer is
    one list per new rank of ``(piece, start, stop)`` (rows ``start:stop`` of that piece, in
    piece order, no empty read), compared with ``course_lib.deploy.read_plan`` on nine layouts:
    uneven splits on 2 and 3 ranks, empty saved pieces, a new rank with no rows, more new ranks
    than rows, one rank, the same layout, and pieces ``fully_shard`` would not make. The list
    passed in must be left as it was.
    """
    missing = "define read_plan(pieces, world_size) and pass it here."
    if (refusal := refused(_RP_NAME, fn, missing, strict)) is not None:
        return refusal
    for what, pieces, world_size in _RP_CASES:
        given = list(pieces)
        got, failed = call_or_verdict(_RP_NAME, strict, fn, given, world_size,
                                      after=f" on {what}. Hint: {_RP_HINT}")
        if failed is not None:
            return failed
        want = read_plan(pieces, world_size)
        mine = _rp_normal(got, world_size)
        if isinstance(mine, str):
            return verdict(_RP_NAME, False, f"on {what}: {mine}.", strict)
        if given != pieces:
            return verdict(_RP_NAME, False, f"on {what}: the list of pieces passed in was "
                           "changed.", strict)
        for rank, (a, b) in enumerate(zip(mine, want)):
            if a != b:
                return verdict(_RP_NAME, False, f"on {what}: new rank {rank} should read "
                               f"{b}, received {a}. Hint: {_RP_HINT}", strict)
    return verdict(_RP_NAME, True, f"right on {len(_RP_CASES)} layouts (uneven splits, empty "
                   "pieces and empty ranks, more ranks than rows, pieces of another layout): "
                   "every rank reads only the rows it holds.", strict)


# ---- save_sharded / resume_sharded: model and Adam through DCP, 2 ranks to 3 ------------------

_SR_NAME = "save_sharded and resume_sharded"
_SR_EXAMPLES = ("my_dcp:save_sharded", "my_dcp:resume_sharded")
_SR_HINT = ("a resume must bring back everything the next step reads (the parameters, Adam's "
            "step count and moments, its learning rate in param_groups) into the model and "
            "optimizer of the new layout; dcp.load fills only the dicts it is given.")
#: The checker's run: float64 MLP widths (7 rows: 4 + 3 on 2 ranks, 3 + 3 + 1 on 3), Adam steps
#: before the save, batch rows (a multiple of 2 and 3), the run's learning rate, and the other
#: learning rate the resuming Adam is built with (the saved one must come back).
_SR_SIZES, _SR_STEPS, _SR_BATCH, _SR_LR, _SR_FRESH_LR = (6, 4, 7, 2), 3, 12, 0.05, 1e-3


def _sr_sharded_adam(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A float64 MLP drawn from ``seed``, every Linear and the whole under ``fully_shard`` on
    this group's CPU mesh (gloo), and a fresh Adam on it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(_SR_SIZES[:-1], _SR_SIZES[1:]):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _sr_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One Adam step on this rank's rows of batch ``step`` (the same batch on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + step)
    X = torch.randn(_SR_BATCH, _SR_SIZES[0], dtype=torch.float64, generator=gen)
    y = torch.randn(_SR_BATCH, _SR_SIZES[-1], dtype=torch.float64, generator=gen)
    rows = slice(rank * _SR_BATCH // world, (rank + 1) * _SR_BATCH // world)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(X[rows]), y[rows]).backward()
    opt.step()


def _sr_full(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Every rank calls it (it all-gathers); rank 0 gets full copies, the others ({}, {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(get_state_dict(model, opt, options=options))


def _sr_problem(got: tuple[dict, dict], want: tuple[dict, dict], whose: str) -> str | None:
    """What differs between two full (model, optimizer) states, bit for bit, or None."""
    (model, optim), (model_w, optim_w) = got, want
    for k, v in model_w.items():
        if k not in model or not torch.equal(model[k], v):
            far = ((model[k] - v).abs().max().item() if k in model and model[k].shape == v.shape
                   else float("nan"))
            return (f"{whose}, parameter {k!r} is not the saved one (largest difference "
                    f"{far:.2e})")
    for k, s in optim_w["state"].items():
        mine = optim.get("state", {}).get(k, {})
        for name, v in s.items():
            if name not in mine:
                return f"{whose}, Adam's state of {k!r} has no {name!r}"
            if not torch.equal(torch.as_tensor(mine[name]), torch.as_tensor(v)):
                if name == "step":
                    return (f"{whose}, Adam's step count of {k!r} is {float(mine[name]):g}, the "
                            f"saved run's is {float(v):g}")
                return (f"{whose}, Adam's {name} of {k!r} is not the saved one (largest "
                        f"difference {(mine[name] - v).abs().max().item():.2e})")
    for g, g_w in zip(optim.get("param_groups", []), optim_w["param_groups"]):
        if g.get("lr") != g_w["lr"]:
            return (f"{whose}, the optimizer's learning rate is {g.get('lr')}, the saved run's "
                    f"is {g_w['lr']} (the optimizer passed in was built with another one; "
                    f"its param_groups were not restored)")
    return None


def _sr_error(e: BaseException) -> str:
    """An exception in words; DCP's ``CheckpointException`` (a BaseException that gathers every
    rank's error) as the first rank's own error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _sr_call(what: str, fn: Callable, *args) -> None:
    """The learner's ``fn(*args)``; what it raised (DCP's errors too) becomes a ``StopRank``."""
    try:
        fn(*args)
    except NotImplementedError:
        raise StopRank(UNANSWERED) from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: B036 - DCP raises CheckpointException, a BaseException
        raise StopRank(f"{what} raised {_sr_error(e)}") from None


def _sr_tag(specs: tuple) -> str:
    """A folder name for one pair of answers, the same on every rank."""
    names = [f"{getattr(s, '__module__', '')}.{getattr(s, '__qualname__', s)}" for s in specs]
    return hashlib.sha1(repr(names).encode()).hexdigest()[:12]


def _sr_cases(specs: tuple, folder: str) -> str | None:
    """In every rank: ``_sr_case`` on the learner's pair, in step with the other ranks."""
    answers, error = load_answers(specs, ("function save_sharded", "function resume_sharded"))
    if error:
        return error
    return run_in_step([(_sr_case(*answers, os.path.join(folder, _sr_tag(specs))), "")])


def _sr_case(save: Callable, resume: Callable, here: str) -> Iterator[str | None]:
    """On 2 ranks, train, save with the answer and with the course's ``save_sharded``, step on
    (the run that never stopped); on 3 ranks, the course's resume of the answer's directory,
    then the answer's resume of the course's directory, each compared with the saved state bit
    for bit, and the answer's next step with the course's (bit for bit) and with the run that
    never stopped (to float64 rounding)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    yours, course, run = (os.path.join(here, n) for n in ("yours", "course", "run.pt"))
    if world == 2:
        os.makedirs(here, exist_ok=True)
        model, opt = _sr_sharded_adam(seed=0, lr=_SR_LR)
        for step in range(_SR_STEPS):
            _sr_step(model, opt, step)
        saved = _sr_full(model, opt)
        _sr_call("save_sharded(model, optimizer, path)", save, model, opt, yours)
        _course_save(model, opt, course)
        _sr_step(model, opt, _SR_STEPS)                        # the run that never stopped
        after = _sr_full(model, opt)[0]
        if rank == 0:
            torch.save({"saved": saved, "next": after}, run)
        return
    ran = torch.load(run, weights_only=True)
    saved = (ran["saved"][0], ran["saved"][1])
    where = f"world_size={world}: saved on 2 ranks, resumed on {world}"
    # 1. the answer's directory, read by the course's resume
    theirs, opt_t = _sr_sharded_adam(seed=7, lr=_SR_FRESH_LR)
    found = None
    try:
        _course_resume(theirs, opt_t, yours)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: B036 - DCP raises CheckpointException, a BaseException
        found = _sr_error(e)
    yield found and (f"{where}: the directory your save_sharded wrote does not resume a model "
                     f"and its Adam on {world} ranks: the course's resume_sharded raised {found}")
    got = _sr_full(theirs, opt_t)
    yield _sr_problem(got, saved, f"{where}, read from your save_sharded's directory by the "
                      "course's resume_sharded") if rank == 0 else None
    # 2. the course's directory, read by the answer's resume
    mine, opt_m = _sr_sharded_adam(seed=7, lr=_SR_FRESH_LR)
    _sr_call("resume_sharded(model, optimizer, path)", resume, mine, opt_m, course)
    yield None if opt_m.state else (
        f"{where}: after your resume_sharded the optimizer holds no state at all: Adam's "
        "moments and step count were not loaded (a fresh Adam would start them at zero)")
    got = _sr_full(mine, opt_m)
    yield _sr_problem(got, saved, f"{where}, after your resume_sharded") if rank == 0 else None
    # 3. the next step: the course's resumed run, and the run that never stopped
    _sr_step(mine, opt_m, _SR_STEPS)
    _sr_step(theirs, opt_t, _SR_STEPS)
    yours_next, course_next = _sr_full(mine, opt_m)[0], _sr_full(theirs, opt_t)[0]
    found = None
    if rank == 0:
        for k, v in ran["next"].items():
            far = (yours_next[k] - v).abs().max().item()
            if not torch.equal(yours_next[k], course_next[k]) or far > 1e-12:
                found = (f"{where}: one step after your resume, parameter {k!r} differs from "
                         f"the run that never stopped by {far:.2e}")
                break
    yield found


def check_sharded_resume(save: Callable | str | None, resume: Callable | str | None, *,
                         strict: bool = False) -> ExerciseResult:
    """Exercise 3: ``save(model, optimizer, path)`` and ``resume(model, optimizer, path)``, a
    ``fully_shard`` model and its Adam saved with DCP on 2 ranks and resumed on 3.

    One launch of 3 processes over gloo: a float64 MLP trained 3 Adam steps on 2 ranks, saved
    with ``save`` and with the course's ``deploy.save_sharded``, then one more step (the run
    that never stopped). On 3 ranks, fresh models from other weights with a fresh Adam built
    with another learning rate: the course's ``resume_sharded`` must read ``save``'s directory,
    and ``resume`` the course's, each giving the saved parameters, Adam's step, ``exp_avg``,
    ``exp_avg_sq`` and learning rate bit for bit; the next step must equal the course's resumed
    run bit for bit and the run that never stopped to 1e-12. Pass the functions, or
    ``"module:name"`` strings for functions in a file (``%%writefile my_dcp.py``).
    """
    folder = tempfile.mkdtemp(prefix="course_check_dcp_")
    try:
        return check_answers_in_ranks(
            _SR_NAME, (save, resume), _SR_EXAMPLES, _sr_cases, (folder,),
            missing="write both functions in my_dcp.py and pass "
                    "\"my_dcp:save_sharded\", \"my_dcp:resume_sharded\".",
            world_sizes=(2, 3), timeout=120, hint=_SR_HINT,
            hang_hint="does every rank call save_sharded and resume_sharded (DCP's calls are "
                      "collective)?",
            passed="saved on 2 ranks and resumed on 3: parameters, Adam's moments, step and "
                   "learning rate bit for bit, and the next step equal to the run that never "
                   "stopped.", strict=strict)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
