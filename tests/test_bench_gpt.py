"""Lesson 14's benchmarks (``course_lib.bench.gpt``) at tiny sizes: the one-process baseline
trains (its loss falls, deterministically with the seed) and reports its speed; tensor against
data parallel at 2 ranks computes the same first loss, sends what Megatron's formula and the
gradients' size say, and its CLI writes the JSON it prints. Nothing here asserts a speed."""
import json

import pytest
import torch

from course_lib.bench import main as bench_main
from course_lib.bench.gpt import baseline, parse_config, split_tokens, tp_vs_dp
from course_lib.models.gpt import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=4, n_embd=16, block_size=16)   # splits over 2 ranks: 4 heads, 264
TINY_ARG = ",".join(f"{k}={v}" for k, v in TINY.items())
B, T = 4, 8
MAX_BYTES = 100_000
PROVENANCE = {"benchmark", "command", "machine", "hardware", "torch", "date", "quick",
              "load_average_start", "load_average_end", "load", "taken_on_busy_machine",
              "method", "wall_s"}


@pytest.fixture(autouse=True)
def no_quiet_wait(monkeypatch):
    """A test checks the report; it does not wait for a quiet machine (stamped busy if not)."""
    monkeypatch.setenv("COURSE_QUIET_WAIT_S", "0")


def _baseline(**kw):
    args = dict(config=GPTConfig(**TINY), lr=1e-2, seed=0, threads=1, warmup=2,
                eval_batches=2, max_bytes=MAX_BYTES)
    return baseline(40, 8, 16, **{**args, **kw})


def test_baseline_loss_falls_deterministically():
    """40 steps at lr 1e-2 take the loss from ln(264) ~ 5.6 well down; the same seed gives the
    same losses bit for bit; the tokens per second are positive and their spread holds them."""
    run = _baseline()
    losses = run["losses"]
    assert len(losses) == 40 and all(isinstance(x, float) for x in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    assert run["val_loss"] < run["val_loss_start"]
    assert 0 < run["tokens_per_s_min"] <= run["tokens_per_s"] <= run["tokens_per_s_max"]
    assert run["tokens_per_step"] == 8 * 16
    assert len(run["step_seconds"]) == 40 and run["warmup_steps"] == 2
    assert run["config"] == {**GPTConfig().__dict__, **TINY}
    assert run["data"]["val_tokens"] == MAX_BYTES - int(MAX_BYTES * 0.9)
    assert _baseline()["losses"] == losses                  # deterministic with the seed
    assert _baseline(seed=1)["losses"] != losses


def test_baseline_refuses_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        baseline(5, 2, 32, config=GPTConfig(**TINY))
    with pytest.raises(ValueError, match="warmup"):
        baseline(3, 2, 8, config=GPTConfig(**TINY), warmup=3)


def test_split_and_config_parsing():
    train, val = split_tokens(torch.arange(100))
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    assert parse_config("n_layer=1, n_embd=48,bias=false") == GPTConfig(n_layer=1, n_embd=48,
                                                                        bias=False)
    assert parse_config(None) == GPTConfig()
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_config("layers=3")


def test_tp_vs_dp_refuses_uneven_splits():
    with pytest.raises(ValueError, match="batch_size"):
        tp_vs_dp(2, 3, T, samples=2, steps_per_sample=1, config=GPTConfig(**TINY))
    with pytest.raises(ValueError, match="n_head"):
        tp_vs_dp(2, B, T, samples=2, steps_per_sample=1,
                 config=GPTConfig(**{**TINY, "n_head": 1}))
    with pytest.raises(ValueError, match="samples"):
        tp_vs_dp(2, B, T, samples=1, steps_per_sample=1, config=GPTConfig(**TINY))


@pytest.fixture(scope="module")
def tp_report(tmp_path_factory):
    """One launch, through the command line: ``tp-vs-dp`` at 2 ranks, tiny sizes."""
    out = tmp_path_factory.mktemp("tp") / "tp-vs-dp.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COURSE_QUIET_WAIT_S", "0")
        argv = ["tp-vs-dp", "--world-size", "2", "--batch", str(B), "--seq-len", str(T),
                "--samples", "3", "--steps-per-sample", "2", "--config", TINY_ARG,
                "--max-bytes", str(MAX_BYTES), "--timeout", "120", "--out", str(out)]
        assert bench_main(argv) == 0
    return json.loads(out.read_text())


def test_tp_vs_dp_report(tp_report):
    r = tp_report
    assert PROVENANCE <= set(r), PROVENANCE - set(r)
    assert r["benchmark"] == "tp-vs-dp" and r["world_size"] == 2
    assert r["global_batch"] == B and r["dp_batch_per_rank"] == B // 2
    names = {"tensor_parallel", "data_parallel", "tensor_parallel_compute"}
    assert set(r["seconds_per_step"]) == names
    assert all(len(s) == 3 and min(s) > 0 for s in r["seconds_per_step"].values())
    order = r["order"]                     # interleaved, the first variant changing each round
    rounds = [order[i:i + 3] for i in range(0, len(order), 3)]
    assert len(rounds) == 3 and all(set(one) == names for one in rounds)
    assert len({one[0] for one in rounds}) == 3
    for key in ("compute_over_dp", "tp_over_compute"):   # the split of the step, with intervals
        ratio, low, high = r["split"][key]
        assert 0 < low <= ratio <= high
    low, high = r["ratio_interval"]
    assert 0 < low <= r["ratio_tp_over_dp"] <= high
    if low <= 1 <= high:
        assert r["winner"] is None and "no difference" in r["verdict"]
    else:
        assert r["winner"] in names - {"tensor_parallel_compute"}
        assert "faster" in r["verdict"] or "slower" in r["verdict"]


def test_tp_vs_dp_equal_work(tp_report):
    """The same model, the same global batch: the same loss on the first step (float32)."""
    first = tp_report["first_step_loss"]
    assert first["equal"]
    assert first["tensor_parallel"] == pytest.approx(first["data_parallel"], rel=1e-5)


def test_tp_vs_dp_all_reduces(tp_report):
    """TP: Megatron's count (per block 2 forward and 2 backward of B*T*C, the embedding's
    forward, the head's backward, the loss's 3 of B*T); DP: the gradients' bytes, once."""
    counts = tp_report["all_reduces_per_step"]
    L, C = TINY["n_layer"], TINY["n_embd"]
    want = ([("forward", B * T * C)] * (2 * L + 1) + [("forward", B * T)] * 3
            + [("backward", B * T * C)] * (2 * L + 1))
    tp = counts["tensor_parallel"]
    assert sorted((p, n) for p, n, _ in tp["calls"]) == sorted(want)
    assert tp["bytes"] == 4 * sum(n for _, n in want) and tp["other_collectives"] == []
    assert tp_report["megatron_formula"]["matches"]
    dp = counts["data_parallel"]
    params = sum(p.numel() for p in GPT(GPTConfig(**TINY)).parameters())
    assert dp["bytes"] == 4 * params == tp_report["dp_gradient_bytes"]["param_bytes"]
    assert all(p == "backward" for p, _, _ in dp["calls"]) and dp["other_collectives"] == []


def test_baseline_cli_writes_its_json(tmp_path, capsys):
    out = tmp_path / "gpt-baseline.json"
    argv = ["gpt-baseline", "--steps", "6", "--warmup", "1", "--batch", "2", "--seq-len", "8",
            "--eval-batches", "1", "--threads", "1", "--config", TINY_ARG,
            "--max-bytes", str(MAX_BYTES), "--out", str(out)]
    assert bench_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report
    assert PROVENANCE <= set(report), PROVENANCE - set(report)
    assert report["benchmark"] == "gpt-baseline" and len(report["losses"]) == 6
    assert report["tokens_per_s"] > 0
