"""The root conftest starts a notebook's kernel again when it dies while starting (nbval)."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "root_conftest", Path(__file__).resolve().parent.parent / "conftest.py")
root_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(root_conftest)


def _dies(times):
    calls = []

    def start(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) <= times:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "km", "kc"
    return start, calls


def test_a_kernel_that_dies_while_starting_is_started_again():
    start, calls = _dies(2)
    assert root_conftest._retrying(start)(startup_timeout=5, kernel_name="python3") == ("km", "kc")
    assert len(calls) == 3 and calls[-1][1] == {"startup_timeout": 5, "kernel_name": "python3"}


def test_the_third_death_is_raised():
    start, calls = _dies(3)
    with pytest.raises(RuntimeError, match="died before replying"):
        root_conftest._retrying(start)()
    assert len(calls) == root_conftest.KERNEL_START_TRIES == 3


def test_other_errors_are_not_retried():
    calls = []

    def start():
        calls.append(1)
        raise RuntimeError("Kernel info reqest timed out")
    with pytest.raises(RuntimeError, match="timed out"):
        root_conftest._retrying(start)()
    assert calls == [1]


def test_nbval_starts_kernels_through_the_retry():
    nbval_kernel = pytest.importorskip("nbval.kernel")
    assert getattr(nbval_kernel.start_new_kernel, "_course_retries", False)
