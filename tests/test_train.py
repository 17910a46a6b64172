"""Oracle tests for data-parallel training: k devices must equal one device on the whole batch."""
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from course_lib.devices import devices as make_devices
from course_lib.models.lenet import init_lenet_params, lenet, sgd
from course_lib.parallel.comm import get_params, replicate_params
from course_lib.train import (
    evaluate_accuracy,
    train,
    train_batch,
    train_single,
)


def devs(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_devices(n)


def batch(B, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    X = torch.rand(B, 1, 28, 28, generator=gen, dtype=dtype)
    y = torch.randint(0, 10, (B,), generator=gen)
    return X, y


def one_device_step(params, X, y, lr, net=lenet):
    """The oracle: one SGD step on the mean cross-entropy of the whole batch, on one device."""
    ref = get_params(params, "cpu")
    y_hat = net(X, ref)
    loss = F.cross_entropy(y_hat, y)
    loss.backward()
    sgd(ref, lr)
    return ref, loss.detach(), int((y_hat.argmax(1) == y).sum())


def lenet_params(dtype=torch.float64, seed=0):
    return [p.detach().to(dtype).requires_grad_() for p in init_lenet_params(0.1, seed=seed)]


@pytest.mark.parametrize("k,B", [(k, k + 3) for k in range(1, 9)] + [(2, 16), (4, 16), (3, 7)])
def test_train_batch_equals_one_device_step(k, B):
    """n = 1..8 devices, mostly uneven shards (B = k + 3), plus even ones."""
    params = lenet_params()
    X, y = batch(B, seed=k, dtype=torch.float64)
    ref, ref_loss, ref_correct = one_device_step(params, X, y, lr=0.5)
    device_params = replicate_params(params, devs(k))
    loss, correct = train_batch(X, y, device_params, devs(k), lr=0.5)
    assert_close(loss.cpu(), ref_loss)
    assert int(correct) == ref_correct
    for replica in device_params:                       # every replica took the same step
        for p, q in zip(replica, ref):
            assert_close(p.detach().cpu(), q.detach())


def test_train_batch_float32_with_default_tolerances():
    params = init_lenet_params(0.1, seed=1)
    X, y = batch(10, seed=3)
    ref, _, _ = one_device_step(params, X, y, lr=0.9)
    device_params = replicate_params(params, devs(3))           # uneven: 4, 4, 2
    train_batch(X, y, device_params, devs(3), lr=0.9)
    for p, q in zip(device_params[2], ref):
        assert_close(p.detach().cpu(), q.detach())


def linear(X, params):
    W, b = params
    return X.reshape(X.shape[0], -1) @ W + b             # (B, 10)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 8), extra=st.integers(0, 12), steps=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_train_batch_hypothesis(k, extra, steps, seed):
    """Any k, any batch size >= k (even or not), several steps: replicas track the oracle."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(6, 10, generator=gen, dtype=torch.float64).requires_grad_(),
              torch.zeros(10, dtype=torch.float64, requires_grad=True)]
    ref = get_params(params, "cpu")
    device_params = replicate_params(params, devs(k))
    for _ in range(steps):
        X = torch.randn(k + extra, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (k + extra,), generator=gen)
        ref, _, _ = one_device_step(ref, X, y, lr=0.3, net=linear)
        train_batch(X, y, device_params, devs(k), lr=0.3, net=linear)
    for replica in device_params:
        for p, q in zip(replica, ref):
            assert_close(p.detach().cpu(), q.detach())


@pytest.mark.parametrize("k", [2, 3, 4])
def test_train_batch_threads_give_the_same_step(k):
    params = lenet_params()
    X, y = batch(11, seed=5, dtype=torch.float64)
    ref, _, _ = one_device_step(params, X, y, lr=0.5)
    device_params = replicate_params(params, devs(k))
    train_batch(X, y, device_params, devs(k), lr=0.5, parallel=True)
    for replica in device_params:
        for p, q in zip(replica, ref):
            assert_close(p.detach().cpu(), q.detach())


def test_train_batch_errors():
    params = init_lenet_params(seed=0)
    X, y = batch(3)
    with pytest.raises(ValueError, match="batch size of at least 4"):
        train_batch(X, y, replicate_params(params, devs(4)), devs(4), lr=0.1)
    with pytest.raises(ValueError, match="2 parameter replicas for 3 devices"):
        train_batch(X, y, replicate_params(params, devs(2)), devs(3), lr=0.1)


# --- evaluation -------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_sharded_evaluation_is_exact(k):
    params = init_lenet_params(0.1, seed=2)
    batches = [batch(B, seed=B) for B in (11, 3, 1)]   # short batches use fewer devices
    one = evaluate_accuracy(lambda X: lenet(X, params), batches)
    reps = replicate_params(params, devs(k))
    nets = [functools.partial(lenet, params=p) for p in reps]
    assert evaluate_accuracy(nets, batches, devs(k)) == one
    # one net for every device: it follows its input (on a CPU every device is the CPU)
    assert evaluate_accuracy(lambda X: lenet(X, [p.to(X.device) for p in params]), batches,
                             devs(k)) == one
    assert evaluate_accuracy(nets, batches, devs(k), parallel=True) == one


def test_sharded_evaluation_needs_one_net_per_device():
    nets = [lambda X: X] * 2
    with pytest.raises(ValueError, match="2 nets for 3 devices"):
        evaluate_accuracy(nets, [batch(4)], devs(3))


# --- the training loop ------------------------------------------------------------------------

def test_train_matches_train_single_on_fixed_batches():
    batches = [batch(12, seed=s) for s in range(3)]
    test = [batch(9, seed=10)]
    p1 = lenet_params(torch.float32, seed=4)
    p2 = [p.detach().clone().requires_grad_() for p in p1]
    h1 = train_single(p1, batches, test, num_epochs=2, lr=0.5, plot=False)
    h2 = train(p2, batches, test, devices=devs(3), num_epochs=2, lr=0.5, plot=False)
    assert set(h2) == {"train_loss", "train_acc", "test_acc", "epoch_time"}
    assert len(h2["epoch_time"]) == 2
    for p, q in zip(p1, p2):                             # train copied replica 0 back
        assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5)
    assert_close(torch.tensor(h2["train_loss"]), torch.tensor(h1["train_loss"]))
    assert h2["test_acc"] == h1["test_acc"]


def test_recalibrate_batch_norm_restores_mode_momentum_and_statistics_when_interrupted():
    from torch import nn

    from course_lib.train import recalibrate_batch_norm

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)).eval()
    bn = net[1]
    bn.running_mean.fill_(0.5)
    before = bn.running_mean.clone()

    def batches():
        yield torch.rand(4, 1, 8, 8), None
        raise KeyboardInterrupt  # the learner stops the cell half-way

    with pytest.raises(KeyboardInterrupt):
        recalibrate_batch_norm(net, batches())
    assert not net.training and bn.momentum == 0.1
    assert torch.equal(bn.running_mean, before)      # not half-computed statistics
    recalibrate_batch_norm(net, [(torch.rand(4, 1, 8, 8), None)])
    assert not net.training and not torch.equal(bn.running_mean, before)


def test_plot_false_displays_nothing_even_in_a_notebook(monkeypatch):
    """plot=False (TrainingPlot(live=False)) used to display the final figure in a notebook:
    stray plots in stored outputs."""
    import IPython.display
    import matplotlib.pyplot as plt

    from course_lib import plots
    from course_lib.plots import TrainingPlot

    shown = []
    monkeypatch.setattr(plots, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.append(a))
    figures = plt.get_fignums()
    plot = TrainingPlot(live=False)
    plot.update(1, train_loss=1.0)
    plot.close()
    X, y = batch(8)
    train_single(init_lenet_params(seed=0), [(X, y)], [(X, y)], num_epochs=1, lr=0.1,
                 plot=False)
    assert shown == [] and plt.get_fignums() == figures
    TrainingPlot(live=True).update(1, train_loss=1.0)  # a live plot displays: the counter sees it
    assert len(shown) == 1
