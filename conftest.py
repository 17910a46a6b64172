"""pytest hooks for the notebooks (run under nbval from the repository root; tests/conftest.py
holds the unit tests' fixtures)."""
import re

import pytest

# ---- no library's warning reaches a learner's cell output, on whichever torch runs the suite ----
# A Python warning prints as "PATH:LINE: CategoryWarning: text" on stderr; the course's own
# warnings (course_lib, a notebook's cells) are part of some lessons, a library's never are.
_WARNING_LINE = re.compile(r"^(?P<path>\S+?):\d+: (?P<category>[A-Z]\w*Warning): ", re.M)
# Libraries' logged warnings: torch's glog lines ("W1126 13:19:31.489000 1010 torch/x.py:646]")
# and torchao's note when its compiled kernels do not fit the torch installed.
_LOGGED_WARNING = re.compile(r"^(W\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] .*|"
                             r"Skipping import of cpp extensions.*)$", re.M)


def _foreign_warnings(outputs) -> list[str]:
    found = []
    for out in outputs or []:
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            for m in _WARNING_LINE.finditer(out.get("text", "")):
                if "course_lib" not in m.group("path") and "ipykernel" not in m.group("path") \
                        or "site-packages" in m.group("path"):
                    found.append(m.group(0) + out["text"][m.end():].split("\n", 1)[0])
            found += [m.group(0) for m in _LOGGED_WARNING.finditer(out.get("text", ""))]
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if type(item).__name__ == "IPyNbCell":
        found = _foreign_warnings(getattr(item, "test_outputs", None))
        if found:
            pytest.fail(f"a library's warning reached the learner's output of this cell "
                        f"(torch {__import__('torch').__version__}): {found}", pytrace=False)
    return result


# ---- a kernel that dies while starting is started again (at most three tries) -----------------
# Seen once in about forty clean-clone runs: every cell of one lesson errored at setup with
# "Kernel died before replying to kernel_info". Why it died was not captured (nbval sends the
# kernel's stderr to /dev/null); one known cause is a port taken between jupyter_client choosing
# the kernel's five TCP ports and the kernel binding them, which the suite's workers and the
# processes its tests launch make possible. jupyter_client's start_new_kernel shuts the dead
# kernel down before it raises, so starting again is clean.
KERNEL_START_TRIES = 3


def _retrying(start, tries=KERNEL_START_TRIES):
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, tries + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if attempt == tries or "died before replying" not in str(e):
                    raise
    return start_new_kernel


def pytest_configure(config):
    try:
        import nbval.kernel
    except ImportError:                   # the suite without nbval installed
        return
    if not getattr(nbval.kernel.start_new_kernel, "_course_retries", False):
        nbval.kernel.start_new_kernel = _retrying(nbval.kernel.start_new_kernel)
        nbval.kernel.start_new_kernel._course_retries = True
