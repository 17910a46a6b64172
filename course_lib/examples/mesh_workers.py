"""Worker functions for the device mesh: data, tensor and pipeline parallelism on one GPT.

Every rank builds the same ``course_lib.models.gpt.GPT`` from the same seed, draws the same
real-text batches (``batch_schedule``) and also trains the whole model on the whole batch itself:
that one-process run is the oracle, step after step. ``mesh_groups``: the course's
``init_device_mesh`` beside torch's; ``train_on_mesh``: the GPT on a ("dp", "tp") or a
("pp", "dp", "tp") mesh (course's ``parallelize_gpt``, ``DistributedDataParallel``,
``PipelineStage`` + ``ScheduleGPipe``), optionally with one step's collectives counted per mesh
dimension; ``train_torch_mesh``: the same with torch's ``parallelize_module`` and ``fully_shard``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed.device_mesh import init_device_mesh
from course_lib.distributed.env import current_device
from course_lib.distributed.pipelining import PipelineStage, ScheduleGPipe
from course_lib.distributed.recording import COLLECTIVES, record_collectives
from course_lib.distributed.tensor.parallel import parallelize_gpt, vocab_parallel_cross_entropy
from course_lib.models.gpt import GPT
from course_lib.parallel import DistributedDataParallel

from .tensor_parallel_workers import full_slice
from .workers import _gpt, _max_diff, _text_batches, _torch_mesh, _torch_tp, _train_step

__all__ = ["mesh_groups", "train_on_mesh", "train_torch_mesh"]

#: what a counted step records: every collective, and the sends and receives of a pipeline one
#: by one (not the ``batch_isend_irecv`` that posts them: its records carry no tensor or group)
_COUNTED = tuple(n for n in COLLECTIVES if n != "batch_isend_irecv")


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict:
    """Ours and torch's mesh of ``shape``: each dimension's group (global ranks), this rank's
    coordinate and local ranks, and the sub-mesh rows; ``{"ours": ..., "torch": ...}``."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    out = {}
    for who, make in (("ours", init_device_mesh), ("torch", torch_init_device_mesh)):
        mesh = make(current_device().type, shape, mesh_dim_names=names)
        out[who] = dict(
            mesh=mesh.mesh.tolist(), coordinate=tuple(mesh.get_coordinate()),
            groups={n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names},
            local_ranks={n: mesh.get_local_rank(n) for n in names},
            sizes={n: mesh.size(names.index(n)) for n in names}, size=mesh.size(),
            rows={n: mesh[n].mesh.tolist() for n in names})
    return out


# ---- the model on the mesh ---------------------------------------------------------------------

class _FirstStage(nn.Module):
    """Token and position embeddings and the first blocks of a (split) GPT."""

    def __init__(self, gpt: GPT, blocks: int):
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[:blocks])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)        # (T,)
        x = self.wte(idx) + self.wpe(pos)                          # (b, T, C)
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    """The remaining blocks, the final LayerNorm and the head: this rank's logits."""

    def __init__(self, gpt: GPT, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[blocks:])
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))                          # (b, T, V / t)


def _largest_difference(split: GPT, one: GPT, params: set[int]) -> float:
    """Largest |parameter - matching slice of the one-process model's| over ``params``."""
    full, mine = dict(one.named_parameters()), dict(split.named_parameters())
    names = [n for n, p in mine.items() if id(p) in params]
    return _max_diff((mine[n] for n in names), (full_slice(split, n, full[n]) for n in names))


def _per_dimension(records, mesh) -> dict:
    """``{dimension: {collective: [calls, bytes]}}``: which dimension's group each call used."""
    by_ranks = {tuple(dist.get_process_group_ranks(mesh.get_group(n))): n
                for n in mesh.mesh_dim_names}
    by_ranks[tuple(range(dist.get_world_size()))] = "world"
    counts: dict = {}
    for r in records:
        dim = by_ranks.get(tuple(sorted(r.ranks)), str(r.ranks))
        row = counts.setdefault(dim, {}).setdefault(r.name, [0, 0])
        row[0] += 1
        row[1] += r.bytes
    return counts


def train_on_mesh(config: dict, shape: tuple[int, ...], names: tuple[str, ...],
                  batch_size: int, seq_len: int, steps: int, dtype: str = "float64",
                  lr: float = 3e-3, seed: int = 0, microbatches: int = 2,
                  text_bytes: int | None = 20_000, count: bool = False) -> dict:
    """Train the GPT on a mesh beside one process on the whole batch, AdamW, same batches.

    ``names`` is ("dp", "tp") or ("pp", "dp", "tp"); every batch is split over "dp" (rank i
    of the dp group takes the i-th slice), the model over "tp" (``parallelize_gpt``) and, with
    "pp", its blocks over two stages run by ``ScheduleGPipe`` with ``microbatches``.

    Returns ``{"coordinate", "losses": [(mesh, one) or None (a stage without the loss)] per
    step, "params": [largest difference after each step], "counts": ``{dimension:
    {collective: [calls, bytes]}}`` of one more step (with ``count``; the bytes of each call's
    tensor, sends and receives apart), "param_bytes": this rank's parameters}``.
    """
    if tuple(names) not in (("dp", "tp"), ("pp", "dp", "tp")):
        raise ValueError(f"train_on_mesh: names must be ('dp', 'tp') or ('pp', 'dp', 'tp'), "
                         f"got {names!r}.")
    if "pp" in names and shape[0] != 2:
        raise ValueError(f"train_on_mesh cuts the GPT into two pipeline stages: the 'pp' "
                         f"dimension must be 2, got {shape[0]}.")
    dev, dt = current_device(), getattr(torch, dtype)
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    one = _gpt(config, seed, dt)                                   # the oracle, whole batch
    split = parallelize_gpt(copy.deepcopy(one), group=tp)
    if "pp" in names:
        stage_index, half = mesh.get_local_rank("pp"), len(split.blocks) // 2
        stage_module = (_FirstStage if stage_index == 0 else _LastStage)(split, half)
        stage = PipelineStage(stage_module, stage_index, mesh.size("pp"),
                              group=mesh.get_group("pp"))
        schedule = ScheduleGPipe(stage, microbatches, loss_fn=partial(_flat_loss, group=tp))
        trained = stage_module
    else:
        stage, schedule = None, None
        trained = DistributedDataParallel(split, process_group=dp)
    params = {id(p) for p in trained.parameters()}
    opt = torch.optim.AdamW(trained.parameters(), lr=lr)
    opt_one = torch.optim.AdamW(one.parameters(), lr=lr)
    batches = _text_batches(batch_size, seq_len, seed, text_bytes)
    d, i = mesh.size("dp"), mesh.get_local_rank("dp")
    losses, diffs, counts = [], [], None
    for step in range(steps + count):
        X, Y = (t.to(dev) for t in next(batches))                  # (B, T): the whole batch
        x, y = X.chunk(d)[i], Y.chunk(d)[i]                        # (B / d, T): this dp slice
        counted = step == steps                                    # the extra step, recorded
        with (record_collectives(_COUNTED) if counted else contextlib.nullcontext()) as records:
            opt.zero_grad()
            local = _mesh_step(stage, schedule, trained, x, y, dp)
            opt.step()
        if counted:
            counts = _per_dimension(records, mesh)
            break
        loss, loss_one = _dp_mean(local, dp), _train_step(one, opt_one, X, Y)
        losses.append(None if loss is None else (loss, loss_one.item()))
        diffs.append(_largest_difference(split, one, params))
    return dict(coordinate=mesh.get_coordinate(), losses=losses, params=diffs, counts=counts,
                param_bytes=sum(p.numel() * p.element_size() for p in trained.parameters()))


def _flat_loss(logits: torch.Tensor, targets: torch.Tensor, *, group) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), group=group)


def _mesh_step(stage, schedule, model, x, y, dp) -> torch.Tensor | None:
    """One step's forward and backward on this rank, gradients averaged over dp: the loss of
    this rank's slice of the batch (None on a pipeline stage that does not compute it)."""
    if stage is None:                                 # DDP averages the gradients in backward
        _, loss = model(x, y)
        loss.backward()
        return loss.detach()
    mb_losses: list = []
    schedule.step(*([x] if stage.is_first else []), target=y if stage.is_last else None,
                  losses=mb_losses)
    for p in model.parameters():                      # the mean of the dp ranks' gradients
        dist.all_reduce(p.grad, group=dp)
        p.grad /= dist.get_world_size(dp)
    # equal micro-batches: the mean of their losses is the slice's
    return torch.stack(mb_losses).mean() if stage.is_last else None


def _dp_mean(loss: torch.Tensor | None, dp) -> float | None:
    """The whole batch's loss: the mean over the dp group of its slices' losses."""
    if loss is None:
        return None
    total = loss.clone()
    dist.all_reduce(total, group=dp)
    return total.item() / dist.get_world_size(dp)


# ---- torch's own -------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def train_torch_mesh(config: dict, batch_size: int, seq_len: int, steps: int,
                     lr: float = 3e-3, seed: int = 0, text_bytes: int | None = 20_000) -> dict:
    """The GPT with torch's ``parallelize_module`` on "tp" (each block's qkv / fc colwise,
    out_proj / proj rowwise) and ``fully_shard`` on "dp", of torch's ``init_device_mesh``
    (("dp", "tp") = (2, 2)), float64, beside one process. Returns the losses and the largest
    parameter difference per step, or ``{"error": ...}`` with what torch raised."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        return {"error": f"ImportError: {e}"}
    dev = current_device()
    one = _gpt(config, seed, torch.float64)
    theirs = copy.deepcopy(one)
    batches = _text_batches(batch_size, seq_len, seed, text_bytes)
    losses, diffs = [], []
    try:
        mesh = _torch_mesh(2, 2, mesh_dim_names=("dp", "tp"))
        _torch_tp(theirs.blocks, mesh["tp"])
        for block in theirs.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(theirs, mesh=mesh["dp"])
        opt = torch.optim.AdamW(theirs.parameters(), lr=lr)
        opt_one = torch.optim.AdamW(one.parameters(), lr=lr)
        d, i = mesh["dp"].size(), mesh.get_local_rank("dp")
        for _ in range(steps):
            X, Y = (t.to(dev) for t in next(batches))
            loss = _train_step(theirs, opt, X.chunk(d)[i], Y.chunk(d)[i])
            loss_one = _train_step(one, opt_one, X, Y)
            losses.append((_dp_mean(loss.detach(), mesh.get_group("dp")), loss_one.item()))
            with _quiet("torch.distributed.tensor._redistribute"):   # "2 all_gathers"
                full = [p.full_tensor() if hasattr(p, "full_tensor") else p
                        for p in theirs.parameters()]
            diffs.append(_max_diff(full, one.parameters()))
    except Exception as e:  # noqa: BLE001 - what fails is the finding, reported in words
        return {"error": f"{type(e).__name__}: {e}"}
    return {"losses": losses, "params": diffs,
            "param_type": type(next(theirs.parameters())).__name__}
