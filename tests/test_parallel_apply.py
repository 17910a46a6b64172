"""The one thread-per-device runner: what each worker thread must be handed, and errors."""
import threading

import pytest
import torch
from torch import nn

from course_lib.models.lenet import LeNet
from course_lib.parallel import DataParallel, parallel_apply


def cpus(k: int) -> list[torch.device]:
    return [torch.device("cpu")] * k


def test_results_in_order_and_exceptions_name_the_replica():
    def boom(i):
        if i == 1:
            raise RuntimeError("device 1 failed")
        return i * i

    square = lambda i: i * i  # noqa: E731
    assert parallel_apply([square] * 3, [0, 1, 2], devices=cpus(3)) == [0, 1, 4]
    with pytest.raises(RuntimeError, match="device 1 failed") as info:
        parallel_apply([boom] * 3, [0, 1, 2], devices=cpus(3))
    assert any("replica 1" in note for note in info.value.__notes__)
    with pytest.raises(RuntimeError, match="device 1 failed"):
        parallel_apply([boom] * 3, [0, 1, 2], devices=cpus(3), threads=False)


def test_grad_mode_reaches_the_threads_and_the_callers_thread_cap_is_kept():
    before = torch.get_num_threads()
    with torch.no_grad():
        modes = parallel_apply([lambda _: torch.is_grad_enabled()] * 2, [0, 1], devices=cpus(2))
    assert modes == [False, False]
    assert torch.get_num_threads() == before


def test_cpu_workers_are_capped_and_the_cap_is_restored():
    torch.set_num_threads(2)
    try:
        caps = parallel_apply([lambda _: torch.get_num_threads()] * 2, [0, 1], devices=cpus(2))
        assert all(c >= 1 for c in caps)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


def test_without_threads_the_calls_run_in_the_callers_thread():
    names = parallel_apply([lambda _: threading.current_thread().name] * 2, [0, 1],
                           devices=cpus(2), threads=False)
    assert names == [threading.main_thread().name] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_autocast_reaches_the_replicas(dtype):
    """Autocast is per thread: DataParallel must carry it into its worker threads (as torch's
    parallel_apply does), so the output dtype is the same with 1 and with 3 devices."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    X = torch.rand(6, 1, 28, 28)
    dtypes = []
    for k in (1, 3):
        with torch.autocast("cpu", dtype=dtype):
            dtypes.append(DataParallel(net, cpus(k))(X).dtype)
    assert dtypes == [dtype, dtype]
    with torch.autocast("cpu", dtype=dtype):  # LeNet's convolutions too
        assert DataParallel(LeNet(), cpus(3))(X).dtype == dtype


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply([abs, abs], [1])
    with pytest.raises(ValueError, match="2 modules but 1 kwargs"):
        parallel_apply([abs, abs], [1, 2], [{}])
    with pytest.raises(ValueError, match="2 modules but 3 devices"):
        parallel_apply([abs, abs], [1, 2], devices=cpus(3))
