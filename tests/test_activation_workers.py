"""``course_lib.examples.activation_workers.precision_memory``: the memory of one training step in
each precision, measured, equals the count from the parameter count and the element sizes.

Exact: weights, gradients and optimizer state (Adam's moments, plus the float32 master copy in
``bf16-weights+fp32-master``) against ``param_count`` times 4 + 4 + 8 bytes (float32, and both
autocast modes: autocast keeps float32 weights) or 2 + 2 + 12 (16-bit weights with a float32
master copy: the ZeRO paper's count); under autocast the 16-bit weight copies saved for backward
are exactly 2 bytes per element of every ``nn.Linear`` weight. Activations: positive, and
smaller in 16 bits than in float32.
"""
import pytest
import torch
from torch import nn

from course_lib.examples import activation_workers as W
from course_lib.models.gpt import GPT, GPTConfig

CONFIG = dict(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_embd=24)
B, T = 2, 16


@pytest.fixture(scope="module")
def results():
    return {mode: W.precision_memory(CONFIG, B, T, mode) for mode in W.MODES}


def _linear_weight_elements():
    return sum(m.weight.numel() for m in GPT(GPTConfig(**CONFIG)).modules()
               if isinstance(m, nn.Linear))


def test_measured_equals_counted_exactly(results):
    n = sum(p.numel() for p in GPT(GPTConfig(**CONFIG)).parameters())
    per_param = {"float32": (4, 4, 8), "bf16-autocast": (4, 4, 8),
                 "fp16-autocast+scaler": (4, 4, 8), "bf16-weights+fp32-master": (2, 2, 12)}
    for mode, r in results.items():
        assert r["supported"], (mode, r["note"])
        assert r["param_count"] == n
        assert (r["weights"], r["gradients"], r["optimizer"]) == tuple(
            b * n for b in per_param[mode]), mode
        assert r["counted"] == {"weights": r["weights"], "gradients": r["gradients"],
                                "optimizer": r["optimizer"]}, mode
        assert r["bytes_per_param"]["total"] == 16, mode
        assert r["optimizer_steps"] == 4 * len(list(GPT(GPTConfig(**CONFIG)).parameters()))
        assert r["skipped_steps"] == 0 and r["loss"] > 0
    master = results["bf16-weights+fp32-master"]
    assert {k: master["bytes_per_param"][k] for k in W.PAPER_BYTES_PER_PARAM} == \
        W.PAPER_BYTES_PER_PARAM
    assert master["master_weights"] == 4 * n and master["optimizer_moments"] == 8 * n
    assert master["transient_master_gradients"] == 4 * n


def test_activations_and_autocast_weight_copies(results):
    acts = {mode: r["activations"] for mode, r in results.items()}
    assert all(a > 0 for a in acts.values()), acts
    assert acts["bf16-autocast"] < acts["float32"], acts
    assert acts["bf16-weights+fp32-master"] < acts["bf16-autocast"], acts
    assert acts["fp16-autocast+scaler"] == acts["bf16-autocast"], acts    # 2 bytes either way
    copies = 2 * _linear_weight_elements()
    assert results["bf16-autocast"]["activation_weight_copies"] == copies
    assert results["fp16-autocast+scaler"]["activation_weight_copies"] == copies
    assert results["float32"]["activation_weight_copies"] == 0
    assert "4 bytes a parameter, not the paper's 2" in results["bf16-autocast"]["note"]


def test_unsupported_autocast_is_said_not_faked(monkeypatch):
    monkeypatch.setattr(W, "autocast_supports", lambda device, dtype: (False, "not here"))
    r = W.precision_memory(CONFIG, B, T, "fp16-autocast+scaler")
    assert r["supported"] is False and "does not compute in torch.float16 (not here)" in r["note"]
    assert "weights" not in r


def test_autocast_support_probe_and_bad_mode():
    assert W.autocast_supports("cpu", torch.bfloat16) == (True, "")
    with pytest.raises(ValueError, match="mode must be one of"):
        W.precision_memory(CONFIG, B, T, "fp8")


# ------------------------------------------------------------------------------------------------
# layer_memory, formula_per_layer, with_recomputation (notebook 15's figure and timing)
# ------------------------------------------------------------------------------------------------

LAYER = dict(vocab_size=48, block_size=12, n_layer=2, n_head=6, n_embd=24)
LB, LT = 2, 12


def _launched_layer_memory():
    from course_lib.distributed import launch
    return launch(W.layer_memory, 3, LAYER, LB, LT)


def test_layer_memory_equals_the_formula_plus_its_named_extras():
    """One process and, in one launch, 3 ranks (TP and TP + SP): every measurement equals the
    paper's formula without its dropout terms plus the LayerNorm statistics and causal mask,
    byte for byte; the split model's loss equals one process's; SP sends TP's bytes plus one
    all-gather per column-parallel layer (backward's re-gather) and small all-reduces."""
    one = W.layer_memory(LAYER, LB, LT)
    ranks = _launched_layer_memory()
    settings = {"one": dict(t=1), "tp": dict(t=3), "sp": dict(t=3, sequence_parallel=True)}
    for r in [one, *ranks]:
        for variant in set(r) & set(settings):
            for recompute in W.RECOMPUTE:
                f = W.formula_per_layer(LAYER, LB, LT, recompute=recompute, **settings[variant])
                assert r[variant][recompute] == f["expected"], (variant, recompute, f)
                assert abs(r[variant][recompute] - f["formula"]) <= 0.05 * f["formula"]
    full = one["one"]["full"]
    assert full == LB * LT * LAYER["n_embd"] * 4                       # the input, float32
    assert ranks[0]["sp"]["full"] * 3 == full and ranks[0]["tp"]["full"] == full
    assert ranks[0]["sp"]["none"] < ranks[0]["tp"]["none"] < one["one"]["none"]
    n = LB * LT * LAYER["n_embd"]
    for r in ranks:
        assert max(v for k, v in r["loss"].items() if k != "one") < 1e-5, r["loss"]
        tp = sum(b for kind, e, b in r["wire"]["tp"] if e == n)
        pairs = sum(b for kind, e, b in r["wire"]["sp"] if e == n and kind != "all_reduce")
        k = 2 * LAYER["n_layer"] + 1                                  # column-parallel layers
        assert abs(pairs - tp * (1 + 1 / 4)) < 1e-6 * tp, (pairs, tp, k)
        assert sum(kind == "all_gather" and e == n for kind, e, _ in r["wire"]["sp"]) == 3 * k


def test_formula_per_layer_terms_and_with_recomputation_gradients():
    f = W.formula_per_layer(LAYER, LB, LT)
    s, b, h, a = LT, LB, LAYER["n_embd"], LAYER["n_head"]
    assert f["paper"] == s * b * h * (34 + 5 * a * s / h)
    assert f["dropout"] == 2 * s * b * h + 3 * a * s * s * b
    assert f["formula"] == 4 * (16 * s * b * h + a * s * s * b)       # float32, no dropout
    torch.manual_seed(0)
    model = GPT(GPTConfig(**LAYER)).double()
    idx = torch.randint(LAYER["vocab_size"], (LB, LT))
    grads = {}
    for recompute in W.RECOMPUTE:
        m = W.with_recomputation(model, recompute)
        m(idx, idx)[1].backward()
        grads[recompute] = [p.grad for p in m.parameters()]
    assert isinstance(W.with_recomputation(model, "full").blocks[0], W.Recomputed)
    assert model.blocks[0].attn.core_attention.__name__ == "causal_attention"   # a copy
    for recompute in ("selective", "full"):
        for g, want in zip(grads[recompute], grads["none"]):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="recompute must be one of"):
        W.with_recomputation(model, "half")


def test_peak_saved_bytes_counts_the_recomputed_layer_during_backward():
    """Full recomputation keeps L inputs after forward, but its peak is L - 1 inputs plus one
    whole layer; without recomputation the peak is what forward leaves; selective between."""
    small, L = dict(n_layer=1, n_embd=24, n_head=4, block_size=16), 3
    none, sel, full = (W.peak_saved_bytes(small, 2, 16, L, rc) for rc in W.RECOMPUTE)
    x_bytes = 2 * 16 * 24 * 4                                    # one float32 (B, T, C) input
    assert full["kept"] == x_bytes and none["kept"] == full["whole"] == none["whole"]
    for p in (none, sel, full):
        assert p["forward"] == L * p["kept"]
    assert none["peak"] == L * none["kept"]
    assert full["peak"] == (L - 1) * x_bytes + full["whole"] > full["forward"]
    assert L * sel["kept"] <= sel["peak"] <= (L - 1) * sel["kept"] + sel["whole"]
    assert full["peak"] < sel["peak"] < none["peak"]
