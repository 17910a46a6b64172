"""course_lib.parallel.ddp: DistributedDataParallel from scratch against two oracles.

The oracles: (a) one process training a copy of the model on the whole batch, (b) torch's own
``torch.nn.parallel.DistributedDataParallel`` run in the same worker on the same data. Workers
handed to ``launch`` are module-level functions here (worker processes import them by name).
Each world size is one launch that runs many cases and returns the failures as strings, read by
several tests: a launch costs 1-2 s, plus about 3 s of CPU per rank the first time a process
builds torch's DDP (it imports torch._dynamo).
"""
import copy
import functools
import gc
import json
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_oracle import (
    MLP,
    PER_RANK,
    Branchy,
    batches,
    check,
    grads,
    launch_checks,
    shard,
    torch_buckets,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib.bench.ddp import main as bench_main
from course_lib.models.lenet import LeNet
from course_lib.parallel import ddp as D
from course_lib.parallel.ddp import DistributedDataParallel as DDP

STRATEGIES = list(D.STRATEGIES)
STEPS = 3


# ------------------------------------------------------------------------------------------------
# models: each covers one way a parameter can be special
# ------------------------------------------------------------------------------------------------

class Tied(nn.Module):
    """``b`` shares its weight with ``a``: one parameter, used twice."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.b.weight = self.a.weight

    def forward(self, X):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(X)))))  # (B, 4)


class Scaled(MLP):
    """A fixed parameter (requires_grad=False) that still takes part in the forward pass."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(4) + 0.5, requires_grad=False)

    def forward(self, X):
        return super().forward(X) * self.scale  # (B, 4)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(64, 4)

    def forward(self, X):                                   # (B, 1, 6, 6)
        return self.fc(F.relu(self.bn(self.conv(X))).flatten(1))  # (B, 4, 4, 4) -> (B, 4)


def frozen_layer() -> nn.Module:
    net = MLP()
    net.fc1.requires_grad_(False)
    return net


def bias_without_grad() -> nn.Module:
    net = MLP()
    net.fc2.bias.requires_grad_(False)
    return net


#: name -> (builder, input shape of one example, compare with one process?)
MODELS = {
    "mlp": (MLP, (8,), True),
    "frozen_layer": (frozen_layer, (8,), True),
    "bias_without_grad": (bias_without_grad, (8,), True),
    "fixed_parameter": (Scaled, (8,), True),
    "tied": (Tied, (8,), True),
    # buffers follow rank 0, which one process cannot reproduce: torch's DDP is the oracle
    "batch_norm": (WithBatchNorm, (1, 6, 6), False),
    "lenet": (LeNet, (1, 28, 28), True),
}


# ------------------------------------------------------------------------------------------------
# helpers (run inside the workers)
# ------------------------------------------------------------------------------------------------

def sgd_steps(net: nn.Module, data, local: bool, lr: float = 0.1, **kwargs) -> None:
    """A few SGD steps of the mean cross-entropy, on this rank's shard when ``local``."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for X, y in data:
        if local:
            X, y = shard(X), shard(y)
        opt.zero_grad()
        F.cross_entropy(net(X, **kwargs), y).backward()
        opt.step()


def bucket_problems(ddp: DDP, cap_bytes: int) -> list[str]:
    """What is wrong with ``ddp``'s buckets: cap, dtype, coverage of the trainable parameters."""
    problems = []
    seen = []
    for b in ddp.reducer.buckets:
        params = b.parameters()
        nbytes = [p.numel() * p.element_size() for p in params]
        if sum(nbytes[:-1]) >= cap_bytes:  # torch's rule: closed by the parameter reaching it
            problems.append(f"bucket {b.index()} held {sum(nbytes[:-1])} bytes >= cap "
                            f"{cap_bytes} before its last parameter")
        if len({(p.dtype, p.device) for p in params}) != 1:
            problems.append(f"bucket {b.index()} mixes dtypes or devices")
        if b.buffer().numel() != sum(p.numel() for p in params):
            problems.append(f"bucket {b.index()}: buffer size")
        seen += [id(p) for p in params]
    trainable = [id(p) for p in ddp.module.parameters() if p.requires_grad]
    if sorted(seen) != sorted(trainable):
        problems.append("buckets do not hold each trainable parameter once")
    return problems


# ------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------

def train_against_oracles(cases: list[tuple[str, str, float]]) -> list[str]:
    """For each (model, strategy, bucket_cap_mb): ours == torch's DDP == one process."""
    failures = []
    for model, strategy, cap_mb in cases:
        label = f"{model} strategy={strategy} bucket_cap_mb={cap_mb}"
        build, shape, single_oracle = MODELS[model]
        torch.manual_seed(1000 + dist.get_rank())  # every rank starts from different weights
        net = build()
        theirs = TorchDDP(copy.deepcopy(net))
        ours = DDP(net, strategy=strategy, bucket_cap_mb=cap_mb)
        single = copy.deepcopy(ours.module)
        check(failures, f"{label}, state after construction (rank 0's)", ours.state_dict(),
              theirs.state_dict())
        data = batches(shape, STEPS)
        sgd_steps(ours, data, local=True)
        sgd_steps(theirs, data, local=True)
        # the buckets as rebuilt after the first iteration (before it, one for everything)
        failures += [f"{label}: {p}" for p in bucket_problems(ours, int(cap_mb * D.MB))]
        check(failures, f"{label} vs torch's DDP", ours.state_dict(), theirs.state_dict())
        if single_oracle:
            sgd_steps(single, data, local=False)
            check(failures, f"{label} vs one process", dict(ours.module.named_parameters()),
                  dict(single.named_parameters()))
    return failures


def no_sync_semantics() -> list[str]:
    """Two micro-batches accumulated under no_sync, the third synchronised: as torch's."""
    failures = []
    for strategy in STRATEGIES:
        torch.manual_seed(1000 + dist.get_rank())
        net = MLP()
        theirs = TorchDDP(copy.deepcopy(net))
        ours = DDP(net, strategy=strategy)
        single = copy.deepcopy(ours.module)
        micro = batches((8,), 3, seed=1)
        for i, (X, y) in enumerate(micro):
            for model in (ours, theirs):
                if i < 2:
                    with model.no_sync():
                        F.cross_entropy(model(shard(X)), shard(y)).backward()
                else:
                    F.cross_entropy(model(shard(X)), shard(y)).backward()
            F.cross_entropy(single(X), y).backward()
            label = f"no_sync strategy={strategy} micro-batch {i}"
            check(failures, label, grads(ours.module), grads(theirs.module))
        check(failures, f"no_sync strategy={strategy} vs one process", grads(ours.module),
              grads(single))
        if ours.require_backward_grad_sync is not True:
            failures.append("no_sync did not restore require_backward_grad_sync")
    # the flag comes back even when the body raises, and nested contexts restore their own
    try:
        with ours.no_sync():
            with ours.no_sync():
                pass
            if ours.require_backward_grad_sync is not False:
                failures.append("a nested no_sync re-enabled synchronisation on exit")
            raise KeyError("boom")
    except KeyError:
        pass
    if ours.require_backward_grad_sync is not True:
        failures.append("no_sync did not restore require_backward_grad_sync after an exception")
    # a drop-in: same state_dict keys as torch's (module. prefix), forward passes keywords
    if list(ours.state_dict()) != list(theirs.state_dict()):
        failures.append(f"state_dict keys {list(ours.state_dict())} != torch's "
                        f"{list(theirs.state_dict())}")
    branchy = DDP(Branchy())
    out = branchy(torch.randn(2, 8), use_fc2=True)
    if out.shape != (2, 4) or not isinstance(branchy.module, Branchy):
        failures.append("forward(**kwargs) or .module")
    # wrapping a module again: the dropped wrapper is freed, its hooks do nothing any more
    old = DDP(branchy.module, strategy="naive")
    old(torch.randn(2, 8))  # armed: the next backward would have gone through it
    dropped = weakref.ref(old)
    del old
    gc.collect()
    if dropped() is not None:
        failures.append("a dropped DistributedDataParallel stays alive (held by its hooks)")
    return failures


def unused_parameters() -> list[str]:
    """No gradient for fc2: a clear error, or with find_unused_parameters=True torch's results."""
    failures = []
    rank = dist.get_rank()
    for strategy in STRATEGIES:
        torch.manual_seed(1000 + rank)
        net = Branchy()
        theirs = TorchDDP(copy.deepcopy(net))
        ours = DDP(net, strategy=strategy, bucket_cap_mb=0.0003)  # a few buckets
        X, y = batches((8,), 1)[0]
        try:
            F.cross_entropy(ours(shard(X), use_fc2=False), shard(y)).backward()
            failures.append(f"strategy={strategy}: no error for the unused fc2")
        except RuntimeError as e:
            if "fc2.weight" not in str(e) or "find_unused_parameters=True" not in str(e):
                failures.append(f"strategy={strategy}: unclear error: {e}")
        # no hang, nothing left in flight: the next step works and matches torch's
        ours.module.zero_grad()
        F.cross_entropy(ours(shard(X)), shard(y)).backward()
        F.cross_entropy(theirs(shard(X)), shard(y)).backward()
        check(failures, f"strategy={strategy} after the error", grads(ours.module),
              grads(theirs.module))

        # find_unused_parameters=True: fc2 used everywhere, on rank 0 only, nowhere, not on 0
        torch.manual_seed(1000 + rank)
        net = Branchy()
        theirs = TorchDDP(copy.deepcopy(net), find_unused_parameters=True)
        ours = DDP(net, strategy=strategy, find_unused_parameters=True, bucket_cap_mb=0.0003)
        recorded: dict[str, list] = {"ours": [], "theirs": []}
        for name, model in (("ours", ours), ("theirs", theirs)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step, (X, y) in enumerate(batches((8,), 4, seed=2)):
                opt.zero_grad()
                use = (True, rank == 0, False, rank != 0)[step]
                F.cross_entropy(model(shard(X), use_fc2=use), shard(y)).backward()
                recorded[name].append(grads(model.module))  # None where no rank used it
                opt.step()
        for step, (mine, ref) in enumerate(zip(recorded["ours"], recorded["theirs"])):
            check(failures, f"find_unused strategy={strategy} step {step}", mine, ref)
        check(failures, f"find_unused strategy={strategy} weights", ours.state_dict(),
              theirs.state_dict())
    return failures


def sub_group() -> list[str]:
    """process_group=: ranks 1, 2, 3 of 4 average among themselves, as torch's DDP does."""
    failures = []
    group = dist.new_group([1, 2, 3])  # every rank takes part in creating it
    if dist.get_rank() == 0:
        return failures
    me = dist.get_rank(group)
    for strategy in STRATEGIES:
        torch.manual_seed(1000 + dist.get_rank())
        net = MLP()
        theirs = TorchDDP(copy.deepcopy(net), process_group=group)
        ours = DDP(net, process_group=group, strategy=strategy)
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(3 * PER_RANK, 8, generator=g),
                 torch.randint(0, 4, (3 * PER_RANK,), generator=g)) for _ in range(2)]
        rows = slice(me * PER_RANK, (me + 1) * PER_RANK)  # this rank's shard, by group rank
        for model in (ours, theirs):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for X, y in data:
                opt.zero_grad()
                F.cross_entropy(model(X[rows]), y[rows]).backward()
                opt.step()
        check(failures, f"sub-group strategy={strategy}", ours.state_dict(),
              theirs.state_dict())
    return failures


def record_buckets(state: list, bucket) -> torch.futures.Future:
    """A comm hook that writes down what it was handed, then averages as the default."""
    params = bucket.parameters()
    state.append({
        "index": bucket.index(), "is_last": bucket.is_last(), "params": [id(p) for p in params],
        "shapes_ok": [g.shape == p.shape for g, p in zip(bucket.gradients(), params)],
        "numel_ok": bucket.buffer().numel() == sum(p.numel() for p in params),
    })
    return D.allreduce_hook(None, bucket)


def wrong_shape_hook(state, bucket) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(torch.zeros(1))
    return fut


def comm_hooks() -> list[str]:
    """torch's hooks run on our buckets; ours give torch's results; buckets look like torch's."""
    failures = []
    X, y = batches((1, 28, 28), 1)[0]
    bf16 = {"rtol": 1.6e-2, "atol": 1e-5}  # assert_close's tolerance for bfloat16
    for strategy in STRATEGIES:
        references = {}
        for name, hook in [("default", None), ("bf16", torch_hooks.bf16_compress_hook)]:
            torch.manual_seed(1000 + dist.get_rank())
            theirs = TorchDDP(LeNet(), bucket_cap_mb=0.2)
            if hook is not None:
                theirs.register_comm_hook(None, hook)
            F.cross_entropy(theirs(shard(X)), shard(y)).backward()
            references[name] = grads(theirs.module)
        cases = [("torch allreduce_hook", torch_hooks.allreduce_hook, "default", {}),
                 ("our allreduce_hook", D.allreduce_hook, "default", {}),
                 ("torch bf16_compress_hook", torch_hooks.bf16_compress_hook, "bf16", {}),
                 ("our bf16_compress_hook", D.bf16_compress_hook, "bf16", bf16)]
        for label, hook, reference, tolerance in cases:
            torch.manual_seed(1000 + dist.get_rank())
            ours = DDP(LeNet(), strategy=strategy, bucket_cap_mb=0.2)
            ours.register_comm_hook(None, hook)
            F.cross_entropy(ours(shard(X)), shard(y)).backward()
            check(failures, f"strategy={strategy} {label}", grads(ours.module),
                  references[reference], **tolerance)
            if hook is D.bf16_compress_hook:  # and close to the exact average, as a whole
                for name, g in grads(ours.module).items():
                    exact = references["default"][name]
                    error = torch.linalg.vector_norm(g - exact) / torch.linalg.vector_norm(exact)
                    if error > 2**-7:  # bfloat16 keeps 8 significant bits
                        failures.append(f"strategy={strategy} bf16 {name}: error {error:.1e}")

        # what a hook is handed: buckets in order, one parameter each for naive and overlap
        # (in the second iteration: the first has one bucket for everything, as torch's)
        torch.manual_seed(0)
        ours = DDP(LeNet(), strategy=strategy, bucket_cap_mb=0.2)
        seen: list[dict] = []
        ours.register_comm_hook(seen, record_buckets)
        for _ in range(2):
            seen.clear()
            F.cross_entropy(ours(shard(X)), shard(y)).backward()
        expected = [[id(p) for p in b.parameters()] for b in ours.reducer.buckets]
        if [s["params"] for s in seen] != expected:
            failures.append(f"strategy={strategy}: hook saw other buckets than ddp.reducer's")
        if [s["index"] for s in seen] != list(range(len(expected))) or \
                [s["is_last"] for s in seen] != [False] * (len(expected) - 1) + [True]:
            failures.append(f"strategy={strategy}: bucket index() / is_last() {seen}")
        if not all(all(s["shapes_ok"]) and s["numel_ok"] for s in seen):
            failures.append(f"strategy={strategy}: gradients() or buffer() shapes")
        one_each = all(len(b) == 1 for b in expected)
        if one_each != (strategy != "bucketed") or (strategy == "bucketed" and len(expected) < 2):
            failures.append(f"strategy={strategy}: bucket sizes {[len(b) for b in expected]}")

        # bytes on the wire: bf16 halves them; the ring's 2 (p - 1) / p of the payload
        p = dist.get_world_size()
        payload = sum(q.numel() * 4 for q in ours.module.parameters())
        if D.bytes_on_wire(ours) != 2 * (p - 1) * payload // p or \
                D.bytes_on_wire(ours, torch.bfloat16) != D.bytes_on_wire(ours) // 2:
            failures.append(f"bytes_on_wire {D.bytes_on_wire(ours)} for payload {payload}")

    # misuse: clear errors
    for bad, exception in [(lambda: ours.register_comm_hook(None, D.allreduce_hook),
                            RuntimeError),  # a second hook
                           (lambda: DDP(MLP()).register_comm_hook(None, "hook"), TypeError)]:
        try:
            bad()
            failures.append(f"no {exception.__name__}")
        except exception:
            pass
    ours = DDP(MLP())
    ours.register_comm_hook(None, wrong_shape_hook)
    try:
        F.cross_entropy(ours(shard(X).flatten(1)[:, :8]), shard(y)).backward()
        failures.append("a hook returning the wrong shape went unnoticed")
    except RuntimeError as e:
        if "shaped like bucket.buffer()" not in str(e):
            failures.append(f"unclear error for a wrong hook result: {e}")
    return failures


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

def oracle_cases(world_size: int) -> list[tuple[str, str, float]]:
    """(model, strategy, bucket_cap_mb): every model and strategy; bucket caps at 2 ranks."""
    cases = [(model, strategy, 25) for model in MODELS for strategy in STRATEGIES]
    if world_size == 2:
        caps = [1e-6, 0.0005, 0.1, 1000]  # each parameter alone, a few, LeNet's fc1 alone, one
        cases += [(m, "bucketed", cap) for m in ("mlp", "tied", "lenet") for cap in caps]
    return cases


def oracles() -> list[str]:
    """Worker: every case of ``oracle_cases`` for this world size."""
    return train_against_oracles(oracle_cases(dist.get_world_size()))


#: The checks each world size runs, in one launch (see the module docstring).
PLAN = {2: {"oracles": oracles, "unused": unused_parameters, "hooks": comm_hooks},
        3: {"oracles": oracles, "no_sync": no_sync_semantics},
        4: {"oracles": oracles, "group": sub_group}}


@functools.cache
def failures(world_size: int) -> dict[str, list[str]]:
    """Every rank's failures for each check of ``PLAN[world_size]`` (one launch, cached)."""
    return launch_checks(PLAN[world_size], world_size, timeout=240)


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_torch_ddp_and_one_process(world_size):
    assert not failures(world_size)["oracles"]


def test_no_sync_matches_torch_and_restores_the_flag():
    assert not failures(3)["no_sync"]


def test_unused_parameter_raises_clearly_or_counts_as_zero():
    assert not failures(2)["unused"]


def test_comm_hooks_torch_and_ours():
    assert not failures(2)["hooks"]


def test_process_group_of_three_ranks_out_of_four():
    assert not failures(4)["group"]


_DTYPES = [torch.float32, torch.float64, torch.float16]


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3),
                                 st.sampled_from(_DTYPES)), min_size=1, max_size=12),
       cap=st.integers(1, 20_000))
def test_assign_buckets_is_torchs_assignment(shapes, cap):
    params = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    buckets = D.assign_buckets(params, cap)
    order = list(reversed(range(len(params))))                # the default: last parameter first
    assert sorted(buckets) == sorted(torch_buckets(params, [cap], order))
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(params)))           # each parameter once
    nbytes = {}
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1         # one dtype per bucket
        size = [params[i].numel() * params[i].element_size() for i in b]
        assert sum(size[:-1]) < cap                           # closed by its last parameter...
        nbytes.setdefault(params[b[0]].dtype, []).append(sum(size))
        assert b == sorted(b, reverse=True)                   # last parameter first
    for sizes in nbytes.values():
        assert all(n >= cap for n in sizes[:-1])              # ...once it held the cap or more
    assert [b[0] for b in buckets] == sorted((b[0] for b in buckets), reverse=True)
    if len(set(_DTYPES) & {dtype for _, dtype in shapes}) == 1:
        assert flat == list(reversed(range(len(params))))     # one dtype: plain reverse order
        assert buckets == torch_buckets(params, [cap], order)


def test_lenets_buckets_at_a_tenth_of_a_mib_are_torchs():
    """torch's DDP puts fc1.weight with the layers after it (the bucket passes the cap by it);
    closing a bucket before the cap would be passed makes three buckets instead of two."""
    params = list(LeNet().parameters())
    cap = int(0.1 * D.MB)
    assert D.assign_buckets(params, cap) == [[7, 6, 5, 4], [3, 2, 1, 0]]
    assert D.assign_buckets(params, cap) == torch_buckets(params, [cap], [7, 6, 5, 4, 3, 2, 1, 0])


def test_clear_errors_for_bad_arguments(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # whatever ran before in here
    with pytest.raises(ValueError, match="strategy must be one of 'naive', 'overlap', 'buck"):
        DDP(MLP(), strategy="ring")
    for cap in (0, -1, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB > 0"):
            DDP(MLP(), bucket_cap_mb=cap)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        DDP(lambda X: X)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(MLP())


@pytest.mark.slow
def test_bench_ddp_quick_prints_json(tmp_path, capsys):
    out = tmp_path / "ddp.json"
    assert bench_main(["--quick", "--models", "lenet", "--batch", "16", "--rounds", "2",
                       "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["benchmark"] == "ddp" and report["torch"] == torch.__version__
    assert "--quick" in report["command"] and report["hardware"]
    results = report["models"]["lenet"]["results"]
    assert set(results) == {"local", "naive", "overlap", "bucketed", "bucketed+bf16", "torch"}
    assert results["torch"]["ratio_to_torch"] == 1.0
    for r in results.values():
        assert 0 < r["min_s"] <= r["median_s"] and r["iqr_s"] >= 0
        assert r["ratio_low"] <= r["ratio_to_torch"] <= r["ratio_high"]
    assert report["ratio_to_torch"]["lenet"]["bucketed"] == round(
        results["bucketed"]["ratio_to_torch"], 3)
