"""Checkers for the exercises of lesson 14 (tensor parallelism, Megatron-LM style).

Each checker runs the learner's answer in worker processes at 2, 3 and 4 ranks, in float64,
against the same computation in one process, and counts its collectives where their number is
the point (its docstring says what it tries; it prints its verdict, the first failing case,
and returns it, truthy when right): ``check_conjugates`` (f and g),
``check_parallel_linears``, ``check_megatron_mlp``, ``check_vocab_parallel_cross_entropy``.
Worker processes import the answers by module and name, so they must live in files (in the
notebook: ``%%writefile my_conjugate.py``, ``my_linears.py``, ``my_mlp.py``, ``my_loss.py``);
pass them as objects or as strings such as ``"my_conjugate:f"``. PyTorch counterpart:
``torch.distributed.tensor.parallel``; the harness is ``course_lib.checks.harness``.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.gpt import MLP, GPTConfig
from ._core import ExerciseResult
from .harness import (
    ATOL,
    RTOL,
    UNANSWERED,
    StopRank,
    call_answer,
    check_answers_in_ranks,
    check_in_ranks,
    close,
    counting,
    describe,
    group_of_one,
    load_answer,
    load_answers,
    refusal_problem,
    run_in_step,
    said,
)

__all__ = ["check_conjugates", "check_megatron_mlp", "check_parallel_linears",
           "check_vocab_parallel_cross_entropy"]

_DTYPE = torch.float64


# ---- f and g ------------------------------------------------------------------------------------

_CONJUGATES_NAME = "conjugates f and g"
_CONJUGATES_HINT = ("f and g are there for autograd. f marks where every rank starts using the "
                    "same whole tensor: forward nothing changes, and backward the tensor's "
                    "gradient has a part on every rank, to be added up. g marks where each rank "
                    "holds a partial sum: forward the parts are added up, and backward every "
                    "rank already holds the same gradient. An autograd.Function lets forward and "
                    "backward do different things; its backward gives one gradient per input of "
                    "forward (a group has none). all_reduce writes into the tensor it is given, "
                    "and autograd may still need that tensor.")
_SHAPE = (3, 5)


def _conjugate_case(fn: Callable, which: str, group, xs: torch.Tensor, us: torch.Tensor,
                    where: str) -> Iterator[str | None]:
    """``fn`` (f or g) on ``tanh(xs[rank])``, upstream gradient ``us[rank]``: yields what is
    wrong (or None) after forward, then after backward (``in_step``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = world if group is None else 1
    a = xs[rank].clone().requires_grad_()
    x = torch.tanh(a)                             # tanh saves its output x for its backward
    x.retain_grad()
    before = x.detach().clone()
    y = call_answer(f"{where}: forward", fn, x, group)
    yield _conjugate_forward_problem(y, x, before, which, t, torch.tanh(xs), where)
    call_answer(f"{where}: backward", y.backward, us[rank].clone())
    yield _conjugate_backward_problem(x.grad, which, t, us, where)


def _conjugate_forward_problem(y, x: torch.Tensor, before: torch.Tensor, which: str, t: int,
                               parts: torch.Tensor, where: str) -> str | None:
    """What is wrong with ``y = which(x)`` (``parts``: every rank's input), or None."""
    rank = dist.get_rank()
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = describe(y) if isinstance(y, torch.Tensor) else type(y).__name__
        return f"{where}: returned {got}, expected a tensor of shape {tuple(x.shape)}."
    own, total, mean = parts[rank], parts.sum(0), parts.mean(0)
    want = own if which == "f" or t == 1 else total
    if not close(y, want):
        why = ""
        if which == "f" and close(y, total):
            why = (" It is the sum of every rank's input: f's forward is the identity; its "
                   "all-reduce belongs in its backward (summing forward is g's job).")
        elif close(y, mean):
            why = (" It is the average of every rank's input: "
                   + ("f's forward is the identity." if which == "f" else
                      "g sums, it does not average."))
        elif t == 1 and close(y, total):
            why = (" It is the sum over all the ranks, but the group given has this rank alone: "
                   "the collective ran over the whole world, not over the group.")
        elif which == "g" and close(y, own):
            why = " It is this rank's own input: g's forward sums it over the ranks."
        expected = ("its input unchanged" if which == "f" or t == 1
                    else "the sum of every rank's input")
        return (f"{where}: forward returned {describe(y)}, expected {expected} "
                f"{describe(want)}.{why}")
    if not torch.equal(x.detach(), before):
        return (f"{where}: {which} changed its input in place (dist.all_reduce writes into the "
                "tensor it is given). Autograd may have saved that tensor for the backward of "
                "the operation that made it (here tanh saved it), so the result must be written "
                "somewhere else.")
    if not y.requires_grad:
        return (f"{where}: the output does not require grad, so no gradient can flow back "
                f"through {which}: autograd follows an autograd.Function only when its output "
                "comes from the Function's apply.")
    return None


def _conjugate_backward_problem(got: torch.Tensor | None, which: str, t: int, us: torch.Tensor,
                                where: str) -> str | None:
    """What is wrong with the input's gradient ``got`` (``us``: every rank's upstream
    gradient), or None."""
    rank = dist.get_rank()
    total, mean, own = us.sum(0), us.mean(0), us[rank]
    want = total if which == "f" and t > 1 else own
    if not close(got, want):
        why = ""
        if which == "f" and close(got, own):
            why = (" It is this rank's own upstream gradient: f's backward must all-reduce "
                   "(sum) it over the group (every rank used the whole input).")
        elif which == "f" and close(got, mean):
            why = (" It is the average of the ranks' gradients, not their sum: each rank's "
                   "part is a separate term of the input's gradient.")
        elif which == "g" and close(got, total):
            why = (" It is the sum of every rank's upstream gradient: g's backward is the "
                   "identity (its output is the same on every rank; there is nothing to add).")
        elif which == "g" and close(got, mean):
            why = " It is the average over the ranks: g's backward is the identity."
        elif t == 1 and close(got, total):
            why = (" It is the sum over all the ranks, but the group given has this rank alone: "
                   "the collective in backward ran over the whole world, not over the group "
                   "(backward knows only what forward kept for it).")
        expected = ("the sum of every rank's upstream gradient" if which == "f" and t > 1
                    else "its upstream gradient unchanged")
        return (f"{where}: the input's gradient is {describe(got)}, expected {expected} "
                f"{describe(want)}.{why}")
    return None


def _conjugate_cases(specs: tuple, seed: int) -> str | None:
    """In every rank: f and g on the whole group, then on a group of this rank alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    answers, error = load_answers(specs, ("function f", "function g"))
    if error:
        return error
    fns = dict(zip("fg", answers))
    alone = group_of_one()
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(world, *_SHAPE, generator=gen, dtype=_DTYPE)   # rank r's input: xs[r]
    us = torch.randn(world, *_SHAPE, generator=gen, dtype=_DTYPE)   # and upstream gradient
    return run_in_step(
        (_conjugate_case(fns[which], which, group, xs, us,
                         f"world_size={world}, rank {rank}, {which}(x"
                         + (")" if group is None else ", group=a group of this rank alone)")), "")
        for group in (None, alone) for which in "fg")


def check_conjugates(f: Callable | str | None, g: Callable | str | None, *,
                     world_sizes: tuple[int, ...] = (2, 3, 4), timeout: float = 60.0,
                     strict: bool = False) -> ExerciseResult:
    """Exercise 1: Megatron's conjugate operations ``f(x, group=None)`` and ``g(x, group=None)``.

    For each world size, a process group of that many worker processes; in float64, each rank
    passes its own input (the output of a tanh, which autograd saved) through your function
    and back-propagates its own upstream gradient. f must return its input unchanged and give
    the input the sum of every rank's upstream gradient; g must return the sum of every rank's
    input and give the input its own upstream gradient unchanged. Neither may change its input
    in place. Then both again with a group of this rank alone: the identity both ways.

    Args:
        f: your f (importable by worker processes) or ``"my_conjugate:f"``; None: not answered
            yet.
        g: your g, or ``"my_conjugate:g"``; None: not answered yet.
        world_sizes: numbers of processes to try.
        timeout: seconds for each world size (a function that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_answers_in_ranks(
        _CONJUGATES_NAME, (f, g), ("my_conjugate:f", "my_conjugate:g"), _conjugate_cases, (14,),
        world_sizes=world_sizes, timeout=timeout, hint=_CONJUGATES_HINT,
        hang_hint="Does every rank call all_reduce the same number of times, with the same "
                  "group? f communicates in backward only, g in forward only.",
        passed=f"f and g give the right values and gradients on every rank for world sizes "
               f"{list(world_sizes)}, leave their input alone, and honour the group.",
        missing="write f and g to my_conjugate.py and pass them here.", strict=strict)


# ---- ColumnParallelLinear and RowParallelLinear -------------------------------------------------

_LINEARS_NAME = "parallel linears"
_LINEARS_HINT = ("weight is (out, in): a column-parallel layer keeps a block of output "
                 "features, a row-parallel one a block of input features, each rank its own "
                 "block in rank order, as parameters of its own. Which of f and g a layer's "
                 "input or output passes through follows from what each rank holds: in one "
                 "layer every rank uses the whole input, in the other each rank's product is a "
                 "partial sum of the whole output. The bias is one vector: it must count once "
                 "in the output. The rank, the number of blocks and the collectives all come "
                 "from the group given. (Does check_conjugates pass?)")
_B, _T = 2, 3
_IN = 7     # no world size divides it: a column-parallel layer must not split it


def _split_size(world: int) -> int:
    """Features split over the ranks: 24 (2, 3 and 4 divide it), else a multiple of ``world``."""
    return 24 if 24 % world == 0 else 6 * world


def _shard_problem(layer: nn.Module, attr: str, full: torch.Tensor | None, index: tuple,
                   others: list[tuple], what: str, where: str) -> str | None:
    """What is wrong with ``layer.<attr>`` as this rank's shard ``full[index]`` of a full
    weight or bias (``others``: the other ranks' indices, to recognise their blocks)."""
    p = getattr(layer, attr, None)
    if full is None:
        if p is not None:
            return (f"{where}: the nn.Linear has no bias (bias=False), so self.bias should be "
                    f"None, found {describe(p) if isinstance(p, torch.Tensor) else type(p)}.")
        return None
    want = full.detach()[index]
    shape = tuple(want.shape)
    if not isinstance(p, nn.Parameter):
        return (f"{where}: expected self.{attr}, an nn.Parameter of shape {shape} ({what}), "
                f"found {type(p).__name__}: the optimizer trains only what the layer "
                "registers as a parameter.")
    if p.dtype != full.dtype:
        return (f"{where}: self.{attr} has dtype {p.dtype}, the nn.Linear given has "
                f"{full.dtype}: a shard has the dtype of the layer it comes from.")
    if tuple(p.shape) != shape:
        why = ""
        if p.shape == full.shape:
            why = (f" It is the whole {attr}'s shape: this rank keeps only its block, "
                   "a 1/t share.")
        elif full.dim() == 2 and p.dim() == 2 and p.shape[0] == full.shape[0] and \
                shape[0] != full.shape[0]:
            why = (" You kept every row and split the columns: a column-parallel layer splits "
                   "the output features, which are the rows of weight (out, in).")
        elif full.dim() == 2 and p.dim() == 2 and p.shape[1] == full.shape[1] and \
                shape[1] != full.shape[1]:
            why = (" You kept every column and split the rows: a row-parallel layer splits the "
                   "input features, which are the columns of weight (out, in).")
        return (f"{where}: self.{attr} has shape {tuple(p.shape)}, expected {shape}: "
                f"{what}.{why}")
    if not torch.equal(p.detach(), want):
        why = ""
        for rank, other in enumerate(others):
            if other != index and torch.equal(p.detach(), full.detach()[other]):
                why = f" It is rank {rank}'s block: rank r keeps block r, in rank order."
                break
        return f"{where}: self.{attr} is {describe(p)}, expected {what} {describe(want)}.{why}"
    if p.untyped_storage().nbytes() > p.numel() * p.element_size():
        return (f"{where}: self.{attr} shares the memory of the whole tensor (a view of it): "
                f"this rank would keep all {full.numel()} elements alive, not its share; a "
                "shard must own its memory.")
    return None


def _params_problem(layer: nn.Module, expected: int, where: str) -> str | None:
    held = sum(p.numel() for p in layer.parameters())
    if held != expected:
        return (f"{where}: the layer holds {held} parameter elements, its shard is {expected}: "
                "did it keep the whole nn.Linear (or its weight) as well? Keep only the shard.")
    return None


def _grad_problem(got: torch.Tensor | None, want: torch.Tensor, what: str, where: str,
                  t: int) -> str | None:
    if got is None:
        return (f"{where}: {what} has no gradient after backward (None): is it used in forward "
                "through operations autograd follows?")
    if close(got, want):
        return None
    why = ""
    if t > 1 and close(got, want * t):
        why = (f" It is {t} times too large: the gradient of the replicated output was summed "
               "over the ranks (g's backward is the identity).")
    elif t > 1 and close(got, want / t):
        why = (f" It is 1/{t} of it: a bias split into t shares before the all-reduce gives "
               "the right output, but each rank's bias then enters it as a 1/t share and gets "
               "1/t of its gradient. The bias should enter the output whole, once.")
    return f"{where}: {what} is {describe(got)}, expected {describe(want)}.{why}"


def _grads_problem(grads: list[tuple], where: str, t: int) -> str | None:
    """The first ``_grad_problem`` of ``(got, want, what)`` in ``grads``, or None."""
    return next(filter(None, (_grad_problem(*g, where, t) for g in grads)), None)


def _one_process(module: nn.Module, n_in: int, n_out: int,
                 seed: int) -> tuple[torch.Tensor, ...]:
    """A batch ``X`` (B, T, n_in) and an output gradient ``U`` (B, T, n_out), the same on every
    rank, and ``module``'s output and input gradient on them in one process."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(_B, _T, n_in, generator=gen, dtype=_DTYPE)
    U = torch.randn(_B, _T, n_out, generator=gen, dtype=_DTYPE)
    X_ref = X.clone().requires_grad_()
    Y = module(X_ref)
    Y.backward(U)
    return X, U, Y, X_ref.grad


def _construct(cls: Callable, kind: str, n_in: int, out: int, bias: bool, group,
               where: str) -> tuple[nn.Linear, str, nn.Module]:
    """A new ``nn.Linear(n_in, out)``, ``where`` naming the layer, and ``cls(copy of it[,
    group=group])``; ``StopRank`` when that raises."""
    linear = nn.Linear(n_in, out, bias=bias, dtype=_DTYPE)
    where = (f"{where}, {kind}ParallelLinear(nn.Linear({n_in}, {out}"
             f"{'' if bias else ', bias=False'})"
             + (")" if group is None else ", group=a group of this rank alone)"))
    splits = f"out_features = {out}" if kind == "Column" else f"in_features = {n_in}"
    args = {} if group is None else {"group": group}
    try:
        return linear, where, cls(copy.deepcopy(linear), **args)
    except NotImplementedError:
        raise StopRank(UNANSWERED) from None
    except Exception as e:  # noqa: BLE001 - the learner's error, said in words
        text = " ".join(str(e).split())
        why = ""
        if isinstance(e, ValueError):
            why = (f" Here {splits} is divisible by the world size, and it is the only "
                   "size this layer splits.")
        raise StopRank(f"{where}: the constructor raised {type(e).__name__}: {text.rstrip('.')}."
                    f"{why}") from None


def _column_case(cls: Callable, bias: bool, group, where: str) -> Iterator[str | None]:
    """The column-parallel layer against one nn.Linear(7, out) (``in_step``)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    out = _split_size(dist.get_world_size())
    per = out // t
    full, where, layer = _construct(cls, "Column", _IN, out, bias, group, where)
    blocks = [(slice(k * per, (k + 1) * per),) for k in range(t)]
    span = f"{r * per}:{(r + 1) * per}"
    yield (_shard_problem(layer, "weight", full.weight, blocks[r], blocks,
                          f"rows {span} of the full weight {tuple(full.weight.shape)}", where)
           or _shard_problem(layer, "bias", full.bias, blocks[r], blocks,
                             f"elements {span} of the full bias", where)
           or _params_problem(layer, per * _IN + (per if bias else 0), where))
    X, U, Y, X_grad = _one_process(full, _IN, out, 3)
    X = X.requires_grad_()
    y = call_answer(f"{where}: forward", layer, X)
    want = Y.detach()[..., blocks[r][0]]
    problem = None
    if not close(y, want):
        why = ""
        if close(y, Y.detach()):
            why = (" It is the whole output: a column-parallel layer returns this rank's block "
                   "of output features, without gathering.")
        problem = (f"{where}: the output is "
                   f"{describe(y) if isinstance(y, torch.Tensor) else type(y).__name__}, "
                   f"expected features {span} of the full output {describe(want)}.{why}")
    yield problem
    call_answer(f"{where}: backward", y.backward, U[..., blocks[r][0]].clone())
    got = X.grad
    if not close(got, X_grad):
        why = ""
        mine = U[..., blocks[r][0]] @ full.weight.detach()[blocks[r]]
        if t > 1 and close(got, mine):
            why = (" It is this rank's part only (its block of features' contribution): "
                   "every rank used the whole input, so its gradient is the sum of every "
                   "rank's part.")
        problem = (f"{where}: the input's gradient is {describe(got)}, expected the one-process "
                   f"gradient {describe(X_grad)}.{why}")
    yield problem or _grads_problem(
        [(getattr(layer, attr).grad, tensor.grad[blocks[r]], f"self.{attr}.grad")
         for attr, tensor in (("weight", full.weight), ("bias", full.bias)) if tensor is not None],
        where, t)


def _row_case(cls: Callable, bias: bool, group, where: str) -> Iterator[str | None]:
    """The row-parallel layer against one nn.Linear(in, 7) (``in_step``)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n_in = _split_size(dist.get_world_size())
    out = _IN
    per = n_in // t
    full, where, layer = _construct(cls, "Row", n_in, out, bias, group, where)
    cols = [(slice(None), slice(k * per, (k + 1) * per)) for k in range(t)]
    yield (_shard_problem(layer, "weight", full.weight, cols[r], cols,
                          f"columns {r * per}:{(r + 1) * per} of the full weight "
                          f"{tuple(full.weight.shape)}", where)
           or _shard_problem(layer, "bias", full.bias, (slice(None),), [(slice(None),)],
                             "the whole bias", where)
           or _params_problem(layer, out * per + (out if bias else 0), where))
    X, U, Y, X_grad = _one_process(full, n_in, out, 4)
    x = X[..., cols[r][1]].clone().requires_grad_()               # this rank's block of features
    y = call_answer(f"{where}: forward", layer, x)
    problem = None
    if not close(y, Y.detach()):
        why = ""
        partial = x.detach() @ full.weight.detach()[cols[r]].T
        if isinstance(y, torch.Tensor) and y.shape == Y.shape and bias and t > 1:
            off = y.detach() - Y.detach()
            b = full.bias.detach()
            times = float((off * b).sum() / (b * b).sum().clamp_min(1e-30) / (_B * _T))
            if abs(times - (t - 1)) < 1e-6 and close(off, (t - 1) * b.expand_as(off)):
                why = (f" It holds the bias {t} times (t*b instead of b): every rank added it "
                       "to its partial sum, and the partial sums were added up.")
            elif close(off, times * b.expand_as(off)):
                why = (f" It is the right output plus {times:.4g} times the bias: the bias "
                       f"counted {times + 1:.4g} times instead of once.")
        if not why and t > 1 and (close(y, partial) or (bias and close(
                y, partial + full.bias.detach()))):
            why = (" It is this rank's partial product only: the output is the sum of every "
                   "rank's part.")
        problem = (f"{where}: the output is "
                   f"{describe(y) if isinstance(y, torch.Tensor) else type(y).__name__}, "
                   f"expected the full output {describe(Y)} on every rank.{why}")
    yield problem
    call_answer(f"{where}: backward", y.backward, U.clone())
    grads = [(x.grad, X_grad[..., cols[r][1]], "the gradient of this rank's block of the input"),
             (layer.weight.grad, full.weight.grad[cols[r]], "self.weight.grad")]
    if bias:
        grads.append((layer.bias.grad, full.bias.grad, "self.bias.grad"))
    yield _grads_problem(grads, where, t)


def _refusal_case(cls: Callable, kind: str, group, where: str) -> Iterator[str | None]:
    """``cls`` must refuse an nn.Linear whose split dimension the world size does not divide
    (yields what is wrong, or None)."""
    world = dist.get_world_size()
    odd = 6 * world + 1                     # 13, 19, 25: no world size divides it
    sizes = (_IN, odd) if kind == "column" else (odd, _IN)
    split = "output" if kind == "column" else "input"
    label = f"{'Column' if kind == 'column' else 'Row'}ParallelLinear(nn.Linear{sizes})"
    yield refusal_problem(
        lambda: cls(nn.Linear(*sizes, dtype=_DTYPE)), f"{where}, {label}",
        what=f"{odd} {split} features", named=f"the {odd} {split} features",
        advice=f"Raise ValueError with a clear message when the world size does not divide the "
               f"{split} size.")


def _linear_cases(specs: tuple, seed: int) -> str | None:
    """In every rank: both layers with and without bias, the refusals, then a group of one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    classes, error = load_answers(specs, ("class ColumnParallelLinear",
                                          "class RowParallelLinear"))
    if error:
        return error
    column, row = classes
    alone = group_of_one()
    where = f"world_size={world}, rank {rank}"
    cases = [(_column_case, column, True, None), (_column_case, column, False, None),
             (_row_case, row, True, None), (_row_case, row, False, None),
             (_refusal_case, column, "column", None), (_refusal_case, row, "row", None),
             (_column_case, column, True, alone), (_row_case, row, True, alone)]
    alone_note = (" With a group of one rank the layer is the whole nn.Linear: the rank, the "
                  "number of blocks and the collectives must all come from the group given, "
                  "not from the whole world.")
    # each from the same seed: the same full layer on every rank
    return run_in_step((_seeded(seed, case(cls, option, group, where)),
                        "" if group is None else alone_note)
                       for case, cls, option, group in cases)


def _seeded(seed: int, case: Iterator[str | None]) -> Iterator[str | None]:
    """``case`` started from ``torch.manual_seed(seed)``, when ``in_step`` first runs it."""
    torch.manual_seed(seed)
    yield from case


def check_parallel_linears(column_cls: Callable | str | None, row_cls: Callable | str | None,
                           *, world_sizes: tuple[int, ...] = (2, 3, 4), timeout: float = 60.0,
                           strict: bool = False) -> ExerciseResult:
    """Exercise 2: ``ColumnParallelLinear(linear, group=None)`` and
    ``RowParallelLinear(linear, group=None)``, an ``nn.Linear`` split over the ranks.

    For each world size t, a process group of t worker processes; in float64, each builds the
    same ``nn.Linear(7, 24)`` (column) and ``nn.Linear(24, 7)`` (row), with and without bias,
    hands a copy to your class and compares with the whole layer in one process, on the same
    batch (2, 3, features):

    - column: ``self.weight`` is exactly rows ``r*24/t:(r+1)*24/t`` of the weight (a copy, an
      ``nn.Parameter``), ``self.bias`` that block of the bias (or None); the output is that
      block of the full output; the input's gradient is the whole one-process gradient (f sums
      it), the weight and bias gradients the matching blocks;
    - row: ``self.weight`` is exactly columns ``r*24/t:(r+1)*24/t``, ``self.bias`` the whole
      bias; given this rank's block of the input features, the output is the full output on
      every rank (the bias added once), and the gradients are the matching slices;
    - ``nn.Linear(7, 6t+1)`` (column) and ``nn.Linear(6t+1, 7)`` (row) are refused with
      ``ValueError``;
    - with a group of this rank alone both layers are the whole ``nn.Linear``.

    Args:
        column_cls: your class (importable by worker processes) or
            ``"my_linears:ColumnParallelLinear"``; None: not answered yet.
        row_cls: your class or ``"my_linears:RowParallelLinear"``; None: not answered yet.
        world_sizes: numbers of processes to try (3 matters: many wrong answers pass at 2).
        timeout: seconds for each world size (a layer that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_answers_in_ranks(
        _LINEARS_NAME, (column_cls, row_cls),
        ("my_linears:ColumnParallelLinear", "my_linears:RowParallelLinear"), _linear_cases,
        (14,), world_sizes=world_sizes, timeout=timeout, hint=_LINEARS_HINT,
        hang_hint="Does every rank make the same collectives, in the same order, with the "
                  "same group?",
        passed=f"shards, outputs and gradients equal one nn.Linear for world sizes "
               f"{list(world_sizes)}, with and without bias; sizes that do not divide are "
               f"refused; a group of one rank is honoured.",
        missing="write both classes to my_linears.py and pass them here.", strict=strict)


# ---- the Megatron MLP ---------------------------------------------------------------------------

_MLP_NAME = "Megatron MLP"
_MLP_HINT = ("GELU acts on each number alone, but GELU(a + b) is not GELU(a) + GELU(b): what "
             "each rank holds after fc must be something GELU can act on alone, whole values "
             "rather than parts of a sum, and proj must take exactly that as its input, so that "
             "nothing is sent between the two layers. Which of your two layers gives that, and "
             "which takes it? Then the MLP needs one all-reduce forward and one backward.")


def _mlp_case(fn: Callable, bias: bool, where: str) -> Iterator[str | None]:
    """The learner's parallel MLP against the MLP in one process (``in_step``)."""
    t, r = dist.get_world_size(), dist.get_rank()
    C = 12 if 48 % t == 0 else 3 * t            # 4C divisible by t
    per = 4 * C // t
    where = f"{where}, MLP(GPTConfig(n_embd={C}{'' if bias else ', bias=False'}))"
    ref = MLP(GPTConfig(n_embd=C, n_head=1, bias=bias)).to(_DTYPE)
    mlp = call_answer(f"{where}: parallel_mlp", fn, copy.deepcopy(ref))
    if not isinstance(mlp, nn.Module):
        yield (f"{where}: parallel_mlp returned {type(mlp).__name__}, expected a module (the "
               "MLP changed in place, or a new one) whose forward is proj(gelu(fc(x))).")
    fc, proj = getattr(mlp, "fc", None), getattr(mlp, "proj", None)
    if not isinstance(fc, nn.Module) or not isinstance(proj, nn.Module):
        yield (f"{where}: expected the module returned to have .fc and .proj (the MLP's two "
               f"layers, split), found {type(fc).__name__} and {type(proj).__name__}.")
    rows = [(slice(k * per, (k + 1) * per),) for k in range(t)]
    cols = [(slice(None), slice(k * per, (k + 1) * per)) for k in range(t)]
    span = f"{r * per}:{(r + 1) * per}"
    problem = (
        _shard_problem(fc, "weight", ref.fc.weight, rows[r], rows,
                       f"rows {span} of fc's weight {tuple(ref.fc.weight.shape)}",
                       f"{where}, fc")
        or _shard_problem(fc, "bias", ref.fc.bias, rows[r], rows, f"elements {span} of fc's "
                          "bias", f"{where}, fc")
        or _shard_problem(proj, "weight", ref.proj.weight, cols[r], cols,
                          f"columns {span} of proj's weight {tuple(ref.proj.weight.shape)}",
                          f"{where}, proj")
        or _shard_problem(proj, "bias", ref.proj.bias, (slice(None),), [(slice(None),)],
                          "proj's whole bias", f"{where}, proj")
        or _params_problem(mlp, 2 * per * C + ((per + C) if bias else 0), where))
    yield problem
    X, U, Y, X_grad = _one_process(ref, C, C, 5)
    X = X.requires_grad_()
    forward, backward = [], []
    with counting(forward):
        y = call_answer(f"{where}: forward", mlp, X)
    if not close(y, Y.detach()):
        yield (f"{where}: the output is "
               f"{describe(y) if isinstance(y, torch.Tensor) else type(y).__name__}, expected "
               f"the one-process MLP's {describe(Y)} on every rank.")
    yield None
    with counting(backward):
        call_answer(f"{where}: backward", y.backward, U.clone())
    grads = [(X.grad, X_grad, "the input's gradient"),
             (fc.weight.grad, ref.fc.weight.grad[rows[r]], "fc.weight.grad"),
             (proj.weight.grad, ref.proj.weight.grad[cols[r]], "proj.weight.grad")]
    if bias:
        grads += [(fc.bias.grad, ref.fc.bias.grad[rows[r]], "fc.bias.grad"),
                  (proj.bias.grad, ref.proj.bias.grad, "proj.bias.grad")]
    yield _grads_problem(grads, where, t)
    one = [("all_reduce", _B * _T * C)]
    if forward == one and backward == one:
        return
    made = (f"{where}: one call of your MLP made {said(forward)} in forward and "
            f"{said(backward)} in backward")
    megatron = (f"exactly one all-reduce of B*T*C = {_B * _T * C} elements in forward and one "
                f"in backward")
    if len(forward) + len(backward) > 2:
        why = ""
        if any("gather" in n for n, _ in forward + backward):
            why = (" Nothing needs gathering between the layers: GELU acts on each hidden "
                   "feature alone, so each rank can apply it to the whole values it holds.")
        yield (f"{made}. That communicates more than Megatron's MLP, which makes {megatron}, "
               f"nothing else.{why}")
        return
    yield (f"{made}; Megatron's MLP makes {megatron}. (Collectives are counted through "
           f"torch.distributed: call them as dist.all_reduce.)")


def _mlp_cases(spec, seed: int) -> str | None:
    """In every rank: the learner's parallel MLP with and without biases."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fn, error = load_answer(spec)
    if error:
        return error
    where = f"world_size={world}, rank {rank}"
    return run_in_step((_seeded(seed, _mlp_case(fn, bias, where)), "")  # the same MLP on
                       for bias in (True, False))                       # every rank


def check_megatron_mlp(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3, 4),
                       timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise 3: ``fn(mlp, group=None)``, a GPT MLP split the Megatron way.

    For each world size t, a process group of t worker processes; each builds the same
    ``course_lib.models.gpt.MLP(GPTConfig(n_embd=12))`` in float64 (with and without biases),
    passes a copy to your function and compares the module it returns with the MLP in one
    process on the same batch (2, 3, 12): ``.fc`` holds rows ``r*48/t:(r+1)*48/t`` of fc's weight
    and bias, ``.proj`` those columns of proj's weight and its whole bias; the output, the
    input's gradient and the weight-gradient shards equal the one-process ones. And it counts
    the collectives of one call: exactly one all-reduce of B*T*C = 72 elements in forward and
    one in backward, nothing else.

    Args:
        fn: your function (importable by worker processes) or ``"my_mlp:parallel_mlp"``; None:
            not answered yet.
        world_sizes: numbers of processes to try.
        timeout: seconds for each world size (an MLP that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_in_ranks(
        _MLP_NAME, fn, "my_mlp:parallel_mlp", _mlp_cases, (14,), world_sizes=world_sizes,
        timeout=timeout, hint=_MLP_HINT,
        hang_hint="Does every rank make the same collectives, with the same group?",
        passed=f"output and gradients equal the one-process MLP for world sizes "
               f"{list(world_sizes)}, with one all-reduce forward and one backward.",
        missing="write parallel_mlp to my_mlp.py and pass it here.", strict=strict)


# ---- the vocabulary-parallel cross-entropy ------------------------------------------------------

_LOSS_NAME = "vocabulary-parallel cross-entropy"
_LOSS_HINT = ("for one position with logits z and target y, loss = log(sum_j exp(z_j - m)) - "
              "(z_y - m) for any m common to the whole vocabulary; with m the largest logit no "
              "exponential exceeds 1. Each of the three quantities (m, the sum, z_y) is a max "
              "or a sum over the vocabulary: each rank can compute its part from its block, "
              "and the parts combine into one number per position. Only the rank whose block "
              "holds y knows z_y; what do the others contribute? Which of the three must "
              "carry a gradient back to the shards, and which needs none?")
_POSITIONS = 6      # N: 6 rows (2-D), 2 x 3 (3-D)
_HIGH = 1000.0      # logits this large: an unshifted exp overflows float64 (past about 709)
_GAP = 720.0        # how far below a position's largest block the others lie (exp(-720) ~ 0)


def _loss_inputs(kind: str, t: int, per: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full logits ``(..., t * per)`` and the targets ``(...)`` of a case, the same on
    every rank; position i's target lies in block ``i % t`` ("2d") or ``(i // 2) % t``
    ("3d"), so that every rank's block holds targets.

    "2d", ``(6, V)``: every logit near 1000, so an exp without the shift overflows. "3d",
    ``(2, 3, V)``: position i's largest logits all lie in block ``i % t``, the other blocks 720
    lower, and the positions lie alternately near 0 and near 1000, so that a shift missing the
    block of the largest overflows and one shift for the whole batch underflows.
    """
    gen = torch.Generator().manual_seed(seed)
    n, vocab = _POSITIONS, t * per
    i = torch.arange(n)
    noise = 3 * torch.randn(n, vocab, generator=gen, dtype=_DTYPE)
    if kind == "2d":
        z, blocks, shape = _HIGH + noise, i % t, (n,)
    else:
        hot = torch.zeros(n, vocab, dtype=_DTYPE)
        for k in range(n):
            hot[k, k % t * per:(k % t + 1) * per] = _GAP
        base = _HIGH * (i % 2).to(_DTYPE) - _GAP
        z, blocks, shape = base[:, None] + hot + noise, (i // 2) % t, (2, 3)
    y = blocks * per + torch.randint(per, (n,), generator=gen)
    return z.reshape(*shape, vocab), y.reshape(shape)


def _loss_variants(z: torch.Tensor, y: torch.Tensor, per: int, t: int) -> dict[str, float]:
    """What some wrong answers return for the full logits ``z`` and targets ``y``: each rank's
    block shifted by its own largest logit ("local max"); a target logit added from every
    rank, the index of a target outside the block set to 0 ("masked") or clamped into it."""
    z, y = z.reshape(-1, z.shape[-1]), y.reshape(-1)
    n = y.numel()
    rows = torch.arange(n)
    m = z.amax(-1)
    shifted = z - m[:, None]
    lse = shifted.exp().sum(-1).log()
    blocks = z.view(n, t, per)
    m_r = blocks.amax(-1)                                                   # (n, t)
    s_local = (blocks - m_r[..., None]).exp().sum(-1).sum(-1)
    found = {"local max": float((s_local.log() - (z[rows, y] - m_r[rows, y // per])).mean())}
    for rule in ("masked", "clamped"):
        total = torch.zeros(n, dtype=z.dtype)
        for r in range(t):
            local = y - r * per
            outside = (local < 0) | (local >= per)
            local = local.clamp(0, per - 1) if rule == "clamped" else local.masked_fill(outside, 0)
            total += shifted[rows, r * per + local]
        found[rule] = float((lse - total).mean())
    return found


def _loss_diagnosis(value: float, want: float, z: torch.Tensor, y: torch.Tensor, per: int,
                    t: int) -> str:
    """Why the loss is ``value`` rather than ``want``, where recognised (else "")."""
    n = y.numel()

    def near(x: float) -> bool:
        return math.isclose(value, x, rel_tol=1e-9, abs_tol=1e-12)

    if t > 1:
        found = _loss_variants(z, y, per, t)
        if near(found["local max"]):
            return (" It is what shifting each rank's block by its own largest logit gives: the "
                    "ranks' sums of exponentials then carry different shifts, and adding them "
                    "up mixes them. At each position every rank must subtract the same number, "
                    "the largest logit of the whole vocabulary.")
        if near(found["masked"]) or near(found["clamped"]):
            return (" It is what adding up a target logit from every rank gives: only the rank "
                    "whose block holds the target has the target's logit; the other ranks must "
                    "add nothing to that sum.")
    ratio = value / want                         # a cross-entropy is positive
    k = round(n / ratio) if ratio > 0 else 0
    divided = 1 <= k < n and math.isclose(n / ratio, k, rel_tol=1e-9)
    summed = t > 1 and math.isclose(ratio, t, rel_tol=1e-9)
    mean = (f"the sum of the {n} per-position losses divided by {k} instead of {n} (the mean is "
            f"over every position: every dimension but the last)")
    added = f"the loss added up over the {t} ranks (every rank already holds all of it)"
    if divided and summed:
        return f" It is {ratio:.4g} times the expected loss: {mean}, or {added}?"
    if divided:
        return f" It is {mean}."
    if summed:
        return f" It is {t} times the expected loss: {added}."
    m = float(z.reshape(-1, z.shape[-1]).amax(-1).mean())
    if near(want + m) or near(want - m):
        return (" It differs from the expected loss by the mean of the positions' largest "
                "logits: the shift was subtracted from one of the two terms (the sum of "
                "exponentials, the target's logit) and not from the other.")
    return ""


def _loss_value_problem(loss, want: float, losses: list | None, z: torch.Tensor,
                        y: torch.Tensor, per: int, t: int, where: str) -> str | None:
    """What is wrong with the loss returned (``losses``: every rank's, or None), or None."""
    n = y.numel()
    if not isinstance(loss, torch.Tensor):
        return (f"{where}: returned {type(loss).__name__}, expected the mean loss, a scalar "
                "tensor.")
    if loss.dim() != 0:
        why = (" That is one loss per position: the loss is their mean."
               if loss.shape == y.shape else "")
        return (f"{where}: returned {describe(loss)}, expected the mean loss over the {n} "
                f"positions, a scalar (shape ()).{why}")
    value = float(loss.detach())
    if math.isnan(value) or value == math.inf:
        then = " (and then nan: inf - inf, or inf / inf)" if math.isnan(value) else ""
        return (f"{where}: the loss is {value}, expected {want:.10g}. The logits here reach "
                f"about {_HIGH:g}, and exp overflows float64 past about 709: a sum of "
                f"exponentials became inf{then}. Subtract the largest logit first: "
                "log(sum_j exp(z_j)) = m + log(sum_j exp(z_j - m)) for any m, and with m the "
                "largest logit of the position, over the whole vocabulary, no term exceeds 1.")
    if value == -math.inf:
        tops = z.reshape(-1, z.shape[-1]).amax(-1)
        spread = float(tops.max() - tops.min())
        apart = (f"; here the positions' largest logits lie up to {spread:.0f} apart, so no one "
                 "number serves the whole batch" if spread > 745 else "")
        return (f"{where}: the loss is -inf, expected {want:.10g}: at some position every "
                "exponential underflowed to 0 (exp is 0 in float64 below about -745), and "
                "log(0) is -inf. The number subtracted at a position must be that position's "
                f"own largest logit, over the whole vocabulary, which makes its largest term "
                f"exp(0) = 1{apart}.")
    if losses is not None and not all(
            v is not None and math.isclose(v, losses[0], rel_tol=RTOL, abs_tol=ATOL)
            for v in losses):
        said = ", ".join("?" if v is None else f"{v:.10g}" for v in losses)
        return (f"{where}: the ranks returned different losses ({said}), expected {want:.10g} "
                "on every rank. A part of the loss was left as this rank's own share: each "
                "sum over the vocabulary is a sum over every rank's block.")
    if math.isclose(value, want, rel_tol=RTOL, abs_tol=ATOL):
        return None
    return (f"{where}: the loss is {value:.10g}, expected {want:.10g} (F.cross_entropy of the "
            f"whole logits).{_loss_diagnosis(value, want, z, y, per, t)}")


def _is_max(op) -> bool:
    try:
        return bool(op == dist.ReduceOp.MAX)
    except Exception:  # noqa: BLE001 - whatever the learner passed as op is not MAX
        return False


def _loss_forward_calls_problem(calls: list[tuple[str, int]], tracked: list, n: int,
                                per: int, where: str) -> str | None:
    """What is wrong with the collectives of one forward (``tracked``: those handed a tensor
    that requires grad), or None."""
    made = f"{where}: one call made {said(calls)} in forward"
    three = (f"three all-reduces of one number per position ({n} elements each): the largest "
             "logit, the sum of exponentials and the target's logit")
    if any(k >= n * per for _, k in calls):
        return (f"{made}. That sends the logits themselves: V/t = {per} numbers per position "
                f"instead of 3. The vocabulary-parallel loss needs {three}; the logits never "
                "leave their rank.")
    sizes = [k for name, k in calls if name == "all_reduce"]
    if len(sizes) != len(calls) or sum(sizes) != 3 * n or any(k % n for k in sizes):
        note = ("" if sum(k for _, k in calls) >= 3 * n else " (Collectives are counted "
                "through torch.distributed: call them as dist.all_reduce.)")
        return f"{made}; the vocabulary-parallel loss needs {three}, nothing else.{note}"
    if any(_is_max(op) for _, op in tracked):
        return (f"{where}: forward handed an all-reduce (MAX) a tensor that requires grad. The "
                "shift needs no gradient (the loss does not change when all of a position's "
                "logits move by the same amount), so the tensor given to that collective should "
                "carry none; autograd does not see a collective called directly, and torch "
                "warns that sending a gradient back through one is deprecated and may be "
                "silently wrong.")
    if tracked:
        return (f"{where}: forward handed {tracked[0][0]} a tensor that requires grad. Autograd "
                "does not see a collective called directly: the gradient goes back through it "
                "as if it were not there, which torch warns is deprecated and may be silently "
                "wrong. A sum whose gradient must reach the shards goes through an operation "
                "whose backward is defined: g.")
    return None


def _loss_grad_problem(got: torch.Tensor | None, z: torch.Tensor, y: torch.Tensor, per: int,
                       r: int, t: int, where: str) -> str | None:
    """What is wrong with this rank's shard's gradient ``got``, or None."""
    vocab, n = z.shape[-1], y.numel()
    shape = (*y.shape, per)
    block = slice(r * per, (r + 1) * per)
    soft = torch.softmax(z.reshape(-1, vocab), dim=-1)[:, block].reshape(shape) / n
    hit = F.one_hot(y.reshape(-1), vocab).to(_DTYPE)[:, block].reshape(shape) / n
    want = soft - hit
    if got is None:
        return (f"{where}: logits_shard.grad is None after backward: the loss does not depend "
                "on logits_shard through operations autograd follows.")
    if close(got, want):
        return None
    why = ""
    if t > 1 and close(got, want * t):
        why = (f" It is {t} times too large: the gradient was added up over the ranks on its "
               "way back, but every rank holds the same loss, and each shard's gradient is its "
               "own (the backward of a sum over the ranks passes the gradient through "
               "unchanged).")
    elif t > 1 and close(got, want / t):
        why = (f" It is 1/{t} of it: the gradient was shared out between the ranks, but each "
               "shard gets the whole gradient of its own logits.")
    elif close(got, -hit):
        why = (" It has the target's part (-1/N at the target) but not the softmax's: the "
               "gradient did not come back through the sum of exponentials. That sum over the "
               "ranks must be one autograd follows, whose backward reaches every rank's part.")
    elif close(got, soft):
        why = (" It has the softmax's part but not the target's (-1/N at the target): the "
               "gradient did not come back through the target's logit. That sum over the "
               "ranks must be one autograd follows, whose backward reaches the rank that holds "
               "the target.")
    return (f"{where}: logits_shard.grad is {describe(got)}, expected this rank's block of the "
            f"whole logits' gradient {describe(want)}.{why}")


def _loss_case(fn: Callable, kind: str, group, seed: int,
               where: str) -> Iterator[str | None]:
    """The learner's loss on this rank's block of a case's logits against ``F.cross_entropy``
    of the whole logits (``in_step``); collectives are counted with every rank only."""
    world = dist.get_world_size()
    t, r = dist.get_world_size(group), dist.get_rank(group)
    per = _split_size(world) // world
    z, y = _loss_inputs(kind, t, per, seed)
    shard = z[..., r * per:(r + 1) * per].clone().requires_grad_()
    where = (f"{where}, vocab_parallel_cross_entropy(logits_shard {tuple(shard.shape)}, targets "
             f"{tuple(y.shape)}" + (")" if group is None else
                                    ", group=a group of this rank alone)"))
    args = {} if group is None else {"group": group}
    forward: list[tuple[str, int]] = []
    tracked: list[tuple[str, object]] = []
    with counting(forward, tracked):
        loss = call_answer(f"{where}: forward", fn, shard, y.clone(), **args)
    losses = None
    if group is None:                               # every rank's loss, to compare them
        mine = float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 \
            else None
        losses = [None] * world
        dist.all_gather_object(losses, mine)
    want = float(F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1)))
    yield _loss_value_problem(loss, want, losses, z, y, per, t, where)
    yield None if group is not None else \
        _loss_forward_calls_problem(forward, tracked, y.numel(), per, where)
    yield None if loss.requires_grad else (
        f"{where}: the loss does not require grad, so no gradient can reach logits_shard: it "
        "was computed from tensors autograd does not follow back to logits_shard (a "
        "detached copy, or what a collective wrote).")
    backward: list[tuple[str, int]] = []
    with counting(backward):
        call_answer(f"{where}: backward", loss.backward)
    yield _loss_grad_problem(shard.grad, z, y, per, r, t, where)
    yield None if group is not None or not backward else (
        f"{where}: backward made {said(backward)}; the loss's backward needs no "
        "communication: every rank holds the same loss, and each shard's gradient follows "
        "from numbers this rank already has.")


def _loss_cases(spec, seed: int) -> str | None:
    """In every rank: 2-D and 3-D logits over every rank, then 2-D with a group of one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fn, error = load_answer(spec)
    if error:
        return error
    alone = group_of_one()
    alone_note = (" With a group of one rank the shard is the whole vocabulary: the rank, the "
                  "number of ranks and the collectives must all come from the group given, not "
                  "from the whole world.")
    return run_in_step(
        (_loss_case(fn, kind, group, seed + index, f"world_size={world}, rank {rank}"),
         "" if group is None else alone_note)
        for index, (kind, group) in enumerate((("2d", None), ("3d", None), ("2d", alone))))


def check_vocab_parallel_cross_entropy(fn: Callable | str | None, *,
                                       world_sizes: tuple[int, ...] = (2, 3, 4),
                                       timeout: float = 60.0,
                                       strict: bool = False) -> ExerciseResult:
    """Exercise 4: ``fn(logits_shard, targets, group=None)``, the cross-entropy of logits split
    over the ranks by vocabulary, without gathering them.

    For each world size t, a process group of t worker processes; in float64, rank r gets
    columns ``r*V/t:(r+1)*V/t`` of the same logits (V = 24 for t = 2, 3, 4) and the same
    targets, which fall in every rank's block, as ``(6, V/t)`` and ``(6,)``, then ``(2, 3, V/t)``
    and ``(2, 3)``. The logits reach about 1000, so an exp without a shift overflows; in the 3-D
    case each position's largest logits lie in one block, 720 above the others, and the
    positions lie 1000 apart. The loss must equal ``F.cross_entropy`` of the whole logits
    (the mean over positions) on every rank, and each shard's gradient the matching block of
    the whole gradient. One call may make three all-reduces of one number per position in
    forward (none given a tensor that requires grad: the sums go through g, the max needs no
    gradient) and nothing in backward. Then the 2-D case with a group of this rank alone: the
    shard is the whole vocabulary.

    Args:
        fn: your function (importable by worker processes) or
            ``"my_loss:vocab_parallel_cross_entropy"``; None: not answered yet.
        world_sizes: numbers of processes to try (3 matters: some wrong answers pass at 2).
        timeout: seconds for each world size (a loss that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_in_ranks(
        _LOSS_NAME, fn, "my_loss:vocab_parallel_cross_entropy", _loss_cases, (14,),
        world_sizes=world_sizes, timeout=timeout, hint=_LOSS_HINT,
        hang_hint="Does every rank make the same collectives, in the same order, with the same "
                  "group, also a rank whose block holds none of the targets?",
        passed=f"the loss and every shard's gradient equal F.cross_entropy of the whole logits "
               f"for world sizes {list(world_sizes)}, 2-D and 3-D, with logits an unshifted exp "
               f"overflows on; three all-reduces of one number per position, nothing gathered; "
               f"a group of one rank is honoured.",
        missing="write vocab_parallel_cross_entropy to my_loss.py and pass it here.", strict=strict)
