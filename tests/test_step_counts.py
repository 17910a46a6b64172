"""course_lib.bench.step_counts: kernels counted at dispatch, torch's gradient buckets."""
import torch
from torch import nn

from course_lib.bench.step_counts import CountKernels, kernels_per_step, nbytes, torch_bucket_bytes


def test_views_are_not_counted_and_computing_operations_are():
    x = torch.ones(4, 4)
    with CountKernels() as counter:
        x.view(16)
        x.t()
    assert counter.kernels == 0
    with CountKernels() as counter:
        y = x + 1
        (y @ y).sum()
    assert counter.kernels == 3


def test_a_larger_net_launches_more_and_the_count_ignores_the_batch():
    small = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    large = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    assert kernels_per_step(large) > kernels_per_step(small) > 0
    assert kernels_per_step(small, (2, 1, 28, 28)) == kernels_per_step(small, (16, 1, 28, 28))


def test_foreach_makes_one_update_of_every_tensor():
    """torch.optim.SGD's multi-tensor update (its default on a GPU) is one operation for all
    parameters, where the per-tensor update is one each."""
    from course_lib.models.lenet import LeNet

    for net in (nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10)),
                LeNet()):
        tensors = len(list(net.parameters()))
        assert kernels_per_step(net) - kernels_per_step(net, foreach=True) == tensors - 1


def test_torch_buckets_reverse_order_add_then_close():
    net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 100))   # 440, 40, 4000, 400 bytes
    sizes = [nbytes([p]) for p in net.parameters()]
    assert sizes == [400, 40, 4000, 400]
    assert torch_bucket_bytes(net, [10**9]) == [sum(sizes)]              # one bucket
    assert torch_bucket_bytes(net, [1]) == sizes[::-1]                   # one tensor each
    # add, then close once full: 400 + 4000 reaches 1000, then 40 + 400
    assert torch_bucket_bytes(net, [1000]) == [4400, 440]
    # the first cap applies to the first bucket only
    assert torch_bucket_bytes(net, [1, 10**9]) == [400, 4440]
