"""Reading a ``step_comm.measure_step_comm`` run (lesson 10, section 2): each number with its
95 % bootstrap interval, and a verdict only where two intervals lie apart.

- ``prediction_check``: each strategy's all-reduces alone against the alpha-beta model's price;
- ``step_parts``: a step's exposed time split into the wrapper's own work and its all-reduces;
- ``stamp_summary``: when ``bucketed``'s all-reduces ran, from their stamps (each step read by
  ``overlap_of_step``), how much of their time in the step did not lengthen it, and how long
  they ran once both ranks had launched them (``after_launch``), in the step and alone.

Every function takes the run as ``measure_step_comm`` returns it and returns plain numbers
(seconds, as ``(median, low, high)``); the ``*_table`` functions print them.
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable

from .._compare import _percentile_interval
from ..timing import bootstrap_difference, bootstrap_median
from .cost_model import predicted_comm, ring_time
from .step_comm import STRATEGIES_TIMED, slower_rank_wait

__all__ = ["ms", "compare_intervals", "prediction_check", "prediction_table", "step_parts",
           "parts_table", "overlap_of_step", "after_launch", "stamp_summary", "stamp_table",
           "comm_after_backward", "bucket_cap_rows", "bucket_cap_table"]

Interval = tuple[float, float, float]   # (median, low, high), seconds


def ms(t: Interval) -> str:
    """``(median, low, high)`` in seconds as ``"median [low, high]"`` in ms (2 decimals under
    10 ms, else 1)."""
    d = 2 if abs(t[0]) < 0.01 else 1
    return f"{t[0] * 1e3:.{d}f} [{t[1] * 1e3:.{d}f}, {t[2] * 1e3:.{d}f}]"


def compare_intervals(a: Interval, b: Interval) -> str:
    """``"lower"`` or ``"higher"`` where a's interval lies wholly below or above b's, else
    ``"not told apart"``."""
    return "lower" if a[2] < b[1] else "higher" if a[1] > b[2] else "not told apart"


def prediction_check(run: dict, alpha: float, beta: float, p: int = 2) -> dict:
    """For each (model, strategy): ``calls`` (all-reduces per step), ``alone`` (the same calls
    all-reduced alone, one round's seconds, as an interval), ``predicted`` (their price as ring
    all-reduces one after another, ``cost_model.predicted_comm``) and ``ratio`` (predicted /
    alone, an interval: the prediction over the interval's ends). Per model, ``"<model>
    naive - bucketed"``: the paired difference of the two strategies' rounds alone."""
    out: dict = {}
    for m, e in run["models"].items():
        for s in STRATEGIES_TIMED:
            msgs, alone = e["messages"][s], bootstrap_median(e["alone"][s])
            pred = predicted_comm(msgs, p, alpha, beta)
            out[m, s] = {"calls": len(msgs), "bytes": sum(msgs), "alone": alone,
                         "predicted": pred,
                         "ratio": (pred / alone[0], pred / alone[2], pred / alone[1])}
        out[m, "naive - bucketed"] = bootstrap_difference(e["alone"]["naive"],
                                                          e["alone"]["bucketed"])
    return out


def prediction_table(check: dict) -> str:
    """``prediction_check``'s rows, one per model and strategy, then each model's difference."""
    lines = [f"{'':>18} calls | {'alone, ms [95 %]':<22} | predicted ms | predicted / alone"]
    for key, c in check.items():
        if key[1] in STRATEGIES_TIMED:
            r = c["ratio"]
            lines.append(f"{key[0]:>9} {key[1]:>8}: {c['calls']:>3} | {ms(c['alone']):<22} | "
                         f"{c['predicted'] * 1e3:12.2f} | {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]")
    for key, d in check.items():
        if key[1] == "naive - bucketed":
            lines.append(f"{key[0]}: naive's calls alone - bucketed's, paired rounds: {ms(d)} ms")
    return "\n".join(lines)


def _wait_interval(wait: Callable[[list[list[float]]], float], durations: list[list[float]],
                   resamples: int = 1000, seed: int = 0) -> Interval:
    """``wait(durations)`` and its percentile bootstrap interval, the steps resampled whole (a
    drawn step brings every rank's duration of it)."""
    steps = len(durations[0])

    def resample(rng: random.Random) -> float:
        idx = [rng.randrange(steps) for _ in range(steps)]
        return wait([[d[i] for i in idx] for d in durations])
    return (wait(durations), *_percentile_interval(resample, 0.95, resamples, seed))


def step_parts(run: dict, wait: Callable[[list[list[float]]], float] = slower_rank_wait) -> dict:
    """For each (model, strategy), paired differences of steps (intervals): ``exposed`` =
    step - local, ``wrapper`` = nosend - local (the wrapper's own work), ``comm`` = step -
    nosend (the all-reduces in the step, the wait for the slower rank included). Per model,
    ``(model, "wait")``: ``wait(local_met)``, seconds per step, with its interval (the steps
    resampled, every rank's duration of a drawn step together), and ``(model, "naive -
    bucketed")``: the steps' paired difference."""
    out: dict = {}
    for m, e in run["models"].items():
        st = e["step"]
        for s in STRATEGIES_TIMED:
            out[m, s] = {"exposed": bootstrap_difference(st[s], st["local"]),
                         "wrapper": bootstrap_difference(st[f"{s}_nosend"], st["local"]),
                         "comm": bootstrap_difference(st[s], st[f"{s}_nosend"])}
        out[m, "wait"] = _wait_interval(wait, e["local_met"])
        out[m, "naive - bucketed"] = bootstrap_difference(st["naive"], st["bucketed"])
    return out


def parts_table(parts: dict, check: dict) -> str:
    """``step_parts`` beside the calls alone (``prediction_check``), ms per step."""
    lines = ["ms per step, median [95 %]:  exposed (step - local) | wrapper (nosend - local) |",
             f"{'':>29}all-reduces in the step (step - nosend) | the same calls alone"]
    for key, p in parts.items():
        if key[1] in STRATEGIES_TIMED:
            lines.append(f"{key[0]:>9} {key[1]:>8}: " + " | ".join(
                ms(p[k]) for k in ("exposed", "wrapper", "comm")) + f" | {ms(check[key]['alone'])}")
    for key, d in parts.items():
        if key[1] == "naive - bucketed":
            m = key[0]
            lines.append(f"{m}: naive's step - bucketed's {ms(d)}; waiting for the slower rank "
                         f"{ms(parts[m, 'wait'])} ms per step")
    return "\n".join(lines)


def overlap_of_step(calls: list[tuple[float, float]], backward_end: float) -> tuple[float, float]:
    """One rank's stamped step: ``calls``, each all-reduce's (start, end) clock readings in launch
    order, and the clock at ``backward_end``. Returns ``(share, tail)``: the share of the calls'
    summed time (launch to result) that ran before backward's end, a call that straddles it
    split there; and the seconds from backward's end to the last result, 0 when every result
    came before it."""
    busy = sum(e - s for s, e in calls)
    before = sum(max(0.0, min(e, backward_end) - s) for s, e in calls)
    return before / busy, max(0.0, max(e for _, e in calls) - backward_end)


def _stamped_rows(rounds: list, in_step: bool,
                  overlap: Callable[..., tuple[float, float]] = overlap_of_step) -> list[dict]:
    rows = []
    for ranks in rounds:
        for r in ranks:
            calls = r["calls"]
            row = {"calls": sum(e - s for s, e in calls)}
            if in_step:
                end = r["backward_end"]
                share, tail = overlap([tuple(c) for c in calls], end)
                row |= {"lead": end - calls[0][0], "tail": tail, "share": share}
            rows.append(row)
    return rows


def _hidden(calls_by_step: list[list[float]], step: list[float], nosend: list[float],
            resamples: int = 2000, seed: int = 0) -> Interval:
    """``median(calls) - (median(step) - median(nosend))`` and its percentile bootstrap
    interval: the stamped steps resampled whole (every rank's row of a drawn step), and, apart
    from them, the rounds of step and nosend resampled whole (the two were timed in the same
    rounds; the stamped steps ran later)."""
    def stat(rows: list[float], s: list[float], n: list[float]) -> float:
        return statistics.median(rows) - (statistics.median(s) - statistics.median(n))

    def resample(rng: random.Random) -> float:
        rows = [c for _ in calls_by_step for c in calls_by_step[rng.randrange(len(calls_by_step))]]
        idx = [rng.randrange(len(step)) for _ in step]
        return stat(rows, [step[i] for i in idx], [nosend[i] for i in idx])
    return (stat([c for cs in calls_by_step for c in cs], step, nosend),
            *_percentile_interval(resample, 0.95, resamples, seed))


def after_launch(ranks: list[dict]) -> float:
    """One stamped round (``[rank] -> {"calls": [[start, end], ...], ...}``): the seconds the
    calls ran once every rank had launched them, averaged over the ranks. For each rank, the
    length of the union of ``[latest start of call j over the ranks, this rank's end of call
    j]``: an all-reduce cannot finish before the last rank launches it, so the time before
    that is waiting for a rank, and the union counts a call queued behind another once."""
    starts = [max(r["calls"][j][0] for r in ranks) for j in range(len(ranks[0]["calls"]))]
    busy = []
    for r in ranks:
        total, reach = 0.0, float("-inf")
        for s, e in sorted((s, e) for s, (_, e) in zip(starts, r["calls"])):
            if e > max(s, reach):
                total += e - max(s, reach)
                reach = e
        busy.append(total)
    return statistics.fmean(busy)


def stamp_summary(run: dict, model: str,
                  overlap: Callable[..., tuple[float, float]] = overlap_of_step) -> dict:
    """``bucketed``'s stamped steps of ``model``, over steps and ranks (medians, intervals):
    ``lead`` (the first call's start before backward's end), ``share`` (of the calls' time
    before backward's end), ``tail`` (backward's end to the last result), ``in_step`` (the
    calls' summed time, launch to result, in the step) and ``alone`` (the same in the rounds
    alone); ``steps``: how many (steps x ranks); ``hidden``: the calls' time in the step that
    did not lengthen it, ``in_step`` less the step's growth over ``bucketed_nosend``
    (``_hidden``); ``after_step`` and ``after_alone``: ``after_launch`` per round, in the step
    and alone, and ``after_extra`` their difference, rounds paired in the order run (a stamped
    block of steps, then one of rounds alone). ``overlap``: the function that reads one step's
    share and tail (a learner's passing answer, or ``overlap_of_step``)."""
    e = run["models"][model]
    stamps = e["bucketed_calls"]
    rows = _stamped_rows(stamps["step"], in_step=True, overlap=overlap)
    out = {k: bootstrap_median([r[k] for r in rows]) for k in ("lead", "share", "tail", "calls")}
    out["in_step"] = out.pop("calls")
    out["alone"] = bootstrap_median([r["calls"] for r in _stamped_rows(stamps["alone"], False)])
    out["steps"] = len(rows)
    by_step = [[r["calls"] for r in _stamped_rows([ranks], True)] for ranks in stamps["step"]]
    out["hidden"] = _hidden(by_step, e["step"]["bucketed"], e["step"]["bucketed_nosend"])
    after = {k: [after_launch(ranks) for ranks in stamps[k]] for k in ("step", "alone")}
    out["after_step"], out["after_alone"] = (bootstrap_median(after[k]) for k in after)
    out["after_extra"] = bootstrap_difference(after["step"], after["alone"])
    return out


def stamp_table(summaries: dict) -> str:
    """``{model: stamp_summary(...)}`` printed, one block per model."""
    lines = ["bucketed's calls, stamped: median over steps and ranks [95 %], ms"]
    for m, s in summaries.items():
        lines.append(f"{m:>9} ({s['steps']} steps x ranks): the first call starts "
                     f"{ms(s['lead'])} before backward's end; {s['share'][0]:.0%} of the calls' "
                     f"time runs before it;\n{'':>11}the tail after it {ms(s['tail'])}; the calls "
                     f"last {ms(s['in_step'])} in the step, {ms(s['alone'])} alone "
                     f"({s['in_step'][0] / s['alone'][0]:.1f}x)")
        lines.append(f"{'':>11}of their time in the step, {ms(s['hidden'])} did not lengthen "
                     "it (the calls in the step - the step's growth over bucketed_nosend)")
        extra = s["after_extra"]
        lines.append(f"{'':>11}once both ranks had launched them: {ms(s['after_step'])} in the "
                     f"step, {ms(s['after_alone'])} alone; paired difference {ms(extra)}, "
                     + ("longer in the step" if extra[1] > 0 else "shorter in the step"
                        if extra[2] < 0 else "not told apart"))
    return "\n".join(lines)


def comm_after_backward(ready: list[float], sizes: list[float], p: int, alpha: float,
                        beta: float) -> float:
    """The alpha-beta model of a bucketed step's tail: bucket i, of ``sizes[i]`` bytes, is full
    ``ready[i]`` seconds into backward (launch order); its ring all-reduce starts once it is
    full and the previous call is done (a group's calls run one at a time, in order) and lasts
    ``ring_time(sizes[i], p, alpha, beta)``. Returns the seconds from backward's end (the
    latest ``ready``) to the last call's end."""
    end = float("-inf")
    for r, n in zip(ready, sizes):
        end = max(end, r) + ring_time(n, p, alpha, beta)
    return end - max(ready)


def bucket_cap_rows(run: dict, alpha: float, beta: float, p: int = 2,
                    after: Callable[..., float] = comm_after_backward,
                    over_link: bool = False) -> list[dict]:
    """One row per cap of a ``step_comm.measure_bucket_caps`` run (``over_link``: the caps
    timed over its link, whose alpha and beta the caller passes): ``cap_mb``, ``buckets``,
    ``extra`` (the step's time over ``local``), ``vs_last`` (over the last cap's step), both
    paired intervals; the model's ``after_backward`` (the tail, by ``after``: a learner's
    passing answer or ``comm_after_backward``), ``model_vs_last`` (that tail less the last
    cap's) and ``all_calls`` (every call one after another, nothing overlapped)."""
    caps, prefix = ((run["link_caps_mb"], "link cap") if over_link else (run["caps_mb"], "cap"))
    last = caps[-1]
    steps = run["step"]

    tail = {cap: after(run["buckets"][cap]["ready"], run["buckets"][cap]["bytes"], p, alpha, beta)
            for cap in caps}
    rows = []
    for cap in caps:
        b = run["buckets"][cap]
        rows.append({"cap_mb": cap, "buckets": len(b["bytes"]),
                     "extra": bootstrap_difference(steps[f"{prefix} {cap:g}"], steps["local"]),
                     "vs_last": bootstrap_difference(steps[f"{prefix} {cap:g}"],
                                                     steps[f"{prefix} {last:g}"]),
                     "after_backward": tail[cap], "model_vs_last": tail[cap] - tail[last],
                     "all_calls": predicted_comm(b["bytes"], p, alpha, beta)})
    return rows


def bucket_cap_table(rows: list[dict]) -> str:
    """``bucket_cap_rows`` printed, ms: measured [95 %] beside the model."""
    last = rows[-1]["cap_mb"]
    versus = f"step - {last:g} MiB's step"
    lines = ["ms per step, median [95 %] | the model: the calls' tail after backward, and "
             "every call with none overlapped",
             f"cap MiB buckets | {'step - local':<20} | {versus:<22} "
             f"| tail | tail - {last:g} MiB's | every call"]
    for r in rows:
        lines.append(f"{r['cap_mb']:>7g} {r['buckets']:>7} | {ms(r['extra']):<20} | "
                     f"{ms(r['vs_last']):<22} | {r['after_backward'] * 1e3:>4.1f} | "
                     f"{r['model_vs_last'] * 1e3:>{12 + len(f'{last:g}')}.1f} | "
                     f"{r['all_calls'] * 1e3:>10.1f}")
    return "\n".join(lines)
