"""Memory per rank of tensor parallelism: measured on real gloo ranks
(``course_lib.examples.tensor_parallel_workers.measure_memory``) against the count derived from
the code
(``course_lib.distributed.tensor.parallel.accounting``), byte for byte, at t = 1, 2, 4.

Configurations: the lesson's default ``GPTConfig`` at batch 8, sequence 64; one without biases,
three layers, 8 heads and T below block_size; a tiny one at t = 4 with one head per rank, one
sequence and one position (the matmul's reshapes become views there: the count must not
change). t = 1 runs in this process (no group: the plain model), t = 2 and 4 in ``launch``.
"""
import pytest

from course_lib.distributed import launch
from course_lib.distributed.tensor.parallel.accounting import (
    activation_bytes_per_layer,
    parameter_counts,
    tensor_parallel_memory,
)
from course_lib.examples.tensor_parallel_workers import measure_memory
from course_lib.models import GPTConfig
from course_lib.utils import activation_memory_per_layer

CASES = {
    "default": (dict(), 8, 64),
    "no bias": (dict(vocab_size=100, block_size=24, n_layer=3, n_head=8, n_embd=64,
                     bias=False), 3, 20),
    "one head per rank": (dict(vocab_size=20, block_size=8, n_layer=1, n_head=4, n_embd=16),
                          1, 1),
}
WORLDS = (1, 2, 4)
MEASURED = ("parameters", "gradients", "optimizer", "activations")


@pytest.fixture(scope="module")
def measured():
    out = {}
    for name, (config, batch, seq) in CASES.items():
        out[name, 1] = [measure_memory(config, batch, seq)]
        for world in WORLDS[1:]:
            out[name, world] = launch(measure_memory, world, config, batch, seq, timeout=120)
    return out


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t", WORLDS)
def test_measured_equals_formula(measured, name, t):
    config, batch, seq = CASES[name]
    formula = tensor_parallel_memory(GPTConfig(**config), t, batch, seq)
    rows = measured[name, t]
    assert [r["rank"] for r in rows] == list(range(t))
    for row in rows:
        assert row["world_size"] == t
        assert {k: row[k] for k in MEASURED} == {k: formula[k] for k in MEASURED}, (name, row)
        assert row["param_count"] == formula["params_per_rank"]


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_part_divides_by_t(name):
    config = GPTConfig(**CASES[name][0])
    one = parameter_counts(config, 1)
    assert one["total"] == one["sharded"] + one["replicated"] == one["per_rank"]
    for t in WORLDS:
        counts = parameter_counts(config, t)
        assert counts["sharded"] == one["sharded"] and counts["replicated"] == one["replicated"]
        assert counts["sharded_per_rank"] * t == one["sharded"]
        assert counts["per_rank"] == one["sharded"] // t + one["replicated"]


def test_parameter_count_by_hand():
    """The default model, V = 264, C = 96, block 64, 2 layers, with biases."""
    V, C, P, L = 264, 96, 64, 2
    sharded = 2 * V * C + L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C)
    replicated = P * C + L * (4 * C + 2 * C) + 2 * C
    counts = parameter_counts(GPTConfig(), 4)
    assert (counts["sharded"], counts["replicated"]) == (sharded, replicated)
    assert counts["tensors"] == 2 + L * 12 + 3
    memory = tensor_parallel_memory(GPTConfig(), 4, 8, 64)
    assert memory["parameters"] == memory["gradients"] == 4 * (sharded // 4 + replicated)
    assert memory["optimizer"] == 2 * memory["parameters"] + 4 * counts["tensors"]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t", WORLDS)
def test_layer_activations_beside_the_paper(name, t):
    """Our per-layer bytes = the paper's sbh(10 + 24/t + 5as/(ht)) without its dropout terms
    (masks 2sbh, softmax dropout 3as^2b/t), at 4 bytes an element instead of 2, plus what the
    paper leaves out: the LayerNorm statistics (4sb elements) and the causal mask (s^2 bytes)."""
    config, b, s = CASES[name]
    config = GPTConfig(**config)
    h, a, e = config.n_embd, config.n_head, 4
    ours = activation_bytes_per_layer(config, t, b, s)
    paper = activation_memory_per_layer(s, b, h, a, t=t)
    without_dropout = (paper - 2 * s * b * h - 3 * a * s * s * b / t) * e / 2
    assert ours["total"] == pytest.approx(without_dropout + 4 * s * b * e + s * s, rel=1e-12)
    assert ours["whole"] == e * (4 * s * b * h + 4 * s * b) + s * s        # Korthikanti's 10sbh
    assert ours["split"] * t == e * (12 * s * b * h + a * s * s * b)        # their 24/t, 5as/(ht)
    memory = tensor_parallel_memory(config, t, b, s)
    assert memory["paper_activations_per_layer"] == paper
    assert memory["activations_layers"] == config.n_layer * ours["total"]
    assert memory["activations"] == sum(memory[f"activations_{part}"] for part in
                                        ("embedding", "layers", "head", "loss"))


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match=r"n_head = 12 is not divisible .* world size 5"):
        tensor_parallel_memory(GPTConfig(), 5, 2, 8)
    with pytest.raises(ValueError, match=r"vocab_size = 100 is not divisible .* world size 8"):
        tensor_parallel_memory(GPTConfig(vocab_size=100, n_head=8, n_embd=64), 8, 2, 8)
    with pytest.raises(ValueError, match="t must be a positive integer"):
        tensor_parallel_memory(GPTConfig(), 0, 2, 8)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        tensor_parallel_memory(GPTConfig(), 2, 2, 65)
    with pytest.raises(ValueError, match="optimizer_states"):
        tensor_parallel_memory(GPTConfig(), 2, 2, 8, optimizer_states=-1)
    with pytest.raises(TypeError, match="GPTConfig"):
        tensor_parallel_memory(dict(n_head=12), 2, 2, 8)
