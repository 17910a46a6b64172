"""The exercise checkers of notebooks 01-06: None is "not answered yet", a right answer passes,
a wrong one fails (and raises with strict=True), and each oracle agrees with the real thing."""
import math
import warnings

import pytest
import torch

from course_lib import checks
from course_lib.checks.lesson02 import _ring_sends
from course_lib.devices import devices
from course_lib.distributed.collectives import ring_chunk_bounds
from course_lib.models.lenet import LeNet
from course_lib.parallel import DataParallel
from course_lib.parallel.comm import allreduce, ring_allreduce, scatter


def verdicts(check, unanswered, right, wrong):
    """The three verdicts of one checker: open, right and wrong answers."""
    assert check(unanswered).ok is None
    assert check(right).ok is True
    assert check(wrong).ok is False
    with pytest.raises(AssertionError):
        check(wrong, strict=True)


# ---- notebook 02 ---------------------------------------------------------------------------------

def butterfly(tensors):
    n, distance = len(tensors), 1
    while distance < n:
        received = [tensors[i ^ distance].to(tensors[i].device, copy=True) for i in range(n)]
        for t, r in zip(tensors, received):
            t += r
        distance *= 2


def rebinding(tensors):  # the classic bug: new list entries, the caller's tensors unchanged
    total = sum(t.cpu() for t in tensors)
    for i in range(len(tensors)):
        tensors[i] = total.clone()


def test_check_allreduce_fn():
    def check(fn, strict=False):  # a butterfly needs a power-of-two number of devices
        return checks.check_allreduce_fn(fn, device_counts=(1, 2, 4, 8), strict=strict)

    verdicts(check, None, butterfly, rebinding)
    assert checks.check_allreduce_fn(allreduce)
    assert checks.check_allreduce_fn(ring_allreduce, device_counts=(3, 5))


def test_ring_sends_matches_the_trace_of_ring_allreduce():
    for numel, n in [(1000, 4), (7, 3), (2, 4), (1, 1), (1001, 8)]:
        trace = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # n logical devices on one CPU: expected here
            devs = devices(n)
        ring_allreduce([torch.zeros(numel).to(d) for d in devs], trace=trace)
        bounds, sent = ring_chunk_bounds(numel, n), [0] * n
        for record in trace:
            for src, _dst, chunk in record["sends"]:
                sent[src] += bounds[chunk][1] - bounds[chunk][0]
        assert _ring_sends(numel, n) == sent
    verdicts(checks.check_ring_sends, None, [1500] * 4, [1000] * 4)


# ---- notebook 03 ---------------------------------------------------------------------------------

def test_check_balanced_sizes():
    def right(B, n):
        base, extra = divmod(B, n)
        return [base + (i < extra) for i in range(n)]

    def chunk_sizes(B, n):  # torch.chunk's sizes: not balanced
        return [c.shape[0] for c in torch.chunk(torch.zeros(B), n)]

    verdicts(checks.check_balanced_sizes, None, right, chunk_sizes)
    assert checks.check_balanced_sizes(lambda B, n: right(B, n)[::-1])  # any order
    assert checks.check_balanced_sizes(lambda B, n: 1 / 0).ok is False    # raising: a verdict


def test_check_devices_used():
    for B, n in [(9, 8), (17, 8), (5, 4), (256, 3)]:
        used = len(scatter(torch.zeros(B), [torch.device("cpu")] * n))
        assert used == math.ceil(B / math.ceil(B / n))
        verdicts(lambda a, strict=False, B=B, n=n: checks.check_devices_used(B, n, a,
                                                                             strict=strict),
                 None, used, used + 1)


# ---- notebook 04 ---------------------------------------------------------------------------------

def test_check_lr_for_shard_means():
    verdicts(lambda a, strict=False: checks.check_lr_for_shard_means(a, k=4, lr=0.5,
                                                                      strict=strict),
             None, 0.125, 0.5)


def test_check_scaled_batch():
    check = checks.check_scaled_batch
    assert check(None, None, None).ok is None
    assert check(2048, 7.2, 30).ok is True
    assert check(2048, 0.9 * 8, 30).ok is True      # 7.2 as a float expression
    assert check(2048, 0.9, 30).ok is False          # lr not scaled
    assert check(2048, 7.2, 29).ok is False          # steps rounded down: the last batch counts
    with pytest.raises(AssertionError):
        check(256, 0.9, 235, strict=True)


# ---- notebook 05 ---------------------------------------------------------------------------------

def test_check_bn_examples_seen_agrees_with_data_parallel():
    devs = devices(3)                  # repeats of one CPU on a machine without GPUs
    net = torch.nn.Sequential(torch.nn.BatchNorm2d(2)).to(devs[0])
    X = torch.rand(7, 2, 3, 3)
    DataParallel(net, devs)(X)
    assert int(net[0].num_batches_tracked) == 1
    # running_mean moved by momentum * (mean of replica 0's shard): the first 3 examples
    torch.testing.assert_close(net[0].running_mean.cpu(), 0.1 * X[:3].mean(dim=(0, 2, 3)))
    verdicts(checks.check_bn_examples_seen, None, 3, 7)


def test_check_module_calls_counts_with_a_hook():
    verdicts(checks.check_module_calls, None, 1, 2)
    devs = devices(2)                  # repeats of one CPU on a machine without GPUs
    net, calls = LeNet().to(devs[0]), []
    net.register_forward_hook(lambda *a: calls.append(1))
    DataParallel(net, devs)(torch.rand(4, 1, 28, 28))
    assert checks.check_module_calls(len(calls), batch=4, n=2).ok is True  # 2 calls for 4


# ---- notebook 06 ---------------------------------------------------------------------------------

def test_check_tree_rounds():
    from course_lib.checks.lesson06 import _tree_rounds

    assert all(_tree_rounds(p) == math.ceil(math.log2(p)) for p in range(1, 65))
    verdicts(checks.check_tree_rounds, None, lambda p: math.ceil(math.log2(p)),
             lambda p: p - 1)


def test_check_elements_sent():
    from course_lib.checks.lesson06 import _elements_sent

    for n, p in [(10**6, 8), (1000, 4), (7, 3)]:
        total = sum(_elements_sent(n, p, r) for r in range(p))
        assert total == 2 * (p - 1) * n                       # every chunk travels 2 (p - 1) hops
    assert _elements_sent(10**6, 4) == 2 * 3 / 4 * 10**6
    verdicts(checks.check_elements_sent, None, _elements_sent,
             lambda n, p, rank=0: round(2 * (p - 1) / p * n))


def test_a_verdict_prints_once_and_displays_nothing_as_a_cells_last_value(capsys):
    result = checks.check_answer("x", 2, 2)
    assert capsys.readouterr().out == "[x] correct: well done.\n"
    assert result._ipython_display_() is None and capsys.readouterr().out == ""


# ---- notebook 01 ---------------------------------------------------------------------------------

def test_lesson01_checkers_accept_the_solutions_and_reject_realistic_mistakes():
    from solutions import lesson01

    def no_zeroing(params, lr):  # the step is right, the gradients pile up
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad

    def rebinds(params, lr):     # new tensors in a list the caller never sees
        params = [p - lr * p.grad for p in params]

    def scaffold(*args):
        raise NotImplementedError

    verdicts(checks.check_sgd_fn, None, lesson01.sgd, no_zeroing)
    assert checks.check_sgd_fn(rebinds).ok is False
    assert checks.check_sgd_fn(scaffold).ok is None
    verdicts(checks.check_accuracy_fn, None, lesson01.accuracy,
             lambda y_hat, y: int((y_hat.argmax(dim=0)[:len(y)] == y).sum()))
    assert checks.check_accuracy_fn(scaffold).ok is None
    verdicts(checks.check_initial_loss, None, lesson01.initial_loss_d2l, 0.0)
    assert checks.check_initial_loss(math.log(10)) and not checks.check_initial_loss(math.log(2))
