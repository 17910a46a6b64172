"""The optional learning-rate schedule of train_single and train_module (a warm-up, lessons 04
and 05): step t uses lr * lr_lambda(t), counted over epochs; oracle: the same steps by hand."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from course_lib.data import TensorBatches
from course_lib.devices import cpu_threads
from course_lib.models.lenet import LeNet, init_lenet_params, lenet, sgd
from course_lib.train import train_module, train_single


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster and does not stall on a loaded machine."""
    with cpu_threads(1):
        yield


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 256, (12, 28, 28), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (12,), generator=g)
    data = TensorBatches(X, y, 4, shuffle=False)   # 3 steps per epoch, in order
    batches = list(data)                           # what the loops receive (floats in [0, 1])
    return data, torch.cat([b for b, _ in batches]), torch.cat([c for _, c in batches])


def warm(t):
    return 0.25 + 0.25 * t   # 0.25, 0.5, 0.75, 1.0, ...


def test_train_single_follows_the_schedule_across_epochs():
    data, X, y = _data()
    params = init_lenet_params(0.1, seed=0)
    ref = [p.detach().clone().requires_grad_() for p in params]
    train_single(params, data, data, num_epochs=2, lr=0.4, plot=False, lr_lambda=warm)
    for t in range(6):
        Xb, yb = X[4 * (t % 3):4 * (t % 3) + 4], y[4 * (t % 3):4 * (t % 3) + 4]
        F.cross_entropy(lenet(Xb, ref), yb).backward()
        sgd(ref, 0.4 * warm(t))
    for p, q in zip(params, ref):
        assert_close(p.detach(), q.detach())


def test_train_module_follows_the_schedule_and_none_keeps_a_constant_lr():
    data, X, y = _data()
    torch.manual_seed(0)
    net, ref, const = LeNet(), LeNet(), LeNet()
    ref.load_state_dict(net.state_dict())
    const.load_state_dict(net.state_dict())
    train_module(net, data, data, num_epochs=1, lr=0.4, plot=False, lr_lambda=warm)
    train_module(const, data, data, num_epochs=1, lr=0.4, plot=False)
    for t in range(3):                       # the oracle: plain SGD at lr * warm(t) by hand
        ref.zero_grad()
        F.cross_entropy(ref(X[4 * t:4 * t + 4]), y[4 * t:4 * t + 4]).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.4 * warm(t) * p.grad
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(net.parameters(), const.parameters()))
