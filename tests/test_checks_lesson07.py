"""The lesson-07 checker: None is "not answered yet", the reference answer passes (as a function
and as a "module:function" string), and realistic wrong answers fail with the case shown."""
import pytest
import torch
import torch.distributed as dist

from course_lib.checks.lesson07 import check_average_gradients
from solutions.lesson07 import average_gradients

FAST = {"world_sizes": (2, 3), "timeout": 60}


def sum_without_dividing(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def weights_only(model):  # forgets the biases
    for name, p in model.named_parameters():
        if p.grad is not None and name.endswith("weight"):
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def averages_a_copy(model):  # the average lands in a new tensor that nobody keeps
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()


def averages_the_parameters(model):  # the parameter instead of its gradient
    for p in model.parameters():
        if p.grad is not None:
            with torch.no_grad():
                dist.all_reduce(p.data)
                p.data /= dist.get_world_size()


def ignores_frozen_parameters(model):  # crashes on a parameter whose .grad is None
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def only_rank_zero(model):  # a collective called by one rank: the others never join
    if dist.get_rank() == 0:
        average_gradients(model)


def defined_in_main(model):
    pass


def test_unanswered():
    assert check_average_gradients(None).ok is None


def test_reference_solution_passes_for_2_3_and_4_ranks(capsys):
    assert check_average_gradients(average_gradients, timeout=60)
    assert "world sizes [2, 3, 4]" in capsys.readouterr().out


def test_module_string_is_imported_in_the_workers(tmp_path, monkeypatch):
    (tmp_path / "my_ddp_answer.py").write_text(
        "import torch.distributed as dist\n\n"
        "def average_gradients(model):\n"
        "    for p in model.parameters():\n"
        "        if p.grad is not None:\n"
        "            dist.all_reduce(p.grad)\n"
        "            p.grad.div_(dist.get_world_size())\n")
    monkeypatch.chdir(tmp_path)
    assert check_average_gradients("my_ddp_answer:average_gradients", **FAST)
    result = check_average_gradients("no_such_module:average_gradients", world_sizes=(2,))
    assert result.ok is False and "could not import" in result.message


@pytest.mark.parametrize("wrong, says", [
    (sum_without_dividing, "times too large: the sum"),
    (weights_only, "parameter fc1.bias"),
    (averages_a_copy, "this rank's own gradient, unchanged"),
    (averages_the_parameters, "this rank's own gradient, unchanged"),
    (ignores_frozen_parameters, "model 'frozen fc1'"),
])
def test_wrong_answers_fail_with_the_first_failing_case(wrong, says):
    result = check_average_gradients(wrong, **FAST)
    assert result.ok is False
    assert says in result.message and "expected" in result.message.lower()
    with pytest.raises(AssertionError):
        check_average_gradients(wrong, world_sizes=(2,), strict=True)


def test_a_hang_fails_within_the_timeout():
    result = check_average_gradients(only_rank_zero, world_sizes=(2,), timeout=5)
    assert result.ok is False


def test_a_function_workers_cannot_import_is_explained():
    defined_in_main.__module__ = "__main__"
    result = check_average_gradients(defined_in_main)
    assert result.ok is False and "%%writefile" in result.message
