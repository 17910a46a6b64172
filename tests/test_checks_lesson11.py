"""Lesson 11's checkers: the reference answers pass, realistic wrong answers fail with a reason.

The wrong answers are small variations of ``solutions/lesson11.py`` defined here, at module
level, so that worker processes can import them by name. Each checker is asked for one world
size where that is enough to show the mistake (a launch costs seconds on a loaded machine).
"""
import pytest
import torch
import torch.distributed as dist

from course_lib.checks import check_fsdp, check_zero
from solutions import lesson11 as S

# ------------------------------------------------------------------------------------------------
# wrong ZeRO-1 answers
# ------------------------------------------------------------------------------------------------


class StepsEverything(S.ZeRO1):
    """Every rank keeps state for, and steps, every parameter: right values, no memory saved."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.optim = optimizer_class(self.params, **defaults)


class NoBroadcast(S.ZeRO1):
    """Each rank steps its shard and keeps the rest stale."""

    @torch.no_grad()
    def step(self):
        self.optim.step()


class BroadcastFromRankZero(S.ZeRO1):
    """Broadcasts every parameter from rank 0, whoever owns it."""

    @torch.no_grad()
    def step(self):
        self.optim.step()
        for p in self.params:
            dist.broadcast(p, src=0)


class RoundRobin(S.ZeRO1):
    """Deals parameters out in turn, whatever their size: unbalanced shards."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        world = dist.get_world_size()
        self.owner = {p: i % world for i, p in enumerate(self.params)}
        mine = [p for p in self.params if self.owner[p] == dist.get_rank()]
        self.optim = optimizer_class([{"params": mine}], **defaults)


# ------------------------------------------------------------------------------------------------
# wrong FSDP units
# ------------------------------------------------------------------------------------------------


class SumsGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, shard, unit):
        return S.GatherLinear.forward(ctx, X, shard, unit)

    @staticmethod
    def backward(ctx, grad_out):
        grad_X, grad_shard, _ = S.GatherLinear.backward(ctx, grad_out)
        return grad_X, grad_shard * dist.get_world_size(), None


class Summing(S.ShardedLinear):
    """Reduce-scatters the sum and forgets to divide by the world size."""

    def forward(self, X):
        return SumsGradients.apply(X, self.shard, self)


class NoPadding(S.ShardedLinear):
    """Splits the flat vector into floor(N / world) pieces: the tail is lost."""

    def __init__(self, linear):
        super().__init__(linear)
        flat = torch.cat([linear.weight.detach().flatten(), linear.bias.detach()])
        size = flat.numel() // dist.get_world_size()
        rank = dist.get_rank()
        self.shard = torch.nn.Parameter(flat[rank * size:(rank + 1) * size].clone())


class KeepsWeights(torch.autograd.Function):
    """Saves the gathered weight for backward instead of gathering it again."""

    @staticmethod
    def forward(ctx, X, shard, unit):
        W, b = S._gather(shard, unit)
        ctx.save_for_backward(X, shard, W)
        ctx.unit = unit
        return X @ W.T + b

    @staticmethod
    def backward(ctx, grad_out):
        X, shard, W = ctx.saved_tensors
        flat = torch.cat([(grad_out.T @ X).flatten(), grad_out.sum(0)])
        world = dist.get_world_size()
        grad_shard = torch.empty_like(shard)
        S.reduce_scatter_tensor(grad_shard, S._pad(flat, world))
        return grad_out @ W, grad_shard / world, None


class NotFreeing(S.ShardedLinear):
    def forward(self, X):
        return KeepsWeights.apply(X, self.shard, self)


class LocalGradient(torch.autograd.Function):
    """Keeps this rank's slice of its own gradient: no reduce-scatter."""

    @staticmethod
    def forward(ctx, X, shard, unit):
        return S.GatherLinear.forward(ctx, X, shard, unit)

    @staticmethod
    def backward(ctx, grad_out):
        X, shard = ctx.saved_tensors
        W, _ = S._gather(shard, ctx.unit)
        flat = S._pad(torch.cat([(grad_out.T @ X).flatten(), grad_out.sum(0)]),
                      dist.get_world_size())
        n, r = shard.numel(), dist.get_rank()
        return grad_out @ W, flat[r * n:(r + 1) * n].clone(), None


class NoReduce(S.ShardedLinear):
    def forward(self, X):
        return LocalGradient.apply(X, self.shard, self)


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------


def test_solutions_pass_both_checkers():
    assert check_zero(S.ZeRO1)
    assert check_fsdp(S.ShardedLinear)


class ZeRO1Scaffold(S.ZeRO1):  # notebook 11's scaffold, not yet written
    def __init__(self, params, optimizer_class, **defaults):
        raise NotImplementedError("ZeRO1.__init__")


class ShardedLinearScaffold(S.ShardedLinear):
    def __init__(self, linear):
        torch.nn.Module.__init__(self)
        raise NotImplementedError("ShardedLinear.__init__")


def test_not_answered_yet():
    assert check_zero(None).ok is None
    assert check_fsdp(None).ok is None


def test_scaffolds_are_not_answered_yet():
    assert check_zero(ZeRO1Scaffold, world_sizes=(2,)).ok is None
    assert check_fsdp(ShardedLinearScaffold, world_sizes=(2,)).ok is None


@pytest.mark.parametrize("wrong, world, says", [
    (StepsEverything, 2, "keeps optimizer state for every parameter"),
    (NoBroadcast, 2, "did each owner broadcast"),
    (BroadcastFromRankZero, 2, "the unsharded optimizer gives"),
    (RoundRobin, 2, "balance the shards by size"),
])
def test_check_zero_rejects(wrong, world, says, capsys):
    result = check_zero(wrong, world_sizes=(world,))
    assert result.ok is False
    assert says in result.message, result.message


@pytest.mark.parametrize("wrong, world, says", [
    (Summing, 2, "the sum, not the average"),
    (NoPadding, 3, "ceil(65/3) = 22"),
    (NotFreeing, 2, "still held"),
    (NoReduce, 2, "the whole-batch gradient gives"),
])
def test_check_fsdp_rejects(wrong, world, says, capsys):
    result = check_fsdp(wrong, world_sizes=(world,))
    assert result.ok is False
    assert says in result.message, result.message


def test_a_notebook_class_is_refused_with_what_to_do():
    Local = type("Local", (), {"__module__": "__main__"})
    result = check_zero(Local)
    assert result.ok is False and "%%writefile" in result.message
