"""Quick mode: the same lessons on a small slice of data, for CI and for a first look.

``COURSE_QUICK=1`` (set by ``make test``) shrinks data and epochs; the default is the full lesson.
``claim`` holds a lesson's text to the run it was written from, without failing a learner's run
on other hardware.
"""
from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["QUICK_TEST_SIZE", "QUICK_TRAIN_SIZE", "choose", "claim", "quick_mode", "stored_run"]

T = TypeVar("T")

#: Examples kept from each split in quick mode.
QUICK_TRAIN_SIZE = 2048
QUICK_TEST_SIZE = 1024


def _flag(name: str) -> bool:
    """True when the environment variable ``name`` is set to 1/true/yes/on."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def quick_mode() -> bool:
    """True when the environment variable ``COURSE_QUICK`` is set to 1/true/yes/on."""
    return _flag("COURSE_QUICK")


def choose(full: T, quick: T) -> T:
    """``quick`` in quick mode, ``full`` otherwise: ``num_epochs = choose(10, 1)``."""
    return quick if quick_mode() else full


def stored_run() -> bool:
    """True in the run that stores a lesson's outputs (``COURSE_STORED_RUN=1``, set by
    ``make notebooks``), False in a learner's run and under ``make test``."""
    return _flag("COURSE_STORED_RUN")


def claim(holds: object, finding: str) -> bool:
    """A measured finding of this run that the lesson's text reads, for example
    ``claim(gain > 0, "bucketed's step is shorter than naive's")``.

    The text was written from the stored run. In that run (``stored_run()``) the finding must
    hold: AssertionError otherwise, so no stored output contradicts its text. In any other run a
    finding that does not hold is printed, not raised: that machine answered differently, and
    the text describes the stored run. Returns whether it held.
    """
    if not isinstance(finding, str) or not finding:
        raise TypeError(f"claim: finding must be the text's sentence, a non-empty str; got "
                        f"{finding!r}.")
    if bool(holds):
        return True
    if stored_run():
        raise AssertionError(f"the text reads {finding!r}, and this run does not show it")
    print(f"Your run differs from the stored run the text reads: not {finding!r}. Read your "
          "numbers above; the text describes the stored run's.")
    return False
