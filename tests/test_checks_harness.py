"""course_lib.checks.harness and make grade, as a learner and a homework author meet them.

A script without ``if __name__ == "__main__":`` is told so (not "rank 3 exited"); a rank that
calls no collective is named; an answer that skips ``p.grad is None`` only behind
``p.requires_grad`` fails; a class exercise says "your class" under the class's name; a checker
leaves the learner's random state and grad mode as found and passes a right answer with
gradients switched off; ``grade`` numbers cells from 1, leaves no ``my_*.py`` beside the copy,
keeps ipykernel's log out of its output and says what it is doing while it runs. The old
private paths (``checks._launch``, ``checks._core``) still import, with no import circle.
"""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from course_lib.checks import grade
from course_lib.checks import harness as H
from course_lib.checks.lesson04 import check_train_batch
from course_lib.checks.lesson05 import check_data_parallel_fn
from course_lib.checks.lesson07 import check_average_gradients, check_ddp
from course_lib.checks.lesson13 import check_load_matching, check_strip_prefix
from solutions.lesson04 import train_batch
from solutions.lesson05 import data_parallel
from solutions.lesson07 import average_gradients
from solutions.lesson13 import load_matching, strip_prefix

ROOT = Path(__file__).resolve().parent.parent


# ---- the launch: a script without a main guard -------------------------------------------------

@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    script = tmp_path / "check_mine.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from course_lib.checks import check_average_gradients\n\n"
        "def average_gradients(model):\n"
        "    for p in model.parameters():\n"
        "        if p.grad is not None:\n"
        "            dist.all_reduce(p.grad)\n"
        "            p.grad /= dist.get_world_size()\n\n"
        "print(repr(check_average_gradients('check_mine:average_gradients', "
        "world_sizes=(2,), timeout=20)))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    assert 'if __name__ == "__main__":' in done.stdout and "check_mine.py" in done.stdout, out
    assert "exited" not in out and "bootstrapping" not in out, out


def test_a_guarded_script_is_not_refused(monkeypatch, tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text("def main():\n    pass\n\n\nif __name__ == '__main__':\n    main()\n")
    fake = type(sys)("__main__")
    fake.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", fake)
    assert H.unguarded_script() is None
    script.write_text("main()\n")
    assert "guarded.py" in H.unguarded_script()


# ---- lesson 07's checker: a silent rank, a .grad of None behind requires_grad ------------------

def only_rank_zero(model):  # rank 1 never calls the collective
    if dist.get_rank() == 0:
        average_gradients(model)


def skips_only_frozen(model):  # a parameter that requires grad and gets none crashes it
    for p in model.parameters():
        if p.requires_grad:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def test_a_rank_that_never_calls_the_collective_is_named():
    result = check_average_gradients(only_rank_zero, world_sizes=(2,), timeout=20)
    assert result.ok is False
    assert "rank 1 called no collective" in result.message, result.message


def test_an_answer_that_skips_none_grads_only_when_frozen_fails():
    result = check_average_gradients(skips_only_frozen, world_sizes=(2,), timeout=30)
    assert result.ok is False
    assert "model 'unused layer'" in result.message, result.message


# ---- class exercises: labelled and worded as classes --------------------------------------------

class Unwritten:
    def __init__(self, module):
        raise NotImplementedError


def _unanswered_worker(spec):
    cls, error = H.load_answer(spec)
    if error:
        return error
    try:
        cls(None)
    except NotImplementedError:
        return H.UNANSWERED
    return None


def test_a_class_exercise_says_your_class_under_the_class_name(capsys):
    result = H.check_in_ranks("OverlapDDP", Unwritten, "my_ddp:OverlapDDP", _unanswered_worker,
                              (), world_sizes=(2,), timeout=20, hint="", hang_hint="",
                              passed="", strict=False)
    assert result.ok is None and "your class still raises" in result.message
    assert H.answer_kind(average_gradients, "my_ddp:average_gradients") == "function"
    assert check_ddp(None).name == "OverlapDDP"
    assert check_ddp(None, bucket_cap_mb=1.0).name == "BucketedDDP"
    assert capsys.readouterr().out.startswith("[OverlapDDP] not answered yet: your class")


# ---- the learner's kernel left as found ----------------------------------------------------------

def _draw_after(check) -> float:
    torch.manual_seed(1)
    check()
    return torch.rand(1).item()


def test_checkers_leave_the_random_state_as_found():
    torch.manual_seed(1)
    want = torch.rand(1).item()
    for check in (lambda: check_data_parallel_fn(data_parallel),
                  lambda: check_strip_prefix(strip_prefix),
                  lambda: check_load_matching(load_matching)):
        assert _draw_after(check) == want


def test_a_right_answer_passes_with_gradients_switched_off():
    torch.set_grad_enabled(False)
    try:
        assert check_train_batch(train_batch)
        assert check_data_parallel_fn(data_parallel)
        assert not torch.is_grad_enabled()                 # and left off, as found
    finally:
        torch.set_grad_enabled(True)


# ---- the old paths ------------------------------------------------------------------------------

def test_old_private_paths_still_import_without_a_circle():
    import grimp

    from course_lib.checks import _core, _launch

    assert _launch.check_in_ranks is H.check_in_ranks and _core.verdict is H.verdict
    graph = grimp.build_graph("course_lib")
    assert graph.find_shortest_chain(importer="course_lib.checks._core",
                                     imported="course_lib.checks._launch") is None
    assert graph.find_shortest_chain(importer="course_lib.checks._core",
                                     imported="course_lib.checks.harness") is None


# ---- make grade ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_grade_counts_cells_from_one_and_leaves_nothing_beside_the_copy(tmp_path, capfd):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# a lesson"),
                nbformat.v4.new_code_cell("%%writefile my_answer.py\nANSWER = 42"),
                nbformat.v4.new_code_cell(
                    "# EXERCISE: answer\nfrom my_answer import ANSWER\n"
                    "from course_lib.checks import check_answer\n"
                    "check_answer('answer', ANSWER, 42);")]
    copy = tmp_path / "my_copy.ipynb"
    nbformat.write(nb, copy)
    assert grade.main([str(copy), "--timeout", "120"]) == 0
    out, err = capfd.readouterr()                   # the kernel's own stderr included
    row = next(line for line in out.splitlines() if " answer " in line)
    assert row.split()[:3] == ["3", "answer", "right"], out     # JupyterLab's third cell
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_copy.ipynb"]
    assert "cell 3: checking answer" in err, err
    assert "without encryption" not in out + err
