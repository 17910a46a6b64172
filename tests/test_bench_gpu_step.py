"""Lesson 01's GPU step benchmark: its pieces on the CPU, its refusal without a GPU, its stored
run complete and saying what lesson 01 reads from it."""
import json
from pathlib import Path

import pytest
import torch

from course_lib.bench import gpu_step

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_union_of_intervals_counts_overlaps_once():
    assert gpu_step._union_us([]) == 0
    assert gpu_step._union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert gpu_step._union_us([(4, 6), (0, 10)]) == 10     # one inside another, any order


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refused_without_a_gpu(capsys):
    assert gpu_step.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_timing_and_trace_on_the_cpu():
    cpu = torch.device("cpu")
    times = gpu_step.time_by_batch_size(cpu, (8, 32), samples=3, min_sample_s=0.0,
                                        baseline=32)
    assert times["batches"] == [8, 32] and times["ratio_to_baseline"][32] == [1.0, 1.0, 1.0]
    assert all(times["min_s"][b] <= times["median_s"][b] for b in (8, 32))
    with pytest.raises(ValueError, match="baseline batch 256"):
        gpu_step.time_by_batch_size(cpu, (8, 32), samples=3)
    trace = gpu_step.profile_step(cpu, 8, steps=2)
    assert trace["kernels_per_step"] == 0 and trace["gpu_busy_s_per_step"] == 0   # no GPU
    assert trace["ops_per_step"] > 20 and trace["profiled_wall_s_per_step"] > 0


def test_stored_run_is_complete():
    """Lesson 01 prints the stored run and asserts what its prose says."""
    paths = sorted(RESULTS.glob("gpu-step-*.json"))
    assert paths, "results/gpu-step-*.json is missing: run `python -m course_lib.bench gpu-step`"
    r = json.loads(paths[0].read_text())
    t, trace = r["time_by_batch_size"], r["trace"]
    assert r["device"].startswith("cuda") and not r["quick"] and not r["taken_on_busy_machine"]
    assert [int(b) for b in t["median_s"]] == list(gpu_step.BATCHES)
    assert len(t["comparison"]["variants"]["batch 256"]["seconds"]) >= 10
    assert trace["batch_size"] == 256 and trace["kernels_per_step"] > 50
    assert 0 < trace["gpu_busy_s_per_step"] < t["median_s"]["256"]
    assert abs(r["gpu_busy_share"] - trace["gpu_busy_s_per_step"] / t["median_s"]["256"]) < 1e-12
