"""The lesson figures draw what they say (titles, panels, marks), on any backend."""
import matplotlib
import pytest

matplotlib.use("agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib.plots import draw_async_queue, draw_parallelism, draw_ring_processes  # noqa: E402


def test_parallelism_figure_has_the_three_ways_and_every_layers_allreduce():
    fig = draw_parallelism(3)
    assert [ax.get_title() for ax in fig.axes] == [
        "data parallelism: split the batch", "model parallelism: split the layers",
        "split within each layer"]
    # data parallelism: 4 layers x (3 - 1) neighbour pairs of gradient arrows
    assert len(fig.axes[0].patches) - 3 * (1 + 4) - 3 == 4 * 2
    plt.close(fig)


def test_within_layer_split_exchanges_once_per_pair_of_layers_not_after_every_layer():
    fig = draw_parallelism(3)
    within = fig.axes[2]
    # 3 devices x 4 layer boxes, then one arrow per neighbour pair per (column, row) layer pair
    assert len(within.patches) - 3 * 4 == (3 - 1) * (4 // 2)
    assert "one all-reduce after each pair" in " ".join(t.get_text() for t in within.texts)
    plt.close(fig)


def test_async_queue_puts_the_unsynchronized_clock_before_the_work_ends():
    fig = draw_async_queue(launch_s=0.1, kernel_s=1.0, n=4)
    lines = [ln.get_xdata()[0] for ln in fig.axes[0].lines]     # the two clock readings
    assert lines == pytest.approx([4 * 0.1, 0.1 + 4 * 1.0])   # launches; first launch + 4 runs
    fig.canvas.draw()                                          # labels beside their lines
    renderer = fig.canvas.get_renderer()
    for x, text in zip(lines, [t for t in fig.axes[0].texts if "clock" in t.get_text()]):
        box = text.get_window_extent(renderer).transformed(fig.axes[0].transData.inverted())
        assert not box.x0 < x < box.x1, text.get_text()
    plt.close(fig)


def test_ring_over_processes_labels_the_chunk_each_rank_sends():
    fig = draw_ring_processes(4, step=1)
    labels = sorted(t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("chunk"))
    assert labels == ["chunk 0", "chunk 1", "chunk 2", "chunk 3"]    # rank r sends r - 1
    plt.close(fig)


def test_mesh_joins_the_ranks_of_every_group_of_each_dimension():
    from course_lib.plots import draw_mesh

    fig = draw_mesh((2, 2, 2), ("pp", "dp", "tp"))
    assert [len(ax.lines) for ax in fig.axes] == [4, 4, 4]          # 8 / 2 groups per dimension
    tp = fig.axes[2]
    ends = sorted(tuple(line.get_xdata()) for line in tp.lines)
    assert all(b - a == 1 for a, b in ends)                        # tp: neighbours in a row
    assert sorted(t.get_text() for t in tp.texts) == [str(r) for r in range(8)]
    assert draw_mesh((2, 3), ("dp", "tp")).axes[0].get_title() == '"dp": 3 groups of 2'
    with pytest.raises(ValueError, match="one name each"):
        draw_mesh((2, 2), ("dp",))
    plt.close("all")


def test_cost_model_figure_has_one_log_log_panel_per_size_and_a_dashed_bound():
    from course_lib.bench.cost_model import allreduce_model_curves
    from course_lib.plots import draw_cost_model
    ps = [2, 4, 8]
    panels = {f"{n} bytes": allreduce_model_curves(n, ps, 1e-5, 1e-10) for n in (4096, 1e8)}
    fig = draw_cost_model(ps, panels, title="model")
    try:
        axes = fig.get_axes()
        assert len(axes) == 2
        for ax in axes:
            assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
            labels = [line.get_label() for line in ax.get_lines()]
            assert "ring" in labels and labels[-1].startswith("bound")
            assert ax.get_lines()[-1].get_linestyle() == "--"
    finally:
        plt.close(fig)
