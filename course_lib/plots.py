"""Training curves: a live plot that updates in place in JupyterLab, and a final static figure.

PyTorch counterpart: none (d2l's ``Animator``). Unlike ``Animator``, the live plot updates one
display handle instead of clearing the cell's output, so outputs do not pile up under nbval.
"""
from __future__ import annotations

import inspect
import re

import matplotlib.pyplot as plt

__all__ = ["TrainingPlot", "draw_async_queue", "draw_collective_trace", "draw_collectives",
           "draw_cost_model", "draw_held_per_rank", "draw_memory_per_rank", "draw_mesh",
           "draw_parallelism", "draw_pipeline_timeline", "draw_read_plan", "draw_ring",
           "draw_ring_processes", "plot_history", "show"]


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
    ax.set(xlabel="epoch", title=title or "")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


class TrainingPlot:
    """Live per-epoch plot of loss and accuracies, titled ``title``.

    ``plot.update(epoch, train_loss=..., train_acc=..., test_acc=...)`` appends the values to
    ``plot.history`` and, when ``live`` (default: inside a Jupyter kernel), redraws the figure in
    place through one display handle; otherwise nothing is displayed. ``plot.close()`` leaves
    the final figure when live.
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

    def _image(self):
        """The current figure as a PNG ``IPython.display.Image``: shown the same way under any
        matplotlib backend (a bare ``Figure`` renders only once the inline backend is active)."""
        import io

        from IPython.display import Image

        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=100)
        return Image(data=buf.getvalue(), format="png")

    def _draw(self) -> None:
        from IPython.display import display

        if self._handle is None:
            self._handle = display(self._image(), display_id=True)
        else:
            self._handle.update(self._image())

    def close(self) -> None:
        """Draw the final state once more when ``live`` (else ``plot.figure()`` gives it)."""
        if self.live:
            self._draw()


def draw_parallelism(num_devices: int = 2) -> plt.Figure:
    """Three ways to put ``num_devices`` devices to work on one network, side by side (as in
    d2l's Fig. 13.5.2): data parallelism (the whole model on every device, the batch split,
    every layer's gradients allreduced), model parallelism (the layers split over the devices,
    activations passed along) and splitting within a layer (every layer's units split over the
    devices in column/row pairs, one all-reduce of the activation after each pair)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, (ax_d, ax_m, ax_t) = plt.subplots(1, 3, figsize=(14, 3.9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    layers = ["conv 1", "conv 2", "linear 1", "linear 2"]
    k = num_devices

    def box(ax, x, y, w, h, text, color, alpha=0.25):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", alpha=alpha))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=7)

    def arrow(ax, a, b, style="-|>", color="black"):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=9, color=color))

    def columns(ax, width):  # x and width of device i's column; its name under it
        cols = [(0.5 + i * (9 / k), 9 / k - width) for i in range(k)]
        for i, (x, w) in enumerate(cols):
            ax.text(x + w / 2, 0.15, f"device {i}", ha="center", fontsize=8, weight="bold")
        return cols

    def allreduce(ax, cols, ys):  # red two-way arrows between neighbouring columns
        for i in range(k - 1):
            x0 = cols[i][0] + cols[i][1]
            for y in ys:
                arrow(ax, (x0, y), (x0 + 0.6, y), style="<|-|>", color="crimson")

    def caption(ax, text, title):
        ax.text(5, 0.7, text, ha="center", fontsize=8, color="crimson")
        ax.set_title(title, fontsize=10)
        ax.set(xlim=(0, 10), ylim=(0, 5.6))
        ax.axis("off")

    # data parallelism: every device holds all layers and 1/k of the batch; every layer's
    # gradients are allreduced (red), not just one
    cols = columns(ax_d, 0.6)
    for i, (x, w) in enumerate(cols):
        box(ax_d, x, 4.6, w, 0.8, f"batch shard {i}\n(B/{k} examples)", colors[0])
        arrow(ax_d, (x + w / 2, 4.6), (x + w / 2, 4.3))
        for j, name in enumerate(layers):
            box(ax_d, x, 3.6 - j * 0.8, w, 0.7, name, colors[1 + j % 3])
    allreduce(ax_d, cols, [3.6 - j * 0.8 + 0.35 for j in range(len(layers))])
    caption(ax_d, "every layer's gradients allreduced (red):\nthe replicas stay identical",
            "data parallelism: split the batch")

    # model parallelism: layers spread over devices, activations flow between them
    cols = columns(ax_m, 0.8)
    per = max(1, -(-len(layers) // k))
    where = [min(j // per, k - 1) for j in range(len(layers))]
    for j, name in enumerate(layers):
        x, w = cols[where[j]]
        box(ax_m, x, 4.3 - j * 0.9, w, 0.7, name, colors[1 + j % 3])
    for j in range(len(layers) - 1):
        (x0, w0), (x1, w1) = cols[where[j]], cols[where[j + 1]]
        arrow(ax_m, (x0 + w0 / 2, 4.3 - j * 0.9), (x1 + w1 / 2, 4.3 - (j + 1) * 0.9 + 0.7),
              color="crimson" if where[j] != where[j + 1] else "black")
    caption(ax_m, "whole batch; activations forward and gradients\nback between devices (red)",
            "model parallelism: split the layers")

    # within a layer (Megatron-LM): layers go in pairs, the first split by its output units
    # (columns), the second by its input units (rows); device i's partial output of the pair is
    # summed over the devices by one all-reduce after the pair, none in between
    cols = columns(ax_t, 0.6)
    for i, (x, w) in enumerate(cols):
        for j, name in enumerate(layers):
            part = "outputs" if j % 2 == 0 else "inputs"
            box(ax_t, x, 4.3 - j * 0.9, w, 0.7, f"{name}\n{part} {i + 1}/{k}", colors[1 + j % 3])
    allreduce(ax_t, cols, [4.3 - j * 0.9 - 0.1 for j in range(1, len(layers), 2)])  # per pair
    caption(ax_t, "whole batch; layers in pairs (columns, then rows):\n"
            "one all-reduce after each pair in the forward pass (red)", "split within each layer")
    fig.tight_layout()
    return fig


def draw_async_queue(launch_s: float = 0.1, kernel_s: float = 1.0, n: int = 4) -> plt.Figure:
    """How a GPU runs work (lesson 00): the CPU queues ``n`` kernels, each launch taking
    ``launch_s``, and returns at once; the GPU runs them one after another, ``kernel_s`` each.
    A clock read right after the last launch (no synchronize) stops long before the work is
    done; ``synchronize`` waits for the queue to drain. Durations are illustrative units."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    gpu_free = 0.0
    for i in range(n):
        start = i * launch_s
        ax.broken_barh([(start, launch_s * 0.9)], (1.1, 0.6), facecolors=colors[0])
        run = max(gpu_free, start + launch_s)
        ax.broken_barh([(run, kernel_s * 0.97)], (0.1, 0.6), facecolors=colors[1])
        ax.text(run + kernel_s / 2, 0.4, f"kernel {i + 1}", ha="center", va="center", fontsize=8)
        gpu_free = run + kernel_s
    naive, synced = n * launch_s, gpu_free
    gap = 0.015 * synced                               # labels beside their lines, not on them
    for x, label, color, side in ((naive, "clock read without\nsynchronize", "crimson", 1),
                                  (synced, "clock read after\nsynchronize", "black", -1)):
        ax.axvline(x, color=color, linestyle="--")
        ax.text(x + side * gap, 2.0, label, ha="left" if side > 0 else "right", va="bottom",
                fontsize=8, color=color)
    ax.set_yticks([0.4, 1.4], ["GPU runs", "CPU queues"])
    ax.set(ylim=(0, 2.6), xlim=(-0.05, synced * 1.08), xlabel="time (illustrative units)")
    ax.set_title("a CUDA call returns when the kernel is queued, not when it has run", fontsize=10)
    fig.tight_layout()
    return fig


def draw_ring(tables: list[tuple[str, list[list[str]]]], n: int) -> plt.Figure:
    """One panel per step of a ring allreduce over n devices (lesson 02): ``tables`` holds
    ``(title, table)`` pairs (the start, the n-1 reduce-scatter steps, the n-1 all-gather steps);
    ``table[i][c]`` names the devices whose values chunk c on device i has summed ("-": none).
    Rows are devices, columns chunks; darker means more summed."""
    fig, axes = plt.subplots(2, n, figsize=(2.4 * n, 5.4))
    panels = [axes[0][j] for j in range(n)] + [axes[1][j] for j in range(1, n)]
    axes[1][0].axis("off")
    for ax, (title, table) in zip(panels, tables):
        counts = [[0 if c == "-" else len(c) for c in row] for row in table]
        ax.imshow(counts, cmap="Blues", vmin=0, vmax=n + 1)
        for i in range(n):
            for c in range(n):
                ax.text(c, i, table[i][c], ha="center", va="center", fontsize=8,
                        color="white" if counts[i][c] == n else "black")
        ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"dev {i}" for i in range(n)], fontsize=7)
        ax.set_title(title.replace(": ", "\n").replace(", 2", ",\n2"), fontsize=7)
    fig.suptitle(f"ring allreduce over {n} devices: which devices each chunk has summed",
                 fontsize=9)
    fig.tight_layout()
    return fig


def draw_cost_model(ps: list[int], panels: dict[str, dict[str, list[float]]], *,
                    title: str = "") -> plt.Figure:
    """Modelled seconds of each all-reduce against the number of devices, one log-log panel per
    message size (lesson 02): ``panels`` maps it to ``{algorithm: [seconds per p]}``
    (``bench.cost_model.allreduce_model_curves``); a name starting with "bound" is drawn as a
    dashed black line (a lower bound, not an algorithm)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    markers = "osD^vx"
    for ax, (panel, curves) in zip(axes[0], panels.items()):
        algorithms = [name for name in curves if not name.startswith("bound")]
        for k, name in enumerate(algorithms):
            ax.plot(ps, [t * 1e6 for t in curves[name]], marker=markers[k % len(markers)],
                    markersize=4, label=name)
        for name in curves:
            if name.startswith("bound"):
                ax.plot(ps, [t * 1e6 for t in curves[name]], "k--", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.set(xlabel="devices n", ylabel="modelled time of one all-reduce (us)")
        ax.set_title(panel, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)   # below, off the curves
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    return fig


def draw_held_per_rank(bars: dict[str, dict[str, float]], *, unit: str = "MiB",
                       title: str = "") -> plt.Figure:
    """What each rank holds (lesson 11): one horizontal bar per rank, top to bottom, stacked
    from its parts, e.g. ``{"DDP, rank 0": {"parameters": 20.1, "gradients": 20.1, ...}}``
    (sizes in ``unit``; ``examples.sharded_workers.held_parts`` builds it)."""
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars) + 1), layout="constrained")
    names = list(dict.fromkeys(name for parts in bars.values() for name in parts))
    colours = dict(zip(names, ["C0", "C1", "C7", "C2", "C3", "C4"]))
    for y, parts in enumerate(bars.values()):
        left = 0.0
        for name, size in parts.items():
            ax.barh(-y, size, left=left, color=colours[name], edgecolor="white",
                    label=name if y == 0 else None)
            left += size
    ax.set_yticks([-y for y in range(len(bars))], list(bars))
    ax.set(xlabel=f"{unit} held after a step (measured)", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def draw_memory_per_rank(panels: dict[str, dict[str, dict[str, list[float]]]],
                         worlds: list[int], *, unit: str = "MiB",
                         formulas: dict[str, str] | None = None, title: str = "") -> plt.Figure:
    """Memory per rank against the number of ranks (lesson 11), one panel per model: ``panels``
    maps its title to ``{kind: {"formula", "held", "peak": [size per world]}}``
    (``examples.sharded_workers.curves``): the formula as a line, held after a step as filled
    markers, the peak as open ones, nudged sideways per kind so that equal values stay visible.
    ``formulas``: a legend text per kind."""
    fig, axes = plt.subplots(1, len(panels), figsize=(max(8.0, 5.5 * len(panels)), 5.5),
                             squeeze=False, layout="constrained")
    markers = "os^Dv"
    for ax, (panel, kinds) in zip(axes[0], panels.items()):
        for k, (kind, c) in enumerate(kinds.items()):
            colour, dx = f"C{k}", 0.06 * (k - (len(kinds) - 1) / 2)
            xs = [w + dx for w in worlds]
            ax.plot(worlds, c["formula"], "-", color=colour, alpha=0.5,
                    label=(formulas or {}).get(kind, kind))
            ax.plot(xs, c["held"], markers[k], color=colour, label=f"{kind}: held after a step")
            ax.plot(xs, c["peak"], markers[k], color=colour, mfc="none",
                    label=f"{kind}: peak during a step")
        ax.set(xlabel="ranks", xticks=worlds, ylabel=f"{unit} per rank (rank 0)", title=panel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    columns = max(1, len(handles) // 3)   # one column per kind: its line, held, peak
    fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize="small",
               title="lines: the formula; markers: measured", title_fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def show(*objs) -> None:
    """Display the source of functions or classes in a notebook: the library is the lesson's code.

    Several objects are shown one after the other in one block; a method is headed by a
    comment naming its class (``# Bucket.mark_ready``), which its source alone does not show.
    The notebook stores one representation per call, a Markdown code block
    (``text/markdown``), which JupyterLab and GitHub render with Python highlighting. Outside a
    notebook the source is printed.
    """
    if not objs:
        raise TypeError("show() needs at least one function or class, e.g. show(scatter).")
    source = "\n\n".join(_owned_source(obj) for obj in objs) + "\n"
    if _in_notebook():
        from IPython.display import display

        display(_markdown_code(source), raw=True)
    else:
        print(source)


def _owned_source(obj) -> str:
    """``obj``'s source; a method's (its qualified name has a class in it) headed by that name."""
    source = inspect.getsource(obj).rstrip()
    qualname = getattr(inspect.unwrap(obj), "__qualname__", "")
    if "." in qualname and "<locals>" not in qualname and not inspect.isclass(obj):
        return f"# {qualname}\n{source}"
    return source


def _markdown_code(source: str) -> dict[str, str]:
    """A display bundle with one mimetype: ``source`` as a fenced Python block in Markdown."""
    longest = max((len(run) for run in re.findall(r"`+", source)), default=0)
    fence = "`" * max(3, longest + 1)                  # longer than any backtick run inside
    return {"text/markdown": f"{fence}python\n{source.rstrip()}\n{fence}"}


def draw_pipeline_timeline(events, *, title: str | None = None, ax: plt.Axes | None = None,
                           unit: str = "ms") -> plt.Figure:
    """Which stage computes what, when (lesson 11): one row per stage, a bar per operation of
    ``events``, ``(stage, kind, microbatch, start, end)`` tuples (``PipeEvent``s), kind "F" (light)
    or "B" (dark); the gaps are the bubble. Times start at 0, in ``unit`` ("ms", "s", or "steps"
    for a simulation's unit times)."""
    fig = ax.figure if ax is not None else plt.figure(figsize=(10, 2.2))
    ax = ax if ax is not None else fig.add_subplot()
    scale = {"ms": 1e3, "s": 1.0, "steps": 1.0}[unit]
    t0 = min(e[3] for e in events)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    stages = sorted({e[0] for e in events})
    for stage, kind, mb, start, end in events:
        color = colors[mb % len(colors)]
        left, width = (start - t0) * scale, (end - start) * scale
        ax.barh(stage, width, left=left, height=0.7, color=color, edgecolor="black", lw=0.5,
                alpha=0.45 if kind == "F" else 0.95)
        ax.text(left + width / 2, stage, f"{kind}{mb}", ha="center", va="center", fontsize=7)
    ax.set_yticks(stages, [f"stage {s}" for s in stages], fontsize=8)
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)
    ax.set_xlabel(unit if unit == "steps" else f"time ({unit})", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


#: Who sends to whom in each collective (lesson 06): "one->all", "all->one", "all->all".
_COLLECTIVE_FLOW = {"broadcast": "one->all", "reduce": "all->one", "all_reduce": "all->all",
                    "gather": "all->one", "all_gather": "all->all", "scatter": "one->all",
                    "reduce_scatter": "all->all", "all_to_all": "all->all"}


def draw_collectives(results: list[dict], names: list[str] | None = None) -> plt.Figure:
    """One panel per collective (lesson 06): every rank's tensor before (top row) and after
    (bottom row), arrows for who sends to whom (rank 0 the source or destination). ``results[r]``
    is what rank r returned from ``examples.workers.collectives`` (``"start"``, each collective's
    value after it, ``"inputs"`` where one started from another): what the ranks really held."""
    from matplotlib.patches import FancyArrowPatch

    names = names or [n for n in _COLLECTIVE_FLOW if n in results[0]]
    world = len(results)
    cols = 4
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        flow = _COLLECTIVE_FLOW[name]
        xs = [(r + 0.5) / world for r in range(world)]
        for r, x in enumerate(xs):
            before = results[r].get("inputs", {}).get(name, results[r]["start"])
            for y, value in ((0.8, before), (0.2, results[r][name])):
                text = str(value).replace("(undefined off rank 0)", "-").replace(
                    "(only rank 0 receives)", "-")
                ax.text(x, y, text, ha="center", va="center", fontsize=7, wrap=True,
                        bbox={"boxstyle": "round", "facecolor": f"C{r}", "alpha": 0.25})
            ax.text(x, 0.98, f"rank {r}", ha="center", va="top", fontsize=7, weight="bold")
        pairs = {"one->all": [(0, r) for r in range(world)],
                 "all->one": [(r, 0) for r in range(world)],
                 "all->all": [(a, b) for a in range(world) for b in range(world)]}[flow]
        for a, b in pairs:
            ax.add_patch(FancyArrowPatch((xs[a], 0.68), (xs[b], 0.32), arrowstyle="-|>",
                                         mutation_scale=7, color=f"C{a}", alpha=0.6,
                                         transform=ax.transAxes))
        ax.set_title(name, fontsize=9)
        ax.set(xlim=(0, 1), ylim=(0, 1))
    fig.suptitle(f"{world} ranks: tensor before (top) and after (bottom) each collective",
                 fontsize=10)
    fig.tight_layout()
    return fig


def draw_ring_processes(world_size: int, step: int = 0) -> plt.Figure:
    """The ring allreduce over processes (lesson 06): ranks on a circle, each sending to its
    right neighbour; labels say which chunk each rank sends in reduce-scatter step ``step``
    (chunk ``rank - step`` mod p, as in ``course_lib.distributed.ring_allreduce``)."""
    import math

    from matplotlib.patches import Circle, FancyArrowPatch

    p = world_size
    fig, ax = plt.subplots(figsize=(4.6, 4.6))
    angles = [math.pi / 2 - 2 * math.pi * r / p for r in range(p)]   # rank 0 at the top
    pos = [(math.cos(a), math.sin(a)) for a in angles]
    for r, (x, y) in enumerate(pos):
        ax.add_patch(Circle((x, y), 0.2, facecolor=f"C{r % 10}", alpha=0.3, edgecolor="black"))
        ax.text(x, y, f"rank {r}", ha="center", va="center", fontsize=9)
    for r in range(p):
        (x0, y0), (x1, y1) = pos[r], pos[(r + 1) % p]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14,
                                     shrinkA=22, shrinkB=22, connectionstyle="arc3,rad=-0.25"))
        mx, my = (x0 + x1) / 2 * 1.35, (y0 + y1) / 2 * 1.35
        ax.text(mx, my, f"chunk {(r - step) % p}", ha="center", va="center", fontsize=8,
                color="crimson")
    ax.set(xlim=(-1.6, 1.6), ylim=(-1.6, 1.6), aspect="equal")
    ax.axis("off")
    ax.set_title(f"ring of {p} processes, reduce-scatter step {step}:\neach rank sends one chunk "
                 "to its right neighbour", fontsize=9)
    fig.tight_layout()
    return fig


_SPLIT_COLOURS = {"column": "tab:blue", "row": "tab:orange", "vocabulary": "tab:purple",
                  "whole": "0.85"}


def draw_collective_trace(trace: dict, prefix: str = "blocks.0.", *,
                          title: str | None = None) -> plt.Figure:
    """Where each collective of one training step falls, for the layers whose names start with
    ``prefix`` (one transformer block by default): rows for forward and backward, the layers as
    boxes in the order they ran (coloured by how they are split), a red mark after each that
    issued a collective. ``trace``: ``examples.tensor_parallel_workers.trace_collectives``'s.
    """
    fig, ax = plt.subplots(figsize=(10, 3.2))
    rows, step, width, shown = {"forward": 1.0, "backward": -0.4}, 1.8, 1.25, set()
    longest = 0
    for phase, y in rows.items():
        names = [n for p, n in trace["layers"] if p == phase and n.startswith(prefix)]
        longest = max(longest, len(names))
        for x, name in enumerate(names):
            kind = trace["kinds"].get(name, "whole")
            shown.add(kind)
            ax.add_patch(plt.Rectangle((x * step, y - 0.25), width, 0.5, ec="k", lw=0.8,
                                       fc=_SPLIT_COLOURS[kind], alpha=0.8))
            ax.text(x * step + width / 2, y, name[len(prefix):].rpartition(".")[2],
                    ha="center", va="center", fontsize=8)
            sent = [e for e in trace["events"] if e[0] == phase and e[1] == name]
            for k, (_, _, op, elements, _) in enumerate(sent):
                mark = x * step + width + (step - width) / 2
                ax.plot(mark, y, marker="D", color="red", ms=8)
                ax.text(mark, y + 0.32 + 0.25 * k, f"{op} of {elements:,}", ha="center",
                        va="bottom", fontsize=7.5, color="red")
        ax.text(-0.25, y, phase, ha="right", va="center", fontsize=9, weight="bold")
    kinds = [k for k in _SPLIT_COLOURS if k in shown]
    ax.legend([plt.Rectangle((0, 0), 1, 1, fc=_SPLIT_COLOURS[k], ec="k", alpha=0.8)
               for k in kinds],
              [f"{k}-parallel" if k != "whole" else "whole on every rank" for k in kinds],
              loc="lower center", ncol=len(kinds), fontsize=8, frameon=False,
              bbox_to_anchor=(0.5, -0.12))
    ax.set(xlim=(-1.6, longest * step), ylim=(-0.9, 1.75))
    ax.axis("off")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def draw_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> plt.Figure:
    """A mesh of ranks (lesson 16), one panel per dimension: the ranks laid out row-major as
    ``init_device_mesh`` lays them (the last dimension innermost, drawn left to right; the one
    before it upwards; a third, outermost, as a second layer drawn behind), and in each panel a
    line joining the ranks of every group of that dimension: who talks to whom in it."""
    import itertools
    import math

    if not 1 <= len(shape) <= 3 or len(names) != len(shape):
        raise ValueError(f"draw_mesh draws meshes of 1 to 3 dimensions with one name each, got "
                         f"shape {tuple(shape)} and names {tuple(names)}.")
    full = (1,) * (3 - len(shape)) + tuple(shape)                  # (outer, middle, inner)

    def where(coord: tuple[int, ...]) -> tuple[float, float]:
        outer, middle, inner = (0,) * (3 - len(coord)) + tuple(coord)
        return inner + 0.45 * outer, middle + 0.3 * outer          # the outer layer: behind

    coords = list(itertools.product(*(range(s) for s in shape)))
    rank = {c: i for i, c in enumerate(coords)}                    # row-major: arange(world)
    fig, axes = plt.subplots(1, len(shape), figsize=(3.1 * len(shape), 2.8), squeeze=False)
    for dim, (ax, name) in enumerate(zip(axes[0], names)):
        colour = f"C{dim}"
        others = [range(s) if d != dim else [None] for d, s in enumerate(shape)]
        for fixed in itertools.product(*others):                   # one group per fixed rest
            members = [tuple(i if d == dim else f for d, f in enumerate(fixed))
                       for i in range(shape[dim])]
            xs, ys = zip(*(where(m) for m in members))
            ax.plot(xs, ys, "-", color=colour, lw=2.5, alpha=0.7, zorder=1)
        for c in coords:
            x, y = where(c)
            ax.scatter([x], [y], s=420, color="white", edgecolor="black", zorder=2)
            ax.text(x, y, str(rank[c]), ha="center", va="center", fontsize=9, zorder=3)
        groups = math.prod(shape) // shape[dim]
        ax.set_title(f'"{name}": {groups} group{"s" * (groups > 1)} of {shape[dim]}',
                     fontsize=9, color=colour)
        ax.set(xlim=(-0.5, full[2] - 0.5 + 0.45 * (full[0] - 1) + 0.1),
               ylim=(-0.5, full[1] - 0.5 + 0.3 * (full[0] - 1) + 0.1), aspect="equal")
        ax.axis("off")
    fig.suptitle(f"mesh {' x '.join(map(str, shape))} ({', '.join(names)}): the ranks of each "
                 "group joined by a line", fontsize=9)
    fig.tight_layout()
    return fig


def draw_read_plan(pieces: list[tuple[int, int]], plan: list[list[tuple[int, int, int]]], *,
                   name: str | None = None) -> plt.Figure:
    """A tensor's rows resharded on load (lesson 13): the saved ``pieces`` (``(offset, length)``
    along dim 0, in saving-rank order) on top, one bar each, and below them each new rank's rows,
    split into the reads of ``plan`` (``read_plan``'s answer: per new rank ``(piece, start,
    stop)``, rows within that piece) shaded in the colour of their piece; ``name`` for the title.
    """
    rows = max((offset + length for offset, length in pieces), default=0)
    n_new = len(plan)
    fig, ax = plt.subplots(figsize=(6.4, 0.5 * (len(pieces) + n_new) + 1.1))
    labels = []
    for i, (offset, length) in enumerate(pieces):              # saved pieces, top down
        y = n_new + len(pieces) - i
        ax.barh(y, length, left=offset, height=0.6, color=f"C{i}", alpha=0.85,
                edgecolor="black")
        if length:
            ax.text(offset + length / 2, y, f"rows {offset}-{offset + length - 1}",
                    ha="center", va="center", fontsize=8)
        labels.append((y, f"saved by rank {i}"))
    for r, reads in enumerate(plan):                            # new ranks, below
        y = n_new - r
        for i, start, stop in reads:
            first = pieces[i][0] + start
            ax.barh(y, stop - start, left=first, height=0.6, color=f"C{i}", alpha=0.35,
                    edgecolor="black", hatch="//")
            ax.text(first + (stop - start) / 2, y, f"piece {i} [{start}:{stop}]",
                    ha="center", va="center", fontsize=7)
        if not reads:
            ax.text(rows / 2, y, "no rows", ha="center", va="center", fontsize=8,
                    color="grey")
        labels.append((y, f"new rank {r} reads"))
    ax.axhline(n_new + 0.5, color="grey", lw=0.8)
    ys, names = zip(*labels)
    ax.set_yticks(ys, names)
    ax.set(xlim=(0, max(rows, 1)), xticks=range(rows + 1), xlabel="row of the whole tensor (dim 0)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{name + ': ' if name else ''}{rows} rows saved in {len(pieces)} pieces, read "
                 f"by {n_new} ranks\neach read shaded in the colour of the piece it comes from",
                 fontsize=9)
    fig.tight_layout()
    return fig
