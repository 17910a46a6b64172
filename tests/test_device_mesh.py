"""course_lib.distributed.device_mesh against torch's, and the GPT trained on a mesh.

The mesh: for shapes (4,), (2, 2), (2, 3), (3, 2) and (2, 2, 2) every dimension's group
(global ranks, ``dist.get_process_group_ranks``), the coordinate, the local ranks and the
sub-mesh rows must equal those of torch's ``init_device_mesh`` on gloo; wrong shapes and names
raise clear errors.

The combination (``course_lib.examples.mesh_workers``): the small GPT on a ("dp", "tp") = (2, 2)
mesh and on a ("pp", "dp", "tp") = (2, 2, 2) mesh must equal one process on the whole batch,
loss and every parameter after each step (float64 to rounding; float32, 2 x 2, to the stated
tolerance), and so must torch's ``fully_shard`` + ``parallelize_module`` on torch's mesh. The
collectives of one step, grouped by the mesh dimension whose group ran them, must be those the
cost model counts. One launch per world size (4, 6, 8 processes).
"""
import pytest

from course_lib.bench.cost_model import tensor_parallel_comm_bytes
from course_lib.distributed import launch
from course_lib.distributed.device_mesh import init_device_mesh
from course_lib.examples import mesh_workers as W

CONFIG = dict(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
B, T, STEPS = 4, 8, 3
F64 = 1e-12          # float64: rounding
F32_LOSS = 1e-5      # float32: relative loss difference
F32_PARAM = 1e-4     # float32: parameters after a few AdamW steps (lr 3e-3)


def _errors() -> list[str]:
    """The message of each misuse (every rank runs them; none reaches new_group)."""
    messages = []
    for call in (lambda: init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp")),
                 lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp",)),
                 lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp"))):
        try:
            call()
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for call in (lambda: mesh["pp"], lambda: mesh.get_group("pp"), lambda: mesh.size("pp")):
        try:
            call()
            messages.append("no error")
        except KeyError as e:
            messages.append(str(e))
    return messages


def _four():
    return dict(
        groups=W.mesh_groups((2, 2), ("dp", "tp")), line=W.mesh_groups((4,), ("dp",)),
        errors=_errors(),
        f64=W.train_on_mesh(CONFIG, (2, 2), ("dp", "tp"), B, T, STEPS, count=True),
        f32=W.train_on_mesh(CONFIG, (2, 2), ("dp", "tp"), B, T, STEPS, dtype="float32"),
        torch=W.train_torch_mesh(CONFIG, B, T, STEPS))


def _six():
    return [W.mesh_groups((2, 3), ("dp", "tp")), W.mesh_groups((3, 2), ("dp", "tp"))]


def _eight():
    return dict(groups=W.mesh_groups((2, 2, 2), ("pp", "dp", "tp")),
                run=W.train_on_mesh(CONFIG, (2, 2, 2), ("pp", "dp", "tp"), B, T, 2,
                                    count=True))


@pytest.fixture(scope="module")
def four():
    return launch(_four, 4, timeout=300)


@pytest.fixture(scope="module")
def eight():
    return launch(_eight, 8, timeout=300)


def _same_as_torch(per_rank):
    for rank, r in enumerate(per_rank):
        assert r["ours"] == r["torch"], f"rank {rank}: ours {r['ours']} torch {r['torch']}"


def test_not_initialised():
    with pytest.raises(RuntimeError, match="init_process_group"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_groups_2x2(four):
    _same_as_torch([r["groups"] for r in four])
    # tensor parallelism innermost: the rows {0, 1}, {2, 3}; data parallelism the columns
    assert [r["groups"]["ours"]["groups"] for r in four] == [
        {"dp": [0, 2], "tp": [0, 1]}, {"dp": [1, 3], "tp": [0, 1]},
        {"dp": [0, 2], "tp": [2, 3]}, {"dp": [1, 3], "tp": [2, 3]}]
    assert [r["groups"]["ours"]["coordinate"] for r in four] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_groups_1d(four):
    _same_as_torch([r["line"] for r in four])          # the whole world: the default group
    assert [r["line"]["ours"]["groups"]["dp"] for r in four] == [[0, 1, 2, 3]] * 4


@pytest.mark.slow
def test_groups_2x3_3x2():
    for shape, per_rank in zip(((2, 3), (3, 2)), zip(*launch(_six, 6, timeout=300))):
        _same_as_torch(per_rank)
        for rank, r in enumerate(per_rank):
            row, col = divmod(rank, shape[1])              # row-major: tp the last dimension
            assert r["ours"]["coordinate"] == (row, col)
            assert r["ours"]["groups"]["tp"] == [row * shape[1] + c for c in range(shape[1])]
            assert r["ours"]["groups"]["dp"] == [d * shape[1] + col for d in range(shape[0])]


@pytest.mark.slow
def test_groups_2x2x2(eight):
    _same_as_torch([r["groups"] for r in eight])
    assert eight[5]["groups"]["ours"]["groups"] == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}


def test_errors(four):
    wrong_shape, wrong_count, same_names, *unknown = four[0]["errors"]
    assert "holds 6 ranks but the world has 4" in wrong_shape
    assert "2 dimensions" in wrong_count and "1 names" in wrong_count
    assert "must differ" in same_names
    assert all("no dimension 'pp'" in m and "('dp', 'tp')" in m for m in unknown), unknown


def _assert_equal_to_one_process(per_rank, loss_tol, param_tol):
    for rank, r in enumerate(per_rank):
        for step, pair in enumerate(r["losses"]):
            if pair is not None:
                mesh, one = pair
                assert abs(mesh - one) <= loss_tol * abs(one), (rank, step, mesh, one)
        assert max(r["params"]) <= param_tol, (rank, r["params"])


def test_2x2_equals_one_process(four):
    _assert_equal_to_one_process([r["f64"] for r in four], F64, F64)
    _assert_equal_to_one_process([r["f32"] for r in four], F32_LOSS, F32_PARAM)
    # the float32 run is not float64's to rounding: the tolerance above is needed
    assert max(max(r["f32"]["params"]) for r in four) > F64


def test_2x2_torch_fully_shard_parallelize_module(four):
    results = [r["torch"] for r in four]
    assert "error" not in results[0], results[0]["error"]
    _assert_equal_to_one_process(results, F64, F64)
    assert results[0]["param_type"] == "DTensor"
    ours = [mesh for mesh, _ in four[0]["f64"]["losses"]]
    assert ours == pytest.approx([mesh for mesh, _ in results[0]["losses"]], rel=F64)


def test_2x2x2_pipeline_equals_one_process(eight):
    runs = [r["run"] for r in eight]
    _assert_equal_to_one_process(runs, F64, F64)
    last = [r for r in runs if r["coordinate"][0] == 1]
    assert all(len(r["losses"]) == 2 and None not in r["losses"] for r in last)


def _tp_bytes(counts):
    calls, nbytes = counts["tp"]["all_reduce"]
    return nbytes * 2 * (2 - 1) / 2                      # a ring over t = 2 ranks


def test_communication_per_dimension(four, eight):
    b, (L, C), t, d = B // 2, (CONFIG["n_layer"], CONFIG["n_embd"]), 2, 2
    model = tensor_parallel_comm_bytes(b, T, C, L, t, bytes_per_element=8,
                                       embedding_and_loss=True)
    assert model != tensor_parallel_comm_bytes(b, T, C, L, t, bytes_per_element=8)
    for r in (r["f64"] for r in four):                   # 2 x 2: dp and tp
        counts = r["counts"]
        assert set(counts) == {"dp", "tp"}, counts
        assert counts["tp"]["all_reduce"][0] == 4 * L + 2 + 3       # layers, wte, head, loss
        assert _tp_bytes(counts) == model
        assert counts["dp"]["all_reduce"][1] == r["param_bytes"]    # every gradient once
    runs = [r["run"] for r in eight]                     # 2 x 2 x 2: the stages share the tp
    first, last = runs[0], runs[-1]                      # traffic, dp is each stage's own
    assert first["coordinate"] == (0, 0, 0) and last["coordinate"] == (1, 1, 1)
    assert _tp_bytes(first["counts"]) + _tp_bytes(last["counts"]) == model
    for r in (first, last):
        assert r["counts"]["dp"]["all_reduce"][1] == r["param_bytes"]
    activations = b * T * C * 8                          # (B/d, T, C) float64, over 2 micro-batches
    header = 10 * 8                                      # the shape header, once a step
    assert first["counts"]["pp"]["isend"][1] == activations + header
    assert first["counts"]["pp"]["irecv"][1] == activations           # the gradients back
    assert last["counts"]["pp"]["isend"][1] == activations
    assert d * t * 2 == len(runs)
