import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture
def no_gpus(monkeypatch):
    """Make torch report a CPU-only machine, whatever this one has."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# ---- no library's warning reaches a learner's cell output, on whichever torch runs the suite ----
# A Python warning prints as "PATH:LINE: CategoryWarning: text" on stderr; the course's own
# warnings (course_lib, a notebook's cells) are part of some lessons, a library's never are.
_WARNING_LINE = re.compile(r"^(?P<path>\S+?):\d+: (?P<category>[A-Z]\w*Warning): ", re.M)


def _foreign_warnings(outputs) -> list[str]:
    found = []
    for out in outputs or []:
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            for m in _WARNING_LINE.finditer(out.get("text", "")):
                if "course_lib" not in m.group("path") and "ipykernel" not in m.group("path") \
                        or "site-packages" in m.group("path"):
                    found.append(m.group(0) + out["text"][m.end():].split("\n", 1)[0])
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    if type(item).__name__ == "IPyNbCell":
        found = _foreign_warnings(getattr(item, "test_outputs", None))
        if found:
            pytest.fail(f"a library's warning reached the learner's output of this cell "
                        f"(torch {__import__('torch').__version__}): {found}", pytrace=False)
