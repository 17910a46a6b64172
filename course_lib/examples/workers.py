"""Worker functions that notebook 06 hands to ``course_lib.distributed.launch``.

``launch`` starts fresh processes that import the function by module and name, so workers live
in a file like this one, never in a notebook cell. Each runs in every rank, after the process
group is initialised; rank and world size come from ``torch.distributed``. At the end: the
set-up that the later lessons' workers share (a seeded GPT on this rank's device, its batches,
a training step, torch's own sharding, ...).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import (
    current_device,
    reduce_value,
    ring_all_gather,
    ring_allreduce,
    ring_allreduce_pipelined,
    tree_broadcast,
)
from course_lib.distributed.compat import reduce_scatter_tensor
from course_lib.models.gpt import GPT, GPTConfig

__all__ = ["collectives", "compare_by_hand", "fail_on_rank", "hang_on_rank", "point_to_point",
           "whoami"]


def whoami() -> dict:
    """What a worker can find out about itself."""
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "local_rank": int(os.environ["LOCAL_RANK"]),
            "pid": os.getpid(), "threads": torch.get_num_threads(),
            "master": f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"}


def point_to_point() -> list[int]:
    """Rank 0 sends a tensor to rank 1 (blocking), then rank 1 replies with isend/irecv."""
    rank, dev = dist.get_rank(), current_device()
    x = torch.zeros(3, dtype=torch.int64, device=dev)
    if rank == 0:
        # send returns once its tensor may be reused; that promises nothing about rank 1 (gloo
        # in fact waits until rank 1's recv is posted; NCCL only queues the copy on a stream).
        dist.send(torch.tensor([1, 2, 3], device=dev), dst=1)
        req = dist.irecv(x, src=1)  # returns at once; read x only after wait()
        req.wait()
    elif rank == 1:
        dist.recv(x, src=0)
        dist.isend(x * 10, dst=0).wait()
    return x.tolist()


def collectives() -> dict[str, list]:
    """Every collective on small integer tensors; rank r starts from ``[r + 1, r + 1]``."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), current_device()
    i64 = {"dtype": torch.int64, "device": dev}
    mine = lambda: torch.full((2,), rank + 1, **i64)  # (2,) on every rank
    out: dict[str, list] = {"start": mine().tolist()}

    x = mine()
    dist.broadcast(x, src=0)
    out["broadcast"] = x.tolist()

    x = mine()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    out["all_reduce"] = x.tolist()

    x = mine()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined
    out["reduce"] = x.tolist() if rank == 0 else "(undefined off rank 0)"

    parts = [torch.zeros(2, **i64) for _ in range(world)]
    dist.all_gather(parts, mine())
    out["all_gather"] = [p.tolist() for p in parts]

    parts = [torch.zeros(2, **i64) for _ in range(world)] if rank == 0 else None
    dist.gather(mine(), gather_list=parts, dst=0)
    out["gather"] = [p.tolist() for p in parts] if rank == 0 else "(only rank 0 receives)"

    x = torch.zeros(2, **i64)
    pieces = [torch.full((2,), 10 * (i + 1), **i64) for i in range(world)]
    dist.scatter(x, scatter_list=pieces if rank == 0 else None, src=0)
    out["scatter"] = x.tolist()

    x = torch.zeros(1, **i64)
    mine_rs = torch.arange(world, **i64) + rank                # (world,) in, (1,) out
    # course_lib's wrapper: dist.reduce_scatter_tensor on gloo and NCCL; other backends get the
    # same result from an all_reduce and a slice
    reduce_scatter_tensor(x, mine_rs)
    out["reduce_scatter"] = x.tolist()

    x = torch.zeros(world, **i64)
    mine_a2a = torch.arange(world, **i64) + 10 * rank
    dist.all_to_all_single(x, mine_a2a)
    out["all_to_all"] = x.tolist()

    out["mean_loss"] = reduce_value(float(rank + 1))  # average a Python number for logging

    x = mine()
    work = dist.all_reduce(x, async_op=True)   # returns a Work at once; x holds the sum only
    work.wait()                                # after wait() (meanwhile: other work, not x)
    out["async all_reduce"] = x.tolist()

    ends = [0, world - 1]
    pair = dist.new_group(ends)                # every rank calls new_group, members or not
    x = mine()
    if rank in ends:
        dist.all_reduce(x, group=pair)         # only the group's ranks take part
    out[f"all_reduce in group {ends}"] = x.tolist() if rank in ends else "(not in the group)"
    # what the last three started from instead of "start" (for plots.draw_collectives)
    out["inputs"] = {"scatter": [p.tolist() for p in pieces] if rank == 0 else "-",
                     "reduce_scatter": mine_rs.tolist(), "all_to_all": mine_a2a.tolist()}
    return out


def compare_by_hand(numel: int | list[int] | tuple[int, ...], seed: int = 0) -> dict[str, bool]:
    """The hand-written collectives give what torch's give, on random tensors of ``numel``.

    Several sizes in one launch: ``numel`` a list or tuple; the keys then name the size too
    (``"ring_allreduce, 7 elements"``).
    """
    if isinstance(numel, (list, tuple)):
        return {f"{name}, {n} elements": ok for n in numel
                for name, ok in compare_by_hand(n, seed).items()}
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(numel, generator=g).to(current_device())  # (numel,) different on every rank

    mine, ref = x.clone(), x.clone()
    ring_allreduce(mine)
    dist.all_reduce(ref)
    same = {"ring_allreduce": torch.allclose(mine, ref, rtol=1e-5, atol=1e-5)}

    mine = x.clone()
    ring_allreduce_pipelined(mine, segments=3)
    same["ring_allreduce_pipelined"] = torch.allclose(mine, ref, rtol=1e-5, atol=1e-5)

    mine, ref = x.clone(), x.clone()
    tree_broadcast(mine, src=world - 1)
    dist.broadcast(ref, src=world - 1)
    same["tree_broadcast"] = torch.equal(mine, ref)

    mine = [torch.empty_like(x) for _ in range(world)]
    ref = [torch.empty_like(x) for _ in range(world)]
    ring_all_gather(mine, x)
    dist.all_gather(ref, x)
    same["ring_all_gather"] = all(torch.equal(a, b) for a, b in zip(mine, ref))
    return same


def fail_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` raises; the others are in a barrier when ``launch`` hears of it."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} found a NaN in its batch")
    dist.barrier()
    return dist.get_rank()


def hang_on_rank(bad_rank: int) -> int:
    """Rank ``bad_rank`` never reaches the collective that the others wait in."""
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    dist.barrier()
    return dist.get_rank()


# ---- the set-up the lessons' workers share ------------------------------------------------------

def _gpt(config: dict, seed: int = 0, dtype: torch.dtype | None = None,
         device: torch.device | str | None = None) -> GPT:
    """``GPT(GPTConfig(**config))`` from ``seed``, on ``device`` (default: this rank's)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**config)).to(device or current_device(), dtype)


def _tokens(vocab_size: int, batch_size: int, seq_len: int, seed: int,
            device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and separate targets, each (B, T), drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    idx, targets = (torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
                    for _ in range(2))
    return idx.to(device), targets.to(device)


def _text_batches(batch_size: int, seq_len: int, seed: int = 0,
                  text_bytes: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The one-process baseline's batches: ``batch_schedule`` of the first 90 % of the text."""
    from course_lib.data_text import batch_schedule, load_text, split_tokens

    train, _ = split_tokens(load_text(max_bytes=text_bytes))
    return batch_schedule(train, batch_size, seq_len, seed=seed)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
                Y: torch.Tensor) -> torch.Tensor:
    """One step of a GPT (``model(X, Y)`` returns logits and the loss); the loss."""
    opt.zero_grad()
    _, loss = model(X, Y)
    loss.backward()
    opt.step()
    return loss


def _max_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    return max(((x - z).abs().max().item() for x, z in zip(a, b)), default=0.0)


def _torch_mesh(*shape: int, **kwargs):
    """torch's ``init_device_mesh`` on this group's device (default shape: the world), not the
    GPU per rank that ``fully_shard``'s default mesh takes wherever CUDA exists."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(current_device().type, shape or (dist.get_world_size(),), **kwargs)


def _torch_fully_shard(model: nn.Module) -> nn.Module:
    """torch's ``fully_shard`` on every ``Linear`` of ``model``, then on ``model``."""
    from torch.distributed.fsdp import fully_shard

    mesh = _torch_mesh()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _torch_tp(blocks: Iterable[nn.Module], mesh) -> None:
    """torch's ``parallelize_module`` on every GPT block: qkv and fc column-wise, out_proj and
    proj row-wise."""
    from torch.distributed.tensor import parallel

    for block in blocks:
        plan = {"attn.qkv": parallel.ColwiseParallel(), "mlp.fc": parallel.ColwiseParallel(),
                "attn.out_proj": parallel.RowwiseParallel(), "mlp.proj": parallel.RowwiseParallel()}
        parallel.parallelize_module(block, mesh, plan)
