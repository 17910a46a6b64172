"""Train LeNet with the course's DistributedDataParallel: the same code under torchrun or python.

    torchrun --standalone --nproc_per_node=2 train_ddp_script.py [steps]
    python train_ddp_script.py [steps]      # no launcher: one process, DDP over a group of one

Every rank takes its shard of each global batch of Fashion-MNIST; after the last step rank 0
checks that all ranks hold the same weights and prints one line.
"""
import sys
from itertools import islice

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import load_fashion_mnist
from course_lib.distributed import cleanup, init_distributed_mode, is_main_process
from course_lib.models.lenet import LeNet
from course_lib.parallel.ddp import DistributedDataParallel


def main(steps: int = 20, per_rank: int = 64, lr: float = 0.1) -> None:
    info = init_distributed_mode(verbose=False)
    if not info.distributed:  # one process: a group of one, so the same code runs
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_iter, _ = load_fashion_mnist(per_rank * world, quick=True, seed=0)
    torch.manual_seed(rank)          # different initial weights on purpose: DDP broadcasts rank 0's
    model = DistributedDataParallel(LeNet().to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for X, y in islice(train_iter, steps):      # (world * per_rank, 1, 28, 28): a global batch
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        X, y = X[mine].to(info.device), y[mine].to(info.device)  # this rank's shard
        opt.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()              # averages the gradients over the ranks
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    same = all(torch.equal(c, copies[0]) for c in copies)
    if is_main_process():
        print(f"train_ddp_script: {world} rank(s), {steps} steps of {per_rank} examples per rank; "
              f"rank 0's loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
              f"weights equal on every rank: {same}", flush=True)
    cleanup()
    if not same:
        sys.exit("the ranks' weights differ")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
