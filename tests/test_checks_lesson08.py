"""The lesson-08 checker: None is "not answered yet", the reference answer passes (as a function
and as a "module:function" string), and realistic wrong answers fail with the case shown."""
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from course_lib.checks.lesson08 import check_exact_accuracy
from solutions.lesson08 import exact_accuracy

FAST = {"world_sizes": (3,), "timeout": 60}


def _correct(model, X, y) -> int:
    with torch.no_grad():
        return int((model(X).argmax(dim=1) == y).sum())


def mean_of_rank_accuracies(model, X, y):  # each rank's accuracy, then their mean
    rank, world = dist.get_rank(), dist.get_world_size()
    acc = torch.tensor(_correct(model, X[rank::world], y[rank::world]) / len(y[rank::world]),
                       dtype=torch.float64)
    dist.all_reduce(acc)
    return (acc / world).item()


def padded_sampler(model, X, y):  # the popular DistributedSampler evaluation
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(range(len(y)), num_replicas=world, rank=rank, shuffle=False)
    idx = torch.tensor(list(sampler))
    correct = torch.tensor(_correct(model, X[idx], y[idx]))
    dist.all_reduce(correct)
    return correct.item() / sampler.total_size


def no_all_reduce(model, X, y):  # this rank's shard only
    rank, world = dist.get_rank(), dist.get_world_size()
    return _correct(model, X[rank::world], y[rank::world]) / len(y[rank::world])


def everything_everywhere(model, X, y):  # right number, k times the work
    correct = torch.tensor(_correct(model, X, y))
    dist.all_reduce(correct)
    return correct.item() / (len(y) * dist.get_world_size())


def only_rank_zero(model, X, y):  # a collective called by one rank: the others never join
    if dist.get_rank() == 0:
        return exact_accuracy(model, X, y)
    return 0.0


def defined_in_main(model, X, y):
    return 0.0


def test_unanswered():
    assert check_exact_accuracy(None).ok is None


def test_reference_solution_passes_for_2_3_and_4_ranks(capsys):
    assert check_exact_accuracy(exact_accuracy)
    assert "world sizes [2, 3, 4]" in capsys.readouterr().out


def test_module_string_is_imported_in_the_workers(tmp_path, monkeypatch):
    (tmp_path / "my_eval_answer.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n"
        "def exact_accuracy(model, X, y):\n"
        "    r, k = dist.get_rank(), dist.get_world_size()\n"
        "    was = model.training\n"
        "    model.eval()\n"
        "    c = (model(X[r::k]).argmax(1) == y[r::k]).sum()\n"
        "    model.train(was)\n"
        "    t = torch.stack([c, torch.tensor(len(y[r::k]))])\n"
        "    dist.all_reduce(t)\n"
        "    return t[0] / t[1]\n")
    monkeypatch.chdir(tmp_path)
    assert check_exact_accuracy("my_eval_answer:exact_accuracy", **FAST)
    result = check_exact_accuracy("no_such_module:exact_accuracy", world_sizes=(2,))
    assert result.ok is False and "could not import" in result.message


@pytest.mark.parametrize("wrong, says", [
    (mean_of_rank_accuracies, "the mean of the ranks' accuracies"),
    (padded_sampler, "the padded count"),
    (no_all_reduce, "this rank's own accuracy"),
    (everything_everywhere, "evaluated more than once"),
])
def test_wrong_answers_fail_with_the_first_failing_case(wrong, says):
    result = check_exact_accuracy(wrong, **FAST)
    assert result.ok is False
    assert says in result.message and "world_size=3" in result.message, result.message
    assert "Hint: give each rank its own share" in result.message, result.message
    with pytest.raises(AssertionError):
        check_exact_accuracy(wrong, world_sizes=(3,), strict=True)


def left_in_train_mode(model, X, y):  # the right method, but Dropout still active
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.tensor([_correct(model, X[rank::world], y[rank::world]),
                           len(y[rank::world])])
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def left_in_eval_mode(model, X, y):  # evaluates in eval mode, never puts the mode back
    model.eval()
    return left_in_train_mode(model, X, y)


def test_an_answer_that_leaves_the_model_in_eval_mode_fails():
    result = check_exact_accuracy(left_in_eval_mode, **FAST)
    assert result.ok is False
    assert "left in eval mode" in result.message, result.message


def test_an_answer_that_leaves_the_model_in_train_mode_fails():
    result = check_exact_accuracy(left_in_train_mode, **FAST)
    assert result.ok is False
    assert "Dropout" in result.message and "train mode" in result.message, result.message
    assert "model.eval()" in result.message, result.message


def test_a_hang_fails_within_the_timeout():
    result = check_exact_accuracy(only_rank_zero, world_sizes=(2,), timeout=5)
    assert result.ok is False


def test_a_function_workers_cannot_import_is_explained():
    defined_in_main.__module__ = "__main__"
    result = check_exact_accuracy(defined_in_main)
    assert result.ok is False and "%%writefile" in result.message


# ---- check_epoch_shards ------------------------------------------------------------------------

from course_lib.checks.lesson08 import check_epoch_shards  # noqa: E402
from solutions.lesson08 import epoch_shard  # noqa: E402


def sampler_with_set_epoch(n, rank, world_size, epoch, seed):  # asks torch: refused
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def forgets_set_epoch(n, rank, world_size, epoch, seed):  # epoch 0's order every epoch
    return epoch_shard(n, rank, world_size, 0, seed)


def seeded_with_the_rank(n, rank, world_size, epoch, seed):
    return epoch_shard(n, rank, world_size, epoch, seed + 1000 * rank)


def _perm(n, epoch, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def drops_instead_of_padding(n, rank, world_size, epoch, seed):
    return _perm(n, epoch, seed)[rank::world_size]


def never_shuffles(n, rank, world_size, epoch, seed):
    total = -(-n // world_size) * world_size
    return [i % n for i in range(total)][rank::world_size]


def contiguous_blocks(n, rank, world_size, epoch, seed):  # right permutation and padding
    perm = _perm(n, epoch, seed)
    total = -(-n // world_size) * world_size
    order = perm + perm[:total - n]
    m = total // world_size
    return order[rank * m:(rank + 1) * m]


def pads_with_the_last_indices(n, rank, world_size, epoch, seed):
    perm = _perm(n, epoch, seed)
    total = -(-n // world_size) * world_size
    return (perm + perm[n - (total - n):])[rank::world_size]


def another_permutation(n, rank, world_size, epoch, seed):  # its own RNG, seeded right
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.argsort(torch.rand(n, generator=g)).tolist()
    total = -(-n // world_size) * world_size
    return (perm + perm[:total - n])[rank::world_size]


def test_epoch_shards_unanswered():
    assert check_epoch_shards(None).ok is None


def test_epoch_shards_reference_passes_and_matches_torch_where_padding_exceeds_n(capsys):
    assert check_epoch_shards(epoch_shard)
    assert "element by element" in capsys.readouterr().out
    for n, k in ((1, 3), (2, 5), (7, 7)):  # padding longer than the data, and none at all
        for rank in range(k):
            assert epoch_shard(n, rank, k, 2, 5) == sampler_with_set_epoch(n, rank, k, 2, 5)


def test_epoch_shards_refuses_a_distributed_sampler_and_restores_it():
    iter_before = DistributedSampler.__iter__
    result = check_epoch_shards(sampler_with_set_epoch)
    assert result.ok is False and "iterates a torch DistributedSampler" in result.message
    assert DistributedSampler.__iter__ is iter_before
    assert len(sampler_with_set_epoch(10, 0, 3, 1, 5)) == 4  # usable again after the check


@pytest.mark.parametrize("wrong, says", [
    (forgets_set_epoch, "set_epoch"),
    (seeded_with_the_rank, "seeded with the rank"),
    (drops_instead_of_padding, "shard lengths"),
    (never_shuffles, "epoch 1 gives exactly epoch 0's shards"),
])
def test_epoch_shards_wrong_answers_fail_and_are_named(wrong, says):
    result = check_epoch_shards(wrong)
    assert result.ok is False
    assert says in result.message, result.message
    assert "Hint: each epoch the sampler shuffles" in result.message, result.message


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wrong, says", [
    (contiguous_blocks, "consecutive blocks"),
    (pads_with_the_last_indices, "padding index(es) differ"),
    (another_permutation, "permutation is not torch's"),
])
def test_epoch_shards_orders_unlike_torch_fail_at_2_and_3_ranks(wrong, says, world):
    # every one of these covers the data in equal shards with a new order each epoch: only
    # the element-by-element comparison with torch's sampler catches them
    result = check_epoch_shards(wrong, sizes=(11,), world_sizes=(world,))
    assert result.ok is False
    assert says in result.message and f"world_size={world}" in result.message, result.message
    assert "torch's DistributedSampler(range(11)" in result.message


def test_epoch_shards_scaffold_is_not_answered_yet():
    def scaffold(n, rank, world_size, epoch, seed):
        raise NotImplementedError
    assert check_epoch_shards(scaffold).ok is None


#: what a hint may not print: the code of an answer (the idea, not the fix)
_CODE = ("randperm", "manual_seed", "Generator(", "::", "[rank", "% n", "seed + epoch",
         "all_reduce", "dist.", "correct / count", "total_size", "set_epoch", "DistributedSampler",
         "DistributedDataParallel", "DDP", "init_process_group", "destroy_process_group")


@pytest.mark.parametrize("hint", ["_HINT", "_SHARDS_HINT", "_ENTRY_HINT"])
def test_hints_point_at_the_idea_without_the_code(hint):
    from course_lib.checks import lesson08
    text = getattr(lesson08, hint)
    assert not [c for c in _CODE if c in text], text


# ---- check_recipe_entry ------------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from course_lib.checks.harness import UNANSWERED, first_failure_in_ranks, verdicts_as_expected  # noqa: E402,I001
from course_lib.checks.lesson08 import _entry_cases, check_recipe_entry  # noqa: E402
from solutions.lesson08 import train  # noqa: E402


def _recipe(model, dataset, epochs, batch_size, lr, *, set_epoch=True, every_rank_prints=False,
            wrap=True, shard=True, leave=True):
    """The reference entry point, with one of its pieces left out (for the wrong answers)."""
    dist.init_process_group("gloo")
    try:
        sampler = DistributedSampler(dataset) if shard else None
        batches = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        net = DDP(model) if wrap else model
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        for epoch in range(epochs):
            if set_epoch and shard:
                sampler.set_epoch(epoch)
            for X, y in batches:
                loss = F.cross_entropy(net(X), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if every_rank_prints or dist.get_rank() == 0:
                print(f"epoch {epoch}: loss {loss.item():.4f}")
        return model
    finally:
        if leave:
            dist.destroy_process_group()


def recipe_without_set_epoch(*a):
    return _recipe(*a, set_epoch=False)


def recipe_printing_on_every_rank(*a):
    return _recipe(*a, every_rank_prints=True)


def recipe_without_ddp(*a):  # each rank trains alone on its shard
    return _recipe(*a, wrap=False)


def recipe_without_sampler(*a):  # every rank reads the whole dataset
    return _recipe(*a, shard=False)


def recipe_left_in_the_group(*a):
    return _recipe(*a, leave=False)


def recipe_scaffold(model, dataset, epochs, batch_size, lr):
    raise NotImplementedError


_ENTRY_ROWS = [
    ("the solution", _entry_cases, train, {2: None, 3: None}),
    ("no set_epoch", _entry_cases, recipe_without_set_epoch,
     {2: "every epoch read the same examples in the same order",
      3: "every epoch read the same examples in the same order"}),
    ("printing on every rank", _entry_cases, recipe_printing_on_every_rank,
     {2: "rank 1: this rank printed 3 line(s)", 3: "rank 1: this rank printed 3 line(s)"}),
    ("no DDP", _entry_cases, recipe_without_ddp,
     {2: "training alone on its own share", 3: "training alone on its own share"}),
    ("no DistributedSampler", _entry_cases, recipe_without_sampler,
     {2: "read all 24 examples in every epoch", 3: "read all 24 examples in every epoch"}),
    ("group left behind", _entry_cases, recipe_left_in_the_group,
     {2: "still initialised", 3: "still initialised"}),
]


def test_recipe_entry_solution_passes_and_wrong_ones_are_named_at_2_and_3_ranks():
    found = first_failure_in_ranks(verdicts_as_expected, _ENTRY_ROWS, (2, 3), (),
                                   timeout=120.0, hang_hint="", hint="")
    assert found is None, found


def test_recipe_entry_verdicts_unanswered_and_wrong_with_the_hint():
    assert check_recipe_entry(None).ok is None
    assert check_recipe_entry(recipe_scaffold, world_sizes=(2,)).ok is None
    result = check_recipe_entry(recipe_without_set_epoch, world_sizes=(3,))
    assert result.ok is False and "world_size=3" in result.message, result.message
    assert "Hint: each rank joins the process group" in result.message, result.message
    assert UNANSWERED not in result.message
