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
