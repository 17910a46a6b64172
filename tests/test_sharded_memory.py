"""Memory per rank (course_lib.distributed.memory) against hand counts, and the course's FSDP
against torch's own ``fully_shard`` (course_lib.examples.sharded_workers).

The model: Linear(8, 16), Tanh, Linear(16, 4): tensors of 128, 16, 64 and 4 elements, 212 in
all, float32 with AdamW (two moments of 4 bytes per element, plus a 4-byte ``step`` per tensor).
"""
import pytest
import torch

from course_lib.distributed import launch
from course_lib.distributed.memory import (
    PeakMemory,
    grad_bytes,
    optimizer_state_bytes,
    tensor_bytes,
    zero_formula,
)
from course_lib.examples import sharded_workers as W

WIDTHS = [8, 16, 4]
PSI = 212


def adam(elements: int, tensors: int) -> int:
    """AdamW's state in bytes: exp_avg and exp_avg_sq (4 bytes each) and one step per tensor."""
    return 8 * elements + 4 * tensors


# rank -> (params, grads, optimizer) bytes, counted by hand
HAND = {
    ("DDP", 1): {0: (4 * PSI, 4 * PSI, adam(PSI, 4))},
    ("DDP", 4): {r: (4 * PSI, 4 * PSI, adam(PSI, 4)) for r in range(4)},
    # ZeRO-1, largest first to the lightest rank: 2 ranks {128} | {64, 16, 4}
    ("ZeRO-1", 2): {0: (4 * PSI, 4 * PSI, adam(128, 1)), 1: (4 * PSI, 4 * PSI, adam(84, 3))},
    # 4 ranks: {128} | {64} | {16} | {4}
    ("ZeRO-1", 4): {0: (4 * PSI, 4 * PSI, adam(128, 1)), 1: (4 * PSI, 4 * PSI, adam(64, 1)),
                    2: (4 * PSI, 4 * PSI, adam(16, 1)), 3: (4 * PSI, 4 * PSI, adam(4, 1))},
    # FSDP: each Linear one flat vector (144 and 68 elements) padded and split
    ("FSDP", 1): {0: (4 * PSI, 4 * PSI, adam(PSI, 2))},
    ("FSDP", 2): {r: (4 * 106, 4 * 106, adam(106, 2)) for r in range(2)},     # 72 + 34
    ("FSDP", 4): {r: (4 * 53, 4 * 53, adam(53, 2)) for r in range(4)},        # 36 + 17
}


@pytest.fixture(scope="module")
def measured():
    out = {}
    for world in (1, 2, 4):
        # gloo at every size: on a machine with one GPU, one rank alone would take NCCL and
        # the GPU (whose allocator rounds blocks), two and four the CPU
        for rank, rows in enumerate(launch(W.memory_per_rank, world, WIDTHS, 8,
                                           (*W.KINDS, "DDP-view"), backend="gloo",
                                           timeout=180)):
            for row in rows:
                out[row["kind"], world, rank] = row
    return out


@pytest.mark.parametrize("kind, world", list(HAND))
def test_bytes_per_rank_match_hand_counts(measured, kind, world):
    for rank, (params, grads, optimizer) in HAND[kind, world].items():
        row = measured[kind, world, rank]
        assert (row["params"], row["grads"], row["optimizer"]) == (params, grads, optimizer), row
        assert row["peak"] >= params + grads + optimizer


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ddp_keeps_its_buckets_beside_the_gradients(measured, world):
    """The course's DDP, as torch's Reducer, keeps its buckets from step to step: a second copy
    of the gradients (20 bytes per parameter with float32 AdamW), unless the gradients are views
    of the buckets (gradient_as_bucket_view=True: 16). FSDP has no buckets."""
    for rank in range(world):
        for kind in ("DDP", "ZeRO-1"):
            row = measured[kind, world, rank]
            assert row["buckets"] == row["grads"] == 4 * PSI, row
        view = measured["DDP-view", world, rank]
        assert (view["params"], view["grads"], view["buckets"], view["optimizer"]) == (
            4 * PSI, 4 * PSI, 0, adam(PSI, 4)), view
        assert measured["FSDP", world, rank]["buckets"] == 0
        assert view["peak"] < measured["DDP", world, rank]["peak"]


def test_ddp_peak_does_not_shrink_and_sharding_does(measured):
    ddp = {w: measured["DDP", w, 0]["peak"] for w in (1, 2, 4)}
    assert ddp[1] == ddp[2] == ddp[4], ddp
    for w in (2, 4):
        assert measured["FSDP", w, 0]["peak"] < measured["ZeRO-1", w, 0]["peak"] < ddp[w]
    assert measured["FSDP", 4, 0]["peak"] < measured["FSDP", 2, 0]["peak"]


def test_zero_formula():
    """16 bytes per parameter for mixed-precision Adam; each stage divides one more term."""
    assert zero_formula(10, 1, 0)["total"] == 160
    assert zero_formula(10, 4, 0) == {"params": 20, "grads": 20, "optimizer": 120, "total": 160}
    assert zero_formula(10, 4, 1) == {"params": 20, "grads": 20, "optimizer": 30, "total": 70}
    assert zero_formula(10, 4, 2)["total"] == 20 + 5 + 30
    assert zero_formula(10, 4, 3)["total"] == 40
    fp32 = zero_formula(PSI, 1, 0, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32["total"] == 16 * PSI
    with pytest.raises(ValueError, match="stage"):
        zero_formula(10, 2, 4)


def test_peak_memory_counts_live_tensors_on_a_cpu():
    x = torch.ones(100)                         # 400 bytes alive at entry
    with PeakMemory(tensors=[x]) as m:
        a = torch.empty(1000)                   # +4000
        b = a * 2                               # +4000: the peak, 8400
        del a                                   # -4000
        c = torch.empty(500)                    # +2000
        b.untyped_storage().resize_(0)          # -4000: a freed storage counts 0
        d = torch.empty(10)                     # +40
    assert (m.start, m.peak, m.end) == (400, 8400, 2440)
    del c, d


def test_peak_memory_counts_a_gradient_autograd_keeps():
    """``.grad`` is a new tensor on the storage backward made (autograd drops the first): it
    still counts, as long as it lives."""
    w = torch.nn.Parameter(torch.ones(1000))    # 4000 bytes alive at entry
    with PeakMemory(tensors=[w]) as m:
        (w * 2).sum().backward()                # w.grad: +4000
    assert w.grad is not None and (m.start, m.end) == (4000, 8000)


def test_peak_memory_breakdown_labels_the_peak():
    """At the peak: each live storage labelled by ``classify`` or by the phase that made it."""
    x = torch.ones(100)                                  # 400 bytes, alive at entry
    with PeakMemory(tensors=[x], classify=lambda t, made_in: "x" if t is x else None) as m:
        m.phase = "forward"
        a = torch.empty(1000)                            # 4000
        m.phase = "backward"
        b = torch.empty(250)                             # 1000: the peak, 5400
        del a
        c = torch.empty(10)                              # 40, after the peak: not in it
    assert m.peak == 5400 and sum(m.breakdown.values()) == m.peak
    assert m.breakdown == {"x": 400, "made in forward": 4000, "made in backward": 1000}
    del b, c


def test_peak_parts_sum_to_the_peak(measured):
    """The workers' breakdown: parts sum to the peak; FSDP's peak at 2 ranks holds one gathered
    unit and one full unit gradient (the largest unit, 128 + 16 elements), DDP's whole ones."""
    for row in measured.values():
        assert sum(row["peak_parts"].values()) == row["peak"], row
    fsdp = measured["FSDP", 2, 0]["peak_parts"]
    assert fsdp["parameter shards"] == 4 * 106 and "parameters (whole)" not in fsdp, fsdp
    # in a unit's reduce-scatter (144 or 68 elements; at these tiny sizes not always the
    # largest): its weights, its full gradient, gloo's copy of that gradient, and this rank's
    # slice of the result (half)
    unit = fsdp["gathered unit weights"]
    assert unit in (4 * 144, 4 * 68), fsdp
    assert (fsdp["a unit's full gradient, before reduce-scatter"]
            == fsdp["gloo's copy of a full gradient (reduce-scatter)"] == unit), fsdp
    assert 2 * fsdp[W._SLICE] == unit, fsdp
    ddp = measured["DDP", 2, 0]["peak_parts"]
    assert ddp["parameters (whole)"] == 4 * PSI and ddp["optimizer state"] == adam(PSI, 4), ddp


def test_byte_counts_share_storages():
    w = torch.nn.Parameter(torch.ones(10, 10))
    assert tensor_bytes([w, w, w[0], None]) == 400   # a tied or viewed tensor counts once
    (w * 2).sum().backward()
    assert grad_bytes([w]) == 400
    opt = torch.optim.AdamW([w])
    opt.step()
    assert optimizer_state_bytes(opt) == adam(100, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_course_fsdp_equals_torch_fully_shard(world):
    """Same weights, same slices, 3 AdamW steps: ours, torch's fully_shard and one process."""
    result = launch(W.compare_with_torch_fsdp, world, [7, 13, 5], 3, 3, timeout=180)[0]
    if "error" in result:
        pytest.skip(f"torch's fully_shard does not run here: {result['error']}")
    assert result["ours_vs_torch"] <= 1e-6, result
    assert result["ours_vs_one_process"] <= 1e-6, result


@pytest.mark.parametrize("world", [2, 3])
def test_traffic_per_step_counts_each_collective(world):
    """One step's collectives: DDP one all-reduce of Ψ, ZeRO-1 that plus broadcasts of Ψ, FSDP
    two all-gathers and one reduce-scatter of Ψ padded to a multiple of the world size."""
    widths = [7, 13, 5]
    t = launch(W.traffic_per_step, world, widths, 4, timeout=180)[0]
    psi = t["num_params"]
    assert psi == 7 * 13 + 13 + 13 * 5 + 5
    assert t["DDP"] == {"all_reduce": psi}
    assert t["ZeRO-1"] == {"all_reduce": psi, "broadcast": psi}
    padded = sum(-(-n // world) * world for n in (7 * 13 + 13, 13 * 5 + 5))   # per unit
    gathers = {k: v for k, v in t["FSDP"].items() if k.startswith(("all_gather", "_all_gather"))}
    scatters = {k: v for k, v in t["FSDP"].items() if "reduce_scatter" in k}
    assert sum(gathers.values()) == 2 * padded and sum(scatters.values()) == padded
    # the order: each unit gathered in forward; in backward, gathered only once backward reaches
    # it, right after the later unit's reduce-scatter (no prefetch)
    p0, p1 = (-(-n // world) * world for n in (7 * 13 + 13, 13 * 5 + 5))
    order = t["FSDP order"]
    assert [name for name, _ in order] == ["all_gather", "all_gather", "all_reduce", "all_gather",
                                           "reduce_scatter", "all_gather", "reduce_scatter"], order
    assert [e for name, e in order if name != "all_reduce"] == [p0, p1, p1, p1, p0, p0], order
    # the paper's ZeRO-1: one reduce-scatter and one all-gather of Ψ (174 divides by 2 and 3),
    # what a ring all-reduce of Ψ sends; its parameters those of the unsharded AdamW
    paper = t["ZeRO-1 (paper)"]
    assert sorted(paper.values()) == [psi, psi] and not any("all_reduce" in k for k in paper)
    assert t["paper_zero1_vs_unsharded"] <= 1e-6, t


def test_accounting_of_the_rows(measured):
    """The notebook's tables and figures: held bytes, the formula's line, what the peak adds."""
    rows = {(kind, world): measured[kind, world, 0] for (kind, world) in HAND}
    for row in rows.values():
        assert W.held(row) == row["params"] + row["grads"] + row["buckets"] + row["optimizer"]
        # what the peak adds (less what was not made yet) sums to the peak-held column
        extra = W.above_held(row)
        assert not set(extra) & set(W._HELD_LABELS)
        assert sum(extra.values()) == row["peak"] - W.held(row), row   # the peak-held column
        assert list(extra.values()) == sorted(extra.values(), reverse=True)
    # the formula for float32 AdamW (+ 4 bytes of DDP's buckets), by hand
    assert W.formula_bytes("DDP", PSI, 4) == 20 * PSI
    assert W.formula_bytes("ZeRO-1", PSI, 4) == (4 + 4 + 4 + 8 / 4) * PSI
    assert W.formula_bytes("FSDP", PSI, 2) == 16 * PSI / 2
    c = W.curves(rows, [2, 4], kinds=("ZeRO-1",), unit_bytes=1)
    assert c == {"ZeRO-1": {"formula": [W.formula_bytes("ZeRO-1", PSI, w) for w in (2, 4)],
                            "held": [W.held(rows["ZeRO-1", w]) for w in (2, 4)],
                            "peak": [rows["ZeRO-1", w]["peak"] for w in (2, 4)]}}
    every = {("ZeRO-1", 2): [measured["ZeRO-1", 2, r] for r in range(2)]}
    bars = W.held_parts(every, 2, kinds=("ZeRO-1",), unit_bytes=1)
    assert list(bars) == ["ZeRO-1, rank 0", "ZeRO-1, rank 1"]
    assert bars["ZeRO-1, rank 1"]["optimizer state"] == adam(84, 3)


def test_memory_figures_draw_one_mark_per_measurement():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    from course_lib.plots import draw_held_per_rank, draw_memory_per_rank

    bars = {"DDP, rank 0": {"parameters": 4.0, "optimizer state": 8.0},
            "FSDP, rank 0": {"parameters": 2.0, "optimizer state": 4.0}}
    fig = draw_held_per_rank(bars, unit="KiB")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(bars)
    assert sorted(p.get_width() for p in ax.patches) == [2.0, 4.0, 4.0, 8.0]
    plt.close(fig)
    curve = {"formula": [3.0, 2.0], "held": [3.0, 2.0], "peak": [4.0, 3.0]}
    fig = draw_memory_per_rank({"a": {"DDP": curve, "FSDP": curve}, "b": {"DDP": curve}}, [1, 2])
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    assert len(fig.axes[0].lines) == 2 * 3 and len(fig.axes[1].lines) == 3
    plt.close(fig)
