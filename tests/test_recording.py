"""course_lib.distributed.recording: every collective called inside the block, recorded once.

One launch of 3 ranks: the default group (3 ranks) and a sub-group of ranks 0 and 2 (2 ranks),
each call's record checked field by field (name, elements, bytes, ranks, op, requires_grad,
context); a collective inside another counted once; a name imported from torch.distributed
seen; the originals back after the block, also after an exception.
"""
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce

from course_lib.distributed import launch
from course_lib.distributed.recording import CollectiveRecord, record_collectives


def _cases() -> list[str]:
    failures: list[str] = []
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 2])                      # every rank must take part in new_group
    phase = ["forward"]
    real = dist.all_reduce
    x = torch.ones(5, dtype=torch.float64, requires_grad=True)
    with record_collectives(context=lambda: phase[0]) as records:
        dist.all_reduce(x.detach().clone(), op=dist.ReduceOp.MAX)
        phase[0] = "backward"
        parts = [torch.zeros(3, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(parts, torch.ones(3, dtype=torch.float32))
        if rank in (0, 2):
            dist.all_reduce(torch.ones(4, dtype=torch.float64), group=pair)
        objects = [None] * world
        dist.all_gather_object(objects, rank)          # calls all_gather inside: counted once
        imported_all_reduce(x)                         # hands a tensor that requires grad
    want = [CollectiveRecord("all_reduce", 5, 40, tuple(range(world)), dist.ReduceOp.MAX, False,
                             "forward"),
            CollectiveRecord("all_gather", 3, 12, tuple(range(world)), None, False, "backward")]
    if rank in (0, 2):
        want.append(CollectiveRecord("all_reduce", 4, 32, (0, 2), None, False, "backward"))
    want += [CollectiveRecord("all_gather_object", 0, 0, tuple(range(world)), None, False,
                              "backward"),
             CollectiveRecord("all_reduce", 5, 40, tuple(range(world)), None, True, "backward")]
    if records != want:
        failures.append(f"rank {rank}: recorded {records}, expected {want}")
    if dist.all_reduce is not real or imported_all_reduce is not real:
        failures.append(f"rank {rank}: all_reduce not restored after the block")
    # only the names asked for; restored when the block raises
    real_broadcast = dist.broadcast
    try:
        with record_collectives(("broadcast",)) as only:
            dist.all_reduce(torch.ones(2))
            dist.broadcast(torch.ones(2), src=0)
            raise KeyError("inside")
    except KeyError:
        pass
    if [(r.name, r.context) for r in only] != [("broadcast", None)]:
        failures.append(f"rank {rank}: with names=('broadcast',) recorded {only}")
    if dist.broadcast is not real_broadcast:
        failures.append(f"rank {rank}: broadcast not restored after an exception")
    return failures


def test_records_each_collective_once_with_its_group_op_and_context():
    failures = launch(_cases, 3, timeout=120)
    assert failures == [[], [], []]
