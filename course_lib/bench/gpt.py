"""Benchmarks of lesson 14's GPT: the one-process baseline, and tensor against data parallelism.

``python -m course_lib.bench gpt-baseline [--quick] [--steps N] [--out PATH]`` trains the small
GPT (``course_lib.models.gpt``) in ONE process on the real text (``course_lib.data_text``) with
AdamW from a fixed seed, and prints JSON (written to ``results/gpt-baseline-MACHINE.json``, or
``--out``): every step's loss, the tokens per second after a warm-up (median, and the spread
from the fastest and slowest step), the held-out loss at the start and the end, the config. It
is the oracle of later lessons: the same seed, batches (``batch_schedule``) and optimizer must
give the same losses, to rounding.

``python -m course_lib.bench tp-vs-dp [--quick] [--out PATH]`` times, interleaved in the same 2
worker processes (one torch thread each, gloo on a CPU), on the same global batch with AdamW,
the step of ``tensor_parallel`` (``parallelize_gpt`` over the world, Megatron-LM, every rank
the whole batch) and ``data_parallel`` (the whole model on every rank, each ``1/world`` of the
batch, the course's ``DistributedDataParallel(strategy="bucketed")``). It reports the samples,
medians, the TP/DP ratio with its bootstrap interval and a verdict naming a winner only when the
interval excludes 1; the all-reduces one step makes (``dist.all_reduce`` wrapped: for TP
Megatron's ``2 (2 L + 1)`` of ``B*T*C`` and 3 of ``B*T`` for the loss, for DP one per bucket);
and both first-step losses (equal to float32 rounding: equal work). Written to
``results/tp-vs-dp-MACHINE.json``.

Why the course's DDP: torch's sends its buckets from its C++ reducer straight to the process
group, so wrapping ``dist.all_reduce`` counts nothing (checked: zero calls per step); the
course's calls it in its hook, once per bucket, and steps within a few per cent of torch's
(``bench ddp``). PyTorch counterpart: none (torch's DDP and ``torch.distributed.tensor.parallel``
are what the two variants build by hand). Lesson 14.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..data_text import HELD_OUT, batch_schedule, find_text, load_text, split_tokens
from ..devices import cpu_cores, cpu_threads
from ..distributed import current_device, launch, reduce_value
from ..distributed.env import _slowest
from ..distributed.recording import record_collectives
from ..distributed.tensor.parallel import parallelize_gpt
from ..models.gpt import GPT, GPTConfig
from ..parallel.ddp import DistributedDataParallel
from ..timing import Timer, bootstrap_ratio, compare
from .scaling import _finish, _out_option, report_header

__all__ = ["BASELINE_DEFAULTS", "HELD_OUT", "TP_VS_DP_DEFAULTS", "baseline", "batch_schedule",
           "main_baseline", "main_tp_vs_dp", "parse_config", "split_tokens", "tp_vs_dp"]

LR = 1e-3
#: Full run of ``gpt-baseline``: about 70 s in one process on 2 quiet CPU cores (22 ms a step).
BASELINE_DEFAULTS = {"steps": 3000, "batch_size": 16, "seq_len": 64, "warmup": 5,
                     "eval_batches": 20}
BASELINE_QUICK = {"steps": 20, "batch_size": 8, "seq_len": 32, "warmup": 2, "eval_batches": 2}
#: Full run of ``tp-vs-dp``: about 45 s, 2 ranks of one thread each (TP ~50 ms, DP ~35 ms a step).
TP_VS_DP_DEFAULTS = {"world_size": 2, "batch_size": 16, "seq_len": 64, "samples": 20,
                     "steps_per_sample": 20}
TP_VS_DP_QUICK = {"world_size": 2, "batch_size": 8, "seq_len": 32, "samples": 3,
                  "steps_per_sample": 2}
SPLIT_NOTE = ("course_lib.data_text offers no split: the last 10 % of the corpus's tokens are "
              "held out (never drawn for training), the first 90 % train")
DP_NOTE = ("course_lib.parallel.DistributedDataParallel(strategy='bucketed'): its hook calls "
           "dist.all_reduce once per bucket, so the count is what it sends; torch's DDP calls "
           "the process group from its C++ reducer, bypassing dist.all_reduce, so wrapping that "
           "function counts nothing for it (checked: 0 calls per step)")


# ---- the data: the corpus split, and the batches every variant draws ----

def parse_config(text: str | None) -> GPTConfig:
    """``"n_layer=1,n_embd=48"`` -> ``GPTConfig(n_layer=1, n_embd=48)`` (None: the default)."""
    if not text:
        return GPTConfig()
    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    kwargs: dict = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in fields:
            raise ValueError(f"--config expects KEY=VALUE pairs with KEY one of {list(fields)}, "
                             f"got {item!r}.")
        kwargs[key] = value.lower() in {"1", "true", "yes"} if key == "bias" else int(value)
    return GPTConfig(**kwargs)


def _check_sizes(name: str, config: GPTConfig, batch_size: int, seq_len: int) -> None:
    for label, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}.")
    if seq_len > config.block_size:
        raise ValueError(f"{name}: seq_len {seq_len} exceeds the config's block_size "
                         f"{config.block_size}; raise block_size or shorten seq_len.")


def _optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)   # torch's defaults otherwise: the oracle's optimizer


def _optimizer_text(lr: float) -> str:
    return f"torch.optim.AdamW(lr={lr}, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01)"


# ---- 1. the one-process baseline ----

@torch.no_grad()
def _eval_loss(model: GPT, tokens: torch.Tensor, batch_size: int, seq_len: int, batches: int,
               seed: int, device: torch.device) -> float:
    """The mean loss over ``batches`` batches of ``tokens``, always the same ones (``seed``)."""
    sched = batch_schedule(tokens, batch_size, seq_len, seed=seed)
    losses = [model(X.to(device), Y.to(device))[1].item()
              for X, Y in (next(sched) for _ in range(batches))]
    return sum(losses) / batches


def baseline(steps: int, batch_size: int, seq_len: int, *, config: GPTConfig | None = None,
             lr: float = LR, seed: int = 0, threads: int | None = None, warmup: int = 5,
             eval_batches: int = 20, max_bytes: int | None = None,
             device: torch.device | str = "cpu") -> dict:
    """Train the small GPT in one process on the real text; a JSON-ready dict of what happened.

    ``GPT(config)`` is built after ``torch.manual_seed(seed)``; step i (of ``steps``, more than
    ``warmup``) trains with AdamW (``lr``, torch's other defaults) on the i-th ``(batch_size,
    seq_len)`` batch of ``batch_schedule(train, batch_size, seq_len, seed=seed)`` (``train``: the
    first 90 % of the tokens, ``split_tokens``). The held-out loss, before the first step and
    after the last, is the mean over ``eval_batches`` fixed batches of the last 10 % (seed
    ``seed + 1``). ``threads``: torch's threads meanwhile (default ``cpu_cores()``), restored
    after; ``warmup``: first steps left out of the tokens per second; ``max_bytes``: read only
    that much of the corpus; ``device``: default the CPU (the oracle is a CPU run).

    Returns:
        ``{"losses", "loss_first", "loss_last", "val_loss_start", "val_loss", "step_seconds",
        "step_median_s", "step_min_s", "step_max_s", "tokens_per_s", "tokens_per_s_min",
        "tokens_per_s_max", "config", "params", ...}``; the tokens per second are
        ``batch_size * seq_len`` over the median step (``_min`` over the slowest step, ``_max``
        over the fastest) of the steps after ``warmup``.
    """
    config = config or GPTConfig()
    _check_sizes("baseline", config, batch_size, seq_len)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= warmup < steps:
        raise ValueError(f"baseline: steps must be an integer above warmup ({warmup}), got "
                         f"{steps!r}: the tokens per second need steps after the warm-up.")
    if eval_batches < 1:
        raise ValueError(f"baseline: eval_batches must be >= 1, got {eval_batches!r}.")
    threads = cpu_cores() if threads is None else threads
    device = torch.device(device)
    tokens = load_text(max_bytes=max_bytes)
    train, val = split_tokens(tokens)
    start = time.perf_counter()
    with cpu_threads(threads):
        torch.manual_seed(seed)
        model = GPT(config).to(device)
        opt = _optimizer(model.parameters(), lr)
        val_start = _eval_loss(model, val, batch_size, seq_len, eval_batches, seed + 1, device)
        sched = batch_schedule(train, batch_size, seq_len, seed=seed)
        timer = Timer(device)
        losses = []
        for _ in range(steps):
            X, Y = (t.to(device) for t in next(sched))          # (B, T) each
            with timer:
                opt.zero_grad(set_to_none=True)
                _, loss = model(X, Y)
                loss.backward()
                opt.step()
            losses.append(loss.item())
        val_end = _eval_loss(model, val, batch_size, seq_len, eval_batches, seed + 1, device)
    wall = time.perf_counter() - start
    timed = timer.times[warmup:]
    med, fast, slow = statistics.median(timed), min(timed), max(timed)
    per_step = batch_size * seq_len
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"baseline: a loss is not finite (lr={lr} too high?): "
                                 f"{[x for x in losses if not math.isfinite(x)][:3]}")
    return {
        "config": dataclasses.asdict(config),
        "params": sum(p.numel() for p in model.parameters()),
        "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
        "tokens_per_step": per_step, "lr": lr, "optimizer": _optimizer_text(lr), "seed": seed,
        "threads": threads, "device": str(device), "warmup_steps": warmup,
        "data": {"corpus": find_text().name, "max_bytes": max_bytes,
                 "tokens": tokens.numel(), "train_tokens": train.numel(),
                 "val_tokens": val.numel(), "split": SPLIT_NOTE,
                 "batches": "batch_schedule(train, batch_size, seq_len, seed=seed): text_batch "
                            "with one torch.Generator seeded `seed`, one batch per step",
                 "val_batches": eval_batches, "val_seed": seed + 1},
        "init": "torch.manual_seed(seed); GPT(config)",
        "losses": losses, "loss_first": losses[0], "loss_last": losses[-1],
        "loss_last10_mean": statistics.fmean(losses[-10:]),
        "val_loss_start": val_start, "val_loss": val_end,
        "step_seconds": timer.times,
        "step_median_s": med, "step_min_s": fast, "step_max_s": slow,
        "tokens_per_s": per_step / med, "tokens_per_s_min": per_step / slow,
        "tokens_per_s_max": per_step / fast,
        "wall_s": round(wall, 2),
    }


# ---- 2. tensor parallel against data parallel, interleaved in the same workers ----

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all")


def _counted(records: list) -> dict:
    """What one step sent (``record_collectives``' records): the all-reduces counted, their
    elements and bytes, by phase, and the names of any other collective."""
    calls = [(r.context, r.elements, r.bytes) for r in records if r.name == "all_reduce"]
    return {"count": len(calls), "elements": sum(n for _, n, _ in calls),
            "bytes": sum(b for _, _, b in calls),
            "by_phase": {p: sum(1 for q, _, _ in calls if q == p)
                         for p in ("forward", "backward", "optimizer")},
            "calls": [list(c) for c in calls],
            "other_collectives": [r.name for r in records if r.name != "all_reduce"]}


def _tp_vs_dp_worker(config: GPTConfig, batch_size: int, seq_len: int, samples: int,
                     steps_per_sample: int, seed: int, lr: float, warmup: int,
                     max_bytes: int | None) -> dict | None:
    """Runs in every rank of ``launch``: both variants, interleaved; rank 0 returns the dict."""
    torch.set_num_threads(1)
    rank, world, device = dist.get_rank(), dist.get_world_size(), current_device()
    share = batch_size // world
    train, _ = split_tokens(load_text(max_bytes=max_bytes))
    sched = batch_schedule(train, batch_size, seq_len, seed=seed)   # the same on every rank
    batches = [tuple(t.to(device) for t in next(sched)) for _ in range(steps_per_sample)]
    mine = [(X[rank * share:(rank + 1) * share], Y[rank * share:(rank + 1) * share])
            for X, Y in batches]                                    # this rank's (B/w, T)
    torch.manual_seed(seed)
    base = GPT(config).to(device)                                   # the same start everywhere
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    tp_model = parallelize_gpt(copy.deepcopy(base))
    dp_model = DistributedDataParallel(copy.deepcopy(base), strategy="bucketed")
    tp_opt, dp_opt = _optimizer(tp_model.parameters(), lr), _optimizer(dp_model.parameters(), lr)
    alone = parallelize_gpt(copy.deepcopy(base))      # the same split, its all-reduces skipped
    alone_opt = _optimizer(alone.parameters(), lr)
    phase = ["forward"]

    def phased(model, opt, data: list) -> Callable[[int], torch.Tensor]:
        """A training step on ``data[i]`` that keeps ``phase`` up to date."""
        def step(i: int) -> torch.Tensor:
            X, Y = data[i]
            opt.zero_grad(set_to_none=True)
            phase[0] = "forward"
            _, loss = model(X, Y)    # TP: (B, T, V/t) logits, the full loss; DP: (B/w, T, V)
            phase[0] = "backward"
            loss.backward()          # DP: the gradients averaged over the ranks here
            phase[0] = "optimizer"
            opt.step()
            return loss
        return step
    tp_step, dp_step = phased(tp_model, tp_opt, batches), phased(dp_model, dp_opt, mine)
    alone_step = phased(alone, alone_opt, batches)

    def both_losses() -> dict:
        """Each variant's loss on the first batch (DP's: the mean over the ranks)."""
        return {"tensor_parallel": tp_step(0).item(),
                "data_parallel": reduce_value(dp_step(0).item())}

    def tp_compute_step(i: int) -> torch.Tensor:
        """The tensor-parallel step with every all-reduce skipped: the same arithmetic on the
        same shapes (its numbers are wrong: nothing is summed), without the communication."""
        all_reduce, dist.all_reduce = dist.all_reduce, lambda *args, **kwargs: None
        try:
            return alone_step(i)
        finally:
            dist.all_reduce = all_reduce

    # step 1: the same work? The TP loss is the whole batch's; DP's mean over ranks is too.
    first = both_losses()
    # step 2: what each sends (DDP's buckets are rebuilt after its first backward)
    counts = {}
    for name, step in (("tensor_parallel", tp_step), ("data_parallel", dp_step)):
        with record_collectives(_COLLECTIVES, context=lambda: phase[0]) as records:
            step(1 % steps_per_sample)
        counts[name] = _counted(records)

    def run(step: Callable[[int], torch.Tensor]) -> Callable[[], None]:
        def steps() -> None:
            for i in range(steps_per_sample):
                step(i)
        return steps

    # interleaved, the first variant alternating round by round; a barrier before each sample,
    # the slowest rank's time after; one call (steps_per_sample steps) per sample
    timed = compare({"tensor_parallel": run(tp_step), "data_parallel": run(dp_step),
                     "tensor_parallel_compute": run(tp_compute_step)},
                    samples=samples, baseline="data_parallel", warmup=warmup,
                    min_sample_seconds=0.0, calibration_calls=1, device=device,
                    before=dist.barrier, reduce=_slowest)
    last = both_losses()
    if rank != 0:
        return None
    per_step = {name: [s / steps_per_sample for s in seconds]
                for name, seconds in timed.seconds.items()}
    timed = dataclasses.replace(timed, seconds=per_step, _ratios={})
    return {"backend": dist.get_backend(), "first": first, "last": last, "counts": counts,
            "param_bytes": param_bytes, "comparison": timed.to_json(),
            "verdict": timed.verdict("tensor_parallel", "data_parallel"),
            "compute_verdict": timed.verdict("tensor_parallel_compute", "data_parallel"),
            "comm_verdict": timed.verdict("tensor_parallel", "tensor_parallel_compute"),
            "seconds": per_step, "order": timed.order}


def _megatron_count(config: GPTConfig, batch_size: int, seq_len: int) -> dict:
    """Megatron's all-reduces per step: per block 2 forward (after attention's ``out_proj`` and
    the MLP's ``proj``) and 2 backward (before ``qkv`` and ``fc``) of ``B*T*C``; the vocabulary-
    parallel embedding 1 forward, the head 1 backward; the loss 3 of ``B*T`` (max, sum of
    exponentials, target logit)."""
    L, BT, C = config.n_layer, batch_size * seq_len, config.n_embd
    big = 2 * L + 1
    return {"forward": big + 3, "backward": big, "optimizer": 0, "count": 2 * big + 3,
            "elements": 2 * big * BT * C + 3 * BT,
            "bytes": 4 * (2 * big * BT * C + 3 * BT)}          # float32


def tp_vs_dp(world_size: int = 2, batch_size: int = TP_VS_DP_DEFAULTS["batch_size"],
             seq_len: int = TP_VS_DP_DEFAULTS["seq_len"], *,
             samples: int = TP_VS_DP_DEFAULTS["samples"],
             steps_per_sample: int = TP_VS_DP_DEFAULTS["steps_per_sample"],
             config: GPTConfig | None = None, seed: int = 0, lr: float = LR, warmup: int = 1,
             max_bytes: int | None = None, timeout: float = 1800.0) -> dict:
    """Time a tensor-parallel and a data-parallel training step of the small GPT, interleaved in
    the same ``world_size`` workers (one torch thread each); a JSON-ready dict.

    Both start from ``GPT(config)`` after ``torch.manual_seed(seed)`` and train with AdamW on the
    same ``steps_per_sample`` global batches (``batch_schedule`` of the training text), repeated
    every sample: TP (``parallelize_gpt``) gives every rank the whole batch, DP (the course's
    bucketed DDP) rank r rows ``r * B/w`` to ``(r + 1) * B/w``. Step 1 checks the losses agree,
    step 2 counts the all-reduces; then ``samples`` rounds of ``steps_per_sample`` steps each,
    the first variant alternating (a barrier before each sample, the slowest rank's time).

    ``world_size`` must divide ``batch_size`` (the global batch), ``config.n_head`` and
    ``vocab_size``; ``seq_len`` is at most ``config.block_size``; ``samples`` at least 2;
    ``warmup``: untimed calls of each variant (beside the two check steps and one calibration
    call); ``max_bytes``: read only that much of the corpus; ``timeout``: for the whole launch.

    Returns:
        ``{"seconds_per_step": {variant: [...]}, "median_s", "min_s", "ratio_tp_over_dp",
        "ratio_interval", "verdict", "winner", "first_step_loss": {..., "abs_diff",
        "equal"}, "all_reduces_per_step": {variant: {"count", "elements", "bytes", ...}},
        "megatron_formula", "dp_gradient_bytes", "loss_after_run", "comparison", ...}``;
        ``loss_after_run`` is each variant's loss on the first batch after all the timed steps
        (the same training: equal up to float32 drift).
    """
    config = config or GPTConfig()
    _check_sizes("tp_vs_dp", config, batch_size, seq_len)
    for label, value in (("samples", samples), ("steps_per_sample", steps_per_sample),
                         ("world_size", world_size)):
        least = 2 if label == "samples" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"tp_vs_dp: {label} must be an integer >= {least}, got {value!r}.")
    for label, value in (("batch_size", batch_size), ("config.n_head", config.n_head),
                         ("config.vocab_size", config.vocab_size)):
        if value % world_size:
            raise ValueError(f"tp_vs_dp: {label} ({value}) must be a multiple of world_size "
                             f"({world_size}): DP splits the batch, TP the heads and the "
                             "vocabulary, evenly.")
    start = time.perf_counter()
    r = launch(_tp_vs_dp_worker, world_size, config, batch_size, seq_len, samples,
               steps_per_sample, seed, lr, warmup, max_bytes, timeout=timeout)[0]
    seconds = r["seconds"]
    ratio, low, high = bootstrap_ratio(seconds["tensor_parallel"], seconds["data_parallel"])
    split = {"compute_over_dp": bootstrap_ratio(seconds["tensor_parallel_compute"],
                                                seconds["data_parallel"]),
             "tp_over_compute": bootstrap_ratio(seconds["tensor_parallel"],
                                                seconds["tensor_parallel_compute"])}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    winner = None if low <= 1 <= high else ("tensor_parallel" if high < 1 else "data_parallel")
    first = r["first"]
    diff = abs(first["tensor_parallel"] - first["data_parallel"])
    tol = 1e-5 * max(1.0, abs(first["data_parallel"]))
    counts = r["counts"]
    want_tp = _megatron_count(config, batch_size, seq_len)
    tp, dp = counts["tensor_parallel"], counts["data_parallel"]
    return {
        "world_size": world_size, "backend": r["backend"], "threads_per_rank": 1,
        "config": dataclasses.asdict(config), "global_batch": batch_size,
        "dp_batch_per_rank": batch_size // world_size, "seq_len": seq_len,
        "tokens_per_step": batch_size * seq_len, "samples": samples,
        "steps_per_sample": steps_per_sample, "seed": seed, "lr": lr,
        "optimizer": _optimizer_text(lr), "max_bytes": max_bytes,
        "variants": {
            "tensor_parallel": "parallelize_gpt(model) over the world; every rank the whole "
                               "batch",
            "data_parallel": "the whole model on every rank, rank r rows r*B/w to (r+1)*B/w; "
                             + DP_NOTE,
            "tensor_parallel_compute": "the tensor-parallel step with dist.all_reduce replaced "
                                       "by a no-op: its arithmetic without its communication "
                                       "(its numbers are wrong; only its time is used)"},
        "data": "batch_schedule(first 90 % of the corpus, batch_size, seq_len, seed=seed): the "
                "first steps_per_sample batches, the same every sample",
        "method": "both variants in the same processes, interleaved with course_lib.timing."
                  "compare (the first variant alternating round by round), a sample = "
                  "steps_per_sample steps, dist.barrier before, the slowest rank's time after; "
                  "times per step; 95 % bootstrap interval of the median ratio, rounds paired",
        "seconds_per_step": seconds, "order": r["order"], "median_s": medians,
        "min_s": {n: min(s) for n, s in seconds.items()},
        "tokens_per_s": {n: batch_size * seq_len / m for n, m in medians.items()},
        "ratio_tp_over_dp": ratio, "ratio_interval": [low, high], "winner": winner,
        "verdict": r["verdict"],
        "split": {"compute_over_dp": list(split["compute_over_dp"]),
                  "tp_over_compute": list(split["tp_over_compute"]),
                  "compute_verdict": r["compute_verdict"], "comm_verdict": r["comm_verdict"]},
        "first_step_loss": {**first, "abs_diff": diff, "tolerance": tol, "equal": diff <= tol},
        "loss_after_run": r["last"],
        "all_reduces_per_step": counts,
        "megatron_formula": {**want_tp,
                             "matches": (tp["count"], tp["elements"], tp["bytes"])
                             == (want_tp["count"], want_tp["elements"], want_tp["bytes"])
                             and tp["by_phase"] == {k: want_tp[k] for k in tp["by_phase"]}},
        "dp_gradient_bytes": {"param_bytes": r["param_bytes"], "sent_bytes": dp["bytes"],
                              "matches": dp["bytes"] == r["param_bytes"]},
        "comparison": r["comparison"],
        "wall_s": round(time.perf_counter() - start, 1),
    }


# ---- command lines ----

def _model_options(parser: argparse.ArgumentParser) -> None:
    """The options both GPT benchmarks take: --lr, --seed, --config, --max-bytes."""
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None,
                        help="GPTConfig fields, e.g. n_layer=1,n_embd=48 (default GPTConfig())")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="read only this many bytes of the corpus")


def _config_arg(parser: argparse.ArgumentParser, text: str | None) -> GPTConfig:
    try:
        return parse_config(text)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def main_baseline(argv: list[str]) -> int:
    """``python -m course_lib.bench gpt-baseline``: print the JSON, write it; 0 if it ran."""
    d = BASELINE_DEFAULTS
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench gpt-baseline",
                                     description="The small GPT trained in one process on "
                                     "the real text: losses, tokens per second, held-out loss "
                                     "(lesson 14's oracle).")
    q, add = BASELINE_QUICK, parser.add_argument
    add("--quick", action="store_true",
        help=f"a quick look: {q['steps']} steps of batch {q['batch_size']} x {q['seq_len']}")
    add("--steps", type=int, default=None, help=f"default {d['steps']}")
    add("--batch", type=int, default=None, help=f"default {d['batch_size']}")
    add("--seq-len", type=int, default=None, help=f"default {d['seq_len']}")
    add("--warmup", type=int, default=None,
        help=f"steps left out of the tokens per second (default {d['warmup']})")
    add("--eval-batches", type=int, default=None,
        help=f"held-out batches (default {d['eval_batches']})")
    add("--threads", type=int, default=None, help="torch threads (default: every core)")
    _model_options(parser)
    _out_option(parser, "gpt-baseline")
    args = parser.parse_args(argv)
    sizes = BASELINE_QUICK if args.quick else d
    config = _config_arg(parser, args.config)
    steps = args.steps if args.steps is not None else sizes["steps"]
    warmup = args.warmup if args.warmup is not None else min(sizes["warmup"], max(0, steps - 1))
    header = report_header("gpt-baseline", argv, quick=args.quick)
    start = time.perf_counter()
    run = baseline(steps, args.batch or sizes["batch_size"], args.seq_len or sizes["seq_len"],
                   config=config, lr=args.lr, seed=args.seed, threads=args.threads,
                   warmup=warmup, eval_batches=args.eval_batches or sizes["eval_batches"],
                   max_bytes=args.max_bytes)
    print(f"gpt-baseline: loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}, held-out "
          f"{run['val_loss_start']:.3f} -> {run['val_loss']:.3f}; {run['tokens_per_s']:.0f} "
          f"tokens/s ({run['tokens_per_s_min']:.0f}-{run['tokens_per_s_max']:.0f})",
          file=sys.stderr)
    return _finish({**header, "method": "one process, one training step timed at a time "
                    "(course_lib.timing.Timer); tokens/s from the median step after the "
                    "warm-up, the spread from the slowest and fastest", **run},
                   "gpt-baseline", args.out, args.quick, start)


def main_tp_vs_dp(argv: list[str]) -> int:
    """``python -m course_lib.bench tp-vs-dp``: print the JSON, write it; 0 if it ran."""
    d = TP_VS_DP_DEFAULTS
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench tp-vs-dp",
                                     description="A tensor-parallel against a data-parallel "
                                     "training step of the small GPT, interleaved in the same "
                                     "workers, with the all-reduces each sends (lesson 14).")
    q, add = TP_VS_DP_QUICK, parser.add_argument
    add("--quick", action="store_true", help=f"a quick look: {q['samples']} samples of "
        f"{q['steps_per_sample']} steps, batch {q['batch_size']} x {q['seq_len']}")
    add("--world-size", type=int, default=d["world_size"])
    add("--batch", type=int, default=None, help=f"the global batch (default {d['batch_size']})")
    add("--seq-len", type=int, default=None, help=f"default {d['seq_len']}")
    add("--samples", type=int, default=None, help=f"default {d['samples']}")
    add("--steps-per-sample", type=int, default=None, help=f"default {d['steps_per_sample']}")
    _model_options(parser)
    add("--timeout", type=float, default=1800.0,
        help="seconds for the launch before its workers are stopped")
    _out_option(parser, "tp-vs-dp")
    args = parser.parse_args(argv)
    sizes = TP_VS_DP_QUICK if args.quick else d
    config = _config_arg(parser, args.config)
    header = report_header("tp-vs-dp", argv, quick=args.quick)
    start = time.perf_counter()
    run = tp_vs_dp(args.world_size, args.batch or sizes["batch_size"],
                   args.seq_len or sizes["seq_len"], samples=args.samples or sizes["samples"],
                   steps_per_sample=args.steps_per_sample or sizes["steps_per_sample"],
                   config=config, seed=args.seed, lr=args.lr, max_bytes=args.max_bytes,
                   timeout=args.timeout)
    if header["load"]["busy"]:
        run["verdict"] += f"; {header['load']['message']}"
    print(f"tp-vs-dp: {run['verdict']}", file=sys.stderr)
    return _finish({**header, **run}, "tp-vs-dp", args.out, args.quick, start)
