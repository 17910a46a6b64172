"""The launch helpers' old home: they live in ``course_lib.checks.harness`` (public, documented in
``docs/library.md``); these names stay importable from here for checkers written before."""
from .harness import (  # noqa: F401 - re-exported under their old path
    UNANSWERED,
    check_in_ranks,
    first_failure_in_ranks,
    load_answer,
    resolve,
    worker_spec,
)

__all__ = ["UNANSWERED", "check_in_ranks", "first_failure_in_ranks", "load_answer", "resolve",
           "worker_spec"]
