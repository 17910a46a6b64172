"""Lesson 07, exercises: DDP in three steps.

1. ``average_gradients``: average every gradient after backward, in place
   (``course_lib.checks.lesson07.check_average_gradients``);
2. ``OverlapDDP``: each gradient's all-reduce started from its hook during backward
   (``check_ddp``);
3. ``BucketedDDP``: the same with flat buckets under a cap (``check_ddp(..., bucket_cap_mb=)``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

__all__ = ["BucketedDDP", "OverlapDDP", "average_gradients"]


def average_gradients(model: nn.Module) -> None:
    """After ``loss.backward()``: make every ``p.grad`` the average over the ranks, in place.

    Parameters without a gradient (frozen ones) are skipped. This is DDP's "naive" strategy,
    one blocking all-reduce per parameter after backward.
    """
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # in place: every rank gets the sum
        p.grad /= world_size                           # in place: the average


class OverlapDDP(nn.Module):
    """Exercise 2: each gradient's all-reduce starts from its hook; backward returns averages.

    One all-reduce per parameter, launched in a fixed order (the last registered parameter
    first) as soon as it and every parameter before it in that order have their gradient: the
    same order on every rank, whatever order autograd produces them in. A callback queued on
    the autograd engine waits for all of them and divides, before ``backward()`` returns.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.ready: set[int] = set()            # ids of the parameters whose grad is final
        self.works: list = []                   # the all-reduces started in this backward
        self.next = 0                           # the next parameter of self.order to launch
        for p in self.order:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self.ready and not self.works:   # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._finish)
        self.ready.add(id(param))
        while self.next < len(self.order) and id(self.order[self.next]) in self.ready:
            grad = self.order[self.next].grad   # the hook receives the parameter: use .grad
            self.works.append(dist.all_reduce(grad, async_op=True))
            self.next += 1

    def _finish(self) -> None:
        for work in self.works:
            work.wait()
        for p in self.order:
            p.grad /= dist.get_world_size()
        self.ready, self.works, self.next = set(), [], 0


class BucketedDDP(nn.Module):
    """Exercise 3: the overlap with gradients packed into flat buckets of about a cap.

    Buckets are filled last registered parameter first, each closed once it holds the cap or
    more; bucket i is launched once it is full and buckets 0 .. i-1 have been launched (index
    order, the same on every rank).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25):
        super().__init__()
        self.module = module
        cap = int(bucket_cap_mb * 1024 * 1024)
        self.buckets: list[list[torch.Tensor]] = [[]]
        used = 0
        for p in reversed(list(module.parameters())):
            if not p.requires_grad:
                continue
            if used >= cap:                               # full: start the next bucket
                self.buckets.append([])
                used = 0
            self.buckets[-1].append(p)
            used += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.pending = [len(b) for b in self.buckets]   # gradients still to come, per bucket
        self.flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.works: list = []
        self.next = 0
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self.works and self.pending == [len(b) for b in self.buckets]:
            Variable._execution_engine.queue_callback(self._finish)
        self.pending[self.bucket_of[id(param)]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            bucket = self.buckets[self.next]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])   # (bucket numel,)
            self.flat[self.next] = flat
            self.works.append(dist.all_reduce(flat, async_op=True))
            self.next += 1

    def _finish(self) -> None:
        for work in self.works:
            work.wait()
        world_size = dist.get_world_size()
        for bucket, flat in zip(self.buckets, self.flat):
            offset = 0
            for p in bucket:                                         # unpack into each .grad
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / world_size)
                offset += p.numel()
        self.pending = [len(b) for b in self.buckets]
        self.flat, self.works, self.next = [None] * len(self.buckets), [], 0
