"""FSDP in a training loop: clipping, unused layers, no_sync, checkpoints, misuse.

The oracle, as in test_fsdp.py: a copy of the model trained in one process on the whole global
batch, in float64, with the loss the average over ranks of each rank's loss on its slice; FSDP
runs at 2 and 3 ranks (3 pads the flat vectors). Each world size is one launch that returns the
failures as text; every rank checks itself.
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import launch
from course_lib.distributed.fsdp import FullyShardedDataParallel as FSDP

GLOBAL = 6  # examples per step: 3 per rank on 2 ranks, 2 on 3
TOL = 1e-10


class Net(nn.Module):
    """Two units on the main path with a replicated LayerNorm between, an auxiliary head (a
    unit with its own replicated norm) whose loss a rank may or may not add, a layer never
    called. 104, 42 and 70 elements: 3 ranks pad two of them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 3)
        self.aux_norm, self.aux = nn.LayerNorm(13), nn.Linear(13, 5)
        self.never = nn.Linear(3, 3)

    def forward(self, X):                                    # (B, 7)
        h = torch.tanh(self.norm(self.fc1(X)))               # (B, 13)
        return self.fc2(h), self.aux(self.aux_norm(h))       # (B, 3), (B, 5)


def _loss(out, y, use_aux: bool):
    main, aux = out
    loss = F.cross_entropy(main, y)
    return loss + aux.pow(2).mean() if use_aux else loss


def _batch(step: int, n: int = GLOBAL):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, 7, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def _models():
    torch.manual_seed(0)
    net = Net().double()
    return net, copy.deepcopy(net)


def _ref_loss(ref, X, y, world: int, users) -> torch.Tensor:
    """One process, the whole batch: the average over ranks of each rank's loss."""
    out = ref(X)
    per = X.shape[0] // world
    return sum(_loss([o[r * per:(r + 1) * per] for o in out], y[r * per:(r + 1) * per],
                     r in users) for r in range(world)) / world


def _compare(fsdp, ref, where, failures, tol=TOL) -> None:
    full, want = fsdp.full_state_dict(), ref.state_dict()
    for name, t in want.items():
        err = (full[name] - t).abs().max().item()
        if err > tol:
            failures.append(f"{where}: {name} off by {err:.3g}")
            return


def _run(cases) -> list[str]:
    failures: list[str] = []
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for case in cases:
                case(failures)
        failures += [f"warning: {w.message}" for w in caught]
    finally:
        torch.use_deterministic_algorithms(False)
    return failures


# ---- 1. clip_grad_norm_: the global norm -----------------------------------------------------

def _clip_case(norm_type, failures):
    rank, world = dist.get_rank(), dist.get_world_size()
    net, ref = _models()
    fsdp = FSDP(net)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    mine = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    users = range(world)
    for step in range(3):
        where = f"world {world} rank {rank} norm {norm_type} step {step}"
        X, y = _batch(step)
        opt.zero_grad()
        _loss(fsdp(X[mine]), y[mine], True).backward()
        max_norm = 0.05
        total = fsdp.clip_grad_norm_(max_norm, norm_type)
        ref_opt.zero_grad()
        _ref_loss(ref, X, y, world, users).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        if not want > 2 * max_norm:
            failures.append(f"{where}: the test clips nothing (norm {want.item():.3g})")
        if not isinstance(total, torch.Tensor) or abs(total.item() - want.item()) > TOL:
            failures.append(f"{where}: total norm {total!r}, one process {want.item()!r}")
        opt.step()
        ref_opt.step()
        _compare(fsdp, ref, where, failures)
        gathered = [torch.empty_like(fsdp.module.norm.weight) for _ in range(world)]
        dist.all_gather(gathered, fsdp.module.norm.weight.detach())
        if not all(torch.equal(gathered[0], t) for t in gathered):
            failures.append(f"{where}: the replicated norm differs between ranks")


def _clip(_unused=None):
    return _run([lambda f: _clip_case(2.0, f), lambda f: _clip_case(float("inf"), f),
                 lambda f: _clip_case(1.0, f)])


# ---- 2. a unit no rank used keeps .grad None; used on some ranks: the average ------------------

# which ranks add the auxiliary loss, step by step (ranks beyond the world size do not exist)
AUX_USERS = [{0, 2}, set(), {0, 1, 2}, {1}, set()]


def _unused_case(failures):
    rank, world = dist.get_rank(), dist.get_world_size()
    net, ref = _models()
    fsdp = FSDP(net)
    units = {name.rsplit(".", 1)[0]: h for h in fsdp.handles for name in h.names}
    opt = torch.optim.AdamW(fsdp.parameters(), lr=0.01, weight_decay=0.5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.5)
    mine = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    for step, users in enumerate(AUX_USERS):
        users = {r for r in users if r < world}
        where = f"world {world} rank {rank} step {step} aux used by {sorted(users)}"
        X, y = _batch(step)
        opt.zero_grad()
        _loss(fsdp(X[mine]), y[mine], rank in users).backward()
        ref_opt.zero_grad()
        _ref_loss(ref, X, y, world, users).backward()
        for name, shard in (("aux", units["aux"].shard), ("never", units["never"].shard),
                            ("aux_norm.weight", fsdp.module.aux_norm.weight)):
            want_none = name == "never" or not users
            if (shard.grad is None) != want_none:
                failures.append(f"{where}: {name} has grad "
                                f"{None if shard.grad is None else 'a tensor'}")
        opt.step()
        ref_opt.step()
        _compare(fsdp, ref, where, failures)


def _unused(_unused=None):
    return _run([_unused_case])


# ---- 3a. no_sync: micro-batches accumulate whole, reduced at the first synced backward -------

# per step: for each micro-batch (the last one synced), which ranks add the auxiliary loss
MICRO_USERS = [[{0}, set(), set()], [set(), {1, 2}, {0, 1, 2}]]


def _no_sync_case(failures):
    rank, world = dist.get_rank(), dist.get_world_size()
    net, ref = _models()
    fsdp = FSDP(net)
    units = {name.rsplit(".", 1)[0]: h for h in fsdp.handles for name in h.names}
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    mine = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    for step, micro in enumerate(MICRO_USERS):
        where = f"world {world} rank {rank} step {step}"
        opt.zero_grad()
        ref_opt.zero_grad()
        for m, users in enumerate(micro):
            users = {r for r in users if r < world}
            X, y = _batch(10 * step + m)
            if m < len(micro) - 1:
                with fsdp.no_sync():
                    _loss(fsdp(X[mine]), y[mine], rank in users).backward()
                h = units["fc1"]
                if h.shard.grad is not None or h.pending is None \
                        or h.pending.shape != (h.padded,):
                    failures.append(f"{where} micro {m}: inside no_sync the shard has grad "
                                    f"{h.shard.grad is not None}, kept full gradient "
                                    f"{None if h.pending is None else tuple(h.pending.shape)}")
            else:
                _loss(fsdp(X[mine]), y[mine], rank in users).backward()
            _ref_loss(ref, X, y, world, users).backward()
        if any(h.pending is not None for h in fsdp.handles):
            failures.append(f"{where}: a kept gradient was not reduced by the synced backward")
        if units["never"].shard.grad is not None:
            failures.append(f"{where}: the layer never called has a grad")
        opt.step()
        ref_opt.step()
        _compare(fsdp, ref, where, failures)


def _no_sync(_unused=None):
    return _run([_no_sync_case])


# ---- 3b. checkpoints: save at one world size, load at another, train on -----------------------

RESUME_AT, STEPS = 2, 4


def _train(fsdp, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.3)  # stateless: the model is the whole state
    for step in steps:
        X, y = _batch(step)
        opt.zero_grad()
        _loss(fsdp(X[mine]), y[mine], True).backward()
        opt.step()


def _save(_unused=None):
    fsdp = FSDP(_models()[0])
    _train(fsdp, range(RESUME_AT))
    return fsdp.state_dict()


def _resume(state):
    torch.manual_seed(1)  # other initial values: all must come from the checkpoint
    fsdp = FSDP(Net().double())
    fsdp.load_state_dict(state)
    _train(fsdp, range(RESUME_AT, STEPS))
    return fsdp.state_dict()


# ---- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_is_global_and_equals_one_process(world):
    """FSDP.clip_grad_norm_ (norms 2, inf, 1) against torch.nn.utils.clip_grad_norm_ on one
    process, three SGD steps that all clip; the replicated LayerNorm stays equal on all ranks."""
    failures = launch(_clip, world, timeout=120)
    assert failures == [[]] * world, [f for fs in failures for f in fs][:5]


@pytest.mark.parametrize("world", [2, 3])
def test_unused_unit_keeps_grad_none_and_adamw_matches(world):
    """An auxiliary head used by some ranks, none or all, and a layer never called, under AdamW
    with weight decay: .grad None exactly where one process has None, parameters equal."""
    failures = launch(_unused, world, timeout=120)
    assert failures == [[]] * world, [f for fs in failures for f in fs][:5]


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_accumulation_equals_one_process(world):
    """Two micro-batches under no_sync then one synced (the aux head used in a no_sync
    micro-batch on one rank only, and not in the synced one) equal one process."""
    failures = launch(_no_sync, world, timeout=120)
    assert failures == [[]] * world, [f for fs in failures for f in fs][:5]


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 3), (3, 2)])
def test_resume_at_another_world_size_equals_an_uninterrupted_run(saved_on, loaded_on):
    states = launch(_save, saved_on, timeout=120)
    net, ref = _models()
    assert list(states[0]) == list(net.state_dict())  # the module's own names, full shapes
    assert all(states[0][k].shape == t.shape for k, t in net.state_dict().items())
    resumed = launch(_resume, loaded_on, states[0], timeout=120)
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for step in range(STEPS):
        X, y = _batch(step)
        opt.zero_grad()
        _ref_loss(ref, X, y, saved_on if step < RESUME_AT else loaded_on,
                  range(3)).backward()
        opt.step()
    for state in resumed:
        for name, t in ref.state_dict().items():
            assert (state[name] - t).abs().max().item() < TOL, name


# ---- 4. a sharded weight read outside its unit: a clear error, or whole with a policy ---------

class TiedRead(nn.Module):
    """A GPT-style output head that reads the embedding's weight directly in the parent."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(11, 7), nn.Linear(7, 7)

    def forward(self, tokens):                                   # (B, 4) integers
        h = torch.tanh(self.mid(self.emb(tokens).mean(1)))       # (B, 7)
        return F.linear(h, self.emb.weight)                      # (B, 11)


def _tied_read(_unused=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    g = torch.Generator().manual_seed(3)
    tokens, y = torch.randint(0, 11, (GLOBAL, 4), generator=g), torch.randint(0, 11, (GLOBAL,),
                                                                              generator=g)
    mine = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    torch.manual_seed(0)
    fsdp = FSDP(TiedRead().double())
    try:
        out = fsdp(tokens[mine])
        failures.append(f"rank {rank}: no error; output {out.flatten()[:3].tolist()}")
    except RuntimeError as e:
        if "emb.weight" not in str(e) or "policy" not in str(e):
            failures.append(f"rank {rank}: unclear error: {e}")
    # the advice works: one unit around the whole model keeps the head's read inside it
    torch.manual_seed(0)
    net = TiedRead().double()
    ref = copy.deepcopy(net)
    fsdp = FSDP(net, policy=lambda m: m is net)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad()
        F.cross_entropy(fsdp(tokens[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(tokens), y).backward()
        ref_opt.step()
        _compare(fsdp, ref, f"rank {rank} step {step}", failures)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_weight_read_outside_its_unit_raises_a_clear_error(world):
    """F.linear(h, self.emb.weight) in the parent: an error naming emb.weight and what to do
    (never a computation with the empty placeholder); with the advised policy, equal to one
    process in float64."""
    failures = launch(_run_tied, world, timeout=120)
    assert failures == [[]] * world, [f for fs in failures for f in fs][:5]


def _run_tied(_unused=None):
    return _run([lambda f: f.extend(_tied_read())])


# ---- 5. ranks whose models differ: a clear error at construction, on every rank ----------------

def _different_models(_unused=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net().double()
    if rank == world - 1:
        net.fc2 = nn.Linear(13, 4).double()  # one width more, on the last rank only
    try:
        FSDP(net)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_models_fail_clearly_at_construction(world):
    messages = launch(_different_models, world, timeout=60)
    for message in messages:
        assert "FullyShardedDataParallel expects the same model" in message, message
        assert f"rank {world - 1} has parameter 'fc2.weight' of shape (4, 13)" in message
        assert "Build the model the same way on every rank" in message
