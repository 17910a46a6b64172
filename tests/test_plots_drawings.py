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


def test_async_queue_puts_the_unsynchronized_clock_before_the_work_ends():
    fig = draw_async_queue(launch_s=0.1, kernel_s=1.0, n=4)
    lines = [ln.get_xdata()[0] for ln in fig.axes[0].lines]     # the two clock readings
    assert lines == pytest.approx([4 * 0.1, 0.1 + 4 * 1.0])   # launches; first launch + 4 runs
    plt.close(fig)


def test_ring_over_processes_labels_the_chunk_each_rank_sends():
    fig = draw_ring_processes(4, step=1)
    labels = sorted(t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("chunk"))
    assert labels == ["chunk 0", "chunk 1", "chunk 2", "chunk 3"]    # rank r sends r - 1
    plt.close(fig)
