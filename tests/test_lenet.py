import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from course_lib.models.lenet import LENET_SHAPES, LeNet, init_lenet_params, lenet, sgd


def test_init_shapes_and_values():
    params = init_lenet_params(scale=0.01, seed=0)
    assert [tuple(p.shape) for p in params] == LENET_SHAPES
    assert all(p.requires_grad and p.is_leaf for p in params)
    for b in params[1::2]:
        assert torch.count_nonzero(b) == 0  # biases start at zero
    W3 = params[4]
    assert 0.008 < W3.std().item() < 0.012  # 102,400 normal draws times 0.01


def test_seed_reproduces():
    a, b = init_lenet_params(seed=3), init_lenet_params(seed=3)
    for p, q in zip(a, b):
        assert_close(p, q)
    c = init_lenet_params(seed=4)
    assert not torch.equal(a[0], c[0])


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_module_matches_functional_outputs_and_gradients(batch, seed):
    """Oracle: nn.Module with copied weights gives the same logits and gradients."""
    torch.manual_seed(seed)
    params = init_lenet_params(scale=0.1, seed=seed)
    net = LeNet.from_params(params)
    X = torch.rand(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))

    logits = lenet(X, params)
    assert logits.shape == (batch, 10)
    assert_close(logits, net(X))

    F.cross_entropy(logits, y).backward()
    F.cross_entropy(net(X), y).backward()
    mod_grads = [net.conv1.weight.grad, net.conv1.bias.grad, net.conv2.weight.grad,
                 net.conv2.bias.grad, net.fc1.weight.grad.T, net.fc1.bias.grad,
                 net.fc2.weight.grad.T, net.fc2.bias.grad]
    for p, g in zip(params, mod_grads):
        assert_close(p.grad, g)


def test_sgd_matches_torch_optim():
    params = init_lenet_params(scale=0.1, seed=1)
    clones = [p.detach().clone().requires_grad_() for p in params]
    X, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    F.cross_entropy(lenet(X, params), y).backward()
    sgd(params, lr=0.5)
    opt = torch.optim.SGD(clones, lr=0.5)
    F.cross_entropy(lenet(X, clones), y).backward()
    opt.step()
    for p, q in zip(params, clones):
        assert_close(p, q)
        assert torch.count_nonzero(p.grad) == 0  # sgd zeroes the gradients


def test_lenet_rejects_wrong_param_list():
    import pytest

    with pytest.raises(ValueError, match="8 tensors"):
        lenet(torch.rand(1, 1, 28, 28), init_lenet_params()[:6])
