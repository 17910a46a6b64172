import os
import subprocess
import sys
import warnings

import pytest
import torch

from course_lib import devices as D


def test_cpu_fallbacks(no_gpus):
    cpu = torch.device("cpu")
    assert D.num_gpus() == 0
    assert D.try_gpu() == cpu
    assert D.try_gpu(3) == cpu
    assert D.try_all_gpus() == [cpu]  # d2l 1.0.3 returns [] here; we never do


@pytest.mark.parametrize("n", [1, 2, 5])
def test_devices_repeats_the_cpu_with_a_warning_when_asked(no_gpus, n):
    with pytest.warns(UserWarning, match="correctness, not speed"):
        devs = D.devices(n, warn=True)
    assert devs == [torch.device("cpu")] * n


def test_devices_is_silent_by_default(no_gpus):
    """No "course_lib/devices.py:NN: UserWarning" line in the lessons' outputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert D.devices(4) == [torch.device("cpu")] * 4


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_devices_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="integer n >= 1"):
        D.devices(bad)


def test_try_gpu_rejects_negative():
    with pytest.raises(ValueError, match=">= 0"):
        D.try_gpu(-1)


@pytest.mark.slow
def test_hidden_gpus_in_a_real_process():
    """With CUDA_VISIBLE_DEVICES empty, a fresh interpreter sees only the CPU."""
    code = ("from course_lib import devices as D; import torch;"
            "assert D.try_all_gpus() == [torch.device('cpu')];"
            "D.synchronize(); D.synchronize('cpu'); print(D.hardware_summary())")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "GPUs:    0" in out and "torch:" in out and "cores" in out


def test_hardware_summary_names_everything():
    s = D.hardware_summary()
    for word in ("CPU:", "GPUs:", "torch:", "python:"):
        assert word in s
