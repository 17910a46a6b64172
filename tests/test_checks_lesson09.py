"""The lesson-09 checkers: None is "not answered yet", the reference answers pass, and
realistic wrong answers fail with what went wrong named."""
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.checks.lesson09 import check_resume, check_syncbn
from course_lib.parallel.sync_batchnorm import SyncBatchNorm as CourseSyncBatchNorm
from solutions.lesson09 import SyncBatchNorm, _SyncBN, capture, global_stats, restore

# ---- SyncBatchNorm: wrong answers ----------------------------------------------------------------

class LocalStatisticsOnly(nn.BatchNorm2d):  # what DDP without SyncBatchNorm does
    pass


class MeanOfMeans(SyncBatchNorm):  # averages each rank's mean and variance, whatever its size
    def forward(self, x):
        dims = [0, 2, 3]
        stats = torch.stack([x.mean(dims), x.var(dims, unbiased=False)])
        dist.all_reduce(stats)
        stats /= dist.get_world_size()
        mean, var = stats[0], stats[1]
        n = x.numel() // x.shape[1] * dist.get_world_size()
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return _SyncBN.apply(x, self.weight, self.bias, mean, torch.rsqrt(var + self.eps), n)


class BiasedRunningVar(SyncBatchNorm):  # running_var from the biased variance
    def forward(self, x):
        with torch.no_grad():
            mean, var, n = global_stats(x)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var, self.momentum)
        return _SyncBN.apply(x, self.weight, self.bias, mean, torch.rsqrt(var + self.eps), n)


class _NoAllReduceInBackward(_SyncBN):
    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        C, dims = dy.shape[1], [0, 2, 3]
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        n_local = dy.numel() // C
        dx = (weight * invstd).view(1, C, 1, 1) * (
            dy - (sum_dy / n_local).view(1, C, 1, 1)
            - xhat * (sum_dy_xhat / n_local).view(1, C, 1, 1))
        return dx, sum_dy_xhat, sum_dy, None, None, None


class LocalGradientTerms(SyncBatchNorm):  # forward right, backward with this rank's sums only
    def forward(self, x):
        with torch.no_grad():
            mean, var, n = global_stats(x)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return _NoAllReduceInBackward.apply(x, self.weight, self.bias, mean,
                                            torch.rsqrt(var + self.eps), n)


class StatisticsAsConstants(SyncBatchNorm):  # plain autograd with detached global statistics
    def forward(self, x):
        with torch.no_grad():
            mean, var, n = global_stats(x)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, -1, 1, 1)
        xhat = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        return xhat * self.weight.view(shape) + self.bias.view(shape)


def test_syncbn_unanswered():
    assert check_syncbn(None).ok is None


def test_syncbn_reference_and_course_pass_for_2_and_3_ranks(capsys):
    assert check_syncbn(SyncBatchNorm)
    assert check_syncbn(CourseSyncBatchNorm, world_sizes=(3,))
    assert "world sizes [2, 3]" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (LocalStatisticsOnly, "shard alone"),
    (MeanOfMeans, "plain mean of the ranks' means"),
    (BiasedRunningVar, "biased variance"),
    (LocalGradientTerms, "this rank's sum(dy)"),
    (StatisticsAsConstants, "as constants"),
])
def test_syncbn_wrong_answers_fail_and_are_named(wrong, says):
    result = check_syncbn(wrong, world_sizes=(2,))
    assert result.ok is False
    assert says in result.message and "world_size=2" in result.message, result.message


# ---- resume: wrong answers -----------------------------------------------------------------------

def model_only(model, optimizer, scheduler, epoch):
    return {"model": model.state_dict(), "epoch": epoch}


def restore_model_only(state, model, optimizer, scheduler):
    model.load_state_dict(state["model"])
    return state["epoch"]


def without_rng(model, optimizer, scheduler, epoch):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "epoch": epoch}


def restore_without_rng(state, model, optimizer, scheduler):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"]


def without_scheduler(model, optimizer, scheduler, epoch):
    return capture(model, optimizer, scheduler, epoch)


def restore_without_scheduler(state, model, optimizer, scheduler):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return state["epoch"]


def restore_next_epoch_off_by_one(state, model, optimizer, scheduler):
    return restore(state, model, optimizer, scheduler) + 1


def restore_torch_rng_only(state, model, optimizer, scheduler):
    restore(state, model, optimizer, scheduler)
    random.seed(0)                                     # Python's random state forgotten
    return state["epoch"]


def test_resume_unanswered():
    assert check_resume(None, None).ok is None


def test_resume_reference_passes_and_leaves_the_random_states_alone():
    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(1), random.random())
    torch.manual_seed(7)
    random.seed(7)
    assert check_resume(capture, restore)
    assert (torch.rand(1), random.random()) == expected


@pytest.mark.parametrize("save, load, says", [
    (model_only, restore_model_only, "momentum buffers"),
    (without_rng, restore_without_rng, "torch's random state"),
    (without_scheduler, restore_without_scheduler, "schedule did not come back"),
    (capture, restore_next_epoch_off_by_one, "expected 1"),
    (capture, restore_torch_rng_only, "Python's random state"),
])
def test_resume_wrong_answers_fail_and_are_named(save, load, says):
    result = check_resume(save, load)
    assert result.ok is False
    assert says in result.message, result.message
    with pytest.raises(AssertionError):
        check_resume(save, load, stops=(1,), strict=True)


class ScaffoldSyncBatchNorm(nn.BatchNorm2d):
    def forward(self, x):
        raise NotImplementedError


def scaffold(*args):
    raise NotImplementedError


def test_scaffolds_are_not_answered_yet():
    assert check_syncbn(ScaffoldSyncBatchNorm, world_sizes=(2,)).ok is None
    assert check_resume(scaffold, scaffold).ok is None
