"""The checking harness: run a learner's answer in worker processes, compare it with an oracle,
print the verdict. Every multi-process checker of the course is built on it, and so can a
homework author's.

A check has two halves. In every rank, a **worker** ``worker(spec, *args)`` loads the answer
(``load_answer(spec)``), runs it on the cases next to the oracle (the same computation in one
process, or torch's own), and returns None when every case matched, ``UNANSWERED`` when the
answer still raises ``NotImplementedError``, or one sentence saying what was wrong and where. In
the notebook, ``check_in_ranks`` ships the answer (a class or function defined in a file, or a
``"module:name"`` string) to one launch of worker processes that forms a process group of each
world size in turn, and turns the first failure into the printed verdict::

    from course_lib.checks.harness import UNANSWERED, check_in_ranks, load_answer

    def _cases(spec):                          # module level: worker processes import it
        rank, world = dist.get_rank(), dist.get_world_size()
        my_sum, error = load_answer(spec)
        if error:
            return error
        t = torch.full((3,), float(rank))
        try:
            my_sum(t)
        except NotImplementedError:
            return UNANSWERED
        want = torch.full((3,), float(sum(range(world))))
        return None if torch.equal(t, want) else f"rank {rank}: got {t.tolist()}"

    def check_my_sum(fn, *, strict=False):
        return check_in_ranks("my_sum", fn, "my_sum:my_sum", _cases, (), world_sizes=(2, 3),
                              timeout=30, hint="all-reduce in place.",
                              hang_hint="does every rank call the collective?",
                              passed="every rank holds the sum.", strict=strict)

Also here: ``verdict`` / ``ExerciseResult`` (a one-line verdict, logged for ``make grade``),
``call_bounded`` (a learner's function in this process under a deadline), ``check_answer`` /
``check_function`` (a value, or a function on cases, against the oracle),
``keeps_kernel_state`` (a checker leaves the learner's random state and grad mode as found),
``first_failure_in_ranks`` (the launch alone, its first failure as text),
``check_answers_in_ranks`` (``check_in_ranks`` for an exercise of several answers),
``check_cases`` (a function in this process on a list of cases, a diagnosis each). Inside a
worker, for cases that run collectives: ``in_step`` runs a case (a generator yielding what this
rank found wrong) in step with the other ranks, ``run_in_step`` a list of them, ``call_answer``
calls the learner's code (``StopRank`` when it raises), ``group_of_one``, ``counting``
(collectives called, by name and size), ``refusal_problem`` (a size the ranks cannot split,
refused), ``close`` and ``describe`` (tensors in float64, in words).

Why one launch for all world sizes: a fresh worker process pays seconds the first time it builds
torch's DDP or steps an optimizer (both import ``torch._dynamo``). One launch of
``max(world_sizes)`` processes forms a group of each size in turn from the same processes (the
ranks beyond it wait), so 2, 3 and 4 ranks cost 4 process starts instead of 9. Each world size
stays bounded by ``timeout`` on its own: a watchdog in every process ends the launch when one
overruns, and the verdict names that world size. PyTorch counterpart: none (torch's own tests
use ``MultiProcessTestCase``, one process group per test).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import shutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..devices import cpu_cores
from ..distributed.launch import unguarded_main_script
from ..distributed.recording import record_collectives
from ._core import (
    GRADE_LOG,
    CheckTimeout,
    ExerciseResult,
    as_numbers,
    call_bounded,
    check_answer,
    check_function,
    failure,
    refused,
    unanswered,
    verdict,
)

__all__ = ["ATOL", "GRADE_LOG", "RTOL", "UNANSWERED", "CheckTimeout", "ExerciseResult", "StopRank",
           "agree", "answer_kind", "as_numbers", "call_answer", "call_bounded", "check_answer",
           "check_answers_in_ranks", "check_cases", "check_function", "check_in_ranks", "close",
           "counting", "describe", "failure", "first_failure_in_ranks", "group_of_one", "in_step",
           "keeps_kernel_state", "load_answer", "load_answers", "refusal_problem", "resolve",
           "run_in_step", "said", "unanswered", "unguarded_script", "verdict",
           "verdicts_as_expected", "worker_spec"]

#: What a rank's worker returns when the learner's code still raises NotImplementedError.
UNANSWERED = "not answered: NotImplementedError"
#: Exit code of a worker whose world size ran past its time (the launch then stops them all).
_OVERRAN = 70
#: Prefix of a check's folder (rendezvous store, progress marks); the launcher's pid follows.
_PREFIX = "course_check_"


# ---- the learner's kernel, left as found -----------------------------------------------------

def keeps_kernel_state(checker: Callable) -> Callable:
    """Decorate a checker that runs in the learner's kernel: it runs with gradients on (an
    earlier cell may have switched them off; the oracle needs them), and torch's random state
    (CPU, and CUDA's where initialised) and grad mode are put back as found afterwards, so
    that ``torch.manual_seed(1); check(...); torch.rand(1)`` draws what it would without the
    check."""
    @functools.wraps(checker)
    def kept(*args, **kwargs):
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        grad = torch.is_grad_enabled()
        try:
            with torch.enable_grad():
                return checker(*args, **kwargs)
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            torch.set_grad_enabled(grad)
    return kept


def unguarded_script() -> str | None:
    """What to do when this process runs a Python script whose code is not under
    ``if __name__ == "__main__":`` (worker processes import that script again as they start, so
    each would run the check again and fail); None in a notebook or a guarded script."""
    return unguarded_main_script("start the check again")


# ---- the learner's function, as worker processes receive and import it -------------------------

def worker_spec(fn: Callable | str, example: str) -> Callable | tuple[str, str, str] | str:
    """What worker processes receive for the learner's ``fn``: the function itself, or
    ``(module, name, folder)`` for a ``"module:function"`` string (imported afresh in each
    worker from the current folder, so an edited file needs no kernel restart), or an error
    message (str) saying what to do. ``example`` is the string form to suggest.
    """
    if isinstance(fn, str):
        module_name, sep, attr = fn.partition(":")
        if not sep or not module_name or not attr:
            return (f"expected a function or a string 'module:function' such as {example!r}, "
                    f"got {fn!r}.")
        return (module_name, attr, os.getcwd())
    if not callable(fn):
        return f"expected a function or a string 'module:function', got {type(fn).__name__}."
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__" or "<locals>" in qualname or "<lambda>" in qualname:
        file = example.partition(":")[0]
        return ("worker processes cannot import a function defined in a notebook cell (or "
                f"inside another function). Write it to a file with %%writefile {file}.py and "
                f"pass {example!r}.")
    return fn


def resolve(spec: Callable | tuple[str, str, str]) -> Callable:
    """In a worker: the learner's function, given or imported from (module, name, folder)."""
    if callable(spec):
        return spec
    module_name, attr, folder = spec
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    return getattr(importlib.import_module(module_name), attr)


def load_answer(spec: Callable | tuple[str, str, str],
                what: str = "function") -> tuple[Callable | None, str | None]:
    """In a worker: ``(the learner's function or class, None)``, or ``(None, what went wrong)``
    when its file is missing or does not define it."""
    try:
        return resolve(spec), None
    except Exception as e:  # noqa: BLE001 - any import error is the learner's, said in words
        return None, (f"could not import your {what} in the workers: {type(e).__name__}: {e} "
                      "(did the %%writefile cell run?)")


def load_answers(specs: Sequence, whats: Sequence[str]) -> tuple[list | None, str | None]:
    """``load_answer`` of each spec (``whats``: "function f", "class RowParallelLinear", ...):
    ``(the answers, None)``, or ``(None, what went wrong)`` for the first that failed."""
    answers = []
    for spec, what in zip(specs, whats):
        answer, error = load_answer(spec, what)
        if error:
            return None, error
        answers.append(answer)
    return answers, None


# ---- one launch, a process group of each world size in turn ------------------------------------

def _new_folder() -> str:
    """A fresh folder for one check, named after this process; folders of checks whose process
    is gone (killed before its ``finally`` ran) are removed first."""
    from ..distributed.processes import pid_temp_folder

    return pid_temp_folder(_PREFIX)


def _mark(folder: str, name: str) -> None:
    """Leave an empty file ``name`` in ``folder``: how workers tell the launcher where they were."""
    with open(os.path.join(folder, name), "a"):
        pass


def _marked(folder: str, prefix: str) -> int | None:
    """The largest N of the files ``prefix-N`` in ``folder`` (None if there is none)."""
    found = [int(name.rpartition("-")[2]) for name in os.listdir(folder)
             if name.startswith(prefix + "-")]
    return max(found, default=None)


def _overran(folder: str, index: int) -> None:
    """The watchdog's end: world size number ``index`` ran past its time; stop this process
    (the launch then kills the others and the launcher reads the mark)."""
    _mark(folder, f"overran-{index}")
    os._exit(_OVERRAN)


def _in_each_world(worker: Callable, spec: Any, world_sizes: list[int], args: tuple,
                   folder: str, timeout: float) -> tuple[int, dict[int, str | None]] | None:
    """In every process of the launch: ``worker(spec, *args)`` in a group of each world size.

    The ranks below the world size form a fresh default group (a file rendezvous in
    ``folder``), so the learner's code sees ``dist.get_world_size()`` equal to it; the others
    wait. Each world size starts from torch's random state as a fresh worker has it (the same
    on every rank, as a launch of its own would give). A rank that found a failure publishes
    it and returns at once: its process ends, so a peer still waiting for it inside a
    collective fails at once too, as in a launch of its own. The others read every rank's
    result. Returns ``(index of the world size, {rank: result})`` where a failure stopped this
    process, or None when every world size passed.
    """
    rank = dist.get_rank()
    fresh = torch.get_rng_state()  # a rank of an earlier world size has drawn from it since
    dist.destroy_process_group()  # launch's group of every process: each size gets its own
    store = dist.FileStore(os.path.join(folder, "store"), max(world_sizes))
    store.set_timeout(timedelta(seconds=timeout * (len(world_sizes) + 1)))
    for index, world in enumerate(world_sizes):
        watchdog = threading.Timer(timeout, _overran, args=(folder, index))
        watchdog.daemon = True
        watchdog.start()
        try:
            if rank < world:
                _mark(folder, f"entered-{index}")
                torch.set_num_threads(max(1, cpu_cores() // world))
                torch.set_rng_state(fresh)
                dist.init_process_group("gloo", store=dist.PrefixStore(f"group{index}/", store),
                                        rank=rank, world_size=world,
                                        timeout=timedelta(seconds=2 * timeout))
                # every rank fully connected before any may return and exit (as in launch):
                # else a rank whose answer fails at once leaves while a peer still connects
                # to it, and the peer's "connectFullMesh failed" hides the learner's verdict
                dist.barrier()
                try:
                    found = worker(spec, *args)
                finally:
                    dist.destroy_process_group()
                store.set(f"result{index}/{rank}", pickle.dumps(found))
                if found is not None:
                    return index, {rank: found}
            results = {r: pickle.loads(store.get(f"result{index}/{r}")) for r in range(world)}
        finally:
            watchdog.cancel()
        if any(r is not None for r in results.values()):
            return index, results
    return None


def first_failure_in_ranks(worker: Callable, spec: Any, world_sizes: Sequence[int],
                           args: tuple, *, timeout: float, hang_hint: str,
                           hint: str) -> str | None:
    """Run ``worker(spec, *args)`` in a process group of each world size; the first failure.

    One ``launch`` of ``max(world_sizes)`` processes (gloo: the checkers' cases are small CPU
    tensors) forms a group of each size in turn. Each rank's worker returns None or a
    description of what it found wrong. A world size that takes more than ``timeout`` seconds
    becomes "no result within N s" with ``hang_hint``; a rank that raised or died, its first
    line; a wrong value, the description followed by ``hint``. None when every rank of every
    world size was right.
    """
    from ..distributed.launch import LaunchTimeout, WorkerError, launch

    world_sizes = list(world_sizes)
    if not world_sizes:  # the checker's author's mistake: "correct for no world size"
        raise ValueError("first_failure_in_ranks needs at least one world size, got none.")
    unguarded = unguarded_script()
    if unguarded is not None:
        return unguarded
    folder = _new_folder()
    hung = f"no result within {timeout:g} s. {hang_hint}"
    try:
        try:
            results = launch(_in_each_world, max(world_sizes), worker, spec, world_sizes, args,
                             folder, timeout, backend="gloo",
                             timeout=timeout * (len(world_sizes) + 1))
        except LaunchTimeout:
            return f"world_size={world_sizes[_marked(folder, 'entered') or 0]}: {hung}"
        except WorkerError as e:
            index = _marked(folder, "overran")
            if index is not None:
                return f"world_size={world_sizes[index]}: {hung}"
            index = _marked(folder, "entered") or 0
            return f"world_size={world_sizes[index]}: {str(e).splitlines()[0]}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stopped = [r for r in results if r is not None]  # (world size index, {rank: result})
    if not stopped:
        return None
    first = min(index for index, _ in stopped)
    failures = [f for index, found in stopped if index == first for f in found.values()
                if f is not None]
    # a rank that saw a wrong value says more than a peer whose collective then broke
    return f"{sorted(failures, key=lambda f: 'raised' in f)[0]} Hint: {hint}"


def verdicts_as_expected(table: Sequence[tuple], *args: Any) -> str | None:
    """A homework author's test that each wrong answer gets the diagnosis meant for it: a worker
    for ``first_failure_in_ranks(verdicts_as_expected, table, world_sizes, args, ...)``.

    ``table`` holds rows ``(what, cases, answer, expected)``: ``cases(answer, *args)`` is the
    checker's own per-rank worker (a module-level function, it travels to the ranks by name),
    and ``expected`` maps a world size to a phrase its verdict must contain, or to None where
    the answer must pass; world sizes it does not name are skipped. Every rank runs every row
    (the ranks agree on every verdict, so they stay in step). Returns what differed, one line a
    row, or None.
    """
    world = dist.get_world_size()
    differ = []
    for what, cases, answer, expected in table:
        if world not in expected:
            continue
        got, want = cases(answer, *args), expected[world]
        right = got is None if want is None else got is not None and want in got
        if not right:
            differ.append(f"{what}, world_size={world}: expected {want!r}, got {got!r}")
    return "\n".join(differ) or None


def answer_kind(answer: Callable | str, example: str) -> str:
    """"class" when ``answer`` is a class (or names one: ``"my_ddp:OverlapDDP"``, or the
    ``example`` does), else "function": how verdicts speak of the learner's answer."""
    if isinstance(answer, type):
        return "class"
    named = answer if isinstance(answer, str) and ":" in answer else example
    return "class" if named.partition(":")[2][:1].isupper() else "function"


# ---- inside a worker: cases in step with the other ranks ---------------------------------------

#: float64 tolerances: a right answer differs from the oracle by the order of a sum only
RTOL, ATOL = 1e-10, 1e-12


class StopRank(Exception):
    """The learner's code raised: this rank stops at once (a peer may be inside a collective
    this rank will never join; its process ending breaks that collective)."""


def call_answer(what: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; a NotImplementedError becomes ``StopRank(UNANSWERED)``, any other
    exception a ``StopRank`` saying what raised what."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise StopRank(UNANSWERED) from None
    except Exception as e:  # noqa: BLE001 - the learner's error, said in words
        text = " ".join(str(e).split())
        if "modified by an inplace operation" in text:
            text += (" (something overwrote a tensor autograd had saved: all_reduce writes "
                     "its result into the very tensor it is given)")
        raise StopRank(f"{what} raised {type(e).__name__}: {text}") from None


def agree(failure: str | None) -> str | None:
    """The first failure of any rank (lowest rank first), the same on every rank: every rank
    stops, or none (one that returned alone would leave its peers in the next collective)."""
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f is not None), None)


def in_step(case: Iterator[str | None]) -> str | None:
    """Run ``case``, a generator that yields what this rank found wrong (or None) wherever every
    rank must have got as far before any goes on (before the next collective), in step with
    the other ranks: the first failure of any rank, the same on every rank, or None. A
    ``StopRank`` from the learner's code passes through."""
    for found in case:
        found = agree(found)
        if found is not None:
            case.close()
            return found
    return None


def run_in_step(cases: Iterable[tuple[Iterator[str | None], str]]) -> str | None:
    """Each ``(case, note)`` through ``in_step``, in turn: the first failure with ``note``
    added, or what the learner's code raised (``StopRank``), or None when all passed."""
    for case, note in cases:
        try:
            found = in_step(case)
        except StopRank as e:
            return str(e)
        if found is not None:
            return found + note
    return None


def refusal_problem(call: Callable[[], Any], where: str, *, what: str, named: str | None = None,
                    then: str = "", advice: str) -> str | None:
    """None when ``call()`` (the learner's code on a size the ranks cannot split) raises a
    ValueError with a message; else what is wrong. ``what``: what cannot be split ("13
    positions"), ``named`` how the missing message's advice names it (default ``what``),
    ``then`` added to what was expected, ``advice`` what to do when nothing was raised."""
    world = dist.get_world_size()
    try:
        call()
    except NotImplementedError:
        raise StopRank(UNANSWERED) from None
    except ValueError as e:
        if str(e).strip():
            return None
        return (f"{where}: raised ValueError without a message: say what cannot be split "
                f"({named or what} over {world} ranks) and what to do.")
    except Exception as e:  # noqa: BLE001 - the learner's error, said in words
        return (f"{where}: raised {type(e).__name__}: {' '.join(str(e).split())}; expected a "
                f"ValueError saying that {world} ranks cannot split {what} evenly{then}.")
    return f"{where} did not raise: {what} cannot be split evenly over {world} ranks. {advice}"


def group_of_one() -> dist.ProcessGroup:
    """A group of this rank alone (new_group is collective: every rank makes every one)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]


def describe(t: torch.Tensor | None) -> str:
    """A tensor in words: its first values and its shape."""
    if t is None:
        return "None"
    values = ", ".join(f"{v:.4g}" for v in t.detach().flatten()[:3].tolist())
    return f"[{values}{', ...' if t.numel() > 3 else ''}] of shape {tuple(t.shape)}"



def close(got: Any, want: torch.Tensor) -> bool:
    """``got`` is a tensor of ``want``'s shape, equal to it to float64 rounding."""
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got.detach().to(want.dtype), want, rtol=RTOL, atol=ATOL))


@contextlib.contextmanager
def counting(calls: list[tuple[str, int]], tracked: list[tuple[str, object]] | None = None, *,
             collectives: tuple[str, ...] | None = None) -> Iterator[None]:
    """Note ``(name, elements)`` of every collective called inside (``record_collectives``:
    wherever the learner's code finds it, a collective inside another counted once);
    ``tracked`` (if given) gets ``(name, op)`` of each call handed a tensor that requires
    grad."""
    with record_collectives(collectives) as records:
        try:
            yield
        finally:
            calls.extend((r.name, r.elements) for r in records)
            if tracked is not None:
                tracked.extend((r.name, r.op) for r in records if r.requires_grad)


def said(calls: list[tuple[str, int]], none: str = "none") -> str:
    """The collectives ``counting`` noted, in words."""
    return ", ".join(f"{n} of {k} elements" for n, k in calls) or none


# ---- the whole check ---------------------------------------------------------------------------

def check_in_ranks(name: str, answer: Callable | str | None, example: str, worker: Callable,
                   args: tuple, *, world_sizes: Sequence[int], timeout: float, hint: str,
                   hang_hint: str, passed: str, strict: bool,
                   missing: str | None = None) -> ExerciseResult:
    """The verdict on a learner's ``answer`` (a function, a class or ``"module:name"``) that
    ``worker(spec, *args)`` judges in every rank of each world size.

    A function workers cannot import is refused with what to do (``example`` is the string to
    suggest); a worker that returns ``UNANSWERED`` (the learner's code still raises
    ``NotImplementedError``) makes it "not answered yet" ("your class" when the answer is a
    class: ``answer_kind``); the first failure, "not yet right";
    else ``passed``, "correct". With ``missing``, an answer left None is "not answered yet" and
    ``missing`` says what to do.
    """
    if answer is None and missing is not None:
        return verdict(name, None, missing, strict)
    spec = worker_spec(answer, example)
    if isinstance(spec, str):
        return verdict(name, False, spec, strict)
    found = first_failure_in_ranks(worker, spec, world_sizes, args, timeout=timeout,
                                   hang_hint=hang_hint, hint=hint)
    return _verdict_of(name, found, passed, strict, answer_kind(answer, example))


def check_answers_in_ranks(name: str, answers: tuple, examples: tuple[str, ...],
                           worker: Callable, args: tuple, *, missing: str,
                           world_sizes: Sequence[int], timeout: float, hint: str,
                           hang_hint: str, passed: str, strict: bool) -> ExerciseResult:
    """``check_in_ranks`` for an exercise of several answers (f and g; two classes): any None
    is "not answered yet" (``missing`` says what to do), each is sent to the workers as
    ``check_in_ranks`` sends one, and ``worker`` receives the tuple of them."""
    if any(answer is None for answer in answers):
        return verdict(name, None, missing, strict)
    specs = []
    for answer, example in zip(answers, examples):
        spec = worker_spec(answer, example)
        if isinstance(spec, str):
            return verdict(name, False, spec, strict)
        specs.append(spec)
    found = first_failure_in_ranks(worker, tuple(specs), world_sizes, args, timeout=timeout,
                                   hang_hint=hang_hint, hint=hint)
    return _verdict_of(name, found, passed, strict, "function")


def check_cases(name: str, fn: Callable | None, cases: Sequence[tuple],
                problem: Callable[..., str | None], *, missing: str, expected: str, hint: str,
                passed: str, strict: bool,
                raised: Callable[[tuple, BaseException], str] | None = None) -> ExerciseResult:
    """The verdict on a learner's function ``fn`` run in this process: ``problem(fn, *case)``
    says what is wrong on each case (None: right), calling ``fn`` itself.

    None is "not answered yet" (``missing`` says what to do); something not callable is
    refused (``expected``: the function asked for); ``NotImplementedError`` out of ``problem``
    is "not answered yet"; the first problem is "not yet right" with ``hint``; any other
    exception becomes ``raised(case, exc)`` (the whole message), or passes through when
    ``raised`` is None. Else ``passed``.
    """
    if (refusal := refused(name, fn, missing, strict, expected)) is not None:
        return refusal
    for case in cases:
        try:
            found = problem(fn, *case)
        except NotImplementedError:
            return unanswered(name, strict)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the learner's code failed: say how
            if raised is None:
                raise
            return verdict(name, False, raised(case, exc), strict)
        if found is not None:
            return verdict(name, False, f"{found} Hint: {hint}", strict)
    return verdict(name, True, passed, strict)


def _verdict_of(name: str, found: str | None, passed: str, strict: bool,
                what: str) -> ExerciseResult:
    """The verdict on the first failure the ranks found (None: ``passed``)."""
    if found is not None and UNANSWERED in found:
        return unanswered(name, strict, what=what)
    if found is not None:
        return verdict(name, False, found, strict)
    return verdict(name, True, passed, strict)
