"""course_lib.distributed.recording: every collective called inside the block, recorded once.

One launch of 3 ranks: the default group (3 ranks) and a sub-group of ranks 0 and 2 (2 ranks),
each call's record checked field by field (name, elements, bytes, ranks, op, requires_grad,
context); a collective inside another counted once; a name imported from torch.distributed
seen; the originals back after the block, also after an exception. Point-to-point calls carry
the global rank at the other end (``peer``), also those ``batch_isend_irecv`` posts and those
made in a sub-group, where torch passes the rank within the group.
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
    # point-to-point: a ring step in the world (batched) and in the pair (batched: group ranks
    # 0 and 1 are global 0 and 2), then a blocking send from 0 to 2 with a receive from any rank
    right, left = (rank + 1) % world, (rank - 1) % world
    with record_collectives(("send", "isend", "recv", "irecv")) as p2p:
        box = torch.zeros(2)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), right),
                                            dist.P2POp(dist.irecv, torch.zeros(3), left)]):
            work.wait()
        if rank in (0, 2):
            other = 2 - rank
            for work in dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, torch.ones(2), group=pair, group_peer=other // 2),
                    dist.P2POp(dist.irecv, box, group=pair, group_peer=other // 2)]):
                work.wait()
            if rank == 0:
                dist.send(torch.ones(1), dst=2)
            else:
                dist.recv(box[:1])
    want_p2p = [("isend", 3, right), ("irecv", 3, left)]
    if rank in (0, 2):
        want_p2p += [("isend", 2, 2 - rank), ("irecv", 2, 2 - rank),
                     ("send", 1, 2) if rank == 0 else ("recv", 1, None)]
    if [(r.name, r.elements, r.peer) for r in p2p] != want_p2p:
        failures.append(f"rank {rank}: point-to-point recorded "
                        f"{[(r.name, r.elements, r.peer) for r in p2p]}, expected {want_p2p}")
    return failures


def test_records_each_collective_once_with_its_group_op_and_context():
    failures = launch(_cases, 3, timeout=120)
    assert failures == [[], [], []]
