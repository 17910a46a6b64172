import collections
import copy
import threading
import typing
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from course_lib.bench import step_breakdown
from course_lib.devices import num_gpus
from course_lib.models.lenet import LeNet
from course_lib.models.resnet import resnet18
from course_lib.parallel import DataParallel, gather, parallel_apply, replicate, scatter_kwargs
from course_lib.train import train_module


def cpus(k: int) -> list[torch.device]:
    """k logical CPU devices: course_lib.devices.devices(k) here, without the warning."""
    return [torch.device("cpu")] * k


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()]


def small_resnet() -> nn.Module:
    torch.manual_seed(0)
    return resnet18(10, 1)


def bn_net() -> nn.Module:
    """A tiny CNN with batch norm: the same BN behaviour as ResNet, a hundredth of the cost."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


def images(batch: int) -> torch.Tensor:
    """Small 12x12 images: the same ResNet (adaptive pooling), a tenth of the 28x28 compute."""
    return torch.rand(batch, 1, 12, 12)


# --- replicate ---------------------------------------------------------------------------------

def test_replicate_parameters_are_differentiable_copies():
    net = LeNet()
    r0, r1, r2 = replicate(net, cpus(3))
    assert list(r0.parameters()) == []            # replicas hold no leaf parameters
    names = [name for name, _ in net.named_parameters()]      # "conv1.weight", ...
    for name, p in zip(names, net.parameters()):
        q0 = r0.get_submodule(name.rsplit(".", 1)[0]).__dict__[name.rsplit(".", 1)[1]]
        assert not q0.is_leaf and q0.grad_fn is not None
        assert q0.data_ptr() == p.data_ptr()      # replica 0 on the module's device: a view
    w = net.conv1.weight
    for q in (r1.conv1.weight, r2.conv1.weight):  # other replicas: own memory, same values
        assert q.data_ptr() != w.data_ptr() and q.grad_fn is not None
        assert_close(q, w.detach())
    assert isinstance(r1, LeNet) and r1.training == net.training


def test_replicate_buffers_like_torch():
    net = small_resnet()
    r0, r1 = replicate(net, cpus(2))
    assert r0[1].running_mean is net[1].running_mean          # shared: updates land on net
    assert r1[1].running_mean is not net[1].running_mean      # a copy, thrown away later
    assert_close(r1[1].running_var, net[1].running_var)
    assert not r1[1].running_mean.requires_grad


def test_replicate_keeps_shared_submodules_and_parameters_shared():
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    (r,) = replicate(net, cpus(1))
    assert r[0] is r[2] and r[0].weight is r[2].weight


def test_replicate_rejects_no_devices():
    with pytest.raises(ValueError, match="at least one device"):
        replicate(LeNet(), [])


# --- gradient oracles ----------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(k=st.sampled_from([2, 3]), batch=st.integers(1, 11), seed=st.integers(0, 2**16))
def test_lenet_gradients_equal_plain_module_on_whole_batch(k, batch, seed):
    """Oracle: DataParallel over k logical CPU devices gives the plain module's gradients."""
    torch.manual_seed(seed)
    net = LeNet()
    ref = copy.deepcopy(net)
    X, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    out = DataParallel(net, cpus(k))(X)
    assert out.shape == (batch, 10)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(ref(X), y).backward()
    assert_close(out, ref(X))
    for g, g_ref in zip(grads(net), grads(ref)):
        assert_close(g, g_ref)


@pytest.mark.parametrize("k", [3])
def test_resnet_eval_mode_equals_plain_module(k):
    """In eval() mode batch norm uses the running statistics: no difference at all."""
    net = small_resnet().eval()
    ref = copy.deepcopy(net)
    X, y = images(5), torch.randint(0, 10, (5,))
    out = DataParallel(net, cpus(k))(X)
    F.cross_entropy(out, y).backward()
    ref_out = ref(X)
    F.cross_entropy(ref_out, y).backward()
    assert_close(out, ref_out)
    for g, g_ref in zip(grads(net), grads(ref)):
        assert_close(g, g_ref)


@pytest.mark.parametrize("make, k", [(bn_net, 2), (bn_net, 3), (small_resnet, 2)])
def test_train_mode_batch_norm_per_shard(make, k):
    """In train() mode each replica normalizes with its own shard's statistics: the oracle is
    the plain module applied to each shard separately, and the running statistics are those of
    shard 0 only."""
    net = make()
    ref = copy.deepcopy(net)
    X, y = images(6), torch.randint(0, 10, (6,))
    out = DataParallel(net, cpus(k))(X)
    shards = torch.chunk(X, k)
    ref_out = torch.cat([copy.deepcopy(ref)(s) if i else ref(s) for i, s in enumerate(shards)])
    assert_close(out, ref_out)                       # not equal to ref(X): stats per shard
    assert not torch.allclose(out, copy.deepcopy(ref).train()(X), atol=1e-4)
    assert_close(net[1].running_mean, ref[1].running_mean)   # ref saw shard 0 (i == 0) only
    assert_close(net[1].num_batches_tracked, ref[1].num_batches_tracked)

    # gradients: the same per-shard computation, written with the module's own parameters
    ref2 = make()
    parts = [ref2(s) for s in shards]               # one module, k separate BN statistics
    F.cross_entropy(torch.cat(parts), y).backward()
    F.cross_entropy(out, y).backward()
    for g, g_ref in zip(grads(net), grads(ref2)):
        assert_close(g, g_ref)


@pytest.mark.skipif(num_gpus() < 2, reason="nn.DataParallel only splits over >= 2 CUDA GPUs; "
                                           f"this machine has {num_gpus()}")
def test_matches_torch_data_parallel_on_two_gpus():
    torch.manual_seed(0)
    net = LeNet().to("cuda:0")
    ref = copy.deepcopy(net)
    X, y = torch.rand(9, 1, 28, 28, device="cuda:0"), torch.randint(0, 10, (9,), device="cuda:0")
    ours, theirs = DataParallel(net, [0, 1])(X), nn.DataParallel(ref, [0, 1])(X)
    assert_close(ours, theirs)
    F.cross_entropy(ours, y).backward()
    F.cross_entropy(theirs, y).backward()
    for g, g_ref in zip(grads(net), grads(ref)):
        assert_close(g, g_ref)
    # batch norm: same running statistics as torch's (only replica 0's shard counts)
    bn, bn_ref = small_resnet().to("cuda:0"), small_resnet().to("cuda:0")
    DataParallel(bn, [0, 1])(X), nn.DataParallel(bn_ref, [0, 1])(X)
    assert_close(bn[1].running_mean, bn_ref[1].running_mean)


# --- parallel_apply, scatter_kwargs, gather ------------------------------------------------------

def test_parallel_apply_one_thread_per_replica_and_grad_mode():
    seen = []

    def f(x):
        seen.append(threading.current_thread().name)
        return x * 2

    xs = [torch.ones(2, requires_grad=True) for _ in range(3)]
    with torch.no_grad():
        outs = parallel_apply([f, f, f], xs)
    assert sorted(seen) == ["replica-0", "replica-1", "replica-2"]  # not the caller's thread
    assert all(not o.requires_grad for o in outs)         # no_grad reached the threads
    outs = parallel_apply([f, f, f], [(x,) for x in xs])
    assert all(o.requires_grad for o in outs)
    assert_close(outs[1], torch.full((2,), 2.0))


def test_parallel_apply_reraises_with_replica_named():
    def bad(x):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as info:
        parallel_apply([lambda x: x, bad], [torch.ones(1), torch.ones(1)])
    assert any("replica 1" in n for n in info.value.__notes__)
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply([bad, bad], [torch.ones(1)])


def test_scatter_kwargs_splits_tensors_and_repeats_the_rest():
    X = torch.arange(5.0)
    ins, kws = scatter_kwargs((X, "tag"), {"mask": torch.arange(5), "p": 0.5}, cpus(2))
    assert [tuple(a.shape) for a, _ in ins] == [(3,), (2,)]
    assert [t for _, t in ins] == ["tag", "tag"]
    assert [kw["mask"].tolist() for kw in kws] == [[0, 1, 2], [3, 4]]
    assert [kw["p"] for kw in kws] == [0.5, 0.5]
    ins, _ = scatter_kwargs((torch.ones(2, 1),), {}, cpus(3))   # fewer examples than devices
    assert len(ins) == 2


def test_gather_nested_and_differentiable():
    a = torch.ones(2, 3, requires_grad=True)
    b = torch.ones(1, 3, requires_grad=True)
    out = gather([(a, {"z": a}), (b, {"z": b})], "cpu")
    assert out[0].shape == (3, 3) and out[1]["z"].shape == (3, 3)
    out[0].sum().backward()
    assert_close(a.grad, torch.ones(2, 3))
    with pytest.raises(ValueError, match="0-d"):
        gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")


class OneField(collections.namedtuple("OneField", "x")):
    pass


class Pair(typing.NamedTuple):
    x: torch.Tensor
    tag: str


class _CpuScatter:
    """torch's ``Scatter`` refuses CPU devices: the same chunks (torch.chunk along dim 0, as
    torch.cuda.comm.scatter), so torch's own ``scatter_gather`` code builds the structure."""

    @staticmethod
    def apply(target_gpus, chunk_sizes, dim, tensor):
        return tuple(torch.chunk(tensor, len(target_gpus), dim))


class _CpuGather:
    @staticmethod
    def apply(target_device, dim, *tensors):
        return torch.cat(tensors, dim)


def same_structure(ours, theirs) -> None:
    """Equal types at every level, equal keys and lengths, equal tensors, equal leaves."""
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs)
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs)
        for k in ours:
            same_structure(ours[k], theirs[k])
    elif isinstance(ours, (tuple, list)):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            same_structure(a, b)
    else:
        assert ours == theirs


@pytest.mark.parametrize("k", [2, 3])
def test_scatter_kwargs_and_gather_keep_namedtuples_as_torch(k, monkeypatch):
    """A one-field namedtuple came back holding a tuple, one of several fields raised, and gather
    raised on namedtuple outputs. Compared with torch's own scatter_gather code."""
    import torch.nn.parallel.scatter_gather as torch_sg

    monkeypatch.setattr(torch_sg, "Scatter", _CpuScatter)
    monkeypatch.setattr(torch_sg, "Gather", _CpuGather)
    X = torch.arange(10.0).reshape(5, 2)                 # (5, 2): chunks 3+2, or 2+2+1
    inputs = (OneField(X), Pair(X + 1, "t"), [X, "s", (X,)], {"a": X, "b": 3},
              collections.OrderedDict(z=Pair(X, "u")), (), "plain")
    kwargs = {"nt": Pair(X * 2, "k"), "one": OneField(X), "plain": (X, [X])}
    ins, kws = scatter_kwargs(inputs, kwargs, cpus(k))
    torch_ins, torch_kws = torch_sg.scatter_kwargs(inputs, kwargs, cpus(k))
    assert len(ins) == len(torch_ins) == len(kws) == len(torch_kws) == k
    for ours, theirs in [*zip(ins, torch_ins), *zip(kws, torch_kws)]:
        same_structure(ours, theirs)
    assert type(ins[0][0]) is OneField and ins[-1][1].tag == "t"
    assert_close(ins[-1][0].x, X[-ins[-1][0].x.shape[0]:])   # the last chunk of the batch
    XY = collections.namedtuple("XY", "x y")               # outputs: namedtuples of tensors
    for outputs in ([XY(i[0].x, i[1].x) for i in ins], [i[0] for i in ins],
                    [(XY(i[0].x, i[1].x), i[0]) for i in ins],
                    [{"o": i[0], "p": [i[1].x]} for i in ins]):
        same_structure(gather(outputs, "cpu"), torch_sg.gather(outputs, "cpu"))
    joined = gather([XY(i[0].x, i[1].x) for i in ins], "cpu")
    assert type(joined) is XY and torch.equal(joined.x, X) and torch.equal(joined.y, X + 1)

    class Halves(nn.Module):                          # takes and returns namedtuples
        def forward(self, p: Pair, one: OneField):
            return XY(p.x * 2, one.x + 1)

    out = DataParallel(Halves(), cpus(k))(Pair(X, "t"), one=OneField(X))
    assert type(out) is XY and torch.equal(out.x, X * 2) and torch.equal(out.y, X + 1)
    with pytest.raises(ValueError, match="same length, got lengths \\[1, 2\\]"):
        gather([(X,), (X, X)], "cpu")
    with pytest.raises(ValueError, match="same keys"):
        gather([{"a": X}, {"a": X, "b": X}], "cpu")


# --- DataParallel ----------------------------------------------------------------------

def test_data_parallel_splits_batch_on_logical_cpus():
    net = LeNet()
    sizes = []
    net.register_forward_hook(lambda m, inp, out: sizes.append(inp[0].shape[0]))
    dp = DataParallel(net, cpus(2))
    assert dp(torch.rand(7, 1, 28, 28)).shape == (7, 10)
    assert sorted(sizes) == [3, 4]
    assert list(dp.state_dict()) == ["module." + k for k in net.state_dict()]


def test_data_parallel_one_device_just_calls_module():
    net = LeNet()
    sizes = []
    net.register_forward_hook(lambda m, inp, out: sizes.append(inp[0].shape[0]))
    X = torch.rand(4, 1, 28, 28)
    assert_close(DataParallel(net, ["cpu"])(X), net(X))
    assert sizes == [4, 4]


def test_data_parallel_checks_module_device():
    with pytest.raises(RuntimeError, match="device_ids\\[0\\] = meta"):
        DataParallel(LeNet(), ["meta", "meta"])(torch.rand(2, 1, 28, 28))
    with pytest.raises(ValueError, match="at least one device"):
        DataParallel(LeNet(), [])


def test_torch_data_parallel_on_cpu_only_machine_does_not_split(no_gpus):
    """What nn.DataParallel silently does without GPUs: device_ids=[], one call, whole batch."""
    net = LeNet()
    sizes = []
    net.register_forward_hook(lambda m, inp, out: sizes.append(inp[0].shape[0]))
    dp = nn.DataParallel(net, device_ids=[0, 1])
    assert dp.device_ids == []
    dp(torch.rand(6, 1, 28, 28))
    assert sizes == [6]


def test_train_module_data_parallel_equals_plain_training():
    """Two SGD steps through DataParallel on 3 logical devices = two plain steps."""
    torch.manual_seed(1)
    net = LeNet()
    ref = copy.deepcopy(net)
    data = [(torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(2)]
    test = data[:1]
    h = train_module(DataParallel(net, cpus(3)), data, test, num_epochs=1, lr=0.1,
                     device="cpu", plot=False)
    h_ref = train_module(ref, data, test, num_epochs=1, lr=0.1, plot=False)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q)
    assert set(h) == {"train_loss", "train_acc", "test_acc", "epoch_time"}
    assert_close(h["train_loss"][0], h_ref["train_loss"][0])
    assert h["test_acc"] == h_ref["test_acc"]


def test_step_breakdown_phases_and_gradients():
    net = LeNet()
    ref = copy.deepcopy(net)
    X, y = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no zero_grad-on-replica warning etc.
        times = step_breakdown(net, X, y, cpus(2), repeat=2)
    assert list(times) == ["scatter", "replicate", "forward", "gather", "backward"]
    assert all(t >= 0 for t in times.values())
    F.cross_entropy(ref(X), y).backward()
    for g, g_ref in zip(grads(net), grads(ref)):
        assert_close(g, g_ref)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: on a CPU the autograd engine runs every replica's
    backward in the calling thread, so k replicas sleep k times."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import time
        time.sleep(0.05)
        return g


class SleepyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        return _SlowBackward.apply(self.fc(x.flatten(1)))  # after the weights: on the grad path


def test_compare_breakdown_interleaves_and_finds_the_slower_backward():
    from course_lib.bench.breakdown import PHASES, compare_breakdown

    torch.manual_seed(0)
    net, X, y = SleepyNet(), torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    ref = copy.deepcopy(net)
    result = compare_breakdown(net, X, y, {"1 device": cpus(1), "3 devices": cpus(3)},
                               rounds=6, warmup=1)
    # one step of each per round, the first set rotating
    assert result.order == ["1 device", "3 devices", "3 devices", "1 device"] * 3
    for name in result.names:
        assert all(len(result.seconds[name][p]) == 6 for p in (*PHASES, "total"))
        for i in range(6):
            assert result.seconds[name]["total"][i] == pytest.approx(
                sum(result.seconds[name][p][i] for p in PHASES))
    backward = result.phase("backward")  # 3 replicas sleep 3 times in backward
    r, lo, hi = backward.ratio("3 devices")
    assert lo > 1.5 and 2 < r < 4, (r, lo, hi)
    assert backward.verdict("3 devices").startswith("3 devices is slower than 1 device")
    assert "total" in str(result) and "backward" in str(result)
    F.cross_entropy(ref(X), y).backward()  # the last step's gradients are the whole batch's
    for g, g_ref in zip(grads(net), grads(ref)):
        assert_close(g, g_ref)


def test_compare_breakdown_refuses_what_it_cannot_compare():
    from course_lib.bench.breakdown import compare_breakdown

    net, X, y = LeNet(), torch.rand(2, 1, 28, 28), torch.randint(0, 10, (2,))
    with pytest.raises(ValueError, match="at least two sets"):
        compare_breakdown(net, X, y, {"one": cpus(1)})
    with pytest.raises(ValueError, match="rounds >= 2"):
        compare_breakdown(net, X, y, {"a": cpus(1), "b": cpus(2)}, rounds=1)
    with pytest.raises(ValueError, match="repeat >= 1"):
        step_breakdown(net, X, y, cpus(1), repeat=0)


def test_recalibrate_batch_norm_gives_the_average_of_the_batch_statistics():
    from course_lib.train import recalibrate_batch_norm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3))
    batches = [(torch.randn(8, 1, 6, 6) * 2 + 1, None) for _ in range(4)]
    weights_before = [p.detach().clone() for p in net.parameters()]
    recalibrate_batch_norm(net, batches)
    with torch.no_grad():  # the oracle: each batch's statistics of the conv output, averaged
        feats = [net[0](X) for X, _ in batches]
    mean = torch.stack([f.mean(dim=(0, 2, 3)) for f in feats]).mean(0)
    var = torch.stack([f.var(dim=(0, 2, 3), unbiased=True) for f in feats]).mean(0)
    torch.testing.assert_close(net[1].running_mean, mean)
    torch.testing.assert_close(net[1].running_var, var)
    assert net[1].momentum == 0.1 and int(net[1].num_batches_tracked) == 4
    for p, q in zip(net.parameters(), weights_before):
        torch.testing.assert_close(p, q)
