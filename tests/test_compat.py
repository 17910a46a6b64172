"""course_lib.distributed.compat: the flat-tensor collectives under either of torch's names.

torch 2.14 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a FutureWarning
naming ``all_gather_single`` / ``reduce_scatter_single``); older releases have only the old names.
The helper must give torch's own results under every name this torch has, with no warning, on
the native path and on the fallback, at 2 and 3 ranks; and a rank whose call fails must end the
job with its error, never take a path of its own that leaves the ranks' collectives unmatched.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from course_lib.distributed import WorkerError, compat, launch
from course_lib.distributed.fsdp import FullyShardedDataParallel as FSDP


def _expected(world: int, n: int):
    """Every rank's input can be made by every rank: the oracle is plain arithmetic."""
    inputs = [torch.arange(world * n, dtype=torch.float64) * (r + 1) + r for r in range(world)]
    shards = [torch.arange(n, dtype=torch.float64) + 10 * r for r in range(world)]
    return inputs, shards, torch.cat(shards), sum(inputs)


def _every_name(_unused=None) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    n = 5
    inputs, shards, gathered, total = _expected(world, n)
    mine = total[rank * n:(rank + 1) * n]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for native in (True, False):
            compat_has_native = compat.has_native
            if not native:   # force the fallback built from collectives every backend has
                compat.has_native = lambda *a, **k: False
            try:
                full = torch.empty(world * n, dtype=torch.float64)
                compat.all_gather_into_tensor(full, shards[rank])
                if not torch.equal(full, gathered):
                    problems.append(f"all_gather_into_tensor native={native}: {full.tolist()}")
                out = torch.empty(n, dtype=torch.float64)
                compat.reduce_scatter_tensor(out, inputs[rank].clone())
                if not torch.equal(out, mine):
                    problems.append(f"reduce_scatter_tensor native={native}: {out.tolist()}")
            finally:
                compat.has_native = compat_has_native
    problems += [f"warning from the helper: {w.category.__name__}: {w.message}" for w in caught]
    # torch's own functions under every name this torch has: the helper equals each of them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the old names warn on torch >= 2.14: that is the point
        for name in compat.FLAT_COLLECTIVE_NAMES:
            fn = getattr(dist, name)
            if name.startswith("all_gather"):
                full = torch.empty(world * n, dtype=torch.float64)
                fn(full, shards[rank])
                if not torch.equal(full, gathered):
                    problems.append(f"dist.{name} differs from the helper: {full.tolist()}")
            else:
                out = torch.empty(n, dtype=torch.float64)
                fn(out, inputs[rank].clone())
                if not torch.equal(out, mine):
                    problems.append(f"dist.{name} differs from the helper: {out.tolist()}")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_the_helper_equals_torch_under_every_name_without_a_warning(world):
    assert launch(_every_name, world, timeout=120) == [[]] * world


def test_the_names_this_torch_has():
    names = compat.FLAT_COLLECTIVE_NAMES
    assert "all_gather_into_tensor" in names and "reduce_scatter_tensor" in names
    assert ("all_gather_single" in names) == hasattr(dist, "all_gather_single")
    with pytest.raises(ValueError, match="all_gather_into_tensor"):
        compat.has_native("all_gather")


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _reduce_scatter_fails_on_last_rank(_unused=None):
    """The last rank's reduce-scatter raises as a backend lacking it would ("not supported").
    Before the fix, that rank alone switched to an all-reduce for good while the others went on
    reduce-scattering: unmatched collectives. Now the error ends the job, on every rank alike."""
    torch.manual_seed(0)
    model = FSDP(_Two().double())
    if dist.get_rank() == dist.get_world_size() - 1:
        def refuse(*args, **kwargs):
            raise RuntimeError("reduce_scatter is not supported by this backend")
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            if hasattr(dist, name):
                setattr(dist, name, refuse)
        compat._REDUCE_SCATTER = refuse
    for _ in range(2):
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    return [p.grad.tolist() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
def test_a_collective_failing_on_one_rank_is_an_error_not_a_path_of_its_own(world):
    with pytest.raises(WorkerError, match="not supported by this backend"):
        launch(_reduce_scatter_fails_on_last_rank, world, timeout=60)
