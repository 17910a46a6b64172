"""The lesson-12 checkers (a pipeline stage's forward and backward; the 1F1B order of one
stage): None is "not answered yet", the reference answers pass, and realistic wrong answers fail
with the case shown and what it costs."""
import re

import pytest
import torch

from course_lib.checks.lesson12 import _STAGE_HINT, check_one_f_one_b, check_stage
from course_lib.distributed.pipelining import one_f_one_b_order
from solutions.lesson12 import MyStage, one_f_one_b


class StageScaffold(MyStage):   # the notebook's scaffold, not yet written
    def forward_one(self, microbatch, X=None, target=None, loss_fn=None):
        raise NotImplementedError


class NoRequiresGrad(MyStage):   # the received activation is a leaf without requires_grad
    def forward_one(self, microbatch, X=None, target=None, loss_fn=None):
        if self.is_first:
            self.post_sends()
        else:
            X = self.recv_activation(microbatch)
        Y = self.submodule(X)
        if self.is_last:
            self._losses[microbatch] = loss_fn(Y, target)
        else:
            self.send_activation(Y, microbatch)
        self._inputs[microbatch], self._outputs[microbatch] = X, Y
        return Y


class SendsNoGradient(MyStage):   # backward never sends X.grad: the previous stage waits
    def backward_one(self, microbatch, loss_scale=1.0):
        del self._inputs[microbatch]
        Y = self._outputs.pop(microbatch)
        if self.is_last:
            self.post_sends()
            (self._losses[microbatch] * loss_scale).backward()
        else:
            torch.autograd.backward(Y, self.recv_gradient(Y))


class SendsActivation(MyStage):   # sends X back instead of X.grad
    def send_gradient(self, dX):
        super().send_gradient(self._sent_input)

    def backward_one(self, microbatch, loss_scale=1.0):
        self._sent_input = self._inputs[microbatch].detach()
        super().backward_one(microbatch, loss_scale)


class NoLossScale(MyStage):   # the last stage's loss not divided by m
    def backward_one(self, microbatch, loss_scale=1.0):
        super().backward_one(microbatch, 1.0)


def test_stage_checker_unanswered_and_reference(capsys):
    assert check_stage(None).ok is None
    assert check_stage(StageScaffold, world_sizes=(2,)).ok is None
    assert check_stage(MyStage)                      # 2 and 3 stages
    assert "correct" in capsys.readouterr().out


#: what the reference MyStage calls: a first failure must not spell them out
_SOLUTION_CALLS = ("requires_grad", "autograd.backward", ".backward(", "recv_activation",
                   "send_activation", "recv_gradient", "send_gradient", "self.submodule",
                   "X.grad", "loss_scale")


@pytest.mark.parametrize("wrong, world, says", [
    (NoRequiresGrad, (2,), "sent None as the gradient of the stage's input"),
    (SendsNoGradient, (2,), "no result within"),
    (SendsActivation, (3,), "gradients differ from one process"),
    (NoLossScale, (2,), "loss_scale"),
])
def test_stage_checker_rejects(wrong, world, says):
    result = check_stage(wrong, world_sizes=world, timeout=6)
    assert result.ok is False and says in result.message, result.message
    if "differ" in says:     # a wrong value: the message ends with the hint, and no call leaks
        assert result.message.endswith(f"Hint: {_STAGE_HINT}"), result.message
        assert not [call for call in _SOLUTION_CALLS if call in result.message], result.message


def test_stage_checker_hint_points_to_the_idea_not_the_code():
    leaked = [call for call in _SOLUTION_CALLS if call in _STAGE_HINT]
    assert not leaked, f"the hint gives the solution away: {leaked}"


def gpipe(stage, p, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def warmup_one_too_long(stage, p, m):
    w = min(p - stage, m)
    return ([("F", i) for i in range(w)] + [op for i in range(w, m)
                                             for op in (("F", i), ("B", i - w))]
            + [("B", i) for i in range(m - w, m)])


def warmup_reversed(stage, p, m):  # the last stage warms up, the first does not
    return one_f_one_b(p - 1 - stage, p, m)


def forgets_fewer_microbatches(stage, p, m):  # warm-up of p - s - 1 even when m is smaller
    w = p - stage - 1
    return ([("F", i) for i in range(w)] + [op for i in range(w, m)
                                             for op in (("F", i), ("B", i - w))]
            + [("B", i) for i in range(max(0, m - w), m)])


def no_warmup(stage, p, m):  # one forward, one backward from the start
    return [op for i in range(m) for op in (("F", i), ("B", i))]


def test_pipeline_checker_unanswered():
    assert check_one_f_one_b(None).ok is None


def test_pipeline_checker_a_scaffold_that_raises_not_implemented_is_unanswered(capsys):
    def scaffold(stage, num_stages, num_microbatches):
        raise NotImplementedError   # your code

    result = check_one_f_one_b(scaffold)
    assert result.ok is None and "NotImplementedError" in result.message
    assert "not answered yet" in capsys.readouterr().out


def test_pipeline_checker_accepts_the_reference(capsys):
    assert check_one_f_one_b(one_f_one_b)
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (gpipe, "That is GPipe's order"),
    (warmup_one_too_long, "activations at once; 1F1B at most"),
    (warmup_reversed, "never finish: deadlock"),
    (forgets_fewer_microbatches, "found ('F', 1)"),
    (no_warmup, "warm-up too short"),
])
def test_pipeline_checker_rejects_wrong_orders(wrong, says):
    result = check_one_f_one_b(wrong)
    assert result.ok is False and says in result.message, result.message
    with pytest.raises(AssertionError):
        check_one_f_one_b(wrong, strict=True)


@pytest.mark.parametrize("wrong", [gpipe, warmup_one_too_long, no_warmup])
def test_pipeline_checker_names_the_first_difference_without_giving_the_order_away(wrong):
    result = check_one_f_one_b(wrong)
    stage, p, m = map(int, re.search(r"for stage=(\d+), num_stages=(\d+), num_microbatches=(\d+)",
                                     result.message).groups())
    want, got = one_f_one_b_order(stage, p, m), wrong(stage, p, m)
    k = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    kinds = {"F": "a forward", "B": "a backward"}
    assert (f"at step {k} (counting from 0) 1F1B runs {kinds[want[k][0]]}, yours "
            f"{kinds[got[k][0]]} ({got[k][0]}{got[k][1]})") in result.message, result.message
    assert str(want) not in result.message          # 1F1B's order for that stage: the answer
    assert "Expected" not in result.message and "warm-up forwards" not in result.message


def test_pipeline_checker_names_the_first_difference_at_the_right_step():
    result = check_one_f_one_b(no_warmup)    # first wrong at p=2, m=2: F0 B0 ... for F0 F1 ...
    assert "for stage=0, num_stages=2, num_microbatches=2" in result.message, result.message
    assert "at step 1 (counting from 0) 1F1B runs a forward, yours a backward (B0)" in \
        result.message


def test_pipeline_checker_reports_an_exception_and_a_wrong_type():
    result = check_one_f_one_b(lambda s, p, m: 1 / 0)
    assert result.ok is False and "ZeroDivisionError" in result.message
    result = check_one_f_one_b(lambda s, p, m: [("forward", 0)])
    assert result.ok is False and "expected operations" in result.message
