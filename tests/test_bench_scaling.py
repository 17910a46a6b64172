"""The benchmarks of lesson 09 and the alpha-beta model: the fit recovers known alpha and beta,
the textbook formulas hold at p = 1 and 2, and each benchmark's --quick mode prints valid JSON
with the hardware, torch version, date and command (tiny runs: a few seconds each)."""
import json
import math
import re
from pathlib import Path

import pytest

from course_lib.bench import collectives, cost_model, scaling

KB, MB = 2**10, 2**20
SIZES = [4 * KB * 4**i for i in range(8)]  # 4 KB .. 64 MB


@pytest.mark.parametrize("p", [2, 4, 8])
def test_fit_recovers_alpha_and_beta(p):
    alpha, beta = 250e-6, 1 / 1.3e9
    times = [cost_model.ring_time(n, p, alpha, beta) for n in SIZES]
    fit = cost_model.fit_ring(SIZES, times, p)
    assert math.isclose(fit.alpha, alpha, rel_tol=1e-9)
    assert math.isclose(fit.beta, beta, rel_tol=1e-9)
    assert fit.r2 > 0.999999 and fit.max_rel_error < 1e-9


def test_fit_weighs_small_messages():
    """With 5 % noise the relative fit still finds alpha (the small messages are not drowned)."""
    alpha, beta = 1e-3, 1e-9
    noise = [1.05, 0.95, 1.03, 0.97, 1.02, 0.98, 1.04, 0.96]
    times = [cost_model.ring_time(n, 2, alpha, beta) * e for n, e in zip(SIZES, noise)]
    fit = cost_model.fit_ring(SIZES, times, 2)
    assert abs(fit.alpha / alpha - 1) < 0.1 and abs(fit.beta / beta - 1) < 0.1
    assert fit.max_rel_error < 0.1


def test_fit_refuses_bad_input():
    with pytest.raises(ValueError, match="p >= 2"):
        cost_model.fit_ring(SIZES, SIZES, 1)
    with pytest.raises(ValueError, match="distinct"):
        cost_model.fit_ring([4096, 4096], [1e-3, 1e-3], 2)


def test_formulas_at_one_and_two_ranks():
    n, a, b = 1e6, 1e-5, 1e-9
    for f in cost_model.ALGORITHMS.values():
        assert f(n, 1, a, b) == 0.0                        # one rank sends nothing
    assert cost_model.ring_time(n, 2, a, b) == pytest.approx(2 * a + n * b)
    assert cost_model.naive_time(n, 2, a, b) == pytest.approx(2 * (a + n * b))
    assert cost_model.tree_time(n, 2, a, b) == pytest.approx(2 * (a + n * b))
    assert cost_model.ps_time(n, 2, a, b) == pytest.approx(2 * (a + 2 * n * b))
    # large messages: the ring's bytes per rank stay ~2n, the others grow with p
    assert cost_model.ring_time(1e9, 8, a, b) < cost_model.tree_time(1e9, 8, a, b)
    assert cost_model.tree_time(1e9, 8, a, b) < cost_model.naive_time(1e9, 8, a, b)


def test_predicted_step_time():
    model = cost_model.AlphaBeta(alpha=1e-4, beta=1e-9, p=2)
    t = cost_model.predicted_step_time(0.05, [1e6, 1e6], 2, model)
    assert t == pytest.approx(0.05 + 2 * cost_model.ring_time(1e6, 2, 1e-4, 1e-9))
    assert cost_model.predicted_step_time(0.05, [1e6], 2, model, overlap=1.0) == 0.05
    with pytest.raises(ValueError, match="algorithm"):
        cost_model.predicted_step_time(0.05, [1e6], 2, model, algorithm="butterfly")


def test_projections_are_labelled():
    for ic in cost_model.INTERCONNECTS:
        m = ic.model()
        assert m.source.startswith("PROJECTION") and "assumed" in ic.source
        assert m.bandwidth == pytest.approx(ic.bandwidth)


def test_machine_slug():
    slug = scaling.machine_slug()
    assert slug.startswith(("cpu-", "gpu-")) and slug == slug.lower() and " " not in slug


REQUIRED = {"benchmark", "command", "hardware", "torch", "date", "machine", "results"}


def _run(main, argv, capsys):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_collectives_quick(capsys, tmp_path):
    out = tmp_path / "c.json"
    report = _run(collectives.main, ["--quick", "--sizes", "4K,64K", "--samples", "2",
                                     "--min-sample-ms", "2", "--out", str(out)], capsys)
    assert REQUIRED <= set(report) and report["command"].endswith(f"--out {out}")
    assert json.loads(out.read_text())["results"] == report["results"]
    ops = {(r["bytes"], r["op"]) for r in report["results"]}
    assert ops == {(n, op) for n in (4096, 65536) for op in collectives.OPS}
    for r in report["results"]:
        assert 0 < r["min_s"] <= r["median_s"] and r["reps"] >= 1 and r["busbw_GBps"] > 0


@pytest.mark.slow
def test_scaling_quick(capsys):
    report = _run(scaling.main, ["--quick", "--models", "lenet", "--workers", "2",
                                 "--out", "-"], capsys)
    assert REQUIRED - {"results"} <= set(report) and report["quick"] is True
    assert {"load", "taken_on_busy_machine"} <= set(report)
    assert report["workers"] == [1, 2]  # the one-worker launch, the baseline's, always runs
    run = report["models"]["lenet"]["by_workers"]["2"]
    nocomm = [f"{n}_nocomm" for n in scaling.DDP_IMPLS if n != "local"]
    # the baseline is timed once, at one worker: never again inside another launch
    assert set(run["step"]) == set(scaling.DDP_IMPLS + scaling.SINGLE_IMPLS + nocomm)
    assert scaling.BASELINE in report["models"]["lenet"]["by_workers"]["1"]["step"]
    assert all(s["median_s"] > 0 and s["loops"] >= 1 for s in run["step"].values())
    # one launch, every variant interleaved: the order rotates through all of them
    order = run["comparison"]["order"]
    assert len(set(order[:len(run["step"])])) == len(run["step"]) and order[0] != order[13]
    derived = report["models"]["lenet"]["derived"]
    lo, hi = derived["speedup_interval"]["bucketed"]["2"]
    assert lo <= derived["speedup"]["bucketed"]["2"] <= hi
    one = report["models"]["lenet"]["by_workers"]["1"]["step"][scaling.BASELINE]["median_s"]
    assert derived["baseline_s"] == one
    assert derived["speedup"]["bucketed"]["2"] == pytest.approx(one / run["step"]["bucketed"][
        "median_s"])
    assert {"exposed_s", "exposed_interval", "comm_s", "share", "overlap", "buckets"} <= set(
        derived["comm"]["bucketed"]["2"])
    assert derived["comm"]["bucketed"]["2"]["buckets"] == 2  # LeNet: two 0.1 MiB buckets
    assert report["models"]["lenet"]["gradient_bytes"] == 516_272  # LeNet's 129,068 floats


def test_overlap_reason():
    assert "one bucket" in scaling.overlap_reason(1, 1, "gloo")
    assert "one core" in scaling.overlap_reason(3, 1, "gloo")
    assert "too late" in scaling.overlap_reason(3, None, "nccl")


# ---- one baseline for every speed-up, printed beside it ----------------------------------------

def _samples(median, n=6):
    return [median * f for f in (0.98, 0.99, 1.0, 1.0, 1.01, 1.03)[:n]]


def _step(**medians):
    return {name: {"median_s": m, "q1_s": m, "q3_s": m, "min_s": m, "seconds": _samples(m)}
            for name, m in medians.items()}


def _fake_entry():
    """Controlled timings: at one worker the baseline takes 97.4 ms; the two-worker launch of an
    older file re-timed it at 112.3 ms (what results/scaling-*.json holds)."""
    ddp = dict(naive=0.0689, overlap=0.0611, bucketed=0.0552, torch=0.0560)
    one = _step(baseline=0.0974, plain=0.0974, local=0.0974, dp_scratch=0.0952,
                nn_dataparallel=0.0978, naive=0.101, overlap=0.1078, bucketed=0.1095,
                torch=0.1049)
    two = _step(baseline=0.1123, plain=0.0693, local=0.0512, dp_scratch=0.0596,
                nn_dataparallel=0.0684, **ddp)
    return {"global_batch": 256, "steps_per_epoch": 235, "threads_per_worker": 1,
            "param_bytes": [4] * 8, "bucket_bytes": [16, 16],
            "by_workers": {"1": {"step": one, "comm_alone": {}, "backend": "gloo"},
                           "2": {"step": two, "comm_alone": {}, "backend": "gloo"}}}


def test_every_speedup_divides_the_one_baseline():
    """Lesson 10 printed 2.03x for bucketed (a baseline re-timed at 112.3 ms inside the
    two-worker launch) beside a table whose baseline read 97.4 ms: 97.4 / 55.2 = 1.76x."""
    entry = _fake_entry()
    d = scaling.derive(entry)
    assert d["baseline_s"] == pytest.approx(0.0974)
    for impl, by_k in d["speedup"].items():
        for k, s in by_k.items():
            step = entry["by_workers"][k]["step"][impl]["median_s"]
            assert s == pytest.approx(0.0974 / step, rel=1e-12), (impl, k)
            lo, hi = d["speedup_interval"][impl][k]
            assert lo <= s <= hi
    assert d["speedup"]["bucketed"]["2"] == pytest.approx(1.764, abs=1e-3)
    assert d["speedup"]["local"]["2"] < 2  # no super-linear compute floor any more


def test_the_table_prints_the_baseline_beside_every_ratio():
    entry = _fake_entry()
    entry["derived"] = scaling.derive(entry)
    table = scaling.speedup_table({"models": {"lenet": entry}}, "lenet")
    assert "the one baseline 97.4 ms" in table
    cells = re.findall(r"([\d.]+) \[([\d.]+)/([\d.]+) = ([\d.]+)x \(([\d.]+)-([\d.]+)\)\]",
                       table)
    assert len(cells) == 2 * 8  # every implementation at 1 and 2 workers
    for step, base, step_again, ratio, lo, hi in cells:
        assert base == "97.4" and step == step_again
        assert float(ratio) == pytest.approx(float(base) / float(step), abs=0.006)
        assert float(lo) <= float(ratio) <= float(hi)


def test_the_stored_results_can_be_rederived_without_re_running():
    path = Path(__file__).resolve().parent.parent / "results" / "scaling-cpu-2core-epyc.json"
    if not path.is_file():
        pytest.skip(f"{path} is not stored")
    report = json.loads(path.read_text())
    again = scaling.rederive(report)
    lenet = again["models"]["lenet"]
    one = lenet["by_workers"]["1"]["step"]["baseline"]["median_s"]
    for impl in ("bucketed", "local", "torch"):
        step = lenet["by_workers"]["2"]["step"][impl]["median_s"]
        assert lenet["derived"]["speedup"][impl]["2"] == pytest.approx(one / step)
    assert again["goals"]["lenet_speedup_2_vs_1"]["bucketed"] == pytest.approx(one / lenet[
        "by_workers"]["2"]["step"]["bucketed"]["median_s"])
    assert report["models"]["lenet"]["by_workers"] == lenet["by_workers"]  # samples untouched
