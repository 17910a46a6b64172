"""The checking machinery every lesson's checkers share: verdicts, values, functions (the
conventions are in ``course_lib.checks``' docstring; a function that still raises
``NotImplementedError`` is "not answered yet", as an answer left None)."""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GRADE_LOG", "CheckTimeout", "ExerciseResult", "as_numbers", "call_bounded",
           "call_or_verdict", "check_answer", "check_function", "failure", "unanswered",
           "verdict"]

#: Environment variable naming a file: when set (``make grade`` sets it), every verdict is also
#: appended to that file as one JSON line ``{"name", "ok", "message"}``, for the grader to read.
GRADE_LOG = "COURSE_GRADE_LOG"


class ExerciseResult:
    """The verdict of a check: truthy when correct; its repr is the message."""

    def __init__(self, name: str, ok: bool | None, message: str):
        self.name, self.ok, self.message = name, ok, message

    def __bool__(self) -> bool:
        return bool(self.ok)

    def __repr__(self) -> str:
        mark = {True: "correct", False: "not yet right", None: "not answered yet"}[self.ok]
        return f"[{self.name}] {mark}: {self.message}"

    def _ipython_display_(self) -> None:
        """Show nothing as a cell's last value: the check printed its verdict when it ran."""


def verdict(name: str, ok: bool | None, message: str, strict: bool) -> ExerciseResult:
    """Print the one-line verdict of exercise ``name`` and return it (raise if ``strict``)."""
    result = ExerciseResult(name, ok, message)
    print(repr(result))
    log = os.environ.get(GRADE_LOG)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"name": name, "ok": ok, "message": message}) + "\n")
    if strict and not ok:
        raise AssertionError(repr(result))
    return result


def unanswered(name: str, strict: bool, what: str = "function") -> ExerciseResult:
    """The verdict for a scaffold whose body still raises ``NotImplementedError`` (``what``:
    "function", or "class" for an exercise that asks for one)."""
    where = ("its body in place of that line" if what == "function" else
             "the bodies of its methods in place of those lines")
    return verdict(name, None, f"your {what} still raises NotImplementedError: write {where} "
                   "and run the cell again.", strict)


def refused(name: str, fn: Any, missing: str, strict: bool,
            expected: str = "a function") -> ExerciseResult | None:
    """The verdict on an answer that is not a function yet: None is "not answered yet"
    (``missing`` says what to do), anything not callable "not yet right"; None if callable."""
    if fn is None:
        return verdict(name, None, missing, strict)
    if not callable(fn):
        return verdict(name, False, f"expected {expected}, got {type(fn).__name__}.", strict)
    return None


class CheckTimeout(Exception):
    """The learner's function did not return within the checker's time bound."""


class _Stopped(BaseException):
    """Stops an overrunning function's thread (not an Exception: the learner's code may catch
    those)."""


#: Seconds a learner's function may take on one input before the checker gives up on it.
TIME_LIMIT = 20.0
#: Seconds given to an overrunning function to stop once asked to.
STOP_GRACE = 3.0
#: Threads of learner functions that overran and could not be stopped: still running here.
_still_running: list[tuple[threading.Thread, dict]] = []


def _stop(thread: threading.Thread, box: dict, grace: float) -> bool:
    """Raise ``_Stopped`` inside ``thread`` at its next Python instruction (CPython's
    ``PyThreadState_SetAsyncExc``; a thread blocked inside one C call sees it only when the
    call returns), again every 0.1 s (its code may catch the first), for up to ``grace``
    seconds, unless the learner's function is over (``box`` filled); True when it has ended."""
    import ctypes
    import time

    deadline = time.monotonic() + grace
    while thread.is_alive() and time.monotonic() < deadline:
        if not box and thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(_Stopped))
        thread.join(0.1)
    return not thread.is_alive()


_RESTART = ("restart the kernel (Kernel > Restart Kernel, then run the cells again from the top) "
            "to stop it")


def call_bounded(fn: Callable, *args: Any, timeout: float | None = None) -> Any:
    """``fn(*args)`` in a worker thread joined with a deadline: a checker never hangs.

    Returns what ``fn`` returned; re-raises what it raised (``SystemExit`` included, as an
    ordinary exception the checker reports). Raises ``CheckTimeout`` after ``timeout`` seconds
    (default ``TIME_LIMIT``) and stops the thread: an exception is raised inside it at its
    next Python instruction. A function blocked inside one long C call (a wait on a lock, a
    socket) cannot be stopped that way: the verdict then says it is still running and that
    the kernel must be restarted, and no further function is started while it runs (each would
    only compete with it for the cores). The learner's function runs in the kernel's own
    process, not in a worker process, because checkers look at what it changed in place
    (an allreduce, an SGD step) and it may be defined in a notebook cell.
    """
    timeout = TIME_LIMIT if timeout is None else timeout
    for old in list(_still_running):
        if _stop(*old, grace=0.2):
            _still_running.remove(old)
    if _still_running:
        raise CheckTimeout(f"was not run: a function from an earlier check is still running in "
                           f"this kernel ({len(_still_running)} of them), stuck in a call that "
                           f"cannot be interrupted; {_RESTART}.")
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: B036 - handed to the caller below
                box["error"] = e
        except _Stopped:  # asked to stop just as the function ended
            box.setdefault("error", CheckTimeout("stopped"))

    worker = threading.Thread(target=run, name="checked-function", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        what = (f"did not return within {timeout:g} s (an endless loop, or a wait that never "
                "ends?)")
        if _stop(worker, box, STOP_GRACE):
            raise CheckTimeout(f"{what}; the checker stopped it")
        _still_running.append((worker, box))
        raise CheckTimeout(f"{what}, and it is still running in this kernel, stuck in a call "
                           f"that cannot be interrupted: {_RESTART}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def failure(exc: BaseException) -> str:
    """How a learner's exception reads in a verdict."""
    if isinstance(exc, CheckTimeout):
        return str(exc)
    if isinstance(exc, SystemExit):
        return f"called exit() / raised SystemExit({exc.code!r}) instead of returning"
    return f"raised {type(exc).__name__}: {exc}"


def call_or_failure(fn: Callable, *args: Any,
                    reraise: type[BaseException] | tuple = ()) -> tuple[Any, str | None]:
    """``call_bounded(fn, *args)``: ``(its value, None)``, or ``(None, what it raised, in the
    words of ``failure``)``; an exception of a type in ``reraise`` passes through."""
    try:
        return call_bounded(fn, *args), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: B036 - the learner's code failed: said in words
        if isinstance(exc, reraise):
            raise
        return None, failure(exc)


def call_or_verdict(name: str, strict: bool, fn: Callable, *args: Any, after: str = "",
                    before: str = "") -> tuple[Any, ExerciseResult | None]:
    """``call_bounded(fn, *args)`` as checkers call the learner's function: ``(its value,
    None)``, or ``(None, the verdict)`` if it raised: not answered yet for NotImplementedError,
    else what it raised between ``before`` and ``after`` (where it happened, a hint)."""
    try:
        value, error = call_or_failure(fn, *args, reraise=NotImplementedError)
    except NotImplementedError:
        return None, unanswered(name, strict)
    if error is not None:
        return None, verdict(name, False, f"{before}{error}{after}", strict)
    return value, None


def _same(got: Any, want: Any) -> None:
    """Raise AssertionError (or TypeError) unless ``got`` matches the oracle's ``want``."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want),
                                   check_dtype=False)
    elif isinstance(want, (list, tuple)) and want and isinstance(want[0], torch.Tensor):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise AssertionError(f"expected a list of {len(want)} tensors, got {_short((got,))}")
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    elif got != want:
        raise AssertionError(f"expected {want!r}, got {got!r}")


def check_answer(name: str, answer: Any, expected: Any, *, hint: str = "",
                 strict: bool = False) -> ExerciseResult:
    """Compare a value (number, list, tensor) with the expected one."""
    if answer is None:
        return verdict(name, None, "replace None with your answer and run the cell again.", strict)
    try:
        if isinstance(expected, torch.Tensor) or isinstance(answer, torch.Tensor):
            _same(answer, expected)
            ok = True
        elif isinstance(expected, float):
            ok = abs(float(answer) - expected) <= 1e-6 * max(1.0, abs(expected))
        else:
            ok = answer == expected
    except (AssertionError, TypeError, ValueError, RuntimeError):
        ok = False
    message = "well done." if ok else f"got {answer!r}. {hint}".strip()
    return verdict(name, ok, message, strict)


def check_function(name: str, fn: Callable | None, oracle: Callable,
                   cases: list[tuple], *, hint: str = "", strict: bool = False) -> ExerciseResult:
    """Call ``fn(*case)`` and ``oracle(*case)`` on each case; the results must match."""
    cases = list(cases)
    if not cases:  # the checker's author's mistake, not the learner's: "correct on 0 inputs"
        raise ValueError(f"check_function({name!r}) needs at least one case to try the function "
                         "on, got cases=[]; pass a list of argument tuples, e.g. [(3,), (5,)].")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    for case in cases:
        want = oracle(*case)
        got, failed = call_or_verdict(name, strict, fn, *case,
                                      after=f" on input {_short(case)}. {hint}".rstrip())
        if failed is not None:
            return failed
        try:
            _same(got, want)
        except (AssertionError, TypeError, ValueError, RuntimeError) as exc:
            return verdict(name, False, f"on input {_short(case)}: {exc}. {hint}".strip(), strict)
    return verdict(name, True, f"matches the course's answer on {len(cases)} inputs.", strict)


def _short(case: tuple) -> str:
    parts = [f"tensor{tuple(c.shape)}" if isinstance(c, torch.Tensor) else repr(c) for c in case]
    return "(" + ", ".join(parts) + ")"


def as_numbers(value: Any, count: int, what: str) -> tuple[list[float] | None, str]:
    """A learner's answer read as ``count`` floats: ``(numbers, "")``, or ``(None, message)``
    where the message says what was expected (``count`` numbers: ``what``) and what came."""
    try:
        numbers = [float(v) for v in value]
    except (TypeError, ValueError):
        return None, f"expected a list of {count} numbers ({what}), received {value!r}."
    if len(numbers) != count:
        return None, f"expected {count} numbers ({what}), received {len(numbers)}: {value!r}."
    return numbers, ""
