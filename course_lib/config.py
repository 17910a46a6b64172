"""Quick mode: the same lessons on a small slice of data, for CI and for a first look.

``COURSE_QUICK=1`` (set by ``make test``) shrinks data and epochs; the default is the full lesson.
"""
from __future__ import annotations

import os
from typing import TypeVar

__all__ = ["QUICK_TEST_SIZE", "QUICK_TRAIN_SIZE", "choose", "quick_mode"]

T = TypeVar("T")

#: Examples kept from each split in quick mode.
QUICK_TRAIN_SIZE = 2048
QUICK_TEST_SIZE = 1024


def quick_mode() -> bool:
    """True when the environment variable ``COURSE_QUICK`` is set to 1/true/yes/on."""
    return os.environ.get("COURSE_QUICK", "").strip().lower() in {"1", "true", "yes", "on"}


def choose(full: T, quick: T) -> T:
    """``quick`` in quick mode, ``full`` otherwise: ``num_epochs = choose(10, 1)``."""
    return quick if quick_mode() else full
