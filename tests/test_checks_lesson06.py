"""The checker of lesson 06's canonical-worker exercise: accepts the reference, rejects the
usual mistakes, never raises, never hangs."""
import os
import time

import torch
import torch.distributed as dist

from course_lib.checks import check_spawn_worker

HERE = os.path.dirname(os.path.abspath(__file__))


def forgets_to_destroy(rank, world_size, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    return x.item()


def returns_its_own_value(rank, world_size, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    x = torch.tensor([rank + 1.0])
    dist.destroy_process_group()
    return x.item()


def rank_1_never_joins_the_all_reduce(rank, world_size, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    x = torch.tensor([rank + 1.0])
    if rank == 0:
        dist.all_reduce(x)  # rank 1 never comes: rank 0 waits
    else:
        time.sleep(600)
    dist.destroy_process_group()
    return x.item()


def test_the_reference_passes(capsys):
    from solutions.lesson06 import worker

    assert check_spawn_worker(worker)
    assert "correct" in capsys.readouterr().out


def test_usual_mistakes_are_named(capsys):
    assert not check_spawn_worker(forgets_to_destroy, world_sizes=(2,))
    assert "destroy_process_group" in capsys.readouterr().out
    assert not check_spawn_worker(returns_its_own_value, world_sizes=(2,))
    assert "expected 3 (1 + ... + 2), received 1.0" in capsys.readouterr().out


def test_a_hang_is_reported_in_bounded_time(capsys):
    start = time.monotonic()
    assert not check_spawn_worker(rank_1_never_joins_the_all_reduce, world_sizes=(2,), timeout=4)
    assert time.monotonic() - start < 30
    assert "no result within 4 s" in capsys.readouterr().out


def test_not_answered_and_notebook_functions(capsys):
    assert check_spawn_worker(None).ok is None
    assert not check_spawn_worker(lambda r, w, i: 0.0)
    assert "%%writefile my_worker.py" in capsys.readouterr().out
