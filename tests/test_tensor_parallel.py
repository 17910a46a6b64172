"""course_lib.distributed.tensor.parallel against one process, and against torch's own.

The oracle: the same layer or model in one process (every rank builds it from the same seed and
feeds it the same batch). In float64 every output, the loss, every input gradient and each rank's
weight-gradient shard must equal the one-process values (the matching slice) to rounding; in
float32 to 1e-5. Torch's ``parallelize_module`` (ColwiseParallel / RowwiseParallel on a CPU
DeviceMesh over gloo) must give the same logits, loss and gradient shards. The all-reduces of a
step are counted against Megatron's formula. Each world size is one launch that runs every case
and returns the failures as text.
"""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import launch
from course_lib.distributed.tensor.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    parallelize_gpt,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from course_lib.examples import tensor_parallel_workers as W
from course_lib.models import GPT, GPTConfig

F64 = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=1e-5, atol=1e-5)
CONFIG = dict(vocab_size=48, block_size=8, n_layer=2, n_head=12, n_embd=24)
B, T = 3, 8


def _close(failures, where, got, want, tol):
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as e:
        failures.append(f"{where}: {str(e).splitlines()[0]} {str(e).splitlines()[-1]}")


def _block(full, rank, world, dim):
    """Rank's block of ``full`` along ``dim``: the slice a shard must equal."""
    return full.chunk(world, dim=dim)[rank]


def _mappings(failures, rank, world, dtype, tol):
    x = torch.randn(4, 6 * world, dtype=dtype)                # the same on every rank
    mine = (x * (rank + 1)).requires_grad_()                  # different on every rank
    total = sum(x * (r + 1) for r in range(world))
    _close(failures, "g forward", reduce_from_tensor_model_parallel_region(mine), total, tol)
    w = torch.randn_like(x)
    (reduce_from_tensor_model_parallel_region(mine) * w).sum().backward()
    _close(failures, "g backward", mine.grad, w, tol)
    mine.grad = None
    (copy_to_tensor_model_parallel_region(mine) * w * (rank + 1)).sum().backward()
    _close(failures, "f backward", mine.grad, sum(w * (r + 1) for r in range(world)), tol)
    full = x.clone().requires_grad_()
    part = scatter_to_tensor_model_parallel_region(full)
    _close(failures, "scatter forward", part, _block(x, rank, world, -1), tol)
    gathered = gather_from_tensor_model_parallel_region(part)
    _close(failures, "gather forward", gathered, x, tol)
    (gathered * w).sum().backward()   # each rank's slice of w, gathered back: w on every rank
    _close(failures, "scatter/gather backward", full.grad, w, tol)


def _linears(failures, rank, world, dtype, tol):
    for bias in (True, False):
        fc1, fc2 = nn.Linear(5, 4 * world, bias=bias), nn.Linear(4 * world, 3, bias=bias)
        fc1, fc2 = fc1.to(dtype), fc2.to(dtype)
        X = torch.randn(2, 3, 5, dtype=dtype, requires_grad=True)
        Y = fc2(F.gelu(fc1(X)))
        w = torch.randn_like(Y)
        (Y * w).sum().backward()
        col = ColumnParallelLinear.from_linear(fc1)
        row = RowParallelLinear.from_linear(fc2)
        Xp = X.detach().clone().requires_grad_()
        Yp = row(F.gelu(col(Xp)))
        (Yp * w).sum().backward()
        where = f"MLP bias={bias}"
        _close(failures, f"{where} output", Yp, Y, tol)
        _close(failures, f"{where} input grad", Xp.grad, X.grad, tol)
        _close(failures, f"{where} col weight", col.weight, _block(fc1.weight, rank, world, 0), tol)
        _close(failures, f"{where} col weight grad", col.weight.grad,
               _block(fc1.weight.grad, rank, world, 0), tol)
        _close(failures, f"{where} row weight grad", row.weight.grad,
               _block(fc2.weight.grad, rank, world, 1), tol)
        if bias:
            _close(failures, f"{where} col bias grad", col.bias.grad,
                   _block(fc1.bias.grad, rank, world, 0), tol)
            _close(failures, f"{where} row bias grad", row.bias.grad, fc2.bias.grad, tol)
        # gather_output=True and input_is_parallel=False: full tensors in, full tensors out
        for layer, one in ((ColumnParallelLinear.from_linear(fc1, gather_output=True), fc1),
                           (RowParallelLinear.from_linear(fc2, input_is_parallel=False), fc2)):
            Z = torch.randn(2, one.in_features, dtype=dtype, requires_grad=True)
            Zp = Z.detach().clone().requires_grad_()
            out, out_p = one(Z), layer(Zp)
            _close(failures, f"{type(layer).__name__} full output", out_p, out, tol)
            v = torch.randn_like(out)
            (out * v).sum().backward()
            (out_p * v).sum().backward()
            _close(failures, f"{type(layer).__name__} full input grad", Zp.grad, Z.grad, tol)


def _embedding_and_loss(failures, rank, world, dtype, tol):
    emb = nn.Embedding(4 * world, 5).to(dtype)
    idx = torch.randint(4 * world, (3, 7))
    out = emb(idx)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    par = VocabParallelEmbedding.from_embedding(emb)
    out_p = par(idx)
    (out_p * w).sum().backward()
    _close(failures, "embedding output", out_p, out, tol)
    _close(failures, "embedding grad", par.weight.grad,
           _block(emb.weight.grad, rank, world, 0), tol)
    V = 5 * world
    for scale in (1.0, 30.0):   # 30: logits far apart, the max shift matters
        logits = (scale * torch.randn(11, V, dtype=dtype)).requires_grad_()
        targets = torch.randint(V, (11,))
        targets[:world] = torch.arange(world) * 5 + 4   # a target in every rank's block
        loss = F.cross_entropy(logits, targets)
        loss.backward()
        shard = _block(logits.detach(), rank, world, 1).clone().requires_grad_()
        loss_p = vocab_parallel_cross_entropy(shard, targets)
        loss_p.backward()
        _close(failures, f"vocab cross-entropy x{scale}", loss_p, loss, tol)
        _close(failures, f"vocab cross-entropy x{scale} grad", shard.grad,
               _block(logits.grad, rank, world, 1), tol)


def _gpt_pair(dtype):
    torch.manual_seed(1)
    one = GPT(GPTConfig(**CONFIG)).to(dtype)
    return one, parallelize_gpt(copy.deepcopy(one))


def _compare_grads(failures, where, one, tp, rank, world, tol):
    for (name, p1), (_, pt) in zip(one.named_parameters(), tp.named_parameters()):
        if pt.shape == p1.shape:
            want = p1.grad
        else:
            dim = 1 if name.endswith(("out_proj.weight", "proj.weight")) else 0
            want = _block(p1.grad, rank, world, dim)
        _close(failures, f"{where} grad {name}", pt.grad, want, tol)


def _gpt(failures, rank, world, dtype, tol):
    one, tp = _gpt_pair(dtype)
    opt1 = torch.optim.AdamW(one.parameters(), lr=1e-2)
    optt = torch.optim.AdamW(tp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        idx = torch.randint(CONFIG["vocab_size"], (B, T), generator=gen)
        targets = torch.randint(CONFIG["vocab_size"], (B, T), generator=gen)
        logits, loss = one(idx, targets)
        logits_p, loss_p = tp(idx, targets)
        _close(failures, f"GPT step {step} logits", logits_p,
               _block(logits.detach(), rank, world, -1), tol)
        _close(failures, f"GPT step {step} loss", loss_p, loss, tol)
        for opt, lo in ((opt1, loss), (optt, loss_p)):
            opt.zero_grad()
            lo.backward()
        _compare_grads(failures, f"GPT step {step}", one, tp, rank, world, tol)
        opt1.step()
        optt.step()
    _, loss = one(idx, targets)
    _, loss_p = tp(idx, targets)
    _close(failures, "GPT loss after 3 AdamW steps", loss_p, loss, tol)


def _count_all_reduces(failures, rank, world):
    """Megatron's count: per block 2 all-reduces forward and 2 backward of B*T*C elements; one
    more of each for the embedding (forward) and the head (backward); the loss adds 3 of B*T.
    Each collective is tagged with the layer that issued it: g after out_proj and proj forward,
    f before qkv and fc backward."""
    trace = W.trace_collectives(CONFIG, B, T)
    calls = [(phase, op, n) for phase, _, op, n, _ in trace["events"]]
    L, C = CONFIG["n_layer"], CONFIG["n_embd"]
    want = ([("forward", "all_reduce", B * T * C)] * (2 * L + 1)
            + [("forward", "all_reduce", B * T)] * 3
            + [("backward", "all_reduce", B * T * C)] * (2 * L + 1))
    if sorted(calls) != sorted(want):
        failures.append(f"collectives: got {sorted(calls)}, Megatron's formula says {sorted(want)}")
    if sum(b for *_, b in trace["events"]) != sum(4 * n for *_, n in want):
        failures.append("all-reduce bytes differ from the formula")
    layers = sorted({(phase, layer.rpartition(".")[2]) for phase, layer, *_ in trace["events"]
                     if layer.startswith("blocks.")})
    if layers != [("backward", "fc"), ("backward", "qkv"), ("forward", "out_proj"),
                  ("forward", "proj")]:
        failures.append(f"the blocks' all-reduces come from {layers}: expected g after out_proj "
                        "and proj forward, f before qkv and fc backward")


def _against_torch(failures, rank, world):
    """The blocks parallelised by torch's parallelize_module, our whole model by ours."""
    result = W.against_torch(CONFIG, B, T)
    if "error" in result:
        failures.append(f"torch's parallelize_module failed: {result['error']}")
    elif max(result["logits"], result["loss"], result["grads"]) > 1e-12:
        failures.append(f"ours differs from torch's parallelize_module: {result}")


def _refusals(failures, world):
    cases = [(lambda: ColumnParallelLinear(4, world * 2 + 1), "out_features"),
             (lambda: RowParallelLinear(world * 2 + 1, 4), "in_features"),
             (lambda: VocabParallelEmbedding(world * 2 + 1, 4), "num_embeddings"),
             (lambda: parallelize_gpt(GPT(GPTConfig(**{**CONFIG, "n_head": 5, "n_embd": 10}))),
              "n_head"),
             (lambda: parallelize_gpt(GPT(GPTConfig(**{**CONFIG, "vocab_size": 12 * world + 1}))),
              "vocab_size")]
    for make, what in cases:
        try:
            make()
            failures.append(f"{what} not divisible by {world}: no error")
        except ValueError as e:
            if what not in str(e) or "divisible" not in str(e):
                failures.append(f"unclear error for {what}: {e}")
    try:
        VocabParallelEmbedding(4 * world, 3)(torch.tensor([4 * world]))
        failures.append("out-of-range token: no error")
    except IndexError:
        pass


def _all(_unused=None) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
            torch.manual_seed(0)   # the same "one-process" tensors on every rank
            for case in (_mappings, _linears, _embedding_and_loss, _gpt):
                n = len(failures)
                case(failures, rank, world, dtype, tol)
                failures[n:] = [f"{dtype} {f}" for f in failures[n:]]
        _count_all_reduces(failures, rank, world)
        _against_torch(failures, rank, world)
        _refusals(failures, world)
    failures += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    return failures


@pytest.fixture(scope="module", params=[2, 3, pytest.param(4, marks=pytest.mark.slow)])
def failures(request):
    return launch(_all, request.param, timeout=180)


def test_tensor_parallel_equals_one_process_and_torch(failures):
    """Layers, loss and the converted GPT (3 AdamW steps) equal one process in float64 to
    rounding and float32 to 1e-5; torch's parallelize_module gives the same; the all-reduces
    counted equal Megatron's formula; sizes the world does not divide are refused; no warning."""
    assert failures == [[] for _ in failures], [f for fs in failures for f in fs][:8]


def test_layers_need_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ColumnParallelLinear(4, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize_gpt(GPT(GPTConfig(**CONFIG)))


def _learner_and_long_run(root: str):
    """The lesson's MINE path (the blocks' linears and the loss from the reference answers,
    imported as a learner's files would be) equals one process; the split model trained alone
    on the baseline's batches gives the baseline's losses."""
    from course_lib.bench.gpt import baseline

    mine = {"folder": root, "linears": "solutions.lesson14", "loss": "solutions.lesson14"}
    rows = W.against_one_process({}, B, T, 2, "float64", 3e-3, 0, None, mine)
    worst = max(max(r["logits"], r["grad"], abs(r["loss_one"] - r["loss_tp"])) for r in rows)
    split = W.train_split({}, 4, 16, 4, 1e-3, 0)
    one = baseline(4, 4, 16, eval_batches=1, threads=1, warmup=1)["losses"]
    return worst, max(abs(a - b) for a, b in zip(split, one))


def test_learners_layers_in_the_model_and_the_split_model_learns_like_the_baseline():
    from pathlib import Path
    root = str(Path(__file__).resolve().parent.parent)
    for worst, gap in launch(_learner_and_long_run, 3, root, timeout=180):
        assert worst < 1e-12, f"the learner's layers in the GPT differ from one process: {worst}"
        assert gap < 1e-4, f"the split model's losses differ from the baseline's by {gap}"
