"""Worker functions that notebook 11 (sharded data parallelism) hands to ``launch``.

Each runs in every rank of an initialised process group and returns small picklable results.
The model is an MLP of ``Linear`` layers of the given widths (``widths=[a, b, c]``: Linear(a,
b), Tanh, Linear(b, c)), the same on every rank, trained with AdamW under DDP, ZeRO-1
(``ZeroRedundancyOptimizer``) and FSDP: their memory per rank (``memory_per_rank``), ZeRO-1 and
the course's FSDP against the unsharded run and torch's ``fully_shard``, step times, and the
collectives of a step, the paper's ZeRO-1 among them. The accounting of ``memory_per_rank``'s
rows, for the notebook's tables and figures, is at the end: ``memory_by_world``, ``held``,
``formula_bytes``, ``print_table``, ``held_parts``, ``curves``, ``above_held``.
"""
from __future__ import annotations

import copy
import gc
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from course_lib.distributed.env import _slowest, current_device
from course_lib.distributed.fsdp import FullyShardedDataParallel
from course_lib.distributed.memory import (
    PeakMemory,
    grad_bytes,
    optimizer_state_bytes,
    tensor_bytes,
    zero_formula,
)
from course_lib.distributed.optim import ZeroRedundancyOptimizer, partition_parameters
from course_lib.parallel.ddp import DistributedDataParallel

from .workers import _max_diff, _torch_fully_shard

__all__ = ["HELD", "KINDS", "NOT_YET", "above_held", "bucket_bytes", "compare_with_torch_fsdp",
           "compare_zero_with_unsharded", "curves", "formula_bytes", "held", "held_parts",
           "memory_by_world", "memory_per_rank", "mlp", "print_table", "short_name", "step_times",
           "traffic_per_step"]

KINDS = ("DDP", "ZeRO-1", "FSDP")


def mlp(widths: list[int]) -> nn.Sequential:
    """Linear(widths[0], widths[1]), Tanh, ..., Linear(widths[-2], widths[-1])."""
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _setup(kind: str, widths: list[int], seed: int = 0, lr: float = 1e-3):
    """(model, optimizer, the optimizer holding this rank's state) for one kind."""
    if kind not in (*KINDS, "DDP-view"):
        raise ValueError(f"kind must be one of {(*KINDS, 'DDP-view')}, got {kind!r}.")
    torch.manual_seed(seed)
    net = mlp(widths).to(current_device())
    if kind == "FSDP":
        model = FullyShardedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        return model, opt, opt
    # DDP-view: each .grad a view of its bucket
    model = DistributedDataParallel(net, gradient_as_bucket_view=kind == "DDP-view")
    if kind == "ZeRO-1":
        opt = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=lr)
        return model, opt, opt.optim
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    return model, opt, opt


def _batch(widths: list[int], per_rank: int, seed: int):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    X = torch.randn(per_rank, widths[0], generator=g).to(current_device())            # (B, in)
    y = torch.randint(0, widths[-1], (per_rank,), generator=g).to(current_device())   # (B,)
    return X, y


def _step(model, opt, X, y, memory: PeakMemory | None = None) -> None:
    """One training step; with ``memory``, each phase named for its breakdown."""
    phases = memory if memory is not None else SimpleNamespace()
    opt.zero_grad()
    phases.phase = "forward"
    loss = F.cross_entropy(model(X), y)
    phases.phase = "backward"
    loss.backward()
    phases.phase = "optimizer step"
    opt.step()


def bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets that are not also the ``.grad`` of a parameter (0 when the
    gradients are views of the buckets, or when there is no DDP)."""
    buckets = [b.buffer() for b in getattr(getattr(model, "reducer", None), "buckets", [])]
    params = list(model.parameters())
    return tensor_bytes([*buckets, *(p.grad for p in params)]) - grad_bytes(params)


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _classifier(kind: str, model: nn.Module, local: torch.optim.Optimizer, batch: tuple,
                owner_sizes: frozenset[int] = frozenset()):
    """``classify(tensor, made_in)`` for ``PeakMemory``: what a live storage of a step is,
    looked up at the moment of the peak (parameters, their gradients, optimizer state, DDP's
    buckets, ZeRO-1's broadcast buffers, FSDP's gathered units), else by the phase that made
    it. ``owner_sizes``: ZeRO-1's elements per owner (the size of each broadcast buffer)."""
    sharded = kind == "FSDP"
    params = list(model.parameters())
    param_keys = {_key(p) for p in params}
    state_keys = {_key(v) for st in local.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor)}
    buckets = getattr(getattr(model, "reducer", None), "buckets", [])
    bucket_keys = {_key(b.buffer()) for b in buckets}
    padded = {h.padded for h in getattr(model, "handles", [])}
    shards = {h.padded // h.world for h in getattr(model, "handles", [])}
    batch_keys = {_key(t) for t in batch}

    def classify(t: torch.Tensor, made_in: str) -> str:
        key = _key(t)
        if key in param_keys:
            return "parameter shards" if sharded else "parameters (whole)"
        if key in {_key(p.grad) for p in params if p.grad is not None}:
            return "gradients of the shards" if sharded else "gradients (whole)"
        if key in state_keys:
            return "optimizer state"
        if key in bucket_keys:
            return "DDP's gradient buckets"
        if key in batch_keys:
            return "the batch (inputs, labels)"
        if made_in == "optimizer step" and t.dim() == 1 and t.numel() in owner_sizes:
            return "ZeRO-1's broadcast buffer (one owner's parameters)"
        if sharded:
            gathers = list(model._gathers) + [g for m in model.modules()
                                              for g in m.__dict__.get("_fsdp_gathers", [])]
            if key in {_key(g.full) for g in gathers if g.full is not None}:
                return "gathered unit weights"
            if made_in == "backward" and t.dim() == 1 and t.numel() in padded:
                return "a unit's full gradient, before reduce-scatter"
            if made_in == "backward" and t.dim() == 1 and t.numel() in shards:
                if t.untyped_storage().nbytes() in {n * t.element_size() for n in padded}:
                    # gloo's reduce-scatter: the input copied, all-reduced whole, this rank's
                    # slice copied out (a view of that copy, which NCCL never makes)
                    return "gloo's copy of a full gradient (reduce-scatter)"
                return _SLICE   # this unit's gradient, which the rank keeps: part of "held"
        if made_in == "forward":
            return "activations and loss (made in forward)"
        if made_in == "backward" and t.dim() == 2 and t.shape[0] == batch[0].shape[0]:
            return "activation gradients"
        if made_in == "optimizer step":
            return "temporaries of the optimizer step"
        return f"other, made in {made_in}"

    return classify


def memory_per_rank(widths: list[int], per_rank: int = 8,
                    kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """For each kind: bytes this rank holds after a step, and the peak during one.

    The first step creates AdamW's state; the second is measured with ``PeakMemory`` (CUDA:
    ``max_memory_allocated``; CPU: live tensors counted). Each kind runs alone: the previous
    one is deleted and collected first.

    Returns:
        One dict per kind: ``kind, world, rank, num_params, largest_param, params, grads,
        buckets, optimizer, state_elements, peak, peak_parts``. ``buckets``: ``bucket_bytes``,
        DDP's buckets beside the gradients (kept from step to step, as torch's Reducer keeps
        its own). ``peak_parts``: {what: bytes} alive at the peak, summing to ``peak`` (CPU
        only). ``num_params`` and ``largest_param``: the elements of the unsharded model and of
        its largest parameter; ``state_elements``: the elements of the parameters (or flat
        shards) whose optimizer state this rank keeps (under ZeRO-1: those this rank owns).
    """
    out = []
    for kind in kinds:
        gc.collect()  # the previous kind's tensors, freed
        model, opt, local = _setup(kind, widths)
        X, y = _batch(widths, per_rank, seed=1)
        _step(model, opt, X, y)
        owners = (partition_parameters(opt.param_groups, dist.get_world_size())
                  if kind == "ZeRO-1" else [])
        owner_sizes = frozenset(n for n in (sum(p.numel() for p in s) for s in owners) if n)
        classify = _classifier(kind, model, local, (X, y), owner_sizes)
        with PeakMemory(current_device(), classify=classify) as measured:
            _step(model, opt, X, y, measured)
        params = list(model.parameters())
        sizes = [p.numel() for p in mlp(widths).parameters()]
        out.append({"kind": kind, "world": dist.get_world_size(), "rank": dist.get_rank(),
                    "num_params": sum(sizes), "largest_param": max(sizes),
                    "params": tensor_bytes(params), "grads": grad_bytes(params),
                    "buckets": bucket_bytes(model), "optimizer": optimizer_state_bytes(local),
                    "state_elements": sum(p.numel() for p in local.state),
                    "peak": measured.peak, "peak_parts": measured.breakdown})
        del model, opt, local, params, measured, classify   # classify refers to the model
    return out


def compare_zero_with_unsharded(widths: list[int], per_rank: int = 8, steps: int = 3) -> dict:
    """DDP with AdamW and DDP with ``ZeroRedundancyOptimizer(AdamW)``, from the same weights,
    ``steps`` steps on the same batches (each rank its own); then every parameter compared.
    Returns ``{"steps", "equal", "max_difference"}``, the same on every rank: ``equal`` when every
    parameter is ``torch.equal`` to the unsharded run's on every rank; ``max_difference`` the
    largest absolute difference of an element over the ranks.
    """
    runs = [_setup(kind, widths)[:2] for kind in ("DDP", "ZeRO-1")]
    for step in range(steps):
        X, y = _batch(widths, per_rank, seed=step)
        for model, opt in runs:
            _step(model, opt, X, y)
    pairs = list(zip(runs[0][0].parameters(), runs[1][0].parameters()))
    unequal = sum(not torch.equal(a, b) for a, b in pairs)
    difference = _max_diff(*zip(*pairs))
    summary = torch.tensor([float(unequal), difference], dtype=torch.float64,
                           device=current_device())
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)  # gloo and NCCL both take float64
    return {"steps": steps, "equal": summary[0].item() == 0,
            "max_difference": summary[1].item()}


def step_times(widths: list[int], per_rank: int = 8, samples: int = 10,
               min_sample_seconds: float = 0.05) -> dict:
    """One training step of DDP, ZeRO-1 and FSDP timed interleaved (``timing.compare``), each
    sample started behind a barrier, each time the slowest rank's; rank 0's result as JSON."""
    from course_lib.timing import compare

    setups = {kind: _setup(kind, widths) for kind in KINDS}
    X, y = _batch(widths, per_rank, seed=1)
    variants = {kind: (lambda m=m, o=o: _step(m, o, X, y)) for kind, (m, o, _) in setups.items()}

    result = compare(variants, samples=samples, min_sample_seconds=min_sample_seconds,
                     before=dist.barrier, reduce=_slowest, device=current_device())
    return result.to_json()


def compare_with_torch_fsdp(widths: list[int], per_rank: int = 4, steps: int = 3) -> dict:
    """The course's FSDP, torch's ``fully_shard`` (on every Linear, then the root) and one
    process on the whole batch, trained ``steps`` AdamW steps from the same weights. Returns
    ``{"ours_vs_one_process", "torch_vs_one_process", "ours_vs_torch"}``, the largest absolute
    difference of any parameter, or ``{"error": ...}`` when ``fully_shard`` does not run here.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = mlp(widths).to(current_device())
    one = copy.deepcopy(base)
    ours = FullyShardedDataParallel(copy.deepcopy(base))
    try:
        theirs = _torch_fully_shard(copy.deepcopy(base))
    except Exception as e:  # an old torch, or a backend fully_shard refuses: say which
        return {"error": f"{type(e).__name__}: {e}"}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (one, ours, theirs)]
    g = torch.Generator().manual_seed(1)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for _ in range(steps):
        X = torch.randn(world * per_rank, widths[0], generator=g).to(current_device())
        y = torch.randint(0, widths[-1], (world * per_rank,), generator=g).to(current_device())
        _step(one, opts[0], X, y)                 # one process, the whole batch
        _step(ours, opts[1], X[mine], y[mine])    # each rank its slice
        _step(theirs, opts[2], X[mine], y[mine])
    full_ours = ours.full_state_dict()
    full_theirs = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    want = dict(one.named_parameters())

    def diff(a: dict, b: dict) -> float:
        return _max_diff((a[n] for n in want), (b[n] for n in want))

    return {"ours_vs_one_process": diff(full_ours, want),
            "torch_vs_one_process": diff(full_theirs, want),
            "ours_vs_torch": diff(full_ours, full_theirs)}


class _PaperZeRO1:
    """ZeRO-1 as the paper's section 7 counts it, for ``traffic_per_step``: the gradients
    reduce-scattered as one flat vector (padded to a multiple of the world size), AdamW on this
    rank's flat slice, the updated slices all-gathered. Not the course's optimizer (which keeps
    DDP's all-reduce and broadcasts whole parameters): only its bytes are compared."""

    def __init__(self, net: nn.Module, lr: float = 1e-3):
        from course_lib.distributed.compat import all_gather_into_tensor, reduce_scatter_tensor

        self._gather, self._scatter = all_gather_into_tensor, reduce_scatter_tensor
        self.params = list(net.parameters())
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.size = -(-self.numel // self.world)                     # S = ceil(n / world)
        flat = self._flat([p.detach() for p in self.params])        # (world * S,)
        self.shard = nn.Parameter(flat[rank * self.size:(rank + 1) * self.size].clone())
        self.optim = torch.optim.AdamW([self.shard], lr=lr)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.size * self.world, dtype=tensors[0].dtype,
                           device=tensors[0].device)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        grad = torch.empty_like(self.shard)                          # (S,)
        self._scatter(grad, self._flat([p.grad for p in self.params]))
        self.shard.grad = grad.div_(self.world)                      # this slice, averaged
        self.optim.step()
        full = torch.empty(self.size * self.world, dtype=self.shard.dtype,
                           device=self.shard.device)
        self._gather(full, self.shard.detach())
        nn.utils.vector_to_parameters(full[:self.numel], self.params)


def short_name(name: str) -> str:
    """A collective's name without the variant: all_gather, reduce_scatter, all_reduce, ...
    (``all_gather_single`` and ``all_gather_into_tensor`` are both ``all_gather``)."""
    return next((short for short in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
                 if short in name), name)


def traffic_per_step(widths: list[int], per_rank: int = 8) -> dict:
    """The collectives of one training step of each kind (after one warm-up step), recorded with
    ``record_collectives`` on every rank: {kind: {collective: elements}}, where ``elements`` is
    the size of the whole vector each call reduces, gathers or broadcasts (a reduce-scatter's
    output slice times the world size); ``"FSDP order"``: FSDP's calls as (name, elements) in
    the order rank 0 made them. Also ``"ZeRO-1 (paper)"`` (``_PaperZeRO1``), and
    ``paper_zero1_vs_unsharded``: the largest difference of its parameters from DDP with AdamW
    after the same two steps. Rank 0's result, with ``num_params``."""
    from course_lib.distributed.recording import record_collectives

    world = dist.get_world_size()
    X, y = _batch(widths, per_rank, seed=1)
    out: dict = {"num_params": sum(p.numel() for p in mlp(widths).parameters()), "world": world}
    # The paper's ZeRO-1 last: a plain model, its gradients reduce-scattered, its slices
    # all-gathered; after the two steps, its parameters against DDP's (the unsharded AdamW)
    torch.manual_seed(0)
    net = mlp(widths).to(current_device())
    setups = {kind: _setup(kind, widths)[:2] for kind in KINDS}
    for kind, (model, opt) in {**setups, "ZeRO-1 (paper)": (net, _PaperZeRO1(net))}.items():
        _step(model, opt, X, y)                      # warm-up: lazily built state and buckets
        with record_collectives() as records:
            _step(model, opt, X, y)
        totals: dict[str, int] = {}
        for r in records:
            scale = world if r.name.startswith(("reduce_scatter", "_reduce_scatter")) else 1
            totals[r.name] = totals.get(r.name, 0) + r.elements * scale
        out[kind] = totals
        if kind == "FSDP":   # the order of the calls: when each unit is gathered, when scattered
            out["FSDP order"] = [(short_name(r.name),
                                  r.elements * (world if "reduce_scatter" in r.name else 1))
                                 for r in records]
    ref = setups["DDP"][0]              # the unsharded AdamW, after the same two steps
    difference = torch.tensor([_max_diff(ref.parameters(), net.parameters())],
                              dtype=torch.float64, device=current_device())
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    out["paper_zero1_vs_unsharded"] = difference.item()
    return out


# ---- Accounting: memory_per_rank's rows, as the notebook prints and plots them ----------------

#: What a rank holds after a step, as ``memory_per_rank`` names it, with the figures' labels.
HELD = {"params": "parameters", "grads": "gradients", "buckets": "DDP's buckets",
        "optimizer": "optimizer state"}
#: FSDP: the reduce-scatter's output, this rank's slice of a unit's averaged gradient. It becomes
#: that shard's ``.grad``, so it is part of what the rank holds after the step, not an addition.
_SLICE = "reduce-scatter output (this rank's slice: its kept gradient)"
#: ``peak_parts`` labels of what a rank holds after a step (the rest is the step's own).
_HELD_LABELS = ("parameters (whole)", "parameter shards", "gradients (whole)",
                "gradients of the shards", _SLICE, "optimizer state", "DDP's gradient buckets")
#: ``above_held``'s label for what a rank holds after the step that did not exist yet at the peak
NOT_YET = "held after the step, not made yet at the peak"


def memory_by_world(widths: list[int], per_rank: int, kinds: tuple[str, ...] = KINDS,
            worlds: tuple[int, ...] = (1, 2, 4), timeout: float = 600) -> dict:
    """``memory_per_rank`` launched at each world size: {(kind, world): [rank 0's row, ...]}.

    Every world size runs on one backend: NCCL (GPU memory) when the largest world has a GPU
    per rank, else gloo (the CPU's live tensors). On a machine with one GPU, one rank alone
    would otherwise take the GPU and its allocator's rounding, two and four the CPU."""
    from course_lib.distributed import choose_backend, launch

    backend = choose_backend(max(worlds)).backend
    ranks: dict = {}
    for world in worlds:
        for rank_rows in launch(memory_per_rank, world, widths, per_rank, kinds,
                                backend=backend, timeout=timeout):
            for row in rank_rows:
                ranks.setdefault((row["kind"], world), []).append(row)
    return ranks


def held(row: dict) -> int:
    """Bytes a rank holds after a step: parameters, gradients, DDP's buckets (where they are not
    the gradients themselves) and optimizer state."""
    return sum(row[key] for key in HELD)


def formula_bytes(kind: str, num_params: int, world: int) -> float:
    """The ZeRO paper's bytes per rank for float32 AdamW (4 + 4 + 8 per parameter, divided by
    the world size where ``kind`` shards them), plus DDP's buckets (4 per parameter) under "DDP"
    and "ZeRO-1" (which keeps DDP)."""
    stage = {"DDP": 0, "DDP-view": 0, "ZeRO-1": 1, "FSDP": 3}[kind]
    total = zero_formula(num_params, world, stage, param_bytes=4, grad_bytes=4,
                         optimizer_bytes=8)["total"]
    return total + (4 * num_params if kind in ("DDP", "ZeRO-1") else 0)


def print_table(rows: dict, unit: str = "MiB", unit_bytes: int = 2**20) -> None:
    """One line per (kind, world) of ``{(kind, world): row}``: sizes in ``unit``, held bytes
    per parameter, the peak of the step and what it adds to what is held."""
    print(f"{unit + ':':9}{'ranks':>5}{'params':>10}{'grads':>10}{'buckets':>10}"
          f"{'optimizer':>10}{'held':>10}{'bytes/param':>12}{'peak':>10}{'peak-held':>10}")
    for (kind, world), r in rows.items():
        sizes = [*(r[key] for key in HELD), held(r)]
        print(f"{kind:9}{world:>5}" + "".join(f"{b / unit_bytes:>10.2f}" for b in sizes)
              + f"{held(r) / r['num_params']:>12.2f}{r['peak'] / unit_bytes:>10.2f}"
              f"{(r['peak'] - held(r)) / unit_bytes:>10.2f}")


def held_parts(every_rank: dict, world: int, kinds: tuple[str, ...] = KINDS,
               unit_bytes: int = 2**20) -> dict:
    """{"<kind>, rank <r>": {part: size in units}} for every rank of each of ``kinds`` at
    ``world``, from ``memory_by_world``'s result: what ``plots.draw_held_per_rank`` draws."""
    return {f"{kind}, rank {r['rank']}": {name: r[key] / unit_bytes for key, name in HELD.items()}
            for kind in kinds for r in every_rank[kind, world]}


def curves(rows: dict, worlds: list[int], kinds: tuple[str, ...] = KINDS,
           unit_bytes: int = 2**20) -> dict:
    """{kind: {"formula", "held", "peak": [size in units per world]}} from ``{(kind, world):
    rank 0's row}``: what ``plots.draw_memory_per_rank`` draws."""
    return {kind: {"formula": [formula_bytes(kind, rows[kind, w]["num_params"], w) / unit_bytes
                               for w in worlds],
                   "held": [held(rows[kind, w]) / unit_bytes for w in worlds],
                   "peak": [rows[kind, w]["peak"] / unit_bytes for w in worlds]}
            for kind in kinds}


def above_held(row: dict) -> dict[str, int]:
    """What the peak adds to what the rank holds after the step (``peak_parts``, CPU only), in
    bytes, largest first: the parts that are not parameters, gradients, buckets or optimizer
    state, and, negative, any of those that did not exist yet at the peak (``NOT_YET``). The
    values sum to ``row["peak"] - held(row)``, the table's ``peak-held``."""
    parts = {k: v for k, v in row["peak_parts"].items() if k not in _HELD_LABELS}
    missing = held(row) - sum(v for k, v in row["peak_parts"].items() if k in _HELD_LABELS)
    if missing:
        parts[NOT_YET] = -missing
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))
