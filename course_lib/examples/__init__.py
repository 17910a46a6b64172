"""Runnable example scripts and importable worker functions for notebook 06.

Scripts (run them under a launcher; ``course_lib.distributed.example_path(name)`` gives their
path):

- ``hello_dist.py``: joins the group with ``init_distributed_mode`` (torchrun, mpirun, Slurm or
  none), checks ``dist.all_reduce`` against the hand-written ring, prints one JSON line per rank.

Workers for ``course_lib.distributed.launch`` live in ``workers.py`` (and the lessons' other
``*_workers.py``): ``launch`` starts fresh processes that import the function by name, so it
cannot be defined in a notebook cell. ``hello_records`` reads what ``hello_dist.py`` printed.
"""
from __future__ import annotations

import json

__all__ = ["hello_records"]


def hello_records(output: str | list[str]) -> list[dict]:
    """The ``hello_dist {json}`` line each rank of ``hello_dist.py`` printed, parsed and sorted by
    rank; ``output`` is a launcher's output (a string, or a list of strings to join)."""
    text = "".join(output) if isinstance(output, list) else output
    # mpirun forwards every rank's output through one stream, and two ranks' lines can arrive
    # glued together ("...}hello_dist {..."): decode each record where it starts, not by line
    decoder, records = json.JSONDecoder(), []
    for part in text.split("hello_dist ")[1:]:
        if part.startswith("{"):
            records.append(decoder.raw_decode(part)[0])
    return sorted(records, key=lambda r: r["rank"])
