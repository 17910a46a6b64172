"""Are every rank's tensors alike? One check shared by DDP, FSDP and ZeroRedundancyOptimizer.

As torch's DDP's ``_verify_param_shape_across_processes``: a model that differs on one rank
would pair the wrong tensors in every collective, or hang. Then ``_broadcast_coalesced`` gives
every rank rank 0's values (torch's ``_sync_module_states``).
"""
from __future__ import annotations

import json
from itertools import accumulate

import torch
import torch.distributed as dist


def communication_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where small bookkeeping tensors travel: NCCL needs the GPU, gloo takes the CPU."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def verify_same_tensors(states: list[tuple[str, str, torch.Tensor]],
                        group: dist.ProcessGroup | None, *, owner: str, expects: str,
                        noun: str, advice: str) -> None:
    """Raise on every rank unless every rank has the same tensors, in the same order: two
    all-gathers (length, then each rank's description), the same verdict everywhere.

    ``states``: ``(kind, label, tensor)`` in order; kind, shape, dtype and requires_grad are
    compared, ``label`` only printed. ``owner``, ``expects``, ``noun`` (plural) and ``advice``
    fill the message.
    """
    mine = [[kind, label, list(t.shape), str(t.dtype).removeprefix("torch."),
             bool(t.requires_grad)] for kind, label, t in states]
    device = communication_device(group, states[0][2].device if states else torch.device("cpu"))
    message = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(message)], device=device), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)   # (longest,)
    padded[:len(message)] = message
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    described = [json.loads(bytes(g[:int(n.item())].tolist()).decode())
                 for g, n in zip(gathered, lengths)]
    difference = _first_difference(described)
    if difference is None:
        return
    i, rank = difference
    counts = ", ".join(f"rank {r}: {len(d)}" for r, d in enumerate(described))
    theirs = [f"rank {r} has {_describe(d[i]) if i < len(d) else 'nothing'}"
              for r, d in ((0, described[0]), (rank, described[rank]))]
    raise RuntimeError(
        f"{owner} expects {expects} on every rank, but the ranks' {noun} "
        f"differ at position {i}: {theirs[0]}, {theirs[1]} (tensors per rank: {counts}). "
        f"{advice}")


def verify_same_model(module: torch.nn.Module, group: dist.ProcessGroup | None, *, owner: str,
                      buffers: bool = True) -> None:
    """``verify_same_tensors`` over ``module``'s parameters (and buffers, unless ``buffers`` is
    False): the check a wrapper runs before its first collective on the model."""
    states = [("parameter", repr(name), p) for name, p in module.named_parameters()]
    if buffers:
        states += [("buffer", repr(name), b) for name, b in module.named_buffers()]
    verify_same_tensors(
        states, group, owner=owner, expects="the same model",
        noun="parameters and buffers" if any(kind == "buffer" for kind, *_ in states)
        else "parameters",
        advice="Build the model the same way on every rank (same class, same arguments, same "
               "frozen parameters), then wrap it.")


def _first_difference(described: list[list[list]]) -> tuple[int, int] | None:
    """(position, rank) of the first entry where a rank differs from rank 0, or None."""
    for i in range(max(len(d) for d in described)):
        reference = described[0][i] if i < len(described[0]) else None
        for rank, entries in enumerate(described[1:], start=1):
            entry = entries[i] if i < len(entries) else None
            if entry is None or reference is None or \
                    [entry[0], *entry[2:]] != [reference[0], *reference[2:]]:
                return i, rank
    return None


def _describe(entry: list) -> str:
    kind, label, shape, dtype, requires_grad = entry
    grad = "" if kind == "buffer" else f", requires_grad={requires_grad}"
    return f"{kind} {label} of shape {tuple(shape)}, {dtype}{grad}"


def _broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` with the group's rank 0 values: one broadcast per dtype and device."""
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same])  # (total numel,) one message
            dist.broadcast(flat, src=src, group=group)
            offsets = [0, *accumulate(t.numel() for t in same)]
            for t, start, end in zip(same, offsets, offsets[1:]):
                t.copy_(flat[start:end].view(t.shape))
