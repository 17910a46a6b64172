"""Grade a learner's copy of a lesson: run it, and list each exercise with its verdict.

``python -m course_lib.checks.grade path/to/copy.ipynb`` (or ``make grade NB=...``) executes the
notebook in a fresh kernel in quick mode (``COURSE_QUICK=1``), each cell under a time bound,
collects the verdict of every checker it runs, and prints a table: right, wrong (with the first
failing case), not answered. Cells are numbered from 1, as JupyterLab counts them. The copy runs
in a fresh temporary folder, so the files its cells write (``%%writefile my_ddp.py``) are not
left beside it (two learners graded in one folder do not share answers). The exit status is 1
when an answered exercise is wrong or a cell raised an error, 0 otherwise. PyTorch counterpart:
none (nbgrader does this for whole courses).

Each exercise cell declares itself with a comment line that this module (and the reveal test,
``tests/test_reveal.py``) reads::

    # EXERCISE: ring_allreduce mirrors course_lib.parallel.comm.ring_allreduce

the name the learner defines (also the name of the reference answer in ``solutions/lessonNN.py``)
and, optionally, the library function or value it mirrors, which no earlier cell may display.
The verdicts come as JSON lines that every checker appends to the file named by
``COURSE_GRADE_LOG`` (``_core.verdict``), which the grader sets for the kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from ._core import GRADE_LOG

__all__ = ["Exercise", "GradeReport", "Row", "exercises", "grade", "main"]

#: ``# EXERCISE: name`` or ``# EXERCISE: name mirrors dotted.path``, alone on its line; the
#: mirrored path may instead sit in the cell's metadata, ``{"exercise_mirrors": {name: path}}``,
#: where naming it on screen would point the learner to the answer.
MARKER = re.compile(r"^#\s*EXERCISE:\s*(?P<name>\w+)(?:\s+mirrors\s+(?P<mirrors>[\w.]+))?\s*$",
                    re.MULTILINE)

#: Seconds one cell may run before the grader gives up on it.
CELL_TIMEOUT = 600


@dataclass(frozen=True)
class Exercise:
    """An exercise cell's declaration: the cell, the learner's name, what it mirrors."""

    cell: int
    name: str
    mirrors: str | None = None


@dataclass(frozen=True)
class Row:
    """One line of the grade table (``cell`` counted from 1, as JupyterLab does)."""

    cell: int
    name: str
    status: str          # "right", "wrong", "not answered" or "error"
    message: str


@dataclass
class GradeReport:
    """What ``grade`` found: one row per verdict (or per exercise cell that gave none)."""

    notebook: str
    rows: list[Row] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True when an answered exercise is wrong or a cell raised an error."""
        return any(r.status in ("wrong", "error") for r in self.rows)

    def table(self) -> str:
        """The rows as a fixed-width text table, with a count of each status at the end."""
        width = max([len(r.name) for r in self.rows] + [8])
        lines = [f"{'cell':>4}  {'exercise':<{width}}  {'verdict':<12}  details"]
        lines += [f"{r.cell:>4}  {r.name:<{width}}  {r.status:<12}  {r.message}" for r in self.rows]
        counts = {s: sum(r.status == s for r in self.rows)
                  for s in ("right", "wrong", "not answered", "error")}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f"  ({self.notebook})")
        return "\n".join(lines)


def exercises(nb) -> list[Exercise]:
    """The exercises a notebook (an ``nbformat`` node) declares, in order of their cells."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            hidden = cell.metadata.get("exercise_mirrors", {})   # kept off the learner's screen
            found += [Exercise(i, m["name"], m["mirrors"] or hidden.get(m["name"]))
                      for m in MARKER.finditer(cell.source)]
    return found


#: A verdict's ``ok`` as the table says it.
_STATUS = {True: "right", False: "wrong", None: "not answered"}


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


#: ipykernel's own log (its warning that it talks to the grader over local TCP without
#: encryption) is not the learner's: only errors of the kernel itself are shown.
_KERNEL_QUIET = ["--IPKernelApp.log_level=ERROR"]


def grade(path: str | os.PathLike, *, timeout: int = CELL_TIMEOUT, quick: bool = True,
          progress: Callable[[str], None] | None = None) -> GradeReport:
    """Execute the notebook at ``path`` (the learner's copy; the file is not modified) and grade
    it, each cell under ``timeout`` seconds, in quick mode (``COURSE_QUICK=1``: a slice of the
    data, few epochs) if ``quick``. ``progress`` is called with a line as each exercise cell
    starts (the command line prints it, so that a minute of running does not look like nothing).

    Returns a ``GradeReport``: a row per verdict, in the order the checkers ran (only the cells
    that declare an exercise count when the notebook declares any: a lesson may run a checker
    on the course's own code to show what it rejects); a row "error" for each cell that raised
    (its exception's first line), and for an exercise cell that gave no verdict.
    """
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grade: no notebook at {path}. Pass the path of your copy, e.g. "
                                "make grade NB=notebooks/02_replicate_and_allreduce.ipynb")
    nb = nbformat.read(path, as_version=4)
    declared = exercises(nb)
    report = GradeReport(str(path))
    with tempfile.TemporaryDirectory(prefix="course-grade-") as tmp:
        log, work = Path(tmp) / "verdicts.jsonl", Path(tmp) / "work"  # work: the kernel's folder
        log.touch()
        work.mkdir()
        env = {GRADE_LOG: str(log), "COURSE_QUICK": "1" if quick else "0", "TQDM_DISABLE": "1",
               "MPLBACKEND": "agg", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME",
                                                                          "lo")}
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                extra_arguments=_KERNEL_QUIET,
                                resources={"metadata": {"path": str(work)}})
        # the kernel inherits the environment; the grader's own is restored afterwards
        with mock.patch.dict(os.environ, env), client.setup_kernel():
            seen = 0
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                names = [e.name for e in declared if e.cell == i]
                if progress is not None and names:
                    progress(f"cell {i + 1}: checking {', '.join(names)} ...")
                try:
                    client.execute_cell(cell, i)
                except Exception as exc:  # noqa: BLE001 - a timeout or a dead kernel: a row
                    report.rows.append(Row(i + 1, "(cell)", "error", _first_line(
                        f"{type(exc).__name__}: {exc}")))
                    break
                lines = log.read_text(encoding="utf-8").splitlines()
                verdicts = [json.loads(line) for line in lines[seen:]]
                seen = len(lines)
                if not declared or names:
                    report.rows += [Row(i + 1, v["name"], _STATUS[v["ok"]], v["message"])
                                    for v in verdicts]
                errors = [o for o in cell.outputs if o.output_type == "error"]
                report.rows += [Row(i + 1, "(cell)", "error", _first_line(f"{o.ename}: {o.evalue}"))
                                for o in errors]
                if not verdicts and not errors:
                    report.rows += [Row(i + 1, n, "error", "this exercise cell ran no checker")
                                    for n in names]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: grade one notebook, print the table; exit status 1 if anything failed."""
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.checks.grade",
        description="Run a copy of a lesson in quick mode and list its exercises' verdicts.")
    parser.add_argument("notebook", help="path of the notebook to grade (it is not modified)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT,
                        help=f"seconds each cell may run (default {CELL_TIMEOUT})")
    parser.add_argument("--full", action="store_true",
                        help="run in full mode (all the data, every epoch) instead of quick mode")
    args = parser.parse_args(argv)
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"grading {args.notebook}: running it in a fresh kernel "
        f"({'full' if args.full else 'quick'} mode), cell by cell ...")
    try:
        report = grade(args.notebook, timeout=args.timeout, quick=not args.full, progress=say)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
