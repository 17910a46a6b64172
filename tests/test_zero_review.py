"""course_lib.distributed.optim.ZeroRedundancyOptimizer where a review against torch found it wrong.

1. torch's keywords ``parameters_as_bucket_view`` and ``overlap_with_ddp`` reached the local
   optimizer (a confusing TypeError): accepted as False, refused clearly as True.
2. ``state_dict()`` returned the dict cached by ``consolidate_state_dict``: a learning rate
   changed afterwards was missing. torch builds it when asked.
3. Ranks with different parameters (one LayerNorm less on the last rank) stepped without error
   and ended wrong: refused at construction, on every rank, naming the first difference.

Oracle: the unsharded optimizer in the same process, fed the same gradients (test_zero.py's).
One launch per world size (2 and 3 ranks) runs every check and returns failures as text.
"""
import copy
import functools
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from course_lib.distributed import launch
from course_lib.distributed.optim import ZeroRedundancyOptimizer


def _net(layer_norm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    middle = [nn.LayerNorm(8)] if layer_norm else []
    return nn.Sequential(nn.Linear(7, 8), *middle, nn.Tanh(), nn.Linear(8, 3)).double()


def _step(net: nn.Module, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    X, y = torch.randn(12, 7, generator=g).double(), torch.randint(0, 3, (12,), generator=g)
    opt.zero_grad()
    F.cross_entropy(net(X), y).backward()
    opt.step()


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return ""


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------

def torch_keywords() -> list[str]:
    """False is accepted (positionally too, in torch's order) and changes nothing; True refused."""
    failures, rank = [], dist.get_rank()
    net = _net()
    ref = copy.deepcopy(net)
    try:
        zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, None, False, False,
                                       lr=0.01)
        zero2 = ZeroRedundancyOptimizer(ref.parameters(), torch.optim.AdamW,
                                        parameters_as_bucket_view=False,
                                        overlap_with_ddp=False, lr=0.01)
    except Exception as e:  # noqa: BLE001
        return [f"rank {rank}: torch's keywords at False refused: {type(e).__name__}: {e}"]
    oracle_net = copy.deepcopy(net)
    oracle = torch.optim.AdamW(oracle_net.parameters(), lr=0.01)
    for seed in range(3):
        for model, opt in ((net, zero), (ref, zero2), (oracle_net, oracle)):
            _step(model, opt, seed)
    if not (_same(net, oracle_net) and _same(ref, oracle_net)):
        failures.append(f"rank {rank}: with the keywords at False, not the unsharded optimizer")
    for name in ("parameters_as_bucket_view", "overlap_with_ddp"):
        message = _error(ZeroRedundancyOptimizer, _net().parameters(), torch.optim.SGD,
                         lr=0.1, **{name: True})
        needed = ["NotImplementedError", f"{name}=True", "does not implement",
                  "torch.distributed.optim.ZeroRedundancyOptimizer"]
        if not all(n in message for n in needed):
            failures.append(f"rank {rank}: {name}=True: expected an error with {needed}, got "
                            f"{message or 'none'}")
        message = _error(ZeroRedundancyOptimizer, _net().parameters(), torch.optim.SGD,
                         lr=0.1, **{name: "yes"})
        if not (message.startswith("TypeError") and "True or False" in message):
            failures.append(f"rank {rank}: {name}='yes': {message or 'no error'}")
    return failures


def state_dict_when_asked() -> list[str]:
    """An lr changed after consolidate_state_dict shows in state_dict(), as in torch's."""
    failures, rank, to = [], dist.get_rank(), dist.get_world_size() - 1
    net = _net()
    oracle_net = copy.deepcopy(net)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    oracle = torch.optim.SGD(oracle_net.parameters(), lr=0.1, momentum=0.9)
    for seed in range(2):
        _step(net, zero, seed)
        _step(oracle_net, oracle, seed)
    zero.consolidate_state_dict(to=to)
    for opt in (zero, oracle):
        for group in opt.param_groups:
            group["lr"] = 0.025                      # a scheduler, after the consolidation
    if rank == to:
        full, want = zero.state_dict(), oracle.state_dict()
        if full["param_groups"] != want["param_groups"]:
            failures.append(f"param_groups {full['param_groups']} != {want['param_groups']}")
        for i, state in want["state"].items():
            if not torch.equal(full["state"][i]["momentum_buffer"], state["momentum_buffer"]):
                failures.append(f"state[{i}] differs")
        full["param_groups"][0]["lr"] = 7.0          # the caller's copy, not the optimizer's
        if zero.param_groups[0]["lr"] != 0.025 or zero.state_dict()["param_groups"][0]["lr"] \
                != 0.025:
            failures.append("changing the returned dict changed the optimizer")
    return failures


def different_parameters() -> list[str]:
    """The last rank differs; every rank raises a clear error; the group still works after."""
    failures = []
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    odd = rank == last
    cases = {
        # rank 0: 0 W(8,7) 1 b(8) 2 LN w(8) 3 LN b(8) 4 W(3,8); the last rank: 2 is W(3,8)
        "one LayerNorm less": (lambda: list(_net(layer_norm=not odd).parameters()),
                               ["position 2", "shape (8,)", "shape (3, 8)", "rank 0",
                                f"rank {last}", f"rank {last}: 4", "rank 0: 6"]),
        "other order": (lambda: list(_net().parameters())[::-1 if odd else 1],
                        ["position 0", "(8, 7)", "(3,)", f"rank {last}"]),
        "other groups": (lambda: [{"params": list(_net().parameters())[:2 if odd else 3]},
                                  {"params": list(_net().parameters())[2 if odd else 3:]}],
                         ["position 2", "param_groups[0]", "param_groups[1]", f"rank {last}"]),
    }
    for case, (params, needed) in cases.items():
        message = _error(ZeroRedundancyOptimizer, params(), torch.optim.SGD, lr=0.1)
        needed = ["RuntimeError", "ZeroRedundancyOptimizer expects the same parameters",
                  "in the same order", *needed]
        if not all(n in message for n in needed):
            failures.append(f"rank {rank}, {case}: expected an error with {needed}, got "
                            f"{message or 'none'}")
    net = _net()  # nothing left in flight: the same parameters step as the unsharded optimizer
    oracle_net = copy.deepcopy(net)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    oracle = torch.optim.SGD(oracle_net.parameters(), lr=0.1)
    _step(net, zero, 0)
    _step(oracle_net, oracle, 0)
    if not _same(net, oracle_net):
        failures.append(f"rank {rank}: after the refused cases, a step differs")
    return failures


def _all(_unused=None) -> dict[str, list[str]]:
    out = {}
    for name, check in CHECKS.items():
        try:
            out[name] = check()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            out[name] = [f"rank {dist.get_rank()}: {name} raised {type(e).__name__}: {e}"]
        dist.barrier()
    return out


CHECKS = {"keywords": torch_keywords, "state_dict": state_dict_when_asked,
          "different": different_parameters}


@functools.cache
def failures(world_size: int) -> dict[str, list[str]]:
    per_rank = launch(_all, world_size, timeout=240)
    return {name: [f for rank in per_rank for f in rank[name]] for name in CHECKS}


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_keywords_accepted_as_false_refused_as_true(world_size):
    assert not failures(world_size)["keywords"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dict_built_when_asked_shows_a_later_lr(world_size):
    assert not failures(world_size)["state_dict"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_parameters_refused_on_every_rank(world_size):
    assert not failures(world_size)["different"]


def test_signature_is_torchs_order():
    ours = list(inspect.signature(ZeroRedundancyOptimizer.__init__).parameters)
    theirs = list(inspect.signature(TorchZero.__init__).parameters)
    assert ours == theirs
