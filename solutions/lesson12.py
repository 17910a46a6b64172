"""Lesson 12, exercises: a pipeline stage's forward and backward of one micro-batch; the 1F1B
order of operations of one pipeline stage.

Checked by ``course_lib.checks.lesson12.check_stage`` and ``check_one_f_one_b``; the course's
versions are ``course_lib.distributed.pipelining.PipelineStage`` and ``one_f_one_b_order``.
"""
from __future__ import annotations

import torch

from course_lib.distributed.pipelining import PipelineStageBase

__all__ = ["MyStage", "one_f_one_b"]


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """``[("F", 0), ..., ("B", m - 1)]`` for stage ``stage`` of ``num_stages`` under 1F1B.

    Warm-up: the stages after this one each need a micro-batch in flight before the first
    gradient can come back, so stage s starts with p - s - 1 forwards (fewer if there are fewer
    micro-batches). Then one forward, one backward, while forwards remain; then the backwards.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, num_microbatches):
        order += [("F", i), ("B", i - warmup)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


class MyStage(PipelineStageBase):
    """A pipeline stage's forward and backward of one micro-batch (``PipelineStage``'s, without
    the timing). Sends are queued by ``send_*`` and go out with the next ``recv_*``."""

    def forward_one(self, microbatch: int, X: torch.Tensor | None = None,
                    target: torch.Tensor | None = None, loss_fn=None) -> torch.Tensor:
        if self.is_first:
            self.post_sends()                        # nothing to receive: the sends go alone
        else:
            X = self.recv_activation(microbatch)     # (b, ...) from the previous stage
            X.requires_grad_()                       # so that backward fills X.grad
        Y = self.submodule(X)
        if self.is_last:
            self._losses[microbatch] = loss_fn(Y, target)
        else:
            self.send_activation(Y, microbatch)
        self._inputs[microbatch], self._outputs[microbatch] = X, Y
        return Y

    def backward_one(self, microbatch: int, loss_scale: float = 1.0) -> None:
        X, Y = self._inputs.pop(microbatch), self._outputs.pop(microbatch)
        if self.is_last:
            self.post_sends()
            (self._losses[microbatch] * loss_scale).backward()
        else:
            dY = self.recv_gradient(Y)               # d loss / d Y from the next stage
            torch.autograd.backward(Y, dY)           # fills the parameters' .grad and X.grad
        if not self.is_first:
            self.send_gradient(X.grad)
