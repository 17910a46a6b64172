"""``make grade``: a learner's copy is run and each exercise gets its verdict.

Lesson 03 (small, quick) three ways: as committed (every exercise "not answered", exit 0), with
``solutions/lesson03.py`` pasted into the exercise cells (every one right, exit 0), and with one
known wrong answer (that one wrong, with the failing case; exit 1).
"""
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib.checks import grade

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "03_scatter_and_split_batch.ipynb"
TIMEOUT = 300                                   # per cell; the whole lesson takes well under


def pasted(tmp_path: Path, answers: dict[str, str] | None = None) -> Path:
    """A copy of lesson 03 whose exercise cells define each answer just before the checker runs:
    the reference answer from ``solutions``, or the source given in ``answers`` for that name."""
    nb = nbformat.read(LESSON, as_version=4)
    for e in grade.exercises(nb):
        cell = nb.cells[e.cell]
        code = (answers or {}).get(e.name, f"from solutions.lesson03 import {e.name}")
        lines = cell.source.split("\n")
        first_check = next(i for i, line in enumerate(lines) if line.startswith("checks."))
        cell.source = "\n".join(lines[:first_check] + [code] + lines[first_check:])
    path = tmp_path / "my_copy.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture
def repo_on_path(monkeypatch):
    """The kernel runs in the copy's folder: let it import ``solutions`` from the repository."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


@pytest.mark.slow
def test_the_committed_lesson_grades_as_not_answered(tmp_path, capsys):
    copy = tmp_path / LESSON.name
    shutil.copy(LESSON, copy)
    assert grade.main([str(copy), "--timeout", str(TIMEOUT)]) == 0
    table = capsys.readouterr().out
    declared = grade.exercises(nbformat.read(LESSON, as_version=4))
    assert len(declared) == 6
    rows = [line for line in table.splitlines() if re.match(r"\s*\d+\s.*\snot answered\s", line)]
    assert len(rows) == 6 and "0 right, 0 wrong, 6 not answered, 0 error" in table


@pytest.mark.slow
def test_solutions_pasted_in_grade_all_right(tmp_path, repo_on_path):
    report = grade.grade(pasted(tmp_path), timeout=TIMEOUT)
    assert [r.status for r in report.rows] == ["right"] * 6, report.table()
    assert not report.failed


@pytest.mark.slow
def test_a_wrong_answer_grades_wrong_with_its_failing_case(tmp_path, repo_on_path, capsys):
    chunk_sizes = ("def balanced_sizes(B, n):\n"
                   "    return [len(c) for c in torch.chunk(torch.zeros(B), n)]")
    copy = pasted(tmp_path, {"balanced_sizes": chunk_sizes})
    assert grade.main([str(copy), "--timeout", str(TIMEOUT)]) == 1
    table = capsys.readouterr().out
    wrong = [line for line in table.splitlines() if re.search(r"\bwrong\b", line)
             and "balanced_sizes" in line]
    assert wrong and "balanced_sizes(5, 4)" in wrong[0], table
    assert "5 right, 1 wrong, 0 not answered, 0 error" in table


def test_a_missing_notebook_is_a_usage_error(tmp_path, capsys):
    assert grade.main([str(tmp_path / "nope.ipynb")]) == 2
    assert "no notebook at" in capsys.readouterr().err
