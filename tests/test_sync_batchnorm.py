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


# --- a large mean against a small spread, in float32 ------------------------------------------



def _largest(t: torch.Tensor) -> float:
    """max |t|, 0 for an empty tensor (a rank with an empty shard)."""
    return t.abs().flatten().max().item() if t.numel() else 0.0


def large_mean_float32(sizes: list[int]) -> dict[str, float]:
    """Worker: channel mean 100, spread 0.05, float32. Ours on this rank's shard against torch's
    ``BatchNorm2d`` on the whole batch in float32 and in float64 (the oracle, on the same float32
    input). E[x^2] - E[x]^2 cancels here: 10000.0025 - 10000 leaves no correct digit in float32."""
    rank = dist.get_rank()
    mine = _my_slice(sizes, rank)
    torch.manual_seed(0)  # the same global batch and upstream gradients on every rank
    C = 3
    X = (100 + 0.05 * torch.randn(sum(sizes), C, 4, 4, dtype=torch.float64)).float()
    dY = torch.randn(X.shape, dtype=torch.float64).float()
    torch_bn = nn.BatchNorm2d(C)
    with torch.no_grad():
        torch_bn.weight.uniform_(0.5, 2.0)
        torch_bn.bias.uniform_(-1.0, 1.0)
    exact_bn = nn.BatchNorm2d(C).double()
    exact_bn.load_state_dict(torch_bn.state_dict())
    ours = SyncBatchNorm(C)
    ours.load_state_dict(torch_bn.state_dict())
    results = {}
    for name, bn, X_all, dY_all in [("torch", torch_bn, X, dY),
                                    ("exact", exact_bn, X.double(), dY.double())]:
        X_all = X_all.clone().requires_grad_()
        Y_all = bn(X_all)                                                   # (N, C, 4, 4)
        Y_all.backward(dY_all)
        results[name] = (Y_all.detach()[mine], X_all.grad[mine], bn.running_mean, bn.running_var)
    x = X[mine].clone().requires_grad_()
    y = ours(x)
    y.backward(dY[mine])
    results["ours"] = (y.detach(), x.grad, ours.running_mean, ours.running_var)
    exact = [t.double() for t in results["exact"]]
    errors = {}
    for who in ("ours", "torch"):
        for what, t, e in zip(("output", "input grad", "running mean", "running var"),
                              results[who], exact):
            errors[f"{who} {what}"] = _largest(t.double() - e)
    # torch's float32 BatchNorm2d on the whole batch is within 1e-4 of float64 here (the
    # output); ours must be as close: twice torch's error, plus 4 float32 ulps of the values
    for what, e in zip(("output", "input grad", "running mean", "running var"), exact):
        ulps = 4 * torch.finfo(torch.float32).eps * _largest(e)
        assert errors[f"ours {what}"] <= 2 * errors[f"torch {what}"] + ulps, (what, errors)
    return errors


@pytest.mark.parametrize("sizes", [[5, 3], [5, 3, 8], [6, 0, 10]])  # one rank with no examples
def test_large_mean_small_spread_in_float32_matches_float64(sizes):
    errors = launch(large_mean_float32, len(sizes), sizes, timeout=60)
    assert len(errors) == len(sizes)


# --- ranks whose layers differ in size ---------------------------------------------------------

def channels_differ_on_last_rank() -> str:
    """Worker: a first SyncBatchNorm(3) alike on every rank, then SyncBatchNorm(4), but (5) on
    the last rank. Before the check, gloo failed on the mismatched all-gather ("Received data
    size doesn't match") or the process was killed by signal 6."""
    rank, world = dist.get_rank(), dist.get_world_size()
    width = 5 if rank == world - 1 else 4
    net = nn.Sequential(SyncBatchNorm(3), nn.Conv2d(3, width, 1), SyncBatchNorm(width))
    with pytest.raises(ValueError) as info:
        net(torch.randn(2, 3, 4, 4))
    return str(info.value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_channel_counts_get_a_clear_error(world_size):
    messages = launch(channels_differ_on_last_rank, world_size, timeout=60)
    per_rank = ", ".join(f"rank {r}: {5 if r == world_size - 1 else 4}" for r in range(world_size))
    for rank, message in enumerate(messages):  # every rank raises, none waits for the others
        assert f"different num_features on the ranks: {per_rank}." in message, message
        assert f"the 2nd SyncBatchNorm layer to run in training on rank {rank}" in message
        assert "build it the same way on every rank" in message


def channel_check_runs_once() -> list[int]:
    """Worker: collectives per training step of one SyncBatchNorm: the channel check (one
    all-gather) on the first step only, then the statistics (one all-gather) and the backward
    (one all-reduce) on every step."""
    layer = SyncBatchNorm(3)
    calls = {"all_gather": 0, "all_reduce": 0}
    real = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return call

    per_step = []
    for name in calls:
        setattr(dist, name, counting(name))
    try:
        for _ in range(3):
            before = dict(calls)
            x = torch.randn(4, 3, 2, 2, requires_grad=True)
            layer(x).sum().backward()
            per_step.append([calls[n] - before[n] for n in ("all_gather", "all_reduce")])
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return per_step


@pytest.mark.parametrize("world_size", [2, 3])
def test_channel_check_is_one_all_gather_on_the_first_step_only(world_size):
    per_step = launch(channel_check_runs_once, world_size, timeout=60)
    assert per_step == [[[2, 1], [1, 1], [1, 1]]] * world_size
