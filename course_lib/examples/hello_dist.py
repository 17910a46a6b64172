"""Hello, torch.distributed: the same script under torchrun, mpirun, srun or plain python.

    torchrun --standalone --nproc_per_node=2 hello_dist.py
    torchrun --nnodes=2 --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 hello_dist.py
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 python hello_dist.py
    srun --ntasks=2 python hello_dist.py
    python hello_dist.py            # no launcher: one process, not distributed

Each rank prints one line ``hello_dist {json}`` with what it found; rank 0 checks that the
hand-written ring allreduce equals ``dist.all_reduce`` on a tensor of odd length.
"""
import json
import os
import socket

import torch
import torch.distributed as dist

from course_lib.distributed import cleanup, init_distributed_mode, is_main_process, ring_allreduce


def main() -> None:
    info = init_distributed_mode(verbose=False)
    x = torch.arange(7, dtype=torch.float32, device=info.device) * (info.rank + 1)  # (7,)
    expected = x.clone()
    if info.distributed:
        dist.all_reduce(expected)
        ring_allreduce(x)
        torch.testing.assert_close(x, expected)
    record = {"launcher": info.launcher, "rank": info.rank, "world_size": info.world_size,
              "local_rank": info.local_rank, "backend": info.backend, "device": str(info.device),
              "host": socket.gethostname(), "pid": os.getpid(),
              "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
              "sum": x.tolist()}
    print("hello_dist " + json.dumps(record), flush=True)
    if info.distributed:
        dist.barrier()
    if is_main_process():
        print(f"rank 0: {info.world_size} process(es) via {info.launcher}; ring allreduce == "
              "dist.all_reduce", flush=True)
    cleanup()


if __name__ == "__main__":
    main()
