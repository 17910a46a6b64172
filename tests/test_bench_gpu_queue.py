"""Lesson 00's GPU timing benchmark: refused without a GPU, honest with one, its stored run
readable on machines without one."""
import statistics
from pathlib import Path

import pytest
import torch

from course_lib.bench import gpu_queue

RESULTS = Path(__file__).resolve().parents[1] / "results"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refused_without_a_gpu(capsys):
    assert gpu_queue.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="CUDA stream"):
        gpu_queue.time_three_ways(torch.device("cpu"), 8, 3)


def test_stored_run_is_complete():
    """Lesson 00 prints the newest stored run on a CPU and asserts what it shows."""
    runs = gpu_queue.stored_runs(RESULTS)
    assert runs, "results/gpu-queue-*.json is missing: run `python -m course_lib.bench gpu-queue`"
    r = runs[0]
    assert set(r["seconds"]) == set(gpu_queue.WAYS)
    assert {len(xs) for xs in r["seconds"].values()} == {r["runs"]}
    med = {way: statistics.median(xs) for way, xs in r["seconds"].items()}
    assert med["clock read at once"] < med["after synchronize"] / 5
    assert 0.8 < med["CUDA events"] / med["after synchronize"] < 1.25
    assert not r["quick"] and "gpu" in r["machine"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_three_ways_on_a_gpu():
    times = gpu_queue.time_three_ways(torch.device("cuda"), 2048, runs=5)
    med = {way: statistics.median(xs) for way, xs in times.items()}
    assert med["clock read at once"] < med["after synchronize"] / 5
    assert 0.8 < med["CUDA events"] / med["after synchronize"] < 1.25
