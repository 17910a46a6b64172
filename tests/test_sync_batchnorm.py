"""SyncBatchNorm against its oracle: one plain BatchNorm on the concatenated global batch.

Each rank holds a shard of a different size (5, 3 and 8 examples); forward outputs, input
gradients, weight and bias gradients (summed over the ranks, as DDP would combine them) and the
running statistics must equal those of ``nn.BatchNorm2d`` / ``nn.BatchNorm1d`` run on the whole
batch in one process, in float64 with a tight tolerance.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import launch
from course_lib.models.resnet import resnet18
from course_lib.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

SHARDS = {2: [5, 3], 3: [5, 3, 8]}
TIGHT = {"rtol": 1e-10, "atol": 1e-10}


def _my_slice(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _reference_and_ours(reference: nn.Module) -> tuple[nn.Module, SyncBatchNorm]:
    reference = reference.double()
    with torch.no_grad():
        reference.weight.uniform_(0.5, 2.0)
        reference.bias.uniform_(-1.0, 1.0)
    ours = SyncBatchNorm(reference.num_features).double()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def against_global_batch(shape_tail: tuple[int, ...], steps: int = 3) -> None:
    """Worker: ours on this rank's shard vs one BatchNorm on the global batch, step by step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes, mine = SHARDS[world], _my_slice(SHARDS[world], rank)
    torch.manual_seed(0)  # the same global batch and upstream gradients on every rank
    C = shape_tail[0]
    reference, ours = _reference_and_ours(nn.BatchNorm2d(C) if len(shape_tail) == 3
                                          else nn.BatchNorm1d(C))
    for _ in range(steps):
        X = torch.randn(sum(sizes), *shape_tail, dtype=torch.float64) * 3 + 2  # (N, C, *)
        dY = torch.randn_like(X)                                              # upstream grad
        X_all = X.clone().requires_grad_()
        Y_all = reference(X_all)                                              # (N, C, *)
        Y_all.backward(dY)
        x = X[mine].clone().requires_grad_()                                  # (n_rank, C, *)
        y = ours(x)
        y.backward(dY[mine])
        torch.testing.assert_close(y, Y_all.detach()[mine], **TIGHT)
        torch.testing.assert_close(x.grad, X_all.grad[mine], **TIGHT)
        for name in ("weight", "bias"):
            g = getattr(ours, name).grad.clone()
            dist.all_reduce(g)  # each rank holds its share, as torch's SyncBatchNorm
            torch.testing.assert_close(g, getattr(reference, name).grad, **TIGHT)
            getattr(ours, name).grad = None
            getattr(reference, name).grad = None
        torch.testing.assert_close(ours.running_mean, reference.running_mean, **TIGHT)
        torch.testing.assert_close(ours.running_var, reference.running_var, **TIGHT)
        assert int(ours.num_batches_tracked) == int(reference.num_batches_tracked)
    _eval_mode_does_not_communicate(ours, reference, X[mine])


def _eval_mode_does_not_communicate(ours, reference, x) -> None:
    ours.eval()
    reference.eval()
    real = dist.all_reduce

    def refuse(*args, **kwargs):
        raise AssertionError("SyncBatchNorm communicated in eval mode")

    dist.all_reduce = refuse
    try:
        with torch.no_grad():
            torch.testing.assert_close(ours(x), reference(x), **TIGHT)
    finally:
        dist.all_reduce = real


def converted_resnet_matches() -> None:
    """Worker: resnet18 with its BatchNorms converted, on shards, equals resnet18 on the batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes, mine = SHARDS[world], _my_slice(SHARDS[world], rank)
    torch.manual_seed(0)
    reference = resnet18(num_classes=10, in_channels=1).double()
    X = torch.randn(sum(sizes), 1, 16, 16, dtype=torch.float64)  # (N, 1, 16, 16)
    with torch.no_grad():
        expected = reference(X)                                   # (N, 10)
    torch.manual_seed(0)
    net = convert_sync_batchnorm(resnet18(num_classes=10, in_channels=1).double())
    assert not any(type(m) is nn.BatchNorm2d for m in net.modules())
    with torch.no_grad():
        torch.testing.assert_close(net(X[mine]), expected[mine], rtol=1e-9, atol=1e-9)


def every_shape() -> None:
    """Worker: BatchNorm2d (N, C, H, W), BatchNorm1d (N, C) and (N, C, L)."""
    for shape_tail in [(4, 3, 5), (6,), (4, 7)]:
        against_global_batch(shape_tail)


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_batchnorm_on_the_global_batch(world_size):
    launch(every_shape, world_size, timeout=60)


def test_converted_resnet18_matches_on_unequal_shards():
    launch(converted_resnet_matches, 3, timeout=90)


def test_without_a_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    reference, ours = _reference_and_ours(nn.BatchNorm2d(3))
    X = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    x, X_ref = X.clone().requires_grad_(), X.clone().requires_grad_()
    y, expected = ours(x), reference(X_ref)
    y.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(y, expected, **TIGHT)
    torch.testing.assert_close(x.grad, X_ref.grad, **TIGHT)
    torch.testing.assert_close(ours.running_var, reference.running_var, **TIGHT)


def test_convert_replaces_every_batchnorm_and_keeps_its_tensors():
    torch.manual_seed(0)
    net = resnet18(num_classes=10, in_channels=1)
    net.eval()
    before = {k: v for k, v in net.state_dict().items()}
    old_params = {id(p) for p in net.parameters()}
    count = sum(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    converted = convert_sync_batchnorm(net)
    assert converted is net
    assert sum(isinstance(m, SyncBatchNorm) for m in net.modules()) == count == 17
    assert not any(type(m) is nn.BatchNorm2d for m in net.modules())
    assert {id(p) for p in net.parameters()} == old_params  # an optimizer built before still works
    assert all(not m.training for m in net.modules())
    after = net.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    single = convert_sync_batchnorm(nn.BatchNorm1d(5))
    assert isinstance(single, SyncBatchNorm) and single.num_features == 5


def test_wrong_channels_say_what_was_expected():
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(4\) expects 4 channels"):
        SyncBatchNorm(4)(torch.randn(2, 3, 5, 5))


def eval_without_running_stats_stays_local() -> int:
    """Worker: eval mode with track_running_stats=False never calls a collective, so a rank may
    evaluate a different number of batches; each rank normalises with its own batch, as torch."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ours = SyncBatchNorm(3, track_running_stats=False).double().eval()
    local = nn.BatchNorm2d(3, track_running_stats=False).double().eval()
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        with torch.no_grad():
            for _ in range(1 + 2 * rank):  # rank r evaluates 1 + 2r batches
                x = torch.randn(4, 3, 5, 5, dtype=torch.float64) * 3 + 2  # (4, 3, 5, 5)
                torch.testing.assert_close(ours(x), local(x), **TIGHT)
    finally:
        dist.all_reduce = real
    return len(calls)


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_mode_without_running_stats_does_not_communicate(world_size):
    calls = launch(eval_without_running_stats_stays_local, world_size, timeout=60)
    assert calls == [0] * world_size  # no all_reduce on any rank
