"""Checkers for the exercises of lesson 15 (activation memory: recomputation, mixed precision,
sequence parallelism), each against torch's own version and one process (its docstring says what
it tries; it prints its verdict, the first failing case, and returns it, truthy when right):
``check_checkpoint`` and ``check_scaler_update`` run the learner's function in this process
(defined in a notebook cell is fine); ``check_sequence_parallel_block`` runs the pair in worker
processes at 2, 3 and 4 ranks, which import it by module and name: write it to a file
(``%%writefile my_sequence.py``) and pass objects or strings such as
``"my_sequence:enter_tp_region"``. The harness is ``course_lib.checks.harness``.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed.pipelining.memory import ActivationMeter
from ..models.gpt import MLP, Block, GPTConfig
from ._core import ExerciseResult, call_bounded, failure
from .harness import (
    StopRank,
    call_answer,
    check_answers_in_ranks,
    check_cases,
    close,
    counting,
    describe,
    group_of_one,
    keeps_kernel_state,
    load_answers,
    refusal_problem,
    run_in_step,
    said,
)

__all__ = ["check_checkpoint", "check_scaler_update", "check_sequence_parallel_block"]

_DTYPE = torch.float64


# ---- checkpoint ---------------------------------------------------------------------------------

_CKPT_NAME = "checkpoint"
_CKPT_HINT = ("recomputation keeps only what running the function again needs: its inputs, "
              "and where the random stream stood (dropout draws from it). Backward rebuilds the "
              "graph by running the function again and backpropagates the incoming gradients "
              "through it, which is how they reach the parameters and the inputs. Inside an "
              "autograd.Function, forward runs with grad mode off, and so does backward; the "
              "random stream is the caller's too; backward returns one value per argument of "
              "forward (the function has no gradient).")
_DROPOUT_P = 0.5


class _DropoutMLP(nn.Module):
    """Linear, GELU, dropout (always on), Linear: a function that draws random numbers."""

    def __init__(self, width: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.dropout(F.gelu(self.fc(x)), _DROPOUT_P, training=True))


class _Counted(nn.Module):
    """``module`` that counts its calls (a module still, for answers that expect one)."""

    def __init__(self, module: nn.Module, calls: list[int]):
        super().__init__()
        self.inner, self.calls = module, calls

    def forward(self, *args):
        self.calls[0] += 1
        return self.inner(*args)


def _counted(function: Callable, calls: list[int]) -> Callable:
    if isinstance(function, nn.Module):
        return _Counted(function, calls)

    @functools.wraps(function)
    def call(*args):
        calls[0] += 1
        return function(*args)
    return call


def _checkpoint_cases() -> list[tuple[str, Callable, list[nn.Parameter], list[torch.Tensor],
                                      bool]]:
    """(what, function, its parameters, its inputs, draws random numbers?), in float64."""
    gen = torch.Generator().manual_seed(15)
    torch.manual_seed(15)
    mlp = MLP(GPTConfig(n_embd=8, n_head=2)).to(_DTYPE)
    block = Block(GPTConfig(n_embd=12, n_head=3, block_size=6)).to(_DTYPE)
    linear = nn.Linear(6, 6).to(_DTYPE)
    dropout = _DropoutMLP(8).to(_DTYPE)

    def two_inputs(a, b):
        return torch.tanh(linear(a)) * b + a * torch.sin(b)

    return [
        ("an MLP (Linear 8->32, GELU, Linear 32->8) on x of shape (2, 5, 8)", mlp,
         list(mlp.parameters()), [torch.randn(2, 5, 8, generator=gen, dtype=_DTYPE)], False),
        ("a GPT Block(n_embd=12, n_head=3) on x of shape (2, 6, 12)", block,
         list(block.parameters()), [torch.randn(2, 6, 12, generator=gen, dtype=_DTYPE)], False),
        ("f(a, b) = tanh(linear(a)) * b + a * sin(b), two inputs of shape (3, 6)", two_inputs,
         list(linear.parameters()),
         [torch.randn(3, 6, generator=gen, dtype=_DTYPE),
          torch.randn(3, 6, generator=gen, dtype=_DTYPE)], False),
        (f"an MLP with dropout(p={_DROPOUT_P}) after its GELU, on x of shape (2, 5, 8)", dropout,
         list(dropout.parameters()), [torch.randn(2, 5, 8, generator=gen, dtype=_DTYPE)], True),
    ]


class _Run:
    """What one call of a checkpoint (or of the function itself) did: output, gradients, bytes
    saved for backward, calls of the function, random numbers drawn around backward."""

    def __init__(self):
        self.stage = "forward"
        self.output = None
        self.grads: list = []
        self.saved = self.calls_in_forward = self.calls = 0
        self.between: torch.Tensor | None = None
        self.after: torch.Tensor | None = None


def _one_run(wrap: Callable | None, function: Callable, params: list, inputs: list,
             seed: int, run: _Run | None = None) -> _Run:
    """``wrap(function, *inputs)`` (``function(*inputs)`` when ``wrap`` is None), then backward
    of ``sum(output * w)``, noted in ``run``. The random stream is seeded before forward;
    numbers are drawn between forward and backward (other layers' dropout) and after backward
    (the caller's next draw)."""
    run, calls = run or _Run(), [0]
    for p in params:
        p.grad = None
    xs = [x.clone().requires_grad_() for x in inputs]
    counted = _counted(function, calls)
    torch.manual_seed(seed)
    with ActivationMeter(exclude=params) as meter:
        out = counted(*xs) if wrap is None else wrap(counted, *xs)
        run.saved = meter.saved_alive
    run.output, run.calls_in_forward = out, calls[0]
    if not isinstance(out, torch.Tensor):
        return run
    run.between = torch.rand(5)
    run.stage = "backward"
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    if out.requires_grad:
        (out * w).sum().backward()
    run.after = torch.rand(3)
    run.grads = [x.grad for x in xs] + [p.grad for p in params]
    run.calls = calls[0]
    return run


def _torch_checkpoint(function: Callable, *args):
    import torch.utils.checkpoint as torch_checkpoint

    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)


def _grad_names(n_inputs: int, params: list, function: Callable) -> list[str]:
    names = ["the input's gradient"] if n_inputs == 1 else \
        [f"input {k}'s gradient" for k in range(n_inputs)]
    if isinstance(function, nn.Module):
        names += [f"{name}.grad" for name, _ in function.named_parameters()]
    else:
        names += [f"linear.{name}.grad" for name in ("weight", "bias")][:len(params)]
    return names


def _backward_error_hint(text: str) -> str:
    if "does not require grad" in text or "does not have a grad_fn" in text:
        return (" Backward runs with grad mode off: the function run again there recorded no "
                "graph, so there was nothing to backpropagate through (and inputs that do not "
                "require grad get no gradient).")
    if "number of gradients" in text:
        return " backward returns one value per argument of forward, the function included."
    if "second time" in text:
        return (" A graph was backpropagated through twice: the one rebuilt in backward is "
                "used once, and forward builds none.")
    return ""


def _compare_grads(got: list, want: list, names: list[str], against: str) -> str | None:
    for name, g, w in zip(names, got, want):
        if g is None:
            return (f"{name} is None after backward ({against}: {describe(w)}): no gradient "
                    "reached it. The incoming gradients reach the parameters only through the "
                    "graph rebuilt in backward, and the inputs only through what backward "
                    "returns.")
        if not close(g, w):
            why = ""
            if close(g, 2 * w):
                why = (" It is twice the right one: the gradient reached it twice, as if a "
                       "graph kept from forward and the rebuilt one were both used.")
            return f"{name} is {describe(g)}, {against} gives {describe(w)}.{why}"
    return None


def _checkpoint_problem(fn: Callable, what: str, function: Callable, params: list,
                        inputs: list, dropout: bool, seed: int) -> str | None:
    """What is wrong with ``fn`` on one case, or None."""
    plain = _one_run(None, function, params, inputs, seed)
    theirs = _one_run(_torch_checkpoint, function, params, inputs, seed)
    where = f"checkpoint(function, *inputs) with function {what}"
    mine = _Run()
    try:
        call_bounded(_one_run, fn, function, params, inputs, seed, mine)
    except (NotImplementedError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
        text = failure(exc)
        return f"{where}: {mine.stage} {text}.{_backward_error_hint(text)}"
    out, want = mine.output, plain.output
    if not close(out, want.detach()):
        got = describe(out) if isinstance(out, torch.Tensor) else type(out).__name__
        why = (" With dropout the output must be the function's on the same random stream."
               if dropout else "")
        return f"{where}: returned {got}, function(*inputs) returns {describe(want)}.{why}"
    if not out.requires_grad:
        return (f"{where}: the output does not require grad, so nothing flows back through "
                "it: autograd follows an autograd.Function only when its output comes from the "
                "Function's apply.")
    names = _grad_names(len(inputs), params, function)
    problem = _compare_grads(mine.grads, plain.grads, names, "running function without "
                             "checkpoint")
    if problem is not None:
        why = ""
        if dropout:
            why = (" The functions without randomness pass: here the recomputation drew a "
                   "different dropout mask from the one forward drew, because the random stream "
                   "had moved on since forward.")
        return f"{where}: {problem}{why}"
    problem = _compare_grads(mine.grads, theirs.grads, names,
                             "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
    if problem is not None:
        return f"{where}: {problem}"
    allowed = sum(x.nbytes for x in inputs)
    ran = {1: "once", 2: "twice"}.get(mine.calls, f"{mine.calls} times")
    if mine.saved > allowed:
        kept = (", as many as without checkpoint" if mine.saved >= plain.saved
                else f" (without checkpoint: {plain.saved})")
        once = (f", and the function ran {ran}: nothing was recomputed" if mine.calls < 2
                else "")
        return (f"{where}: {mine.saved} bytes were saved for backward{kept}; the inputs, "
                f"{allowed} bytes, are all a checkpoint may keep{once}. What the function's "
                "operations save for their own backward is what recomputation must not keep.")
    if mine.calls_in_forward != 1 or mine.calls != 2:
        return (f"{where}: the function ran {mine.calls_in_forward} time(s) during forward and "
                f"{mine.calls - mine.calls_in_forward} during backward; recomputation runs it "
                "once in forward (no graph) and once more in backward (with one).")
    if not torch.equal(mine.after, plain.after):
        rewound = torch.equal(mine.after, plain.between[:3])
        why = (" It was rewound to where forward left it: the numbers drawn next repeat ones "
               "already drawn." if rewound else "")
        return (f"{where}: after backward the random stream is not where it was without "
                f"checkpoint.{why} Backward may use the stream for the recomputation, but the "
                "caller's stream must come out of it as it went in.")
    return None


@keeps_kernel_state  # the cases and the runs seed torch's random state: put it back after
def check_checkpoint(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 1: ``checkpoint(function, *args)``, activation recomputation.

    In float64, on an MLP, a GPT ``Block`` (``course_lib.models.gpt``), a function of two tensor
    inputs and an MLP with dropout, each input requiring grad: the output must equal
    ``function(*args)``; after backward every input's and parameter's gradient must equal those
    of running the function without checkpoint (to rounding) and those of
    ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)``; the bytes saved
    for backward (``ActivationMeter``, parameters excluded) must be no more than the inputs'; the
    function must run once in forward and once more in backward; with dropout the same mask
    must be drawn again (the random state restored), and the caller's random stream must be
    left where it would be without checkpoint (numbers are drawn between forward and backward
    and after backward).

    Args:
        fn: your ``checkpoint(function, *args)``; None: not answered yet.
        strict: raise ``AssertionError`` on a wrong answer.
    """
    cases = [(*case, 150 + k) for k, case in enumerate(_checkpoint_cases())]  # seeds
    return check_cases(
        _CKPT_NAME, fn, cases, _checkpoint_problem, missing="define checkpoint and pass it here.",
        expected="a function checkpoint(function, *args)", hint=_CKPT_HINT,
        passed=f"on {len(cases)} functions (an MLP, a GPT Block, a function of two inputs, an "
               "MLP with dropout) the output and every gradient equal running without it and "
               "torch's checkpoint; only the inputs are saved, the function runs twice, dropout "
               "draws the same mask and the caller's random stream is left alone.",
        strict=strict)


# ---- the loss scaler's update rule --------------------------------------------------------------

_SCALER_NAME = "scaler update"
_SCALER_HINT = ("the scale shrinks after a step that overflowed (found_inf) and grows after "
                "growth_interval good steps in a row; growth_tracker counts those good steps, so "
                "whatever changes the scale also ends the run being counted. The factors and the "
                "interval are the arguments given, whatever their defaults.")
_INIT_SCALE = 2.0 ** 16


def _flags(seed: int, n: int, p: float) -> list[bool]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=gen) < p).tolist()


#: (what, keyword arguments passed (None: the defaults, none passed), overflow flags)
_SCALER_CASES = [
    ("growth_interval=3", dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
     [False, False, False, True, False, False, False, False, True, True] + _flags(1, 90, 0.2)),
    ("growth_interval=1, growth_factor=4.0, backoff_factor=0.125",
     dict(growth_factor=4.0, backoff_factor=0.125, growth_interval=1), _flags(2, 40, 0.3)),
    ("growth_interval=5, growth_factor=8.0, backoff_factor=0.25",
     dict(growth_factor=8.0, backoff_factor=0.25, growth_interval=5), _flags(3, 120, 0.1)),
    ("the defaults (growth_factor=2.0, backoff_factor=0.5, growth_interval=2000; no keyword "
     "passed)", None, [False] * 2000 + [True] + [False] * 1999 + [True, True] + [False] * 2001),
]


def _oracle_sequence(flags: list[bool], factors: dict) -> list[tuple[float, int]]:
    """(scale, growth tracker) after each step, by torch's own rule: ``torch._amp_update_scale_``
    on float32 tensors, or, in a torch without it, a ``torch.amp.GradScaler`` driven step by
    step (a zero or an infinite gradient)."""
    growth, backoff, interval = (factors["growth_factor"], factors["backoff_factor"],
                                 factors["growth_interval"])
    states = []
    if hasattr(torch, "_amp_update_scale_"):
        scale = torch.full((), _INIT_SCALE, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        found_inf = {f: torch.full((), float(f), dtype=torch.float32) for f in (False, True)}
        for found in flags:
            torch._amp_update_scale_(scale, tracker, found_inf[found], growth, backoff, interval)
            states.append((scale.item(), tracker.item()))
        return states
    return _oracle_with_grad_scaler(flags, growth, backoff, interval)


def _oracle_with_grad_scaler(flags: list[bool], growth: float, backoff: float,
                             interval: int) -> list[tuple[float, int]]:
    scaler = torch.amp.GradScaler("cpu", init_scale=_INIT_SCALE, growth_factor=growth,
                                  backoff_factor=backoff, growth_interval=interval)
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.0)
    states = []
    for found in flags:
        scaler.scale(torch.zeros(()))
        p.grad = torch.full((1,), float("inf") if found else 0.0)
        scaler.step(optimizer)
        scaler.update()
        states.append((scaler.get_scale(), int(scaler._get_growth_tracker())))
    return states


def _say_flags(flags: list[bool]) -> str:
    """``ok ×3, inf, ok``: the flags as runs."""
    runs: list[list] = []
    for f in flags:
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return ", ".join(("inf" if f else "ok") + (f" ×{n}" if n > 1 else "") for f, n in runs)


def _learner_sequence(fn: Callable, flags: list[bool], factors: dict | None) -> tuple[list, tuple]:
    """The learner's chain: each step from the state it returned; (its outputs, and (step,
    exception) where it raised or returned something unusable, else ())."""
    kwargs = factors or {}
    scale, tracker, outputs = _INIT_SCALE, 0, []
    for i, found in enumerate(flags):
        try:
            got = fn(scale, tracker, found, **kwargs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - the learner's error, said in words
            return outputs, (i, e)
        outputs.append(got)
        try:
            new_scale, new_tracker = got
            scale, tracker = float(new_scale), int(new_tracker)
        except (TypeError, ValueError):
            return outputs, (i, None)
    return outputs, ()


def _scaler_why(scale: float, tracker: int, found: bool, got: tuple[float, float],
                want: tuple[float, int], factors: dict) -> str:
    growth, backoff, interval = (factors["growth_factor"], factors["backoff_factor"],
                                 factors["growth_interval"])
    got_scale, got_tracker = got
    want_scale, want_tracker = want
    if found:
        if got_scale == scale:
            return " On an overflow the scale must shrink, by backoff_factor."
        if got_scale != want_scale and got_scale == scale * 0.5:
            return f" It halved, but backoff_factor is {backoff}."
        if got_scale == scale * growth:
            return (" It grew on an overflow: found_inf means the scale was too large and the "
                    "step was skipped.")
        if got_scale == want_scale and got_tracker != 0:
            return (" On an overflow the tracker goes back to 0: the good steps counted so far "
                    "are no longer in a row.")
        return ""
    if got_scale == scale * backoff and got_scale != want_scale:
        return " The scale shrank on a step without overflow: only an overflow shrinks it."
    if want_scale == scale * growth and got_scale == scale:
        return (f" This is good step number {tracker + 1} in a row, and growth_interval is "
                f"{interval}: the scale grows now (times growth_factor) and the tracker goes "
                "back to 0.")
    if want_scale == scale and got_scale != scale and got_scale > scale:
        return (f" The scale grew after {tracker + 1} good step(s) in a row; torch grows it "
                f"only when the count (tracker + 1) reaches growth_interval = {interval}.")
    if want_scale == scale * growth and got_scale != want_scale and got_scale == scale * 2.0:
        return f" It doubled, but growth_factor is {growth}."
    if got_scale == want_scale and got_tracker == tracker and want_tracker == tracker + 1:
        return " The tracker counts the good steps in a row, and this one is good."
    if got_scale == want_scale and want_tracker == 0 and got_tracker != 0:
        return " When the scale grows the tracker starts again from 0."
    return ""


def _scaler_problem(fn: Callable, what: str, factors: dict | None,
                    flags: list[bool]) -> str | None:
    used = factors or dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    want = _oracle_sequence(flags, used)
    mine, stopped = call_bounded(_learner_sequence, fn, flags, factors)
    kw = "" if factors is None else ", " + ", ".join(f"{k}={v!r}" for k, v in factors.items())
    scale, tracker = _INIT_SCALE, 0
    for i, found in enumerate(flags):  # the first step that differs, said after the loop
        call = f"update({scale!r}, {tracker!r}, found_inf={found}{kw})"
        if stopped and stopped[0] == i and stopped[1] is not None:
            said = f"{failure(stopped[1])}."
            break
        got = mine[i]
        try:
            got_scale, got_tracker = got
            got_scale, got_tracker = float(got_scale), float(got_tracker)
        except (TypeError, ValueError):
            said = f"returned {got!r}; expected a pair (new_scale, new_growth_tracker) of numbers."
            break
        if isinstance(got[1], bool) or not got_tracker.is_integer():
            said = f"returned the tracker {got[1]!r}; it is a count of good steps, an integer."
            break
        w_scale, w_tracker = want[i]
        if abs(got_scale - w_scale) > 1e-6 * abs(w_scale) or got_tracker != w_tracker:
            why = _scaler_why(scale, tracker, found, (got_scale, got_tracker),
                              (w_scale, w_tracker), used)
            said = (f"returned ({got[0]!r}, {got[1]!r}); torch's rule gives ({w_scale!r}, "
                    f"{w_tracker}).{why}")
            break
        scale, tracker = w_scale, w_tracker
    else:
        return None
    return (f"{what}, from scale={_INIT_SCALE:g} and growth_tracker=0, with the overflow flags "
            f"{_say_flags(flags[:i + 1])}: step {i + 1}, {call} {said}")


def check_scaler_update(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 2: the loss scaler's update rule, ``fn(scale, growth_tracker, found_inf, *,
    growth_factor=2.0, backoff_factor=0.5, growth_interval=2000) -> (new_scale,
    new_growth_tracker)``, plain numbers.

    From scale 2**16 and tracker 0, over sequences of overflow flags (``found_inf``, a bool):
    random ones with growth intervals 3, 1 and 5 and other factors passed as keywords, and 6003
    steps with the defaults (no keyword passed), where the scale must grow exactly on the
    2000th good step in a row. Each step starts from the state your function returned; it must
    equal torch's own rule (``torch._amp_update_scale_``, what ``torch.amp.GradScaler.update``
    runs) at every step. The first step that differs is shown with the flags so far.

    Args:
        fn: your update function; None: not answered yet.
        strict: raise ``AssertionError`` on a wrong answer.
    """
    steps = sum(len(flags) for _, _, flags in _SCALER_CASES)
    return check_cases(
        _SCALER_NAME, fn, _SCALER_CASES, _scaler_problem,
        missing="define your update function and pass it here.", expected="a function",
        hint=_SCALER_HINT, raised=lambda case, exc: f"{case[0]}: {failure(exc)}. {_SCALER_HINT}",
        passed=f"equal to torch's update rule at every one of {steps} steps in "
               f"{len(_SCALER_CASES)} sequences, the defaults included.", strict=strict)


# ---- sequence parallelism's conjugate pair ------------------------------------------------------

_SEQ_NAME = "sequence parallelism's g and g-bar (enter_tp_region, leave_tp_region)"
_SEQ_HINT = ("in (B, T, C) the sequence is dimension 1, and rank r holds block r of it. "
             "enter_tp_region makes every rank's block the whole sequence on every rank; "
             "leave_tp_region makes every rank's partial sums of the whole sequence the total "
             "of this rank's block. Backward receives the gradient of the output: which rank's "
             "output used which rank's input decides where each gradient goes and whether "
             "gradients add up. The flat collectives of compat work on flat tensors in rank "
             "order; the rank, the number of blocks and the collectives all come from the "
             "group given.")
_B, _C = 2, 5
_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")
_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
             "_reduce_scatter_base")
#: what counts as communication while the learner's functions run
_COLLECTIVES = (*_GATHERS, *_SCATTERS, "all_reduce", "all_to_all", "all_to_all_single",
                "broadcast", "gather", "scatter", "reduce", "send", "recv", "isend", "irecv",
                "batch_isend_irecv", "all_gather_object", "broadcast_object_list")


#: the harness's counter over this lesson's list, which adds the flat collectives' names
_counting = functools.partial(counting, collectives=_COLLECTIVES)


def _traffic_problem(calls: list[tuple[str, int]], kinds: tuple[str, ...], expected: str,
                     where: str) -> str | None:
    """None when ``calls`` is one collective of ``kinds``; else what is wrong with them."""
    if len(calls) == 1 and calls[0][0] in kinds:
        return None
    why = ""
    if any(n == "all_reduce" for n, _ in calls):
        why = (" An all-reduce moves twice the bytes of an all-gather or a reduce-scatter of the "
               "same tensor (a ring all-reduce is a reduce-scatter then an all-gather): the "
               "values are right, but sequence parallelism's pair would then cost twice "
               "tensor parallelism's all-reduce instead of the same.")
    return f"{where} made {said(calls, 'no collective')}; expected exactly one {expected}.{why}"


def _seq_length(world: int) -> int:
    return 12 if 12 % world == 0 else 3 * world


def _blocks(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(t.chunk(world, dim=1))


def _which_blocks(y: torch.Tensor, parts: torch.Tensor) -> list[int | None]:
    """For each block of ``y`` along dim 1 (of ``parts[0]``'s length), the rank whose part it
    equals (or None)."""
    n = parts.shape[2]
    found = []
    for k in range(y.shape[1] // n):
        block = y[:, k * n:(k + 1) * n]
        found.append(next((r for r in range(parts.shape[0]) if close(block, parts[r])), None))
    return found


def _shape_why(y: torch.Tensor, x_shape: tuple, world: int, gather: bool) -> str:
    B, T, C = x_shape
    if gather:
        if tuple(y.shape) == (world * B, T, C):
            return (" The blocks were joined along dimension 0, the batch: in (B, T, C) the "
                    "sequence is dimension 1.")
        if tuple(y.shape) == (B, T, world * C):
            return (" The blocks were joined along the last dimension, the features (that is "
                    "tensor parallelism's gather): sequence parallelism joins positions, "
                    "dimension 1.")
        if tuple(y.shape) == (B, T, C):
            return " It has this rank's shape: every rank's positions must be gathered."
    else:
        if tuple(y.shape) == (B // world, T, C) or (y.dim() == 3 and y.shape[0] != B):
            return (" It was split along dimension 0, the batch: in (B, T, C) the sequence is "
                    "dimension 1.")
        if y.dim() == 3 and y.shape[:2] == (B, T) and y.shape[2] != C:
            return (" It was split along the features (that is not sequence parallelism): "
                    "split the positions, dimension 1.")
        if tuple(y.shape) == (B, T, C):
            return " It is the whole sequence: keep only this rank's block of positions."
    return ""


def _gather_case(fn: Callable, group, xs: torch.Tensor, us: torch.Tensor,
                 where: str) -> Iterator[str | None]:
    """``fn`` = enter_tp_region on this rank's block ``tanh(xs[rank])``, upstream gradient
    ``us[rank]`` (its first positions with a group of one), for ``in_step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = world if group is None else 1
    parts = torch.tanh(xs)                                          # (world, B, T/world, C)
    want = torch.cat(list(parts), dim=1) if t > 1 else parts[rank]
    u = us[rank] if t > 1 else us[rank][:, :parts.shape[2]]
    want_grad = (sum(_blocks(us[r], world)[rank] for r in range(world)) if t > 1 else u)
    yield from _pair_steps(
        fn, group, xs[rank], u, want, want_grad, parts, t, where, name="enter_tp_region",
        expected="every rank's block, joined along dimension 1 in rank order",
        expected_grad="the sum over the ranks of block r of their upstream gradients",
        then="so it must be left as it is.",
        sends=((_GATHERS, "all-gather"), (_SCATTERS, "reduce-scatter")),
        why_shape=lambda y, x: _shape_why(y, tuple(x.shape), t, gather=True),
        why_value=lambda y: _gather_why(y, parts),
        why_grad=lambda got: _gather_grad_why(got, want_grad, us))


def _scatter_case(fn: Callable, group, ps: torch.Tensor, vs: torch.Tensor, us: torch.Tensor,
                  where: str) -> Iterator[str | None]:
    """``fn`` = leave_tp_region on this rank's partial sums ``tanh(ps[rank])``, upstream
    gradient ``vs[rank]`` (``us[rank]`` with a group of one), for ``in_step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = world if group is None else 1
    parts = torch.tanh(ps)                                          # (world, B, T, C)
    want = _blocks(parts.sum(0), world)[rank] if t > 1 else parts[rank]
    u = vs[rank] if t > 1 else us[rank]
    want_grad = torch.cat(list(vs), dim=1) if t > 1 else u
    yield from _pair_steps(
        fn, group, ps[rank], u, want, want_grad, parts, t, where, name="leave_tp_region",
        expected="the sum over the ranks of block r of x",
        expected_grad="every rank's upstream gradient joined along dimension 1",
        then="so the result must be written somewhere else.",
        sends=((_SCATTERS, "reduce-scatter"), (_GATHERS, "all-gather")),
        why_shape=lambda y, x: (
            " It is the whole sum over the ranks (an all-reduce): keep only this rank's block "
            "of positions." if y.shape == x.shape and close(y, parts.sum(0))
            else _shape_why(y, tuple(x.shape), t, gather=False)),
        why_value=lambda y: _scatter_why(y, parts),
        why_grad=lambda got: _scatter_grad_why(got, want_grad, vs))


def _pair_steps(fn: Callable, group, x_in: torch.Tensor, u: torch.Tensor, want: torch.Tensor,
                want_grad: torch.Tensor, parts: torch.Tensor, t: int, where: str, *, name: str,
                expected: str, expected_grad: str, then: str, sends: tuple, why_shape: Callable,
                why_value: Callable, why_grad: Callable) -> Iterator[str | None]:
    """What both cases check: ``fn`` (``name``) on ``tanh(x_in)`` with upstream gradient ``u``:
    its output (``want``, said as ``expected``; ``parts``: every rank's input) and its input's
    gradient (``want_grad``, ``expected_grad``) against one process, its input left alone
    (``then`` says why), and with t > 1 its collectives (``sends``: (kinds, name) forward,
    backward). The ``why_*`` say what a wrong shape, value or gradient is, where known (t > 1).
    """
    x = torch.tanh(x_in.clone().requires_grad_())     # tanh saves its output x for backward
    x.retain_grad()
    before = x.detach().clone()
    forward, backward = [], []
    with _counting(forward):
        y = _call_seq(f"{where}: forward", fn, x, group)
    problem = None
    if not isinstance(y, torch.Tensor):
        problem = (f"{where}: returned {type(y).__name__}, expected a tensor of shape "
                   f"{tuple(want.shape)}.")
    elif y.shape != want.shape:
        why = why_shape(y, x) if t > 1 else _GROUP_IGNORED
        problem = (f"{where}: returned a tensor of shape {tuple(y.shape)}, expected "
                   f"{tuple(want.shape)}.{why}")
    elif not close(y, want):
        why = why_value(y) if t > 1 else _WHOLE_WORLD if close(y, parts.sum(0)) else ""
        expected = expected if t > 1 else "its input unchanged (a group of one rank)"
        problem = (f"{where}: forward returned {describe(y)}, expected {expected} "
                   f"{describe(want)}.{why}")
    elif not torch.equal(x.detach(), before):
        problem = (f"{where}: {name} changed its input in place; autograd saved it for the "
                   f"backward of the operation that made it (here tanh), {then}")
    elif not y.requires_grad:
        problem = (f"{where}: the output does not require grad, so no gradient can flow back "
                   "through it: autograd follows an autograd.Function only when its output "
                   "comes from the Function's apply.")
    yield problem
    with _counting(backward):
        _call_seq(f"{where}: backward", y.backward, u.clone())
    got, problem = x.grad, None
    if not close(got, want_grad):
        why = why_grad(got) if t > 1 else ""
        if t == 1 and isinstance(got, torch.Tensor) and got.shape == want_grad.shape:
            why = (" With a group of this rank alone the gradient passes unchanged: backward's "
                   "collective must run over the group forward was given.")
        expected_grad = expected_grad if t > 1 else "its upstream gradient unchanged"
        problem = (f"{where}: the input's gradient is {describe(got)}, expected {expected_grad} "
                   f"{describe(want_grad)}.{why}")
    yield problem
    if t > 1:
        (kinds_f, name_f), (kinds_b, name_b) = sends
        yield (_traffic_problem(forward, kinds_f, name_f, f"{where}: forward")
               or _traffic_problem(backward, kinds_b, name_b, f"{where}: backward"))


def _call_seq(what: str, fn: Callable, *args):
    """``call_answer``, and what autograd's complaint about a gradient's shape means."""
    try:
        return call_answer(what, fn, *args)
    except StopRank as e:
        text = str(e)
        if "invalid gradient" in text:
            text += (" (backward returns one gradient per input of forward, of that input's "
                     "shape: enter_tp_region's input is this rank's block (B, T/t, C), "
                     "leave_tp_region's the whole sequence (B, T, C).)")
        raise StopRank(text) from None


_WHOLE_WORLD = (" It is the sum over every rank, but the group given has this rank alone: the "
                "collective ran over the whole world, not over the group.")
_GROUP_IGNORED = (" The group given has this rank alone, so the output is the input: the "
                  "number of blocks and the collective must come from the group, not the whole "
                  "world.")


def _gather_why(y: torch.Tensor, parts: torch.Tensor) -> str:
    rank, t = dist.get_rank(), dist.get_world_size()
    found = _which_blocks(y.detach(), parts)
    if any(r is None for r in found):
        return ""
    if all(r == rank for r in found):
        return " Every block is this rank's own: gather every rank's block."
    return (f" Its blocks along the sequence are those of ranks {found}, in that order: block r "
            f"of the sequence is rank r's, in rank order {list(range(t))}.")


def _gather_grad_why(got, want: torch.Tensor, us: torch.Tensor) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    if got is None:
        return ""
    if close(got, _blocks(us[rank], world)[rank]):
        return (" It is this rank's block of its own upstream gradient only: every rank's "
                "output used this rank's positions, so their gradients add up: the sum over "
                "the ranks of block r, a reduce-scatter (not a split).")
    if close(got, want / world):
        return " It is the average over the ranks: sum them (ReduceOp.SUM)."
    for r in range(world):
        if r != rank and close(got, sum(_blocks(us[q], world)[r] for q in range(world))):
            return f" It is the sum of block {r}, rank {r}'s positions: rank r keeps block r."
    return ""


def _scatter_why(y: torch.Tensor, parts: torch.Tensor) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    if close(y, _blocks(parts[rank], world)[rank]):
        return (" It is this rank's own block, not summed: every rank holds a partial sum of "
                "every position; add them over the ranks.")
    sums = _blocks(parts.sum(0), world)
    for r in range(world):
        if r != rank and close(y, sums[r]):
            return f" It is block {r}'s sum: rank r keeps block r, in rank order."
    return ""


def _scatter_grad_why(got, want: torch.Tensor, vs: torch.Tensor) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return ""
    blocks = _blocks(got.detach(), world)
    if close(blocks[rank], vs[rank]) and all(
            bool((b == 0).all()) for r, b in enumerate(blocks) if r != rank):
        return (" Only this rank's positions got a gradient (its own), zeros elsewhere: every "
                "rank's partial sums reached every rank's output, so the gradient is every "
                "rank's upstream gradient, joined along the sequence (all-gather).")
    if all(close(b, vs[rank]) for b in blocks):
        return (" Every block is this rank's own upstream gradient: gather every rank's, in rank "
                "order.")
    return ""


def _refusal_case(fn: Callable, where: str) -> Iterator[str | None]:
    """``fn`` must refuse a sequence the world size does not divide (yields what is wrong)."""
    world = dist.get_world_size()
    odd = 3 * world + 1                    # 7, 10, 13: no world size divides it
    yield refusal_problem(
        lambda: fn(torch.zeros(_B, odd, _C, dtype=_DTYPE), None),
        f"{where}, leave_tp_region(x) with x of shape ({_B}, {odd}, {_C})",
        what=f"{odd} positions", then=" (check before any collective)",
        advice="Raise ValueError, before any collective, when the world size does not divide "
               "the sequence length.")


def _sequence_cases(specs: tuple, seed: int) -> str | None:
    """In every rank: both functions on the whole group, then on a group of this rank alone,
    then the refusal of a sequence the group does not divide."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fns, error = load_answers(specs, ("function enter_tp_region", "function leave_tp_region"))
    if error:
        return error
    gather, scatter = fns
    alone = group_of_one()
    T = _seq_length(world)
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(world, _B, T // world, _C, generator=gen, dtype=_DTYPE)  # rank r's block
    us = torch.randn(world, _B, T, _C, generator=gen, dtype=_DTYPE)   # upstream, whole sequence
    ps = torch.randn(world, _B, T, _C, generator=gen, dtype=_DTYPE)   # rank r's partial sums
    vs = torch.randn(world, _B, T // world, _C, generator=gen, dtype=_DTYPE)  # upstream, block
    cases = []
    for group in (None, alone):
        tail = ")" if group is None else ", group=a group of this rank alone)"
        head = f"world_size={world}, rank {rank}, "
        cases.append(_gather_case(gather, group, xs, us,
                                  f"{head}enter_tp_region(x of shape {tuple(xs[0].shape)}{tail}"))
        cases.append(_scatter_case(scatter, group, ps, vs, us,
                                   f"{head}leave_tp_region(x of shape {tuple(ps[0].shape)}"
                                   f"{tail}"))
    cases.append(_refusal_case(scatter, f"world_size={world}, rank {rank}"))
    return run_in_step((case, "") for case in cases)


def check_sequence_parallel_block(enter_tp_region: Callable | str | None,
                                  leave_tp_region: Callable | str | None, *,
                                  world_sizes: tuple[int, ...] = (2, 3, 4),
                                  timeout: float = 60.0,
                                  strict: bool = False) -> ExerciseResult:
    """Exercise 3: sequence parallelism's conjugate pair, ``enter_tp_region(x, group=None)`` and
    ``leave_tp_region(x, group=None)``, on ``(B, T, C)`` tensors (the sequence is dimension 1).

    For each world size t, a process group of t worker processes; in float64, each rank passes
    its own input (a tanh's output, which autograd saved) and back-propagates its own upstream
    gradient:

    - ``enter_tp_region`` of this rank's block ``(B, T/t, C)`` must return every rank's block
      joined along dimension 1 in rank order ``(B, T, C)``, and give its input the sum over the
      ranks of block r of their upstream gradients;
    - ``leave_tp_region`` of this rank's partial sums ``(B, T, C)`` must return the sum over
      the ranks of block r ``(B, T/t, C)``, and give its input every rank's upstream gradient
      joined along dimension 1;
    - each equal to one process (which the course's ``gather_from_sequence_parallel_region`` /
      ``reduce_scatter_to_sequence_parallel_region`` equal), neither changing its input in
      place, each making exactly one collective forward and one backward, of no more bytes than
      the result needs;
    - with a group of this rank alone, both the identity both ways; a sequence length t does not
      divide, refused by ``leave_tp_region`` with ``ValueError``.

    Args:
        enter_tp_region: yours (importable by worker processes) or
            ``"my_sequence:enter_tp_region"``; None: not answered yet.
        leave_tp_region: yours, or ``"my_sequence:leave_tp_region"``; None: not
            answered yet.
        world_sizes: numbers of processes to try (3 matters: some wrong answers pass at 2).
        timeout: seconds for each world size (a function that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_answers_in_ranks(
        _SEQ_NAME, (enter_tp_region, leave_tp_region),
        ("my_sequence:enter_tp_region", "my_sequence:leave_tp_region"), _sequence_cases,
        (15,), world_sizes=world_sizes, timeout=timeout, hint=_SEQ_HINT,
        hang_hint="Does every rank make the same collectives, with the same group and tensors of "
                  "the same size? Each of the two makes one collective forward and one "
                  "backward, the same on every rank of the group.",
        passed=f"values and gradients equal one process and the course's for world sizes "
               f"{list(world_sizes)}, one collective each way, a group of one "
               f"rank honoured, a sequence the group does not divide refused.",
        missing="write enter_tp_region and leave_tp_region to my_sequence.py and pass them "
                "here.", strict=strict)
