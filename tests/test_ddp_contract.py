"""course_lib.parallel.ddp against torch's contract: what torch's DDP promises, checked on ours.

Each item names a way the course's DDP used to differ from ``torch.nn.parallel.
DistributedDataParallel`` (a silent wrong answer, a missing argument, an unclear error); the
oracle is torch's own DDP run in the same worker on the same data. One launch per world size
(2 and 3 ranks, gloo) runs every check and returns the failures as strings, read by several tests.
"""
import copy
import functools
import inspect
import math
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_oracle import MLP, Branchy, batches, check, grads, launch_checks, shard, torch_buckets
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib.models.lenet import LeNet
from course_lib.parallel import ddp as D
from course_lib.parallel.ddp import DistributedDataParallel as DDP

STRATEGIES = list(D.STRATEGIES)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, X):
        return self.head(F.relu(self.bn(self.fc(X))))       # (B, 4)


class Backwards(nn.Module):
    """Six 256 x 256 layers (257 KiB each) run last-registered first.

    Registration order is the reverse of execution order, so the gradients arrive in
    registration order: the opposite of what the initial buckets (last parameter first) assume.
    """

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))

    def forward(self, X):                                    # (B, 256)
        for layer in reversed(self.layers):
            X = torch.tanh(layer(X))
        return X[:, :4]                                      # (B, 4)


# ------------------------------------------------------------------------------------------------
# helpers (run inside the workers)
# ------------------------------------------------------------------------------------------------

def same_on_every_rank(failures: list[str], label: str, net: nn.Module) -> None:
    """Every rank's gradients must equal rank 0's (the replicas must not drift apart)."""
    for name, p in net.named_parameters():
        mine = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        check(failures, f"{label}: {name}.grad equal to rank 0's", mine, theirs)


def torch_ddp(module: nn.Module, **kwargs) -> TorchDDP:
    """torch's DDP; torch 2.15 warns that broadcast_buffers is deprecated, which is beside us."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return TorchDDP(module, **kwargs)


def error_of(fn, *args, **kwargs) -> str:
    """The message of the exception ``fn(*args, **kwargs)`` raises ("" if none), with its type."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return ""


def train_step(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward of the mean cross-entropy."""
    F.cross_entropy(model(X), y).backward()


# ------------------------------------------------------------------------------------------------
# 1. find_unused_parameters=True with no_sync
# ------------------------------------------------------------------------------------------------

def unused_with_no_sync() -> list[str]:
    """fc2 used only in no_sync micro-steps counts as used in the synced step, as in torch.

    Four optimizer steps of two micro-steps each (the first under no_sync): which ranks use fc2
    in (micro-step 0, micro-step 1). Step 2 uses it nowhere: its .grad must stay None (the
    record of use is reset at each synchronisation).
    """
    failures = []
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = [(True, False), (rank == 0, False), (False, False), (rank == world - 1, rank == 0)]
    for strategy in STRATEGIES:
        torch.manual_seed(1000 + rank)
        net = Branchy()
        models = {"theirs": torch_ddp(copy.deepcopy(net), find_unused_parameters=True),
                  "ours": DDP(net, find_unused_parameters=True, strategy=strategy)}
        recorded: dict[str, list] = {"ours": [], "theirs": []}
        for name, model in models.items():
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step, uses in enumerate(plan):
                opt.zero_grad()
                for micro, ((X, y), use) in enumerate(zip(batches((8,), 2, seed=step), uses)):
                    if micro == 0:
                        with model.no_sync():
                            F.cross_entropy(model(shard(X), use_fc2=use), shard(y)).backward()
                    else:
                        F.cross_entropy(model(shard(X), use_fc2=use), shard(y)).backward()
                recorded[name].append({k: None if g is None else g.clone()
                                       for k, g in grads(model.module).items()})
                if name == "ours":
                    same_on_every_rank(failures, f"no_sync+unused {strategy} step {step}",
                                       model.module)
                opt.step()
        for step, (mine, ref) in enumerate(zip(recorded["ours"], recorded["theirs"])):
            check(failures, f"no_sync+unused {strategy} step {step} grads", mine, ref)
        check(failures, f"no_sync+unused {strategy} weights", models["ours"].state_dict(),
              models["theirs"].state_dict())
    return failures


# ------------------------------------------------------------------------------------------------
# 2. torch's constructor arguments
# ------------------------------------------------------------------------------------------------

def constructor_arguments() -> list[str]:
    """Positional arguments in torch's order, broadcast_buffers=False, caps, devices."""
    failures = []
    rank = dist.get_rank()
    # positional, torch's order: module, device_ids, output_device, dim, broadcast_buffers,
    # process_group, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view, static_graph
    torch.manual_seed(1000 + rank)
    net = MLP()
    theirs = torch_ddp(copy.deepcopy(net), bucket_cap_mb=0.0001, gradient_as_bucket_view=True)
    ours = DDP(net, None, None, 0, True, None, 0.0001, False, True, False, strategy="bucketed")
    got = (ours.device_ids, ours.output_device, ours.dim, ours.broadcast_buffers,
           ours.process_group, ours.find_unused_parameters, ours.gradient_as_bucket_view,
           ours.static_graph, ours.strategy)
    if got != (None, None, 0, True, dist.group.WORLD, False, True, False, "bucketed"):
        failures.append(f"positional arguments landed elsewhere: {got}")
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for X, y in batches((8,), 3):
            opt.zero_grad()
            F.cross_entropy(model(shard(X)), shard(y)).backward()
            opt.step()
    check(failures, "positional arguments vs torch", ours.state_dict(), theirs.state_dict())
    if len(ours.reducer.buckets) < 2:  # a cap of 105 bytes: several buckets after the rebuild
        failures.append(f"bucket_cap_mb=0.0001 given positionally made "
                        f"{len(ours.reducer.buckets)} bucket(s)")

    # broadcast_buffers=False: each rank keeps its own buffers, also at construction
    for broadcast in (False, True):
        torch.manual_seed(1000 + rank)
        net = WithBatchNorm()
        net.bn.running_mean.fill_(float(rank))               # (8,) this rank's own statistics
        theirs = torch_ddp(copy.deepcopy(net), broadcast_buffers=broadcast)
        ours = DDP(net, broadcast_buffers=broadcast)
        expected = 0.0 if broadcast else float(rank)
        if not torch.all(ours.module.bn.running_mean == expected):
            failures.append(f"broadcast_buffers={broadcast}: rank {rank}'s running_mean after "
                            f"construction is {ours.module.bn.running_mean.tolist()}, expected "
                            f"{expected} everywhere")
        for model in (ours, theirs):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for X, y in batches((8,), 2, seed=5):
                opt.zero_grad()
                F.cross_entropy(model(shard(X)), shard(y)).backward()
                opt.step()
        check(failures, f"broadcast_buffers={broadcast} vs torch", ours.state_dict(),
              theirs.state_dict())

    # bucket_cap_mb: inf is one bucket, None is torch's default (25), nan / <= 0 refused
    for cap in (math.nan, 0, -1.0, True, "25"):
        message = error_of(DDP, MLP(), bucket_cap_mb=cap)
        if "bucket_cap_mb must be a number of MiB > 0" not in message:
            failures.append(f"bucket_cap_mb={cap!r}: {message or 'accepted'}")
    for cap, buckets in ((math.inf, 1), (None, 1), (1e-9, 4)):
        ours = DDP(MLP(), bucket_cap_mb=cap)
        for X, y in batches((8,), 2):                         # the second forward rebuilds
            F.cross_entropy(ours(shard(X)), shard(y)).backward()
        if len(ours.reducer.buckets) != buckets:
            failures.append(f"bucket_cap_mb={cap}: {len(ours.reducer.buckets)} buckets, "
                            f"expected {buckets}")

    # device_ids / output_device on a CPU module: refused, as torch refuses them
    for kwargs in ({"device_ids": [0]}, {"output_device": 1}, {"device_ids": [0, 1]}):
        mine, torch_says = error_of(DDP, MLP(), **kwargs), error_of(torch_ddp, MLP(), **kwargs)
        if not mine.startswith("ValueError") or not torch_says.startswith("ValueError"):
            failures.append(f"{kwargs} on a CPU module: ours {mine!r}, torch's {torch_says!r}")
    # dim, output_device=None, static_graph: accepted; results as torch's with the same
    torch.manual_seed(1000 + rank)
    net = Branchy()
    theirs = torch_ddp(copy.deepcopy(net), dim=1, static_graph=True,
                       find_unused_parameters=True)
    ours = DDP(net, dim=1, static_graph=True, find_unused_parameters=True)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for X, y in batches((8,), 3, seed=7):
            opt.zero_grad()
            F.cross_entropy(model(shard(X), use_fc2=False), shard(y)).backward()
            opt.step()
    check(failures, "static_graph, dim=1 vs torch", ours.state_dict(), theirs.state_dict())
    for flag in ("static_graph", "gradient_as_bucket_view", "broadcast_buffers"):
        if "must be True or False" not in error_of(DDP, MLP(), **{flag: "yes"}):
            failures.append(f"{flag}='yes' accepted or unclear")
    return failures


# ------------------------------------------------------------------------------------------------
# 3. the same model on every rank
# ------------------------------------------------------------------------------------------------

def different_models() -> list[str]:
    """Linear(4, 6) against Linear(6, 4) (same numel), a missing layer, a frozen layer.

    The last rank differs. Each case must raise on every rank, name the parameter and both
    ranks, and come back quickly (no hang); the group must still work after it.
    """
    failures = []
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    odd = rank == last

    def frozen() -> nn.Module:
        net = MLP()
        if odd:
            net.fc1.requires_grad_(False)
        return net

    cases = {
        "shapes": (lambda: nn.Linear(6, 4) if odd else nn.Linear(4, 6),
                   ["'weight'", "(4, 6)", "(6, 4)", "rank 0", f"rank {last}"]),
        "count": (lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 if odd else 3)]),
                  ["'2.weight'", "rank 0: 6", f"rank {last}: 4", f"rank {last} has nothing"]),
        "frozen": (frozen, ["'fc1.weight'", "requires_grad=False", f"rank {last}"]),
        "buffers": (lambda: nn.BatchNorm1d(5 if odd else 3),
                    ["'weight'", "(3,)", "(5,)"]),
    }
    for case, (build, needed) in cases.items():
        torch.manual_seed(rank)
        start = time.monotonic()
        message = error_of(DDP, build())
        elapsed = time.monotonic() - start
        if not message.startswith("RuntimeError") or not all(n in message for n in needed):
            failures.append(f"rank {rank}, {case}: expected an error naming {needed}, got "
                            f"{message or 'none'}")
        if elapsed > 30:
            failures.append(f"rank {rank}, {case}: the check took {elapsed:.0f} s")
    # nothing left in flight: the same model afterwards trains as torch's DDP does
    torch.manual_seed(rank)
    net = MLP()
    theirs, ours = torch_ddp(copy.deepcopy(net)), DDP(net)
    for model in (ours, theirs):
        X, y = batches((8,), 1)[0]
        F.cross_entropy(model(shard(X)), shard(y)).backward()
    check(failures, "after the refused models", grads(ours.module), grads(theirs.module))
    return failures


# ------------------------------------------------------------------------------------------------
# 4. buckets rebuilt in the order gradients arrived
# ------------------------------------------------------------------------------------------------

def rebuilt_buckets() -> list[str]:
    """``Backwards``: after iteration 1 the buckets follow the arrival order; overlap is kept.

    Events (a gradient arrives, a bucket is launched) are recorded in the order they happen,
    by a post-accumulate-grad hook registered before DDP's and by the communication hook.
    """
    failures = []
    rank = dist.get_rank()
    cases = [("bucketed", None), ("bucketed", 0.3), ("overlap", None)]
    for strategy, cap_mb in cases:
        label = f"strategy={strategy} bucket_cap_mb={cap_mb}"
        torch.manual_seed(1000 + rank)
        net = Backwards()
        theirs = torch_ddp(copy.deepcopy(net), **({} if cap_mb is None else
                                                  {"bucket_cap_mb": cap_mb}))
        names = {id(p): name for name, p in net.named_parameters()}
        params = list(net.parameters())
        events: list[tuple] = []
        for p in params:
            p.register_post_accumulate_grad_hook(
                lambda p, events=events, names=names: events.append(("grad", names[id(p)])))

        def recording(state, bucket, events=events, names=names):
            events.append(("launch", [names[id(p)] for p in bucket.parameters()]))
            return D.allreduce_hook(state, bucket)

        ours = DDP(net, bucket_cap_mb=cap_mb, strategy=strategy)
        ours.register_comm_hook(None, recording)
        if strategy == "bucketed" and len(ours.reducer.buckets) != 1:
            failures.append(f"{label}: {len(ours.reducer.buckets)} buckets before the first "
                            f"iteration; torch starts with one")
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
        for step, (X, y) in enumerate(batches((256,), 3)):
            events.clear()
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad()
                F.cross_entropy(model(shard(X)), shard(y)).backward()
                opt.step()
            arrived = [name for kind, name in events if kind == "grad"]
            if step == 0:  # rank 0's order decides (the same here); the next forward rebuilds
                first_order = [[i for i, p in enumerate(params) if names[id(p)] == n][0]
                               for n in arrived]
                continue
            cap = D.MB * (25 if cap_mb is None else cap_mb)
            expected = ours.reducer.assign(params, int(cap), order=first_order,
                                           first_bucket_bytes=D.FIRST_BUCKET_BYTES
                                           if cap_mb is None else int(cap))
            actual = [[names[id(p)] for p in b.parameters()] for b in ours.reducer.buckets]
            if actual != [[names[id(params[i])] for i in b] for b in expected]:
                failures.append(f"{label} step {step}: buckets {actual}, expected arrival "
                                f"order {arrived}")
            first = ours.reducer.buckets[0].parameters()
            if strategy == "bucketed" and cap_mb is None:
                nbytes = [p.numel() * p.element_size() for p in first]  # closed by the last
                if sum(nbytes[:-1]) >= D.FIRST_BUCKET_BYTES or len(ours.reducer.buckets) < 2:
                    failures.append(f"{label}: first bucket {sum(nbytes)} bytes, "
                                    f"{len(ours.reducer.buckets)} buckets")
            launches = [i for i, e in enumerate(events) if e[0] == "launch"]
            grad_times = {e[1]: i for i, e in enumerate(events) if e[0] == "grad"}
            if (not launches or events[launches[0]][1] != arrived[:len(first)]
                    or launches[0] > max(grad_times.values())):
                failures.append(f"{label} step {step}: the first launch must hold the first "
                                f"gradients to arrive {arrived[:len(first)]} and come before "
                                f"the last one arrives; events {events}")
        check(failures, f"{label} vs torch", ours.state_dict(), theirs.state_dict())
    return failures


def buckets_as_torchs_reducer_makes_them() -> list[str]:
    """The bucketed strategy's buckets, in bytes and launch order, are those torch's DDP
    rebuilds (its logging data reports them at its tenth iteration), for LeNet and three caps:
    at 0.1 MiB torch lets the bucket holding fc1.weight pass the cap (two buckets, not three)."""
    failures = []
    for cap_mb in (None, 0.1, 0.05):
        kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
        torch.manual_seed(0)
        net = LeNet()
        ours = DDP(copy.deepcopy(net), strategy="bucketed", **kwargs)
        theirs = torch_ddp(net, **kwargs)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(10):
            X, y = torch.randn(2, 1, 28, 28, generator=g), torch.randint(0, 10, (2,), generator=g)
            for model in (ours, theirs):
                F.cross_entropy(model(X), y).backward()
        logged = theirs._get_ddp_logging_data()
        want = [int(n) for n in str(logged.get("rebuilt_bucket_sizes", "")).split(",") if n]
        got = [sum(p.numel() * p.element_size() for p in b.parameters())
               for b in ours.reducer.buckets]
        if got != want or not want:
            failures.append(f"bucket_cap_mb={cap_mb}: bucket bytes {got}, torch's rebuilt "
                            f"buckets {want} ({logged.get('has_rebuilt_buckets')!r} rebuilt)")
    return failures


# ------------------------------------------------------------------------------------------------
# 5. gradient_as_bucket_view
# ------------------------------------------------------------------------------------------------

def bucket_views() -> list[str]:
    """``.grad`` lives in the bucket buffer, results equal torch's, and memory is saved."""
    failures = []
    rank = dist.get_rank()
    for strategy in STRATEGIES:
        torch.manual_seed(1000 + rank)
        net = MLP()
        models = {"theirs": torch_ddp(copy.deepcopy(net), gradient_as_bucket_view=True,
                                      bucket_cap_mb=0.0005),
                  "plain": DDP(copy.deepcopy(net), strategy=strategy, bucket_cap_mb=0.0005),
                  "ours": DDP(net, gradient_as_bucket_view=True, strategy=strategy,
                              bucket_cap_mb=0.0005)}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                for k, m in models.items()}
        for step, (X, y) in enumerate(batches((8,), 4)):
            for name, model in models.items():
                opts[name].zero_grad(set_to_none=step % 2 == 0)
                with model.no_sync():                        # accumulate, then synchronise
                    F.cross_entropy(model(shard(X)), shard(y)).backward()
                F.cross_entropy(model(shard(X)[:2]), shard(y)[:2]).backward()
            ours = models["ours"]
            for b in ours.reducer.buckets:
                buf = b.buffer()
                lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
                for p in b.parameters():
                    inside = (p.grad is not None and lo <= p.grad.data_ptr() < hi
                              and p.grad.untyped_storage().data_ptr()
                              == buf.untyped_storage().data_ptr())
                    if not inside:
                        failures.append(f"{strategy} step {step}: a .grad is not a view of "
                                        f"bucket {b.index()}'s buffer")
            check(failures, f"bucket view {strategy} step {step} vs torch", grads(ours.module),
                  grads(models["theirs"].module))
            check(failures, f"bucket view {strategy} step {step} vs plain", grads(ours.module),
                  grads(models["plain"].module))
            for opt in opts.values():
                opt.step()
        with_views, without = (D.gradient_memory_bytes(models[k]) for k in ("ours", "plain"))
        buffers = sum(b.buffer().numel() * b.buffer().element_size()
                      for b in ours.reducer.buckets)
        if not (with_views == buffers and without == 2 * buffers):
            failures.append(f"{strategy}: gradient memory {with_views} bytes with views, "
                            f"{without} without; buffers {buffers}")
    return failures


# ------------------------------------------------------------------------------------------------
# 6, 7. clear errors: frozen after wrapping, a hook that returns a tensor
# ------------------------------------------------------------------------------------------------

def tensor_hook(state, bucket) -> torch.Tensor:
    """A wrong hook: returns the buffer instead of a future of it."""
    return bucket.buffer()


def clear_errors() -> list[str]:
    """Freezing (or unfreezing) after wrapping, a hook that returns a tensor: errors that help."""
    failures = []
    X, y = (shard(t) for t in batches((8,), 1)[0])
    for strategy in STRATEGIES:
        ours = DDP(MLP(), strategy=strategy)
        ours.module.fc1.requires_grad_(False)                # after wrapping
        message = error_of(train_step, ours, X, y)
        if not all(s in message for s in ("fc1.weight", "Freeze first, then wrap")):
            failures.append(f"{strategy}, frozen after wrapping: {message or 'no error'}")
        net = MLP()
        net.fc1.requires_grad_(False)
        ours = DDP(net, strategy=strategy)
        net.fc1.requires_grad_(True)                         # unfrozen after wrapping
        message = error_of(train_step, ours, X, y)
        if not all(s in message for s in ("fc1.weight", "then wrap")):
            failures.append(f"{strategy}, unfrozen after wrapping: {message or 'no error'}")
        ours = DDP(MLP(), strategy=strategy)
        ours.register_comm_hook(None, tensor_hook)
        message = error_of(train_step, ours, X, y)
        if not all(s in message for s in ("tensor_hook", "returned a Tensor",
                                          "torch.futures.Future")):
            failures.append(f"{strategy}, a hook returning a tensor: {message or 'no error'}")
    # frozen after wrapping with find_unused_parameters=True: unused, as in torch
    torch.manual_seed(1000 + dist.get_rank())
    net = MLP()
    theirs = torch_ddp(copy.deepcopy(net), find_unused_parameters=True)
    ours = DDP(net, find_unused_parameters=True)
    for model in (ours, theirs):
        model.module.fc1.requires_grad_(False)
        F.cross_entropy(model(X), y).backward()
    check(failures, "frozen after wrapping, find_unused_parameters=True", grads(ours.module),
          grads(theirs.module))
    return failures


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

CHECKS = {"unused_with_no_sync": unused_with_no_sync, "constructor": constructor_arguments,
          "different_models": different_models, "rebuild": rebuilt_buckets,
          "torch_buckets": buckets_as_torchs_reducer_makes_them,
          "bucket_views": bucket_views, "errors": clear_errors}


@functools.cache
def failures(world_size: int) -> dict[str, list[str]]:
    """Every rank's failures for each check (one launch per world size, cached)."""
    return launch_checks(CHECKS, world_size, timeout=300)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_in_no_sync_counts_as_used_as_torch(world_size):
    assert not failures(world_size)["unused_with_no_sync"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_constructor_arguments_honoured(world_size):
    assert not failures(world_size)["constructor"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_models_refused_on_every_rank(world_size):
    assert not failures(world_size)["different_models"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_buckets_rebuilt_in_arrival_order_keep_overlap(world_size):
    assert not failures(world_size)["rebuild"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_sizes_are_those_torchs_ddp_rebuilds(world_size):
    assert not failures(world_size)["torch_buckets"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_as_bucket_view_shares_storage_and_saves_memory(world_size):
    assert not failures(world_size)["bucket_views"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_clear_errors_frozen_after_wrapping_and_tensor_hook(world_size):
    assert not failures(world_size)["errors"]


TORCH_ORDER = ["module", "device_ids", "output_device", "dim", "broadcast_buffers",
               "process_group", "bucket_cap_mb", "find_unused_parameters",
               "gradient_as_bucket_view", "static_graph"]


def test_signature_is_torchs_order_then_course_keywords():
    params = inspect.signature(DDP.__init__).parameters
    positional = [n for n, p in params.items()
                  if p.kind is p.POSITIONAL_OR_KEYWORD and n != "self"]
    assert positional == TORCH_ORDER
    assert params["strategy"].kind is inspect.Parameter.KEYWORD_ONLY
    theirs = inspect.signature(TorchDDP.__init__).parameters
    for name in TORCH_ORDER[1:]:  # every one is torch's, with torch's default (broadcast_buffers:
        assert name in theirs     # None there, deprecated, meaning True)
        if name != "broadcast_buffers":
            assert params[name].default == theirs[name].default, name
    assert params["broadcast_buffers"].default is True


def test_assign_buckets_first_bucket_and_order():
    params = [torch.empty(100) for _ in range(6)]            # 400 bytes each
    assert D.assign_buckets(params, 1000) == [[5, 4, 3], [2, 1, 0]]   # closed at 1000 or more
    order = [0, 1, 2, 3, 4, 5]
    assert D.assign_buckets(params, 1000, order=order, first_bucket_bytes=400) == [
        [0], [1, 2, 3], [4, 5]]
    assert D.assign_buckets(params, 10**9, order=[2, 0, 1, 5, 3, 4]) == [[2, 0, 1, 5, 3, 4]]


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 300), st.sampled_from([torch.float32,
                                                                       torch.float16])),
                       min_size=1, max_size=10),
       cap=st.integers(1, 2000), first=st.integers(1, 2000), data_=st.data())
def test_assign_buckets_in_any_order_with_a_first_cap(shapes, cap, first, data_):
    """torch's assignment (the rebuild in arrival order, a smaller first bucket), and the
    buckets a ``find_unused_parameters`` DDP starts with (registration order, reversed)."""
    params = [torch.empty(n, dtype=dtype) for n, dtype in shapes]
    order = data_.draw(st.permutations(range(len(params))))
    buckets = D.assign_buckets(params, cap, order=order, first_bucket_bytes=first)
    theirs = torch_buckets(params, [first, cap], order)
    assert sorted(buckets) == sorted(theirs)
    if len({dtype for _, dtype in shapes}) == 1:
        assert buckets == theirs
    position = {i: k for k, i in enumerate(order)}
    assert sorted(i for b in buckets for i in b) == list(range(len(params)))
    for b in buckets:                                         # in launch order
        assert len({params[i].dtype for i in b}) == 1
        assert [position[i] for i in b] == sorted(position[i] for i in b)
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)
    first_ones = D.assign_buckets(params, cap, order=range(len(params)),
                                  first_bucket_bytes=first)[::-1]
    assert first_ones == torch_buckets(params, [first, cap])
