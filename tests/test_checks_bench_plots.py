import subprocess
import sys

import matplotlib
import pytest
import torch

matplotlib.use("agg")

from course_lib import checks  # noqa: E402
from course_lib.bench import main  # noqa: E402
from course_lib.config import choose, quick_mode  # noqa: E402
from course_lib.plots import TrainingPlot, draw_parallelism, plot_history  # noqa: E402
from course_lib.timing import Timer, benchmark  # noqa: E402
from course_lib.train import accuracy  # noqa: E402


def test_check_answer_verdicts(capsys):
    assert checks.check_answer("x", None, 3).ok is None
    assert checks.check_answer("x", 3, 3)
    assert not checks.check_answer("x", 4, 3, hint="try again")
    assert "try again" in capsys.readouterr().out
    assert checks.check_answer("t", [1.0, 2.0], torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="not yet right"):
        checks.check_answer("x", 4, 3, strict=True)


def test_check_functions_accept_right_and_reject_wrong():
    assert checks.check_accuracy_fn(lambda y_hat, y: accuracy(y_hat, y))
    assert not checks.check_accuracy_fn(lambda y_hat, y: int((y_hat.argmax(0) == 0).sum()))
    assert checks.check_accuracy_fn(None).ok is None

    def good_sgd(params, lr):
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad.zero_()

    def no_zero_sgd(params, lr):
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad

    def twice_sgd(params, lr):   # a step of 2 lr: torch.optim.SGD's step differs
        good_sgd(params, 2 * lr)

    assert checks.check_sgd_fn(good_sgd)
    assert not checks.check_sgd_fn(no_zero_sgd)
    assert not checks.check_sgd_fn(twice_sgd)
    assert checks.check_try_all_gpus(lambda: [torch.device("cpu")] if not torch.cuda.is_available()
                                     else [torch.device(f"cuda:{i}")
                                           for i in range(torch.cuda.device_count())])
    assert not checks.check_try_all_gpus(lambda: [] if not torch.cuda.is_available() else None)


def test_timer_and_benchmark():
    t = Timer()
    with t:
        sum(range(1000))
    t.start()
    t.stop()
    assert len(t.times) == 2 and t.sum() >= t.times[0] >= 0 and t.avg() >= 0
    with pytest.raises(RuntimeError, match="before"):
        Timer().stop()
    calls = []
    r = benchmark(lambda: calls.append(1), warmup=3, repeat=4)
    assert len(calls) == 7 and len(r.times) == 4
    assert r.min <= r.median <= r.max and r.iqr >= 0
    with pytest.raises(ValueError, match="repeat"):
        benchmark(lambda: None, repeat=0)


def test_bench_cli_lists_and_rejects(capsys):
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "dataloader" in listed and "collectives" in listed
    assert main(["nope"]) == 2


@pytest.mark.slow
def test_bench_entry_point_runs_a_benchmark():
    """``python -m course_lib.bench NAME`` reaches NAME's own options (the JSON each prints is
    checked in tests/test_bench_interleaved.py, in-process and faster)."""
    out = subprocess.run([sys.executable, "-m", "course_lib.bench", "dataloader", "--help"],
                         capture_output=True, text=True, timeout=300, check=True)
    assert "--samples" in out.stdout and "--min-sample-ms" in out.stdout


def test_quick_mode(monkeypatch):
    monkeypatch.setenv("COURSE_QUICK", "1")
    assert quick_mode() and choose(10, 1) == 1
    monkeypatch.setenv("COURSE_QUICK", "0")
    assert not quick_mode() and choose(10, 1) == 10


def test_plots_record_and_draw():
    plot = TrainingPlot(title="t", live=False)
    plot.update(1, train_loss=2.0, test_acc=0.5)
    plot.update(2, train_loss=1.0, test_acc=0.7)
    assert plot.history == {"train loss": [2.0, 1.0], "test acc": [0.5, 0.7]}
    assert len(plot.figure().axes[0].lines) == 2
    assert len(plot_history(plot.history).axes[0].lines) == 2
    assert len(draw_parallelism(3).axes) == 3   # data, model, within a layer


def test_live_plot_renders_png_under_any_backend():
    plot = TrainingPlot(live=False)
    plot.update(1, train_loss=1.0)
    assert plot._image().data[:8] == b"\x89PNG\r\n\x1a\n"
