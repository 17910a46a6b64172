"""Worker functions that notebook 13 (after training) hands to ``launch``.

The recipe (``course_lib.train_ddp``) saves the unwrapped model; ``save_wrapped_checkpoint``
saves the way many scripts do, ``ddp_model.state_dict()``, whose keys all start with
``module.``: the checkpoint that ``course_lib.deploy`` must load.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.data import load_fashion_mnist
from course_lib.models.lenet import LeNet
from course_lib.train_ddp import save_checkpoint

__all__ = ["save_wrapped_checkpoint"]


def save_wrapped_checkpoint(path: str, steps: int = 20, batch_size: int = 32,
                            n_probe: int = 8) -> dict:
    """Train a LeNet under torch's DDP for ``steps`` steps; rank 0 saves ``ddp.state_dict()``.

    Every rank builds ``LeNet()`` seeded with its rank (DDP's broadcast from rank 0 makes them
    equal), takes its stride of the first ``steps * k * batch_size`` real Fashion-MNIST training
    images and takes ``steps`` SGD steps (lr 0.1). Then rank 0 writes the WRAPPED model's state
    dict to ``path`` (atomically), keys ``module.conv1.weight`` and so on. Returns ``{"rank",
    "keys" (the saved keys on rank 0, else []), "logits" (on the first ``n_probe`` test images,
    eval mode, (n_probe, 10)), "loss" (this rank's last)}``; the weights are asserted equal.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    train_iter, test_iter = load_fashion_mnist(batch_size, quick=False)
    n = steps * world * batch_size
    X = train_iter.X[:n][rank::world].float().div_(255)              # (n / k, 1, 28, 28)
    y = train_iter.y[:n][rank::world]                                  # (n / k,)
    torch.manual_seed(rank)
    ddp = nn.parallel.DistributedDataParallel(LeNet())                 # broadcasts rank 0's
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        rows = slice(step * batch_size, (step + 1) * batch_size)
        loss = F.cross_entropy(ddp(X[rows]), y[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                                                # averaged over ranks
        optimizer.step()
    checksums = [None] * world
    dist.all_gather_object(checksums, [p.detach().double().sum().item()
                                       for p in ddp.parameters()])
    assert all(c == checksums[0] for c in checksums), checksums        # equal on every rank
    state = ddp.state_dict()                                           # keys "module.*"
    if rank == 0:
        save_checkpoint(state, path)
    dist.barrier()                                                     # the file is complete
    ddp.module.eval()
    with torch.no_grad():
        logits = ddp.module(test_iter.X[:n_probe].float().div(255))    # (n_probe, 10)
    return {"rank": rank, "keys": list(state) if rank == 0 else [], "logits": logits,
            "loss": loss.item()}
