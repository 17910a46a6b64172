"""course_lib.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1) against the unsharded optimizer.

The oracle: the same optimizer class over the whole model in the same process, fed the same
gradients (every rank computes the gradient of the whole batch, so gradients are equal
everywhere and any difference comes from the optimizer). After every step the parameters must be
bitwise equal. Each world size is one launch that runs every case and returns failures as text.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.checks._zero_cases import MLP, MODELS, Tied
from course_lib.distributed import launch
from course_lib.distributed.optim import ZeroRedundancyOptimizer, partition_parameters

STEPS = 4


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
}


def _groups(net: nn.Module, grouped: bool):
    """Plain parameters, or two groups with their own options (weights / biases)."""
    if not grouped:
        return list(net.parameters())
    named = list(net.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.003,
             "weight_decay": 0.0}]


def _step(net, opt, X, y):
    opt.zero_grad()
    F.cross_entropy(net(X), y).backward()
    opt.step()


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _cases() -> list[str]:
    """Every model x optimizer x grouping; the failures as text."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for model, build in MODELS.items():
        for opt_name, (cls, options) in OPTIMIZERS.items():
            for grouped in (False, True):
                where = f"world {world} rank {rank} {model}/{opt_name}/grouped={grouped}"
                torch.manual_seed(0)
                net = build()
                ref = copy.deepcopy(net)
                zero = ZeroRedundancyOptimizer(_groups(net, grouped), cls, **options)
                oracle = cls(_groups(ref, grouped), **options)
                g = torch.Generator().manual_seed(1)
                for step in range(STEPS):
                    X, y = torch.randn(12, 7, generator=g), torch.randint(0, 3, (12,), generator=g)
                    _step(net, zero, X, y)
                    _step(ref, oracle, X, y)
                    if not _equal(net, ref):
                        failures.append(f"{where}: parameters differ after step {step}")
                        break
                # each rank holds the state of its own parameters only
                owned = {id(p) for p in zero._shards[rank]}
                if any(id(p) not in owned for p in zero.optim.state):
                    failures.append(f"{where}: state for a parameter this rank does not own")
                trainable_owned = [p for p in zero._shards[rank] if p.requires_grad]
                if len(zero.optim.state) != len(trainable_owned):
                    failures.append(f"{where}: {len(zero.optim.state)} states for "
                                    f"{len(trainable_owned)} owned trainable parameters")
                # the options a scheduler would change reach the local optimizer
                for group in zero.param_groups:
                    group["lr"] *= 0.5
                for group in oracle.param_groups:
                    group["lr"] *= 0.5
                _step(net, zero, X, y)
                _step(ref, oracle, X, y)
                if not _equal(net, ref):
                    failures.append(f"{where}: a changed lr did not reach the local optimizer")
    return failures


def _checkpoint() -> list[str]:
    """consolidate_state_dict + state_dict equals the unsharded one; load_state_dict resumes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    torch.manual_seed(0)
    net = Tied()
    ref = copy.deepcopy(net)
    zero = ZeroRedundancyOptimizer(_groups(net, True), torch.optim.AdamW, lr=0.01,
                                   weight_decay=0.1)
    oracle = torch.optim.AdamW(_groups(ref, True), lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 7, generator=g), torch.randint(0, 3, (12,), generator=g))
               for _ in range(4)]
    for X, y in batches[:2]:
        _step(net, zero, X, y)
        _step(ref, oracle, X, y)
    try:
        zero.state_dict()
        failures.append(f"rank {rank}: state_dict() before consolidate_state_dict did not raise")
    except RuntimeError as e:
        if "consolidate_state_dict" not in str(e):
            failures.append(f"rank {rank}: unclear error {e}")
    to = world - 1
    zero.consolidate_state_dict(to=to)
    full = None
    if rank == to:
        full = zero.state_dict()
        want = oracle.state_dict()
        if full["param_groups"] != want["param_groups"]:
            failures.append(f"param_groups differ:\n{full['param_groups']}\n"
                            f"{want['param_groups']}")
        if sorted(full["state"]) != sorted(want["state"]):
            failures.append(f"state keys {sorted(full['state'])} != {sorted(want['state'])}")
        for i, s in want["state"].items():
            for k, v in s.items():
                if not torch.equal(full["state"].get(i, {}).get(k, torch.tensor(-1.0)), v):
                    failures.append(f"state[{i}][{k}] differs")
    else:
        try:
            zero.state_dict()
            failures.append(f"rank {rank}: state_dict() on a rank not named by to= did not raise")
        except RuntimeError:
            pass
    box = [full]
    dist.broadcast_object_list(box, src=to)
    # a fresh model and optimizer resume from the checkpoint and follow the oracle
    net2 = copy.deepcopy(net)
    zero2 = ZeroRedundancyOptimizer(_groups(net2, True), torch.optim.AdamW, lr=0.5,
                                    weight_decay=0.1)  # lr comes from the checkpoint
    zero2.load_state_dict(box[0])
    if zero2.param_groups[1]["lr"] != 0.003:
        failures.append(f"rank {rank}: group options not loaded: {zero2.param_groups[1]['lr']}")
    for X, y in batches[2:]:
        _step(net2, zero2, X, y)
        _step(ref, oracle, X, y)
    if not _equal(net2, ref):
        failures.append(f"rank {rank}: resumed optimizer differs from the oracle")
    # a parameter group added after construction
    torch.manual_seed(2)
    extra = nn.Linear(3, 6)
    extra_ref = copy.deepcopy(extra)
    zero2.add_param_group({"params": list(extra.parameters()), "lr": 0.02})
    oracle.add_param_group({"params": list(extra_ref.parameters()), "lr": 0.02})
    for X, y in batches:
        for m, e, o in ((net2, extra, zero2), (ref, extra_ref, oracle)):
            o.zero_grad()
            F.cross_entropy(e(m(X)), y % 3).backward()
            o.step()
    if not (_equal(net2, ref) and _equal(extra, extra_ref)):
        failures.append(f"rank {rank}: after add_param_group the parameters differ")
    return failures


def _all(_unused=None) -> list[str]:
    return _cases() + _checkpoint()


@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.slow)])
def failures(request):
    return launch(_all, request.param, timeout=240)


def test_zero_equals_unsharded_optimizer(failures):
    """AdamW with weight decay and SGD with momentum, frozen and tied parameters, parameter
    groups, a changed learning rate, checkpoint and resume, add_param_group: bitwise."""
    assert failures == [[] for _ in failures], [f for fs in failures for f in fs][:5]


def test_partition_is_balanced_and_stable():
    """Greedy by size; adding a group never moves an existing parameter."""
    params = [torch.empty(n) for n in (100, 60, 50, 40, 10, 5)]
    shards = partition_parameters([{"params": params}], 3)
    # by hand: 100 -> r0, 60 -> r1, 50 -> r2, 40 -> r2 (90), 10 -> r1 (70), 5 -> r1 (75)
    assert [sum(p.numel() for p in s) for s in shards] == [100, 75, 90]
    more = [torch.empty(n) for n in (30, 1)]
    shards2 = partition_parameters([{"params": params}, {"params": more}], 3)
    for before, after in zip(shards, shards2):
        assert all(any(p is q for q in after) for p in before)
    assert sum(len(s) for s in shards2) == 8


def _broadcast_buffer_bytes(_unused=None) -> dict[str, int]:
    """Bytes alive at once in ``step()`` beyond the parameters and their gradients, on the
    default group and on a group of this rank alone. SGD without momentum makes no tensor, so
    this is what the broadcast packs: Linear(8, 16), Linear(16, 4) in float64."""
    from course_lib.distributed.memory import PeakMemory

    ones = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes each
    out = {}
    for name, group in [("all ranks", None), ("alone", ones[dist.get_rank()])]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
        zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, process_group=group,
                                       lr=0.1)
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        with PeakMemory(tensors=[t for p in net.parameters() for t in (p, p.grad)]) as m:
            zero.step()
        out[name] = m.peak - m.start
    return out


def test_broadcast_keeps_one_owner_buffer_alive():
    """One flat buffer at a time: each owner's is freed before the next is packed. 3 ranks own
    {128}, {64}, {16, 4} elements: the largest buffer, 128 * 8 bytes (two alive at once would
    be (128 + 64) * 8). Alone, a rank broadcasts nothing and packs nothing."""
    for rank, out in enumerate(launch(_broadcast_buffer_bytes, 3, backend="gloo",
                                        timeout=120)):
        assert out == {"all ranks": 128 * 8, "alone": 0}, (rank, out)


def _needs_group(_unused=None):
    return None


def test_zero_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


def _raises_on_rank_1(_unused=None):
    net = MLP()
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails before its step")
    F.cross_entropy(net(torch.randn(4, 7)), torch.zeros(4, dtype=torch.long)).backward()
    zero.step()  # rank 0 waits in a broadcast that rank 1 never joins


def test_a_raising_rank_ends_the_job_with_its_error():
    from course_lib.distributed import WorkerError

    with pytest.raises(WorkerError, match="rank 1 fails before its step"):
        launch(_raises_on_rank_1, 2, None, timeout=60)
