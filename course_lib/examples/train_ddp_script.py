"""Train LeNet with the course's DistributedDataParallel: the same code under torchrun or python.

    torchrun --standalone --nproc_per_node=2 train_ddp_script.py [steps]
    python train_ddp_script.py [steps]      # no launcher: one process, DDP over a group of one

Every rank takes its shard of each global batch of Fashion-MNIST (the quick slice of 2048
examples; a short last batch is left out, so every rank's shard is full). ``steps`` (default 20)
steps run even when one pass over the data has fewer batches: the batches wrap around, a new
pass reshuffled. After the last step rank 0 checks that all ranks hold the same weights and
prints one line: the steps that ran and how many passes over the data they made.
"""
import argparse
import gc
import sys
from itertools import chain, islice, repeat

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import load_fashion_mnist
from course_lib.distributed import cleanup, init_distributed_mode, is_main_process
from course_lib.models.lenet import LeNet
from course_lib.parallel.ddp import DistributedDataParallel


def main(steps: int = 20, per_rank: int = 64, lr: float = 0.1) -> None:
    if steps < 1:
        raise ValueError(f"train_ddp_script: steps must be at least 1, got {steps}.")
    info = init_distributed_mode(verbose=False)
    if not info.distributed:  # one process: a group of one, so the same code runs
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_iter, _ = load_fashion_mnist(per_rank * world, quick=True, seed=0, drop_last=True)
    if len(train_iter) == 0:
        raise ValueError(f"train_ddp_script: a global batch of {per_rank * world} is more than "
                         f"the {len(train_iter.y)} training examples; lower per_rank.")
    torch.manual_seed(rank)          # different initial weights on purpose: DDP broadcasts rank 0's
    model = DistributedDataParallel(LeNet().to(info.device))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    passes = chain.from_iterable(repeat(train_iter))  # wraps around: a new, reshuffled pass
    for X, y in islice(passes, steps):         # (world * per_rank, 1, 28, 28): a global batch
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
        ran = len(losses)          # the steps that ran, counted, not the ones asked for
        print(f"train_ddp_script: {world} rank(s), {ran} steps of {per_rank} examples per rank "
              f"({ran / len(train_iter):.2f} passes over {len(train_iter)} batches); "
              f"rank 0's loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
              f"weights equal on every rank: {same}", flush=True)
    # Drop the wrapper (and the communication work it still references) while the interpreter
    # is whole; wait until every rank is done communicating; then tear the group down. Gloo
    # work destroyed during interpreter shutdown, or a peer that closes its connections while
    # another rank still talks to it, can abort a process after a successful run.
    del model, opt
    gc.collect()
    dist.barrier()
    cleanup()
    if not same:
        sys.exit("the ranks' weights differ")


def _steps(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"steps must be an integer >= 1, got {text}")
    return n


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split(
        "\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="?", type=_steps, default=20,
                        help="training steps to run (default 20); the data wraps around")
    main(parser.parse_args().steps)
