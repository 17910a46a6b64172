"""Sequence parallelism (course_lib.distributed.tensor.parallel.sequence) against tensor
parallelism alone and one process, at 2, 3 and 4 ranks (one launch each).

Equal (float64, to rounding): the g / g-bar mappings forward and backward; the GPT converted by
``parallelize_gpt(..., sequence_parallel=True)`` against the same model in one process (logits
block, loss, every gradient or its shard: LayerNorm, bias and position-embedding gradients summed
over the group as Megatron does) and against ``parallelize_gpt`` alone, over 2 AdamW steps.

Bytes on the wire, counted per collective (a ring moves 2(t-1)/t n bytes per rank for an
all-reduce of n bytes, (t-1)/t n for an all-gather or reduce-scatter of n): the g / g-bar pairs
move exactly the bytes of tensor parallelism's all-reduces (4(2L+1) of B*T*C elements per step,
each all-reduce replaced by a reduce-scatter plus an all-gather). Beyond them sequence
parallelism sends, and the test counts exactly: one all-gather per column-parallel layer in
backward (2L+1), which gathers again the input kept sharded so that activations are divided by
t (Megatron does the same and overlaps it), and the all-reduce of the gradients of the weights
that saw only this rank's positions (LayerNorms, row-parallel biases, position embedding).

Activation memory per rank of one block, measured (bytes saved for backward, float64): with
sequence parallelism it equals one process's divided by t exactly, except the (T, T) causal mask
(T^2 bytes, the same on every rank); beside the paper's sbh(34 + 5as/h)/t adapted to the course
GPT (no dropout: e(16sbh + as^2b)/t at e bytes an element, see tests/test_checkpoint.py) within
3% (the LayerNorm statistics, 4sb e/t, and the mask). Tensor parallelism alone measured
against sbh(10 + 24/t + 5as/(ht)) adapted the same way, exactly plus the same extras.

Against torch's own sequence parallelism (``test_sequence_parallel_equals_torchs``, one launch
for 2 and 3 ranks): the blocks split by ``parallelize_module`` with ``SequenceParallel``
LayerNorms and ``ColwiseParallel(input_layouts=Shard(1))`` / ``RowwiseParallel(output_layouts=
Shard(1))`` on a CPU ``DeviceMesh`` (gloo) give the same outputs and gradients in float64.
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import compat, launch
from course_lib.distributed.tensor.parallel import (
    gather_from_sequence_parallel_region,
    parallelize_gpt,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from course_lib.models import GPT, GPTConfig
from course_lib.utils import activation_memory_per_layer, saved_tensor_bytes

F64 = dict(rtol=1e-10, atol=1e-12)
CONFIG = dict(vocab_size=48, block_size=12, n_layer=2, n_head=12, n_embd=24)
B, T = 2, 12
E = 8   # bytes of a float64


def _close(failures, where, got, want):
    try:
        torch.testing.assert_close(got, want, **F64)
    except AssertionError as e:
        failures.append(f"{where}: {str(e).splitlines()[0]} {str(e).splitlines()[-1]}")


def _block(full, rank, world, dim):
    return full.chunk(world, dim=dim)[rank]


def _mappings(failures, rank, world):
    x = torch.randn(B, T, 5, dtype=torch.float64)             # the same on every rank
    w = torch.randn_like(x)
    mine = _block(x, rank, world, 1).clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(mine)
    _close(failures, "g forward (all-gather)", gathered, x)
    (gathered * w * (rank + 1)).sum().backward()               # each rank's own upstream grad
    _close(failures, "g backward (reduce-scatter)", mine.grad,
           _block(sum(w * (r + 1) for r in range(world)), rank, world, 1))
    part = (x * (rank + 1)).requires_grad_()
    scattered = reduce_scatter_to_sequence_parallel_region(part)
    _close(failures, "g-bar forward (reduce-scatter)", scattered,
           _block(sum(x * (r + 1) for r in range(world)), rank, world, 1))
    (scattered * _block(w, rank, world, 1)).sum().backward()
    _close(failures, "g-bar backward (all-gather)", part.grad, w)
    full = x.clone().requires_grad_()
    split = scatter_to_sequence_parallel_region(full)
    _close(failures, "scatter forward", split, _block(x, rank, world, 1))
    (split * _block(w, rank, world, 1)).sum().backward()
    _close(failures, "scatter backward", full.grad, w)


def _models():
    torch.manual_seed(1)
    one = GPT(GPTConfig(**CONFIG)).double()
    tp = parallelize_gpt(copy.deepcopy(one))                   # the old signature
    sp = parallelize_gpt(copy.deepcopy(one), sequence_parallel=True)
    return one, tp, sp


def _want_grad(name, p_one, p_shard, rank, world):
    if p_shard.shape == p_one.shape:
        return p_one.grad
    dim = 1 if name.endswith(("out_proj.weight", "proj.weight")) else 0
    return _block(p_one.grad, rank, world, dim)


def _gpt(failures, rank, world):
    one, tp, sp = _models()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (one, tp, sp)]
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        idx = torch.randint(CONFIG["vocab_size"], (B, T), generator=gen)
        targets = torch.randint(CONFIG["vocab_size"], (B, T), generator=gen)
        outs = [m(idx, targets) for m in (one, tp, sp)]
        (logits, loss), (logits_tp, loss_tp), (logits_sp, loss_sp) = outs
        _close(failures, f"step {step} logits vs one process", logits_sp,
               _block(logits.detach(), rank, world, -1))
        _close(failures, f"step {step} logits vs TP", logits_sp, logits_tp)
        _close(failures, f"step {step} loss vs one process", loss_sp, loss)
        _close(failures, f"step {step} loss vs TP", loss_sp, loss_tp)
        for opt, (_, lo) in zip(opts, outs):
            opt.zero_grad()
            lo.backward()
        for (name, p1), (_, pt), (_, ps) in zip(one.named_parameters(), tp.named_parameters(),
                                                sp.named_parameters()):
            _close(failures, f"step {step} grad {name} vs one process", ps.grad,
                   _want_grad(name, p1, ps, rank, world))
            _close(failures, f"step {step} grad {name} vs TP", ps.grad, pt.grad)
        for opt in opts:
            opt.step()
    _close(failures, "loss after 2 AdamW steps", sp(idx, targets)[1], one(idx, targets)[1])


def _autocast(failures, rank, world):
    """Under bfloat16 autocast (float32 weights) SP runs and agrees with TP to bfloat16's
    precision: the sequence-parallel linear's backward computes in the forward's dtype."""
    torch.manual_seed(3)
    one = GPT(GPTConfig(**CONFIG))
    tp, sp = parallelize_gpt(copy.deepcopy(one)), parallelize_gpt(one, sequence_parallel=True)
    idx = torch.randint(CONFIG["vocab_size"], (B, T))
    losses = []
    for model in (tp, sp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        losses.append(loss.detach())
    try:
        torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
        for (name, pt), (_, ps) in zip(tp.named_parameters(), sp.named_parameters()):
            if ps.grad is None or ps.grad.dtype != pt.dtype:
                failures.append(f"autocast: grad of {name} is {ps.grad and ps.grad.dtype}")
            else:
                torch.testing.assert_close(ps.grad, pt.grad, rtol=5e-2, atol=5e-3)
    except AssertionError as e:
        failures.append(f"autocast: {str(e).splitlines()[0]}")


def _count(model, idx):
    """(kind, elements) of every collective of one forward and backward."""
    calls = []
    real = {"all_reduce": dist.all_reduce, "all_gather": dist.all_gather,
            "ag": compat.all_gather_into_tensor, "rs": compat.reduce_scatter_tensor}

    def ar(tensor, *a, **k):
        calls.append(("all_reduce", tensor.numel()))
        return real["all_reduce"](tensor, *a, **k)

    def ag(output, input, *a, **k):
        calls.append(("all_gather", input.numel()))            # this rank's block
        return real["ag"](output, input, *a, **k)

    def rs(output, input, *a, **k):
        calls.append(("reduce_scatter", output.numel()))       # this rank's block
        return real["rs"](output, input, *a, **k)

    def other(*a, **k):
        calls.append(("list all_gather", None))
        return real["all_gather"](*a, **k)

    dist.all_reduce, dist.all_gather = ar, other
    compat.all_gather_into_tensor, compat.reduce_scatter_tensor = ag, rs
    try:
        model(idx, idx)[1].backward()
    finally:
        dist.all_reduce, dist.all_gather = real["all_reduce"], real["all_gather"]
        compat.all_gather_into_tensor, compat.reduce_scatter_tensor = real["ag"], real["rs"]
    return calls


def _ring_bytes(calls, world):
    """Bytes each rank sends in a ring, times the world size (to stay an integer)."""
    per = {"all_reduce": lambda n: 2 * (world - 1) * n,        # n: the whole tensor
           "all_gather": lambda m: world * (world - 1) * m,     # m: one rank's block
           "reduce_scatter": lambda m: world * (world - 1) * m}
    return sum(per[kind](n) * E for kind, n in calls)


def _wire(failures, rank, world):
    _, tp, sp = _models()
    idx = torch.randint(CONFIG["vocab_size"], (B, T))
    L, C = CONFIG["n_layer"], CONFIG["n_embd"]
    act, shard, k = B * T * C, B * T * C // world, 2 * L + 1
    loss = [("all_reduce", B * T)] * 3
    want_tp = [("all_reduce", act)] * (2 * k) + loss
    regather = [("all_gather", shard)] * k
    param_grads = ([("all_reduce", C)] * (2 * k)               # LayerNorm weights and biases
                   + [("all_reduce", C)] * (2 * L)              # row-parallel biases
                   + [("all_reduce", CONFIG["block_size"] * C)])   # position embedding
    want_sp = ([("all_gather", shard)] * k + [("reduce_scatter", shard)] * (2 * k)
               + [("all_gather", shard)] * k + regather + param_grads + loss)
    got_tp, got_sp = _count(tp, idx), _count(sp, idx)
    if sorted(got_tp) != sorted(want_tp):
        failures.append(f"TP collectives: got {sorted(got_tp)}, want {sorted(want_tp)}")
    if sorted(got_sp) != sorted(want_sp):
        failures.append(f"SP collectives: got {sorted(got_sp)}, want {sorted(want_sp)}")
    g_pairs = _ring_bytes(got_sp, world) - _ring_bytes(regather + param_grads, world)
    if g_pairs != _ring_bytes(got_tp, world):
        failures.append(f"bytes on the wire: SP's g / g-bar pairs {g_pairs / world}, "
                        f"TP's all-reduces {_ring_bytes(got_tp, world) / world}")


def _memory(failures, rank, world):
    one, tp, sp = _models()
    s, b, h, a = T, B, CONFIG["n_embd"], CONFIG["n_head"]
    x = torch.randn(b, s, h, dtype=torch.float64)
    full = x.clone().requires_grad_()
    mine = _block(x, rank, world, 1).clone().requires_grad_()
    m_one = saved_tensor_bytes(one.blocks[0], full)
    m_tp = saved_tensor_bytes(tp.blocks[0], full)
    m_sp = saved_tensor_bytes(sp.blocks[0], mine)
    mask, stats = s * s, 4 * s * b * E
    if m_sp != (m_one - mask) / world + mask:
        failures.append(f"SP activation bytes {m_sp} != (one process {m_one} - mask {mask}) "
                        f"/ {world} + mask")
    # the paper's terms the course GPT lacks: two 1-byte dropout masks (2sbh), the softmax's
    # dropout mask and output (3as^2b); the rest at E bytes an element instead of 2
    sbh, soft = s * b * h, 3 * a * s * s * b
    paper_sp = activation_memory_per_layer(s, b, h, a, t=world, sequence_parallel=True)
    formula_sp = (paper_sp - (2 * sbh + soft) / world) * E / 2
    if m_sp != formula_sp + stats / world + mask or abs(m_sp - formula_sp) > 0.03 * formula_sp:
        failures.append(f"SP activation bytes {m_sp} vs the formula {formula_sp}")
    paper_tp = activation_memory_per_layer(s, b, h, a, t=world)
    formula_tp = (paper_tp - 2 * sbh - soft / world) * E / 2
    if m_tp != formula_tp + stats + mask:
        failures.append(f"TP activation bytes {m_tp} vs the formula {formula_tp}")
    if not m_sp < m_tp < m_one:
        failures.append(f"not SP {m_sp} < TP {m_tp} < one process {m_one}")


def _refusal(failures, world):
    _, _, sp = _models()
    try:
        sp(torch.zeros(B, 5, dtype=torch.long))
        failures.append(f"sequence of 5 over {world} ranks: no error")
    except ValueError as e:
        if "sequence length" not in str(e) or "divisible" not in str(e):
            failures.append(f"unclear error for a sequence not divisible: {e}")


def _all(_unused=None) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)   # the same "one-process" tensors on every rank
        for case in (_mappings, _gpt, _wire, _memory, _autocast):
            case(failures, rank, world)
        _refusal(failures, world)
    failures += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    return failures


@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.slow)])
def failures(request):
    return launch(_all, request.param, timeout=180)


def test_sequence_parallel_equals_tp_and_one_process(failures):
    """Mappings, the converted GPT over 2 AdamW steps (vs one process and vs TP alone), the
    collectives and bytes on the wire counted, activation bytes per rank measured divided by t,
    a sequence the group does not divide refused; no warning."""
    assert failures == [[] for _ in failures], [f for fs in failures for f in fs][:8]


# ------------------------------------------------------------------------------------------------
# against torch's own sequence parallelism (DTensor)
# ------------------------------------------------------------------------------------------------

def _torch_sp_plan():
    """torch's tensor-parallel tutorial's plan for a block, with sequence parallelism: the
    LayerNorms ``SequenceParallel`` (their input and output sharded along the sequence,
    ``Shard(1)``), the column-parallel layers taking a ``Shard(1)`` input (all-gathered before
    the product), the row-parallel ones returning ``Shard(1)`` (reduce-scattered after)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )
    return {"ln_1": SequenceParallel(),
            "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def _local(grad):
    """A torch gradient as this rank holds it after summing: a ``Partial`` one (the LayerNorms',
    each rank's sum over its positions) all-reduced, a sharded or replicated one as it is."""
    placements = getattr(grad, "placements", ())
    if any(p.is_partial() for p in placements):
        return grad.full_tensor()
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _against_torch(_spec, _seed) -> str | None:
    """In every rank: the blocks of ``parallelize_gpt(..., sequence_parallel=True)`` against
    the same blocks split by torch's ``parallelize_module`` with the plan above on a CPU
    ``DeviceMesh``; float64, each rank feeding its block of positions (B, T/t, C)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    one, _, ours = _models()
    theirs = copy.deepcopy(one)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for block in theirs.blocks:
            parallelize_module(block, mesh, _torch_sp_plan())
    except Exception as e:  # noqa: BLE001 - torch's refusal is the finding, said in words
        return f"world_size={world}: torch: {type(e).__name__}: {e}"
    x = torch.randn(B, T, CONFIG["n_embd"], dtype=torch.float64)      # the same on every rank
    u = torch.randn_like(x)
    failures, results = [], []
    for blocks in (ours.blocks, theirs.blocks):
        h = _block(x, rank, world, 1).clone().requires_grad_()
        y = h
        for block in blocks:
            y = block(y)
        (y * _block(u, rank, world, 1)).sum().backward()
        results.append((y, h.grad))
    (y_ours, g_ours), (y_torch, g_torch) = results
    _close(failures, "blocks' output (B, T/t, C)", y_ours, y_torch)
    _close(failures, "input's gradient", g_ours, g_torch)
    for (name, p_ours), (_, p_torch) in zip(ours.blocks.named_parameters(),
                                            theirs.blocks.named_parameters()):
        _close(failures, f"grad of blocks.{name}", p_ours.grad, _local(p_torch.grad))
    return "\n".join(f"world_size={world}, rank {rank}: {f}" for f in failures) or None


def test_sequence_parallel_equals_torchs():
    """Our sequence-parallel blocks equal torch's (``SequenceParallel`` LayerNorms,
    ``ColwiseParallel(input_layouts=Shard(1))``, ``RowwiseParallel(output_layouts=Shard(1))``
    on ``init_device_mesh("cpu", (t,))``, gloo) at 2 and 3 ranks in float64: outputs, the
    input's gradient and every parameter's gradient (torch leaves the LayerNorms' ``Partial``:
    summed here, as ours are). One launch: a group of 2 ranks, then of 3."""
    from course_lib.checks._launch import first_failure_in_ranks

    found = first_failure_in_ranks(_against_torch, None, (2, 3), (0,), timeout=60.0,
                                   hang_hint="", hint="")
    assert found is None, found
