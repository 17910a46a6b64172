"""One stage of a pipeline across processes: receive an activation, run, send; and back again.

PyTorch counterpart: ``torch.distributed.pipelining.PipelineStage`` (same constructor
arguments: the stage's module, its index, the number of stages, its device). Rank i of the
group holds stage i. Forward: receive the previous stage's activation, run the module, send the
output on. Backward: receive the gradient of that output from the next stage, run autograd,
send the gradient of the input back. The last stage computes the loss. An op's sends go out
with the next op's receive in one ``dist.batch_isend_irecv`` (as torch's ``Schedule1F1B`` fuses
"send activation, receive gradient"): NCCL runs a rank's point-to-point operations in order,
and a send queued before a receive from the same neighbour would wait for a neighbour that
waits too. NCCL has no tags either: the k-th message one rank sends another is the k-th that
one receives. Every message here has tag 0, so that gloo pairs them the same way. Read more:
https://pytorch.org/docs/stable/distributed.pipelining.html. Lesson 12.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ...devices import Device, as_device, synchronize

__all__ = ["PipeEvent", "PipelineStage", "PipelineStageBase"]

#: dtypes an activation may have on the wire; the header names one by its index here
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8
#: one tag for every message: NCCL ignores tags and pairs a link's messages in the order they
#: are posted; gloo matches by tag, so with one tag it pairs them in that order too (CI then sees
#: what a GPU would do with sends and receives in different orders)
_TAG = 0


class PipeEvent(NamedTuple):
    """What a stage computed and when: ``kind`` "F" (forward) or "B" (backward) of one
    micro-batch, between ``start`` and ``end`` (``time.perf_counter()`` seconds, one clock for
    every process of the machine)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


class PipelineStageBase:
    """What a stage needs besides its forward and backward: its place in the pipeline and its
    messages. ``PipelineStage`` adds ``forward_one`` and ``backward_one`` (lesson 12's exercise
    writes them too). The messages: ``recv_activation`` / ``send_activation`` (from the previous
    stage, to the next), ``recv_gradient`` / ``send_gradient`` (from the next, to the previous),
    ``post_sends`` for an op that receives nothing. Sends are queued and go out with the next
    receive, as one batch; ``_inputs``, ``_outputs``, ``_losses`` keep, per micro-batch, what
    backward needs and ``pop_losses`` returns.

    Stage ``stage_index`` of ``num_stages``, run by rank ``stage_index`` of ``group``.

    Call ``forward_one`` and ``backward_one`` in the order a schedule says (``ScheduleGPipe``,
    ``Schedule1F1B``); every stage must follow the same schedule, and ``wait_sends`` ends a
    step. Receives block (bounded by the process group's timeout). The sends of an op are
    posted with the next op's receive, as one batch, and released when that batch is done; with
    no receive to join they go alone and are released before the next batch is posted
    (``schedules.p2p_program`` writes this order out). Messages carry no micro-batch number: a
    receive gets the neighbour's next message, so both must run their ops in matching orders
    (``step`` checks the schedule's order with ``simulate_schedule``). Set ``meter`` to an
    ``ActivationMeter`` to count the buffers held for sends beside the activations saved for
    backward.

    Args:
        submodule: this stage's layers (``split_sequential(model, num_stages)[stage_index]``).
        stage_index: this stage's position, 0 ... num_stages - 1.
        num_stages: stages in the pipeline; equals the group's size (one stage per rank).
        device: where this stage computes (default: where its parameters are).
        group: the process group (default: the default group).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: Device | None = None, group: dist.ProcessGroup | None = None):
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineStage expects num_stages >= 1, got {num_stages!r}.")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage expects stage_index in 0 ... {num_stages - 1}, got "
                             f"{stage_index!r}.")
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage sends activations between processes: call "
                               "dist.init_process_group first (or start the workers with "
                               "course_lib.distributed.launch).")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world != num_stages or rank != stage_index:
            raise ValueError(f"PipelineStage runs one stage per rank: expected num_stages == "
                             f"world size and stage_index == rank, got num_stages={num_stages}, "
                             f"stage_index={stage_index} in rank {rank} of a group of {world}. "
                             "Pass stage_index=dist.get_rank(), num_stages=dist.get_world_size().")
        params = list(submodule.parameters())
        default = params[0].device if params else torch.device("cpu")
        self.submodule = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.device = as_device(device) if device is not None else default
        self.group = group
        self.events: list[PipeEvent] = []
        self.record = False       # True: append a PipeEvent per forward and backward
        self.meter = None         # an ActivationMeter: counts the buffers held for sends
        # gloo sends CPU tensors; NCCL sends GPU tensors in place
        backend = dist.get_backend(group)
        self._wire = self.device if backend == "nccl" else torch.device("cpu")
        self._inputs: dict[int, torch.Tensor] = {}    # micro-batch -> this stage's input
        self._outputs: dict[int, torch.Tensor] = {}   # micro-batch -> this stage's output
        self._losses: dict[int, torch.Tensor] = {}    # micro-batch -> loss (last stage)
        self._pending: list[dist.P2POp] = []          # the last op's sends, not posted yet
        self._metered: set[int] = set()               # id of the sends the meter counts
        self._alone: list[tuple[list[dist.Work], list[dist.P2POp]]] = []  # posted alone
        self._in_meta: tuple[tuple[int, ...], torch.dtype] | None = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _peer(self, stage: int) -> int:
        """The global rank that runs ``stage``."""
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    # ---- point to point --------------------------------------------------------------------

    def _queue_send(self, t: torch.Tensor, to_stage: int, header: bool = False) -> None:
        """Send ``t`` with the next op's receive (``_post``); the buffer is held until done."""
        t = t.detach().to(self._wire).contiguous()
        op = dist.P2POp(dist.isend, t, self._peer(to_stage), self.group, _TAG)
        self._pending.append(op)
        if self.meter is not None and not header:   # the header is not an activation
            self.meter.hold(t)
            self._metered.add(id(op))

    def _release(self, sends: list[dist.P2POp]) -> None:
        """These sends are done: their buffers may go."""
        for op in sends:
            if id(op) in self._metered:
                self._metered.discard(id(op))
                if self.meter is not None:
                    self.meter.release(op.tensor)

    def _post(self, receive: dist.P2POp | None = None) -> None:
        """Post the queued sends and ``receive`` as one batch; wait for it if it receives.

        Sends posted alone earlier are waited for (and released) first, so that a stage holds
        at most one batch of sends in flight beside the one it is building.
        """
        for works, sends in self._alone:
            for work in works:
                work.wait()
            self._release(sends)
        self._alone.clear()
        sends, self._pending = self._pending, []
        ops = sends + ([receive] if receive is not None else [])
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)   # one batch: NCCL runs it as one operation
        if receive is None:
            self._alone.append((works, sends))
            return
        for work in works:
            work.wait()
        self._release(sends)

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, from_stage: int) -> torch.Tensor:
        """Block until ``from_stage``'s next message (of this shape) is here; on this stage's
        device. It is the next one that stage posted to this one, whatever it meant to send."""
        buffer = torch.empty(shape, dtype=dtype, device=self._wire)
        self._post(dist.P2POp(dist.irecv, buffer, self._peer(from_stage), self.group, _TAG))
        return buffer.to(self.device)

    def _send_header(self, Y: torch.Tensor) -> None:
        """Tell the next stage the shape and dtype of the activations of this step."""
        if Y.dim() > _MAX_DIMS or Y.dtype not in _DTYPES:
            raise ValueError(f"PipelineStage {self.stage_index}: expected an output of at most "
                             f"{_MAX_DIMS} dims with a dtype in {_DTYPES}, got shape "
                             f"{tuple(Y.shape)} and {Y.dtype}.")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(Y.dtype), Y.dim()
        header[2:2 + Y.dim()] = torch.tensor(Y.shape)
        self._queue_send(header, self.stage_index + 1, header=True)

    def _recv_header(self) -> None:
        header = self._recv((2 + _MAX_DIMS,), torch.int64, self.stage_index - 1)
        ndim = int(header[1])
        self._in_meta = (tuple(header[2:2 + ndim].tolist()), _DTYPES[int(header[0])])

    def wait_sends(self) -> None:
        """Post the sends still queued and wait until every send is done (end of a step)."""
        self._post()
        self._post()   # the second call waits for what the first posted alone

    # ---- the messages of one op, for forward_one and backward_one --------------------------

    def post_sends(self) -> None:
        """For an op that receives nothing (the first stage's forward, the last stage's
        backward): post the last op's queued sends now, alone."""
        self._post()

    def recv_activation(self, microbatch: int) -> torch.Tensor:
        """The previous stage's output for ``microbatch`` (its shape header first, on micro-batch
        0), posted with the last op's queued sends; blocks until it is here."""
        if self.is_first:
            raise RuntimeError("the first stage receives no activation: it is given X.")
        if microbatch == 0:
            self._recv_header()
        if self._in_meta is None:
            raise RuntimeError(f"PipelineStage {self.stage_index}: micro-batch {microbatch} "
                               "received before micro-batch 0 (whose message carries the shape).")
        shape, dtype = self._in_meta
        return self._recv(shape, dtype, self.stage_index - 1)

    def send_activation(self, Y: torch.Tensor, microbatch: int) -> None:
        """Queue this stage's output for the next stage (with its shape header on micro-batch 0)."""
        if microbatch == 0:
            self._send_header(Y)
        self._queue_send(Y, self.stage_index + 1)

    def recv_gradient(self, Y: torch.Tensor) -> torch.Tensor:
        """The gradient of the loss with respect to output ``Y``, from the next stage, posted with
        the last op's queued sends; blocks until it is here."""
        return self._recv(tuple(Y.shape), Y.dtype, self.stage_index + 1)

    def send_gradient(self, dX: torch.Tensor | None) -> None:
        """Queue the gradient of the loss with respect to this stage's input, for the previous
        stage."""
        if dX is None:
            raise ValueError(f"PipelineStage {self.stage_index}: send_gradient got None, expected "
                             "the gradient of the stage's input (X.grad). X.grad stays None "
                             "unless X.requires_grad_() was called in forward before the layers "
                             "ran on it.")
        self._queue_send(dX, self.stage_index - 1)

    def pop_losses(self) -> list[torch.Tensor]:
        """The last stage's losses of this step, detached, by micro-batch (and forget them)."""
        losses = [self._losses[i].detach() for i in sorted(self._losses)]
        self._losses.clear()
        return losses


class PipelineStage(PipelineStageBase):
    """Stage ``stage_index`` of ``num_stages``, run by rank ``stage_index`` of ``group``.

    Call ``forward_one`` and ``backward_one`` in the order a schedule says (``ScheduleGPipe``,
    ``Schedule1F1B``); every stage must follow the same schedule, and ``wait_sends`` ends a
    step. Messages, timing and the checks of arguments: ``PipelineStageBase``.
    """

    # ---- one micro-batch -------------------------------------------------------------------

    def forward_one(self, microbatch: int, X: torch.Tensor | None = None,
                    target: torch.Tensor | None = None,
                    loss_fn: Callable | None = None) -> torch.Tensor:
        """Forward of one micro-batch: receive (unless first), run, send on (unless last).

        Args:
            microbatch: its number in the step (0 first: stage 0 then sends the shape header).
            X: the micro-batch's inputs (first stage only).
            target, loss_fn: the last stage computes ``loss_fn(output, target)``.

        Returns:
            The stage's output, (b, ...).
        """
        if self.is_first:
            if X is None:
                raise ValueError("the first stage's forward_one needs the micro-batch X.")
            X = X.to(self.device)
            self.post_sends()                                   # the last op's sends, alone
        else:
            X = self.recv_activation(microbatch)                # + the last op's sends
            X.requires_grad_(True)  # its gradient goes back to the previous stage
        start = time.perf_counter()
        Y = self.submodule(X)                                   # (b, ...)
        if self.is_last and loss_fn is not None:
            self._losses[microbatch] = loss_fn(Y, target.to(Y.device))
        synchronize(self.device)
        end = time.perf_counter()
        if self.record:
            self.events.append(PipeEvent(self.stage_index, "F", microbatch, start, end))
        self._inputs[microbatch], self._outputs[microbatch] = X, Y
        if not self.is_last:
            self.send_activation(Y, microbatch)                 # goes with the next receive
        return Y

    def backward_one(self, microbatch: int, loss_scale: float = 1.0) -> None:
        """Backward of one micro-batch: receive the output's gradient (or, last stage, take the
        loss times ``loss_scale``), run autograd, send the input's gradient back (unless first).
        """
        if microbatch not in self._outputs:
            raise RuntimeError(f"PipelineStage {self.stage_index}: backward of micro-batch "
                               f"{microbatch} before its forward (or twice); a schedule runs "
                               "F(i) before B(i) on every stage.")
        X, Y = self._inputs.pop(microbatch), self._outputs.pop(microbatch)
        if self.is_last:
            if microbatch not in self._losses:
                raise RuntimeError("the last stage's backward needs a loss: pass target and "
                                   "loss_fn to forward_one.")
            self.post_sends()                                   # the last op's sends, alone
            start = time.perf_counter()
            (self._losses[microbatch] * loss_scale).backward()
        else:
            dY = self.recv_gradient(Y)                          # + the last op's sends
            start = time.perf_counter()
            torch.autograd.backward(Y, dY)                      # fills .grad and X.grad
        synchronize(self.device)
        end = time.perf_counter()
        if self.record:
            self.events.append(PipeEvent(self.stage_index, "B", microbatch, start, end))
        if not self.is_first:
            self.send_gradient(X.grad)                          # goes with the next receive
