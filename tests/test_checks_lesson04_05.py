"""The code exercises of lessons 04 and 05: None is "not answered yet", the reference answers in
solutions/ pass, and realistic wrong answers fail with the first failing case named."""
import copy

import pytest
import torch
import torch.nn.functional as F

from course_lib.checks import lesson05 as lesson05_checks
from course_lib.checks.lesson04 import (
    check_scaled_batch,
    check_shard_mean_weights,
    check_train_batch,
)
from course_lib.checks.lesson05 import (
    check_bn_examples_seen,
    check_data_parallel_fn,
    check_module_calls,
)
from course_lib.models.lenet import lenet, sgd
from course_lib.parallel import gather, parallel_apply, replicate, scatter
from course_lib.parallel.comm import allreduce, split_batch
from course_lib.train import train_batch as library_train_batch
from solutions import lesson04, lesson05

# ---- lesson 04: train_batch ------------------------------------------------------------------


def _step(X, y, device_params, devices, lr, *, shard_loss, reduce=True):
    """The reference train_batch with one thing changed: how each shard's loss is formed
    (``shard_loss(y_hat, yi, B, k)``), and whether the gradients are allreduced."""
    B = y.shape[0]
    X_shards, y_shards = split_batch(X, y, devices)
    k = len(X_shards)
    loss, correct = 0.0, 0
    for params in device_params:
        for p in params:
            p.grad = torch.zeros_like(p)
    for Xi, yi, params in zip(X_shards, y_shards, device_params):
        y_hat = lenet(Xi, params)
        shard_loss(y_hat, yi, B, k).backward()
        loss = loss + F.cross_entropy(y_hat, yi, reduction="sum").detach() / B  # honest report
        correct = correct + (y_hat.argmax(dim=1) == yi).sum()
    if reduce:
        for grads in zip(*[[p.grad for p in params] for params in device_params]):
            allreduce(list(grads))
    for params in device_params:
        sgd(params, lr)
    return loss, correct


def averages_shard_means(X, y, device_params, devices, lr):
    """The popular mistake: each device's mean loss, then the average of the k gradients."""
    return _step(X, y, device_params, devices, lr,
                 shard_loss=lambda y_hat, yi, B, k: F.cross_entropy(y_hat, yi) / k)


def forgets_the_allreduce(X, y, device_params, devices, lr):
    """Every replica steps with its own shard's gradient: the replicas drift apart."""
    return _step(X, y, device_params, devices, lr, reduce=False, shard_loss=lambda y_hat, yi, B, k:
                 F.cross_entropy(y_hat, yi, reduction="sum") / B)


def sums_shard_means(X, y, device_params, devices, lr):
    """Mean per shard, summed by the allreduce: about k times the gradient."""
    return _step(X, y, device_params, devices, lr,
                 shard_loss=lambda y_hat, yi, B, k: F.cross_entropy(y_hat, yi))


def test_train_batch_unanswered_and_reference_answers_pass():
    assert check_train_batch(None).ok is None
    assert check_train_batch(lesson04.train_batch).ok is True
    assert check_train_batch(library_train_batch).ok is True  # the library's is the contract


def scaffold_train_batch(X, y, device_params, devices, lr):  # notebook 04's, not yet written
    raise NotImplementedError   # your code: split_batch, lenet, backward, allreduce, sgd


def test_train_batch_scaffold_is_not_answered_yet():
    result = check_train_batch(scaffold_train_batch)
    assert result.ok is None, result
    assert "still raises NotImplementedError" in result.message


@pytest.mark.parametrize("wrong, says", [
    (averages_shard_means, "average of the shard MEANS"),
    (forgets_the_allreduce, "replicas now differ"),
    (sums_shard_means, "SUM of the shard means"),
])
def test_train_batch_wrong_answers_fail_with_the_case(wrong, says):
    result = check_train_batch(wrong)
    assert result.ok is False
    assert says in result.message and "expected" in result.message
    if wrong is averages_shard_means:  # right for even shards: caught on an uneven split
        assert "batch of 7 (shards [4, 3])" in result.message
    with pytest.raises(AssertionError):
        check_train_batch(wrong, cases=((3, 7),), strict=True)


def test_number_answers_of_lesson04_pass():
    assert check_scaled_batch(*lesson04.scaled_batch(256, 4, 0.3), per_device=256, k=4,
                              base_lr=0.3).ok is True


def test_shard_mean_weights_checker_rejects_plausible_wrong_answers():
    sizes = (192, 48, 16)                                  # notebook 04's uneven shards, B = 256
    assert check_shard_mean_weights(lesson04.shard_mean_weights(sizes), sizes).ok is True
    assert check_shard_mean_weights([0.444, 1.78, 5.33], sizes).ok is True   # three digits
    assert check_shard_mean_weights(None, sizes).ok is None                  # open, not failed
    for wrong in ([1, 1, 1],                               # "the average is the batch mean"
                  [256 / n for n in sizes],                # forgot the average's 1/k
                  [3 * n / 256 for n in sizes],            # upside down
                  [n / 256 for n in sizes],                # each shard's share of the batch
                  [0.4, 1.8, 5.3],                         # rounded too coarsely
                  [0.444, 1.78],                           # one shard missing
                  0.444):                                  # not one number per shard
        result = check_shard_mean_weights(wrong, sizes)
        assert result.ok is False, wrong
    # Another split: the answer depends on the sizes, not on a memorised list.
    assert check_shard_mean_weights(lesson04.shard_mean_weights((5, 3)), (5, 3)).ok is True
    assert check_shard_mean_weights(lesson04.shard_mean_weights(sizes), (5, 3)).ok is False


# ---- lesson 05: data_parallel ----------------------------------------------------------------


def never_splits(module, X, devices):
    """Right numbers, no parallelism: one call on the whole batch."""
    return module(X)


def deep_copies(module, X, devices):
    """Copies that autograd cannot see: the gradients never reach the module."""
    shards = scatter(X, devices)
    replicas = [copy.deepcopy(module).to(d) for d in devices[:len(shards)]]
    return gather(parallel_apply(replicas, shards), devices[0])


def drops_the_remainder(module, X, devices):
    """torch.split by B // k: the short last piece is zipped away."""
    k = len(devices)
    pieces = [piece.to(d) for piece, d in zip(torch.split(X, max(1, X.shape[0] // k)), devices)]
    replicas = replicate(module, devices[:len(pieces)])
    return gather(parallel_apply(replicas, pieces), devices[0])


def module_on_each_shard(module, X, devices):
    """Right numbers, right calls, but no replicas and no threads: the module itself, shard by
    shard (on a CPU every output and gradient equals the plain module's)."""
    return torch.cat([module(shard) for shard in torch.chunk(X, len(devices))])


def replicas_in_a_loop(module, X, devices):
    """Replicas, but run one after another in the calling thread instead of parallel_apply."""
    shards = scatter(X, devices)
    replicas = replicate(module, devices[:len(shards)])
    return gather([r(s) for r, s in zip(replicas, shards)], devices[0])


def one_replica_for_all(module, X, devices):
    """One copy of the module, run on every shard in threads."""
    shards = scatter(X, devices)
    replica = replicate(module, devices[:1])[0]
    return gather(parallel_apply([replica] * len(shards), shards), devices[0])


def test_data_parallel_unanswered_and_reference_answer_pass():
    assert check_data_parallel_fn(None).ok is None
    assert check_data_parallel_fn(lesson05.data_parallel).ok is True


@pytest.mark.parametrize("wrong, says", [
    (never_splits, "called on batches of"),
    (deep_copies, ".grad is None"),
    (drops_the_remainder, "expected output shape"),
    (module_on_each_shard, "the module itself was called on a shard"),
    (replicas_in_a_loop, "one after another in one thread"),
    (one_replica_for_all, "one copy of the module ran several shards"),
])
def test_data_parallel_wrong_answers_fail_with_the_case(wrong, says):
    result = check_data_parallel_fn(wrong)
    assert result.ok is False and says in result.message
    with pytest.raises(AssertionError):
        check_data_parallel_fn(wrong, strict=True)


def scaffold_data_parallel(module, X, devices):  # notebook 05's, not yet written
    raise NotImplementedError


def test_data_parallel_scaffold_is_not_answered_yet():
    result = check_data_parallel_fn(scaffold_data_parallel)
    assert result.ok is None, result
    assert "still raises NotImplementedError" in result.message


def test_data_parallel_first_hint_gives_the_idea_later_ones_the_recipe(monkeypatch):
    monkeypatch.setattr(lesson05_checks, "_dp_failures", 0)
    first = check_data_parallel_fn(replicas_in_a_loop)
    assert first.ok is False and lesson05_checks._DP_HINT in first.message
    for call in ("scatter", "replicate", "parallel_apply", "gather"):
        assert call not in first.message.split("Hint:")[1], call
    second = check_data_parallel_fn(replicas_in_a_loop)
    assert second.ok is False and lesson05_checks._DP_RECIPE in second.message


def test_number_answers_of_lesson05_pass():
    assert check_bn_examples_seen(lesson05.bn_examples_seen(7, 3), batch=7, n=3).ok is True
    assert check_module_calls(lesson05.module_calls(1, 2), batch=1, n=2).ok is True
    assert check_module_calls(lesson05.module_calls(5, 3), batch=5, n=3).ok is True
