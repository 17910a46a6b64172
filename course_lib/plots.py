"""Training curves: a live plot that updates in place in JupyterLab, and a final static figure.

PyTorch counterpart: none (d2l's ``Animator``). Unlike ``Animator``, the live plot updates one
display handle instead of clearing the cell's output, so outputs do not pile up under nbval.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["TrainingPlot", "plot_history"]


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def plot_history(history: dict[str, list[float]], *, title: str | None = None,
                 ax: plt.Axes | None = None) -> plt.Figure:
    """Static figure of per-epoch curves, e.g. ``{"train loss": [...], "test acc": [...]}``."""
    fig = ax.figure if ax is not None else plt.figure(figsize=(4.5, 3))
    ax = ax if ax is not None else fig.add_subplot()
    for name, values in history.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, label=name)
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


class TrainingPlot:
    """Live per-epoch plot of loss and accuracies.

    ``plot.update(epoch, train_loss=..., train_acc=..., test_acc=...)`` appends the values and,
    in a notebook, redraws the figure in place through one display handle. Outside a notebook it
    only records. ``plot.history`` holds every series; ``plot.close()`` leaves the final figure.

    Args:
        title: figure title.
        live: draw while training (default: only inside a Jupyter kernel).
    """

    def __init__(self, title: str | None = None, live: bool | None = None):
        self.title = title
        self.live = _in_notebook() if live is None else live
        self.history: dict[str, list[float]] = {}
        self.epochs: list[int] = []
        self._handle = None

    def update(self, epoch: int, **values: float) -> None:
        self.epochs.append(epoch)
        for name, v in values.items():
            self.history.setdefault(name.replace("_", " "), []).append(float(v))
        if self.live:
            self._draw()

    def figure(self) -> plt.Figure:
        """The current figure (a fresh matplotlib figure, not registered with pyplot)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(4.5, 3))
        plot_history(self.history, title=self.title, ax=fig.add_subplot())
        return fig

    def _draw(self) -> None:
        from IPython.display import display

        fig = self.figure()
        if self._handle is None:
            self._handle = display(fig, display_id=True)
        else:
            self._handle.update(fig)

    def close(self) -> None:
        """Draw the final state once more (also when ``live`` was off but we are in a notebook)."""
        if self.live:
            self._draw()
        elif _in_notebook():
            from IPython.display import display

            display(self.figure())
