"""Checkers for the exercises of lesson 06 (torch.distributed).

The exercises: the rounds of a tree broadcast, what each rank sends in the ring, the canonical
worker that ``torch.multiprocessing.spawn`` starts (which hands its result back through a queue,
since spawn discards return values), and an allreduce built from send and recv. The oracles stay
private here (``_tree_rounds``, ``_elements_sent``): the learner imports ``course_lib.checks``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..distributed.compat import FLAT_COLLECTIVE_NAMES
from .harness import (
    ExerciseResult,
    StopRank,
    call_answer,
    check_function,
    check_in_ranks,
    describe,
    load_answer,
    resolve,
    unanswered,
    verdict,
    worker_spec,
)
from .lesson02 import _ring_sends

__all__ = ["check_dist_allreduce", "check_elements_sent", "check_spawn_worker",
           "check_tree_rounds"]


def _tree_rounds(p: int) -> int:
    """Rounds of ``distributed.tree_broadcast`` for p ranks: its loop, run without sending."""
    step, rounds = 1, 0
    while step < p:
        step, rounds = step * 2, rounds + 1
    return rounds


def check_tree_rounds(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(p)`` is the number of rounds ``tree_broadcast`` needs for p ranks."""
    return check_function("rounds", fn, _tree_rounds, [(p,) for p in range(1, 17)] + [(1000,)],
                          hint="the number of ranks holding the data doubles every round.",
                          strict=strict)


def _elements_sent(n: int, p: int, rank: int = 0) -> int:
    """Elements rank ``rank`` sends in ``distributed.ring_allreduce`` of n elements over p ranks."""
    return _ring_sends(n, p)[rank]  # the same ring schedule and chunking as lesson 02's


def check_elements_sent(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(n, p, rank)`` is what that rank sends in
    ``course_lib.distributed.ring_allreduce``."""
    cases = [(n, p, r) for n, p in [(10, 2), (1000, 4), (7, 3), (2, 4), (10**6, 8)]
             for r in range(p)]
    return check_function("elements_sent", fn, _elements_sent, cases,
                          hint="Follow the schedule above for this one rank: which chunk it "
                          "sends in each step of each phase, and how many elements that chunk "
                          "has (ring_chunk_bounds). With uneven sizes, which chunks it sends "
                          "matters.", strict=strict)


# ---- the canonical worker: join, work, hand the result back, leave ---------------------------

_WORKER = "spawn_worker"
_WORKER_HINT = ("Every rank makes the four moves: join the group at init_method as this rank "
                "of world_size, all-reduce its tensor, put the pair (rank, sum as a float) on "
                "results, and leave the group, also after an error.")


class _RefusingQueue:
    """A queue whose ``put`` raises: the checker's way to see a worker leave after an error."""

    def put(self, item) -> None:
        raise RuntimeError("the checker's queue refused this put on purpose")


class _SentTensor:
    """What the checker's queue carries in place of a tensor put on it: its text. A tensor that
    crosses a queue travels as a file descriptor served by the sending process, which may have
    exited before the checker reads it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _TensorsAsText:
    """The checker's queue as the learner's worker sees it: ``put`` sends each tensor in the
    item as a ``_SentTensor``; anything else is the real queue's."""

    def __init__(self, queue) -> None:
        self._queue = queue

    def put(self, item) -> None:
        import torch
        if isinstance(item, (tuple, list)):
            item = (tuple if isinstance(item, tuple) else list)(
                _SentTensor(repr(x)) if isinstance(x, torch.Tensor) else x for x in item)
        elif isinstance(item, torch.Tensor):
            item = _SentTensor(repr(item))
        self._queue.put(item)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def _run_worker(spec, rank: int, world_size: int, init_method: str, results, conn,
                refuse_put: bool = False) -> None:
    """One process of the check: the learner's worker with the queue ``results`` (a queue whose
    ``put`` raises, ``refuse_put``); through ``conn`` (the checker's own channel), what it
    returned or raised, and whether its group was still initialised afterwards."""
    import torch.distributed as dist

    try:
        queue = _RefusingQueue() if refuse_put else _TensorsAsText(results)
        returned = resolve(spec)(rank, world_size, init_method, queue)
        try:
            returned = float(returned)                        # a tensor, a number: its value
        except (TypeError, ValueError):
            returned = None if returned is None else repr(returned)[:60]
        conn.send(("ok", returned, dist.is_initialized()))
    except NotImplementedError:
        conn.send(("unanswered", None, None))
    except BaseException as e:  # noqa: B036 - every failure is a verdict, never a crash
        conn.send(("error", f"{type(e).__name__}: {' '.join(str(e).split())}",
                   dist.is_initialized()))
    finally:
        conn.close()


def _spawn_and_collect(spec, world_size: int, timeout: float,
                       refuse_put: bool = False) -> tuple[list[tuple], list] | str:
    """Start ``world_size`` fresh processes (like ``torch.multiprocessing.spawn``, through the
    forkserver), each with the same queue (or one that refuses every put, ``refuse_put``);
    every rank's report in rank order and every item put on the queue, or what went wrong.
    Every process is gone when this returns."""
    import shutil
    import tempfile
    import time
    from multiprocessing.connection import wait

    from ..distributed.launch import _context
    from ..distributed.processes import kill_processes

    ctx = _context("forkserver")  # fresh processes, forked from launch's server, which has torch
    folder = tempfile.mkdtemp(prefix="course_check_")
    init_method = f"file://{folder}/rendezvous"
    results = ctx.SimpleQueue()          # what the learner's workers put; read while they run
    procs, conns, items = [], [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_run_worker,
                            args=(spec, rank, world_size, init_method, results, send,
                                  refuse_put), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return (f"no result within {timeout:g} s from rank(s) {sorted(pending)} (a rank "
                        "that never reaches the collective, or a wrong world size?)")
            for conn in wait(list(pending.values()) + [results._reader], timeout=left):
                if conn is results._reader:
                    items.append(results.get())     # drained while the senders are alive
                    continue
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    return f"rank {rank} died without a report (did it call exit()?)"
        while not results.empty():                 # a put completes before its worker returns
            items.append(results.get())
        return [replies[r] for r in range(world_size)], items
    finally:
        kill_processes([p.pid for p in procs if p.pid is not None])
        for p in procs:
            p.join(timeout=1)
        for c in conns:
            c.close()
        results.close()
        shutil.rmtree(folder, ignore_errors=True)


def _judge_worker(world: int, replies: list[tuple], items: list) -> str | None:
    """The first problem with one world size's run, or None when every rank did its part."""
    want = world * (world + 1) / 2
    for rank, (status, value, _) in enumerate(replies):
        if status == "error":
            return f"world_size={world}, rank {rank}: raised {value}."
    pairs: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            return (f"world_size={world}: found {item!r} on the queue; expected a pair "
                    "(rank, sum), so that the parent knows which rank each result is from.")
        if isinstance(item[1], _SentTensor):
            return (f"world_size={world}: found {item!r} on the queue; expected the sum as a "
                    "plain float (a tensor crossing the queue keeps the worker's memory "
                    "shared with the parent): put its .item().")
        try:
            rank, value = int(item[0]), float(item[1])
        except (TypeError, ValueError):
            return f"world_size={world}: found {item!r} on the queue; expected (rank, sum)."
        if rank in pairs or not 0 <= rank < world:
            return (f"world_size={world}: found the pair {item!r} on the queue; expected one "
                    f"pair per rank 0 ... {world - 1}, each with its own rank.")
        pairs[rank] = value
    missing = [r for r in range(world) if r not in pairs]
    returned = [r for r in missing if replies[r][1] is not None]
    if len(missing) == world and returned:
        return (f"world_size={world}: nothing arrived on the queue; rank(s) {returned} returned "
                f"{replies[returned[0]][1]!r} instead. torch.multiprocessing.spawn discards what "
                "a worker returns: put (rank, sum) on results.")
    if missing:
        return (f"world_size={world}: rank(s) {missing} put nothing on the queue (only "
                f"{sorted(pairs)} did); the parent asks for every rank's result.")
    for rank in range(world):
        if pairs[rank] != want:
            return (f"world_size={world}, rank {rank}: put {pairs[rank]:g}, expected {want:g} "
                    f"(1 + ... + {world}, the all-reduced sum).")
    for rank, (_, _, still_in_group) in enumerate(replies):
        if still_in_group:
            return (f"world_size={world}, rank {rank}: the process group was still initialised "
                    "when the worker returned: call dist.destroy_process_group() at the end (in "
                    "a finally, so that an error leaves too).")
    return None


def check_spawn_worker(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                       timeout: float = 60.0, strict: bool = False) -> ExerciseResult:
    """Exercise 06: the canonical worker that ``torch.multiprocessing.spawn`` starts.

    ``fn(rank, world_size, init_method, results)`` joins a gloo group with
    ``dist.init_process_group``, all-reduces ``torch.tensor([rank + 1.0])``, puts
    ``(rank, sum)`` on the multiprocessing queue ``results`` (spawn discards return values) and
    leaves with ``dist.destroy_process_group()``. The checker starts ``world_size`` fresh
    processes for each world size with one queue (bounded by ``timeout``; a hang is reported,
    every process is stopped), and checks that every rank's pair arrived, once, with the sum,
    and that no rank left its group behind. A worker that only returns the sum, or whose rank 0
    alone reports, is wrong: the parent would get nothing, or one rank's word for all. ``fn``
    must be importable by fresh processes, or ``"module:function"`` (a file written with
    ``%%writefile my_worker.py``, imported from the current folder); None: not answered yet.
    ``world_sizes``: numbers of processes to try; ``timeout``: seconds for each world size;
    ``strict``: raise ``AssertionError`` on a wrong answer.
    """
    if fn is None:
        return verdict(_WORKER, None, "write spawn_worker(rank, world_size, init_method, "
                       "results) to a file and pass it here.", strict)
    spec = worker_spec(fn, "my_worker:spawn_worker")
    if isinstance(spec, str):
        return verdict(_WORKER, False, spec, strict)
    for world in world_sizes:
        run = _spawn_and_collect(spec, world, timeout)
        if isinstance(run, str):
            return verdict(_WORKER, False, f"world_size={world}: {run} {_WORKER_HINT}", strict)
        replies, items = run
        if any(status == "unanswered" for status, _, _ in replies):
            return unanswered(_WORKER, strict)
        problem = _judge_worker(world, replies, items)
        if problem is not None:
            return verdict(_WORKER, False, f"{problem} {_WORKER_HINT}", strict)
    # once more with a queue that refuses the put: the worker must leave its group all the same
    run = _spawn_and_collect(spec, world_sizes[0], timeout, refuse_put=True)
    if isinstance(run, str):
        return verdict(_WORKER, False, f"world_size={world_sizes[0]}, with a queue whose put "
                       f"raises: {run} {_WORKER_HINT}", strict)
    stuck = [rank for rank, (_, _, in_group) in enumerate(run[0]) if in_group]
    if stuck:
        return verdict(_WORKER, False, f"world_size={world_sizes[0]}: when results.put raised "
                       f"(the checker's queue refused it on purpose), rank(s) {stuck} still had "
                       "the process group initialised afterwards. Leave the group in a finally: "
                       "block, so that an error leaves too.", strict)
    return verdict(_WORKER, True, f"every rank joined, summed, reported on the queue and left, "
                   f"for world sizes {list(world_sizes)}, and left also when its put "
                   "raised.", strict)


# ---- an allreduce of one's own, in real processes -----------------------------------------------

_ALLREDUCE = "allreduce"
_ALLREDUCE_HINT = ("allreduce(tensor) runs in every rank and must leave the sum of every rank's "
                   "tensor in that same tensor (in place: tensor += ..., tensor.copy_(...); "
                   "tensor = ... only rebinds a local name).")
#: Shapes tried in every rank: 1, 5, 21 and 28 elements (no world size of 2-4 divides them all).
_DIST_SHAPES = [(1,), (5,), (7, 3), (4, 1, 7)]
#: The collectives that ``p2p_only`` forbids during the learner's call.
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                "all_to_all", "all_to_all_single") + FLAT_COLLECTIVE_NAMES


def _refuse(name: str) -> Callable:
    def refused(*args, **kwargs):
        raise RuntimeError(f"this exercise builds the allreduce from dist.send / dist.recv "
                           f"(or isend / irecv): dist.{name} is not allowed here.")
    return refused


#: The point-to-point calls ``ring=True`` records (``batch_isend_irecv`` posts them too).
_P2P = ("send", "isend", "recv", "irecv")


def _refuse_course_ring() -> Callable[[], None]:
    """Replace the first steps of the course's own rings with a refusal; return the function
    that puts them back."""
    from ..distributed import _ring_pipelined, collectives

    def refused(*args, **kwargs):
        raise RuntimeError("course_lib's ring is the course's answer to this exercise: write the "
                           "ring's messages yourself with dist.send / dist.recv (or isend / "
                           "irecv, or dist.batch_isend_irecv).")
    saved = [(module, name, getattr(module, name))
             for module, name in ((collectives, "_exchange"), (_ring_pipelined, "_pieces"))]
    for module, name, _ in saved:
        setattr(module, name, refused)

    def restore() -> None:
        for module, name, op in saved:
            setattr(module, name, op)
    return restore


def _not_a_ring(record: list, n: int, rank: int, world: int, where: str) -> str | None:
    """What in ``record`` (one rank's point-to-point calls for one tensor of ``n`` elements, as
    ``CollectiveRecord``s) a ring allreduce would not do, or None: every send to the right
    neighbour, every receive from the left one, and at most ``2 (p - 1) ceil(n / p)`` elements
    sent (a chunk per step)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for name, peer in ((r.name, r.peer) for r in record):
        if name in ("send", "isend") and peer != right:
            return (f"{where}: rank {rank} sent to rank {peer}. In a ring each rank sends only to "
                    f"its right neighbour, (rank + 1) % world_size = {right}.")
        if name in ("recv", "irecv") and peer != left:
            return (f"{where}: rank {rank} received from "
                    + ("any rank (src=None)" if peer is None else f"rank {peer}")
                    + f". In a ring each rank receives only from its left neighbour, (rank - 1) "
                    f"% world_size = {left}.")
    sent, most = sum(r.elements for r in record if r.name in ("send", "isend")), \
        2 * (world - 1) * -(-n // world)
    if sent > most:
        return (f"{where}: rank {rank} sent {sent} elements of a {n}-element tensor. A ring cuts "
                f"the tensor into {world} chunks and sends one chunk per step, 2 (p - 1) steps: "
                f"at most 2 (p - 1) ceil(n / p) = {most} elements.")
    return None


def _run_allreduce_cases(spec, seed: int, p2p_only: bool, ring: bool = False) -> str | None:
    """One rank of ``check_dist_allreduce``: every shape; the first failure as text, or None.
    After each case the ranks agree (with torch's own all_reduce) whether any of them failed,
    so that they stop together instead of waiting for a rank that stopped."""
    import torch
    import torch.distributed as dist

    from ..distributed.env import current_device
    from ..distributed.recording import record_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    all_reduce = dist.all_reduce                           # the checker's own, kept aside
    device = current_device()
    fn, error = load_answer(spec)
    if error:
        return error
    for k, shape in enumerate(_DIST_SHAPES):
        # every rank can make every rank's tensor: the oracle is their plain sum
        inputs = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100 * k + r),
                              dtype=torch.float64) for r in range(world)]
        expected = sum(inputs)
        mine = inputs[rank].to(device, copy=True)
        where = f"world_size={world}, tensor of shape {shape}, rank {rank}"
        problem = None
        saved = ({name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
                 if p2p_only else {})
        for name in saved:
            setattr(dist, name, _refuse(name))
        record: list = []
        restore = _refuse_course_ring() if ring else (lambda: None)
        try:
            with (record_collectives(_P2P) if ring else contextlib.nullcontext(record)) as record:
                returned = call_answer(f"{where}: your function", fn, mine)
        except StopRank as e:  # UNANSWERED, or what it raised
            problem = str(e)
        finally:
            restore()
            for name, op in saved.items():
                setattr(dist, name, op)
        if ring and problem is None:
            problem = _not_a_ring(record, mine.numel(), rank, world, where)
        got = mine.cpu()
        if problem is None and not torch.allclose(got, expected):
            why = ""
            if torch.equal(got, inputs[rank]):
                gave_sum = isinstance(returned, torch.Tensor) and torch.allclose(returned.cpu(),
                                                                                 expected)
                why = " The tensor is unchanged" + (": the function returned the sum instead "
                                                    "of writing it in place." if gave_sum else ".")
            elif torch.allclose(got * world, expected):
                why = f" It is the average; the sum is {world} times larger."
            problem = (f"{where}: expected {describe(expected)}, received {describe(got)}.{why}")
        failed = torch.tensor([0.0 if problem is None else 1.0], device=device)
        all_reduce(failed)
        if problem is not None:
            return problem
        if failed.item() > 0:
            return None                                     # another rank says what went wrong
    return None


def check_dist_allreduce(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3, 4),
                         p2p_only: bool = False, ring: bool = False, timeout: float = 60.0,
                         strict: bool = False) -> ExerciseResult:
    """Exercise 06: ``fn(tensor)``, called in every rank, leaves the sum of every rank's tensor in
    ``tensor``, in place (what ``dist.all_reduce(tensor)`` does).

    For each world size, ``launch`` starts that many processes; each calls ``fn`` on its own
    float64 tensor for 4 shapes (1 to 28 elements, sizes the world sizes do not divide) and
    compares with the sum of every rank's tensor. A hang (a send nobody receives) fails within
    ``timeout``; a rank that raises or dies is reported, the others are stopped. ``fn`` must be
    importable by worker processes, or ``"module:function"`` (imported in the workers from the
    current folder); None: not answered yet. ``world_sizes``: numbers of processes to try
    (several: many wrong answers are right for 2). ``p2p_only`` forbids torch's collectives
    (``dist.all_reduce``, ``dist.reduce``, ...) during the call, so that the answer is built
    from send / recv. ``ring``: the answer must be a ring, its point-to-point calls watched
    (``send``, ``isend``, ``recv``, ``irecv``, also inside ``batch_isend_irecv``): each rank
    sends only to rank + 1 and receives only from rank - 1 (mod p), at most ``2 (p - 1)
    ceil(n / p)`` elements in all, and the course's own ring is refused; p = 2 cannot tell a
    ring from gathering at rank 0, so 3 and 4 ranks decide. ``timeout``: seconds for each world
    size. ``strict``: raise ``AssertionError`` on a wrong answer.
    """
    return check_in_ranks(
        _ALLREDUCE, fn, "my_allreduce:allreduce", _run_allreduce_cases, (11, p2p_only, ring),
        world_sizes=world_sizes, timeout=timeout, hint=_ALLREDUCE_HINT,
        hang_hint="Is every send matched by a recv on the rank it names, in every rank? A "
                  "blocking send waits until its receive is posted: if every rank sends "
                  "first, every rank waits.",
        passed=f"every rank holds the sum, for world sizes {list(world_sizes)} and "
               f"{len(_DIST_SHAPES)} shapes" + (", every message sent to the right neighbour, "
                                                "a chunk at a time." if ring else "."),
        strict=strict,
        missing="write allreduce(tensor) to a file and pass it here.")
