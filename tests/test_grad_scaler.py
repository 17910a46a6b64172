"""course_lib.amp.GradScaler against torch.amp.GradScaler("cpu"), step by step on the same run.

Two copies of a tiny model (float32 master weights, forward under ``torch.autocast`` in
float16 on the CPU), each with its own SGD and scaler, see the same batches. After every
iteration the scales, the skipped-or-not decisions and the parameters must be equal (bitwise:
the same float32 operations in the same order). The run starts at 2**20, where float16's
backward overflows by itself (skips and backoffs), then grows every ``growth_interval`` = 3 good
steps; an inf and a NaN forced into a gradient must each give a skipped step and a backoff.
"""

import pytest
import torch
from torch import nn

from course_lib.amp import GradScaler

EXACT = dict(rtol=0, atol=0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _iteration(model, opt, scaler, x, y, *, clip, poison):
    """One step: scale, backward, [unscale_ and clip], step, update. Returns (stepped?)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if poison is not None:
        model[0].weight.grad[0, 0] = poison
    if clip:
        scaler.unscale_(opt)                                    # unscale before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_decisions_scale_and_parameters_equal_torch_step_by_step():
    ours_model, theirs_model = _model(), _model()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.05, momentum=0.9)
    ours = GradScaler(init_scale=2.0**20, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    g = torch.Generator().manual_seed(1)
    poison = {9: float("inf"), 13: float("nan")}
    scales, decisions = [], []
    for i in range(18):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        kw = dict(clip=i % 2 == 0, poison=poison.get(i))
        a = _iteration(ours_model, ours_opt, ours, x, y, **kw)
        b = _iteration(theirs_model, theirs_opt, theirs, x, y, **kw)
        assert a == b, f"iteration {i}: stepped {a}, torch {b}"
        assert ours.get_scale() == theirs.get_scale(), f"iteration {i}"
        for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
            torch.testing.assert_close(p, q, **EXACT)
        scales.append(ours.get_scale())
        decisions.append(a)
        if i in poison:                                         # forced overflow: skip, back off
            assert not a and scales[-1] == scales[-2] / 2, (i, scales)
    assert ours.state_dict() == theirs.state_dict()
    assert scales[0] == 2.0**19 and not decisions[0]            # float16 overflowed by itself
    grew = [i for i in range(1, len(scales)) if scales[i] == 2 * scales[i - 1]]
    assert grew, scales                                         # grew after 3 good steps
    for i in grew:
        assert decisions[i - 2:i + 1] == [True] * 3, (i, decisions, scales)


def test_two_optimizers_one_overflows():
    """Each optimizer decides its own step; update backs off if any of them overflowed."""
    results = []
    for scaler in (GradScaler(init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)):
        a, b = nn.Linear(2, 1), nn.Linear(2, 1)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        scaler.scale(a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum()).backward()
        b.weight.grad[0, 0] = float("inf")
        wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
        scaler.step(oa)
        scaler.step(ob)
        scaler.update()
        results.append((torch.equal(wa, a.weight), torch.equal(wb, b.weight), scaler.get_scale()))
    assert results[0] == results[1] == (False, True, 2.0)


def test_state_dict_round_trip_with_torch():
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    ours = GradScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()
    assert GradScaler(enabled=False).state_dict() == {}
    with pytest.raises(RuntimeError, match="state dict is empty"):
        ours.load_state_dict({})


def test_misuse_raises_torch_errors():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match="scale"):
        scaler.unscale_(opt)                                    # no scale(loss) yet
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.update()
    half = nn.Linear(2, 1).half()
    half_opt = torch.optim.SGD(half.parameters(), lr=0.1)
    scaler.scale(half(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(half_opt)
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(growth_interval=0),
                dict(init_scale=float("inf"))):
        with pytest.raises(ValueError, match="GradScaler"):
            GradScaler(**bad)
    disabled = GradScaler(enabled=False)
    loss = model(torch.ones(1, 2)).sum()
    assert disabled.scale(loss) is loss and disabled.get_scale() == 1.0
