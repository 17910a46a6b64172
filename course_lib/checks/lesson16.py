"""Checkers for the exercises of lesson 16 (context parallelism: ring attention), in float64.
Each docstring says what it tries; each prints its verdict (the first failing case) and returns
it, truthy when right.

``check_merge(fn)`` runs the learner's online-softmax merge ``merge(out_a, lse_a, out_b, lse_b)
-> (out, lse)`` in this process (pass the function itself) against the softmax over all the
keys, rows that see no key and logits that overflow an unshifted exp included.

``check_ring_step(fn)`` runs ``ring_step(k, v, group=None) -> (k, v)`` in worker processes at 2
and 3 ranks (and in a group of ranks 1 and 2), its point-to-point calls watched before they
run: one ``dist.batch_isend_irecv`` of ``P2POp``s to the next rank and from the previous, into
new buffers (an ``isend`` or ``recv`` on its own can deadlock on NCCL).

``check_ring_attention(fn)`` runs the forward ring loop ``ring_attention_forward(q, k, v,
group=None, is_causal=False) -> out`` in worker processes at 2 and 3 ranks against this rank's
slice of ``F.scaled_dot_product_attention`` over the whole sequence, collectives refused.

Worker processes import the answers by module and name: write them to a file (``%%writefile
my_ring.py``, ``my_ring_attention.py``) and pass objects or strings such as
``"my_ring:ring_step"``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from ..distributed.recording import COLLECTIVES, record_collectives
from ._core import ExerciseResult, call_bounded, failure
from ._launch import UNANSWERED, check_in_ranks, load_answer
from .harness import ATOL, RTOL, agree, call_answer, check_cases, close, describe, run_in_step

__all__ = ["check_merge", "check_ring_attention", "check_ring_step"]

_DTYPE = torch.float64


def _same_with_inf(got, want: torch.Tensor) -> bool:
    """Like ``close``, -inf where ``want`` is -inf."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    got = got.detach().to(want.dtype)
    masked = torch.isneginf(want)
    return bool(torch.equal(torch.isneginf(got), masked)
                and torch.allclose(got[~masked], want[~masked], rtol=RTOL, atol=ATOL))


# ---- the online-softmax merge -------------------------------------------------------------------

_MERGE_NAME = "merge of partial attentions"
_MERGE_HINT = ("a partial attention is a softmax over some keys: its output is normalised by "
               "the mass of those keys alone, and its lse is the log of that mass. Over both "
               "sets the mass is the sum of the two masses, and each output enters in "
               "proportion to its set's share of it. Exponentials of large numbers overflow: "
               "work with differences of logs (torch has a function that adds two numbers "
               "given by their logs), and a row that sees no key at all (both masses 0) has "
               "output 0.")


def _partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one key set alone: (out, lse); a row with no visible key: (0, -inf)."""
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ values, lse


def _merge_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(what, scores (..., S, N), values (..., N, D), where key set b starts)."""
    gen = torch.Generator().manual_seed(16)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=_DTYPE)

    cases = [("random partials of shape (2, 3, 5, 4)", randn(2, 3, 5, 7), randn(2, 3, 7, 4), 3),
             ("random partials of shape (6, 4) (no batch or head dimension)", randn(6, 9),
              randn(9, 4), 5)]
    s = randn(2, 4, 8)
    s[:, :2, 4:] = float("-inf")          # queries 0, 1 see no key of set b
    s[:, 2:4, :4] = float("-inf")         # queries 2, 3 see no key of set a
    cases.append(("rows 0 and 1 see no key of set b (lse_b = -inf there), rows 2 and 3 none of "
                  "set a", s, randn(2, 8, 3), 4))
    s = randn(2, 5, 6) * 4 + 1000.0
    s[:, :, 3:] += 5.0
    cases.append(("large logits (lse around 1000: exp(lse) overflows even in float64)", s,
                  randn(2, 6, 3), 3))
    s = randn(3, 6)
    s[1] = float("-inf")                  # query 1 sees no key at all
    cases.append(("row 1 sees no key of either set (both lse -inf)", s, randn(6, 2), 2))
    return cases


def _merge_problem(fn: Callable, what: str, scores: torch.Tensor, values: torch.Tensor,
                   cut: int) -> str | None:
    """What is wrong with ``fn`` on one case, or None."""
    out_a, lse_a = _partial(scores[..., :cut], values[..., :cut, :])
    out_b, lse_b = _partial(scores[..., cut:], values[..., cut:, :])
    want_out, want_lse = _partial(scores, values)
    inputs = [out_a, lse_a, out_b, lse_b]
    before = [t.clone() for t in inputs]
    where = (f"with {what}: merge(out_a {tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, "
             f"out_b, lse_b)")
    got = call_bounded(fn, *inputs)
    if not isinstance(got, (tuple, list)) or len(got) != 2 or \
            not all(isinstance(t, torch.Tensor) for t in got):
        return (f"{where} returned {type(got).__name__}, expected a pair (out, lse) of tensors, "
                "the merged output and its log-sum-exp.")
    out, lse = got
    for t, b, name in zip(inputs, before, ("out_a", "lse_a", "out_b", "lse_b")):
        if not torch.equal(t.nan_to_num(), b.nan_to_num()):
            return (f"{where} changed {name} in place: the caller may still need the partial "
                    "results it passed in; return new tensors.")
    for t, want, name in ((out, want_out, "out"), (lse, want_lse, "lse")):
        if t.shape != want.shape:
            return (f"{where} returned {name} of shape {tuple(t.shape)}, expected "
                    f"{tuple(want.shape)} (the same as {name}_a).")
    if not torch.isfinite(out).all() or torch.isnan(lse).any():
        rows = "large logits" in what
        why = (" exp of an lse around 1000 overflows to inf (and inf/inf is nan): subtract the "
               "larger lse first, or combine the logs without leaving log space." if rows else
               " -inf minus -inf is nan: where a row sees no key at all, its output is 0 and "
               "its lse -inf." if "either" in what else
               " An lse of -inf means no key of that set is visible: its weight is 0, and "
               "nothing should become nan.")
        return f"{where}: the result holds inf or nan ({describe(out)}, lse {describe(lse)}).{why}"
    if not _same_with_inf(lse, want_lse):
        why = ""
        if _same_with_inf(lse, torch.maximum(lse_a, lse_b)):
            why = (" It is the larger of lse_a and lse_b: the masses of the two sets add up, "
                   "so the merged lse is the log of e^lse_a + e^lse_b, larger than both.")
        elif close(lse, lse_a + lse_b):
            why = (" It is lse_a + lse_b: that is the log of the product of the masses; over "
                   "both sets the masses add.")
        return (f"{where}: lse is {describe(lse)}, expected the log-sum-exp over all the keys "
                f"{describe(want_lse)}.{why}")
    if not close(out, want_out):
        why = ""
        share_a = torch.exp(lse_a - want_lse.nan_to_num(neginf=0.0)).nan_to_num(0.0)
        share_b = torch.exp(lse_b - want_lse.nan_to_num(neginf=0.0)).nan_to_num(0.0)
        if close(out, (out_a + out_b) / 2):
            why = (" It is the plain average of out_a and out_b: each must weigh by its key "
                   "set's share of the total mass, e^(lse_a - lse) and e^(lse_b - lse).")
        elif close(out, share_b.unsqueeze(-1) * out_a + share_a.unsqueeze(-1) * out_b):
            why = " The two weights are swapped: out_a's weight is set a's share of the mass."
        elif close(out, out_a + out_b):
            why = (" It is out_a + out_b: each partial output is already normalised over its "
                   "own keys; weigh them by their shares, which add up to 1.")
        return (f"{where}: out is {describe(out)}, expected attention over all the keys "
                f"{describe(want_out)}.{why}")
    return None


def check_merge(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 1: ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``, the online softmax.

    ``out_a`` (..., S, D) is attention of S queries over a set a of keys alone and ``lse_a``
    (..., S) the log-sum-exp of their scores over a (-inf where a row sees no key of a); the
    same for set b. The merge must return attention over both sets and its log-sum-exp, equal
    (float64, to rounding) to the softmax over the concatenated scores: on random partials of
    shape (2, 3, 5, 4) and (6, 4), with rows that see no key of one set, with logits around
    1000 (an unshifted exp overflows) and with a row that sees no key at all (output 0, lse
    -inf, no nan). The inputs must be left as they were.

    Args:
        fn: your merge; None: not answered yet.
        strict: raise ``AssertionError`` on a wrong answer.
    """
    cases = _merge_cases()
    return check_cases(
        _MERGE_NAME, fn, cases, _merge_problem, missing="define merge and pass it here.",
        expected="a function merge(out_a, lse_a, out_b, lse_b)", hint=_MERGE_HINT,
        raised=lambda case, e: f"with {case[0]}: merge {failure(e)}. Hint: {_MERGE_HINT}",
        passed=f"equal to the softmax over all the keys in {len(cases)} cases: random partials, "
               "rows that see no key of one set or of either, and logits large enough to "
               "overflow an unshifted exp.", strict=strict)


# ---- one ring step ------------------------------------------------------------------------------

_RING_NAME = "ring step"
_RING_HINT = ("in one step every rank passes its block on to the next rank of the group and "
              "takes the one the previous rank passes. On NCCL a send or receive posted "
              "alone runs on its pair of peers' own communicator, in the order posted, so a "
              "send and a receive posted one after the other can wait on each other across "
              "ranks: describe every send and every receive as one "
              "operation and post them all together, as one batch. An operation names its "
              "peer by its global rank (torch can translate a rank of the group). Receive into "
              "new tensors of the same shapes: a buffer still being sent must not be written.")
_SHAPE = (2, 2, 3, 4)   # (batch, heads, positions of this rank, head_dim)
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_NOT_P2P = [n for n in COLLECTIVES if n not in _P2P]


class _BadP2P(Exception):
    """A point-to-point pattern refused before it ran (it would hang, race or deadlock)."""


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of memory."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + max(1, a.numel()) * a.element_size()
    b1 = b0 + max(1, b.numel()) * b.element_size()
    return a0 < b1 and b0 < a1


class _P2PGuard:
    """While inside: a ``dist.isend``/``irecv``/``send``/``recv`` outside a batch raises
    ``_BadP2P``, and each ``batch_isend_irecv`` is checked against one ring step (sends to
    ``nxt``, receives from ``prev``, global ranks; new buffers; the group given) before it
    runs. ``batches`` counts the batches that ran."""

    def __init__(self, group, nxt: int, prev: int, k: torch.Tensor, v: torch.Tensor):
        self.group, self.nxt, self.prev, self.inputs = group, nxt, prev, (k, v)
        self.batches, self._inside, self._saved = 0, False, {}
        self._originals = {n: getattr(c10d, n) for n in _P2P}

    def _is_send(self, op) -> bool:
        return op in (self._originals["isend"], self._stand_ins["isend"])

    def _alone(self, name: str) -> Callable:
        original = self._originals[name]

        def call(*args, **kwargs):
            if self._inside:                               # batch_isend_irecv posting its ops
                return original(*args, **kwargs)
            raise _BadP2P(
                f"called dist.{name} on its own, outside dist.batch_isend_irecv. On NCCL a "
                "send or receive posted alone runs on the communicator of its pair of peers, "
                "in the order posted: with two ranks, while each waits on its first one (a "
                "send that needs the peer's receive), neither reaches the one its peer waits "
                "for, and the ring deadlocks once the blocks pass NCCL's buffer (gloo, on "
                "CPUs, happens not to). Make each send and receive a dist.P2POp and post "
                "them together in one dist.batch_isend_irecv.")
        return call

    def _problem(self, ops: list) -> str | None:
        """What is wrong with one batch of a ring step, or None."""
        me = dist.get_rank()
        sends = [op for op in ops if self._is_send(op.op)]
        recvs = [op for op in ops if not self._is_send(op.op)]
        if not sends or not recvs:
            return (f"a batch_isend_irecv holds {len(sends)} send(s) and {len(recvs)} "
                    "receive(s): post the sends and the receives of the step in one batch, "
                    "so that no rank's send waits for a receive it has not posted.")
        group = c10d._group_or_default_group(self.group)
        for op in ops:
            if op.group is not group:
                return ("its P2POps are not on the group given: pass group=group to each "
                        "P2POp, so that the step runs among the ranks of that group.")
        for kind, found, want, other in (("sends", sends, self.nxt, self.prev),
                                         ("receives", recvs, self.prev, self.nxt)):
            peers = sorted({op.peer for op in found})
            if peers != [want]:
                where = "to" if kind == "sends" else "from"
                why = ""
                if peers == [other]:
                    why = (" That is the other neighbour: blocks travel to the next rank "
                           "(rank + 1) and arrive from the previous one (rank - 1), around the "
                           "ring.")
                elif self.group is not None and me in peers:
                    why = (" That is this rank itself: a P2POp's peer is a global rank; "
                           "translate a rank of the group with dist.get_global_rank(group, r).")
                return (f"global rank {me} {kind} {where} global rank(s) {peers}, expected "
                        f"global rank {want}.{why}")
        for r in recvs:
            targets = [(op.tensor, "a tensor this batch is sending") for op in sends]
            targets += [(t, "k or v, this rank's own block") for t in self.inputs]
            for s, which in targets:
                if _overlaps(r.tensor, s):
                    return (f"it receives into {which} (or memory shared with it): the "
                            "incoming block would overwrite the outgoing one while it is still "
                            "being sent, and the caller's block with it. Receive into new "
                            "tensors (one per tensor sent, of the same shape).")
        got = [(tuple(op.tensor.shape), op.tensor.dtype) for op in recvs]
        sent = [(tuple(op.tensor.shape), op.tensor.dtype) for op in sends]
        if got != sent:
            return (f"it sends tensors of shapes {[s for s, _ in sent]} and receives into "
                    f"{[s for s, _ in got]}: every rank sends what this one does, so each "
                    "receive buffer must match the tensor sent in the same position of the "
                    "list, in shape, dtype and order.")
        return None

    def _batch(self, ops):
        problem = self._problem(list(ops))
        if problem is not None:
            raise _BadP2P(problem)
        self.batches += 1
        self._inside = True
        try:
            return self._originals["batch_isend_irecv"](ops)
        finally:
            self._inside = False

    def __enter__(self) -> _P2PGuard:
        self._stand_ins = {n: self._alone(n) for n in _P2P[:4]}
        self._stand_ins["batch_isend_irecv"] = self._batch
        for name, stand_in in self._stand_ins.items():
            for module in (dist, c10d):         # P2POp checks its op against c10d's own names
                self._saved[module, name] = getattr(module, name)
                setattr(module, name, stand_in)
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)


def _ring_case(fn: Callable, group, where: str, seed: int) -> str | None:
    """``fn(k, v, group)`` on this rank's blocks; what is wrong (or None). Ranks of ``group``
    only; every rank of the group ends this case together (no peer left waiting)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    nxt, prev = glob((rank + 1) % world), glob((rank - 1) % world)
    gen = torch.Generator().manual_seed(seed)
    ks = torch.randn(world, *_SHAPE, generator=gen, dtype=_DTYPE)   # rank r's k: ks[r]
    vs = torch.randn(world, *_SHAPE, generator=gen, dtype=_DTYPE)
    k, v = ks[rank].clone(), vs[rank].clone()
    try:
        with _P2PGuard(group, nxt, prev, k, v) as guard, record_collectives(_NOT_P2P) as records:
            got = fn(k, v, group) if group is not None else fn(k, v)
    except NotImplementedError:
        return UNANSWERED
    except _BadP2P as e:
        return f"{where}: {e}"
    except Exception as e:  # noqa: BLE001 - the learner's error, said in words
        return f"{where}: ring_step raised {type(e).__name__}: {' '.join(str(e).split())}"
    if records:
        return (f"{where}: ring_step called {', '.join(sorted({r.name for r in records}))}: a "
                "ring step moves one block to one neighbour, with sends and receives only "
                "(a collective moves every rank's block to every rank).")
    if guard.batches != 1:
        return (f"{where}: ring_step made {guard.batches} calls of dist.batch_isend_irecv, "
                "expected one: the sends and receives of k and v all go in one batch.")
    if not torch.equal(k, ks[rank]) or not torch.equal(v, vs[rank]):
        return (f"{where}: ring_step changed k or v in place: the caller's block must stay as "
                "it was (this rank still attends to it); return the received blocks as new "
                "tensors.")
    if not isinstance(got, (tuple, list)) or len(got) != 2 or \
            not all(isinstance(t, torch.Tensor) for t in got):
        return (f"{where}: ring_step returned {type(got).__name__}, expected a pair (k, v) of "
                "tensors: the blocks received from the previous rank.")
    src = (rank - 1) % world
    for t, name, blocks in ((got[0], "k", ks), (got[1], "v", vs)):
        if close(t, blocks[src]):
            continue
        why = ""
        other = vs if name == "k" else ks
        if close(t, other[src]):
            why = " It is the previous rank's other tensor: k and v are swapped."
        elif close(t, blocks[rank]):
            why = " It is this rank's own block: return the blocks that arrived."
        elif close(t, blocks[(rank + 1) % world]):
            why = " It is the next rank's block: the blocks travel to the next rank."
        return (f"{where}: the returned {name} is {describe(t)}, expected the {name} of group "
                f"rank {src} (the previous rank) {describe(blocks[src])}.{why}")
    return None


def _ring_cases(spec, seed: int) -> str | None:
    """In every rank: the whole world, then (at 3 ranks and more) a group of ranks 1 and 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fn, error = load_answer(spec, "function ring_step")
    if error:
        return error
    found = agree(_ring_case(fn, None, f"world_size={world}, rank {rank}, ring_step(k, v)",
                              seed))
    if found is not None or world < 3:
        return found
    pair = dist.new_group([1, 2])                      # every rank makes it; 1 and 2 use it
    mine = None
    if rank in (1, 2):
        mine = _ring_case(fn, pair, f"world_size={world}, global rank {rank}, ring_step(k, v, "
                          "group=a group of global ranks 1 and 2)", seed + 1)
    return agree(mine)


def check_ring_step(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                    timeout: float = 30.0, strict: bool = False) -> ExerciseResult:
    """Exercise 2: ``ring_step(k, v, group=None) -> (k, v)``, one step of ring attention.

    For each world size, a process group of that many worker processes; each rank passes its
    own blocks k and v (float64, shape (2, 2, 3, 4)) and must get back those of the previous
    rank of the group (rank - 1, wrapping round), its own left as they were. The calls are
    watched before they run: one ``dist.batch_isend_irecv`` holding the sends (to the next rank
    of the group) and the receives (from the previous one), as ``P2POp``s whose peers are
    global ranks, receiving into new tensors; no ``isend``/``irecv``/``send``/``recv`` on its
    own, no collective. At 3 ranks, again with a group of global ranks 1 and 2.

    Args:
        fn: your ring_step (importable by worker processes) or ``"my_ring:ring_step"``; None:
            not answered yet.
        world_sizes: numbers of processes to try (3 matters: the neighbours differ there).
        timeout: seconds for each world size (a function that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_in_ranks(
        _RING_NAME, fn, "my_ring:ring_step", _ring_cases, (16,), world_sizes=world_sizes,
        timeout=timeout, hint=_RING_HINT,
        hang_hint="Does every rank post its sends and receives in one batch, with the same tag, "
                  "and receive as many tensors as the previous rank sends?",
        passed=f"every rank got the previous rank's k and v for world sizes "
               f"{list(world_sizes)} (and in a group of ranks 1 and 2), its own left intact, "
               "through one batch of paired sends and receives.",
        missing="write ring_step to my_ring.py and pass it here.", strict=strict)


# ---- the forward ring loop ----------------------------------------------------------------------

_LOOP_NAME = "ring attention forward"
_LOOP_HINT = ("at step i this rank holds the keys and values of rank (rank - i) mod cp (they "
              "arrive from the previous rank). Compute the attention of this rank's queries "
              "to the block it holds, merge it into the running result, then pass the block "
              "on: cp blocks in all, each seen once. Under a causal mask the block of an "
              "earlier rank is wholly visible, this rank's own block is masked on its diagonal, "
              "and a later rank's block is wholly in the future: skip it (its attention would "
              "be 0/0). Start from out 0 and lse -inf.")
_LOOP_SHAPE = (2, 2, 3, 4)   # (batch, heads, positions per rank, head_dim)


def _loop_case(fn: Callable, is_causal: bool, seed: int):
    """One case in every rank (a generator for ``in_step``): this rank's slice of SDPA."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    B, H, n, D = _LOOP_SHAPE
    Q, K, V = (torch.randn(B, H, n * world, D, generator=gen, dtype=_DTYPE) for _ in range(3))
    mine = slice(rank * n, (rank + 1) * n)                       # the r-th contiguous slice
    q, k, v = (t[:, :, mine].clone() for t in (Q, K, V))
    want = F.scaled_dot_product_attention(Q, K, V, is_causal=is_causal)[:, :, mine]
    where = (f"world_size={world}, rank {rank}, ring_attention_forward(q, k, v, "
             f"is_causal={is_causal})")
    with record_collectives(_NOT_P2P) as records:
        got = call_answer(f"{where}:", fn, q, k, v, is_causal=is_causal)
    if records:
        yield (f"{where} called {', '.join(sorted({r.name for r in records}))}: the keys and "
               "values travel by ring steps (a send to the next rank, a receive from the "
               "previous one), not by collectives.")
        return
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        yield (f"{where} returned {shape}, expected a tensor of shape {tuple(want.shape)}: the "
               "attention output of this rank's queries (return out, not (out, lse)).")
        return
    if close(got, want):
        yield None
        return
    why = ""
    own = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    if not torch.isfinite(got).all():
        why = (" It holds nan or inf: a block wholly in the future (every score masked) has lse "
               "-inf and output 0/0; skip it.")
    elif is_causal and close(got, _later_blocks_seen(q, K, V, rank, n)):
        why = (" It attends to the keys of later ranks too: under a causal mask a later rank's "
               "block is wholly in the future; skip it.")
    elif close(got, own):
        why = (" It is attention over this rank's own block alone: the other ranks' blocks "
               "never reached the result (pass k and v on at every step, and merge).")
    else:
        visible = [(src, K[:, :, src * n:(src + 1) * n], V[:, :, src * n:(src + 1) * n])
                   for src in range(world) if not is_causal or src <= rank]
        last = visible[0] if is_causal else visible[(rank + 1) % world]  # the last computed
        kind = is_causal and last[0] == rank
        alone = F.scaled_dot_product_attention(q, last[1], last[2], is_causal=kind)
        if close(got, alone):
            why = (" It is attention over one block alone: each new block must be merged into "
                   "the running result (output and lse), not replace it.")
        elif is_causal:
            why = (" Without a causal mask the order of the blocks does not matter, with one "
                   "it does: check which rank's block this rank holds at each step (the "
                   "previous rank's arrives first) and which part of it is masked.")
    yield (f"{where}: out is {describe(got)}, expected this rank's slice of "
           f"F.scaled_dot_product_attention over the whole sequence {describe(want)}.{why}")


def _later_blocks_seen(q, K, V, rank: int, n: int) -> torch.Tensor:
    """Attention of this rank's queries with the diagonal block masked but every other block,
    later ranks' included, wholly visible: a loop that does not skip the future's result."""
    query = torch.arange(rank * n, (rank + 1) * n).unsqueeze(-1)   # global positions
    key = torch.arange(K.shape[2]).unsqueeze(0)
    visible = (key // n != rank) | (key <= query)                  # (n, S)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=visible)


def _loop_cases(spec, seed: int) -> str | None:
    """In every rank: without a causal mask, then with one; the first failure or None."""
    fn, error = load_answer(spec, "function ring_attention_forward")
    if error:
        return error
    return run_in_step((_loop_case(fn, causal, seed + causal), "") for causal in (False, True))


def check_ring_attention(fn: Callable | str | None, *, world_sizes: tuple[int, ...] = (2, 3),
                         timeout: float = 30.0, strict: bool = False) -> ExerciseResult:
    """Exercise 3: ``ring_attention_forward(q, k, v, group=None, is_causal=False) -> out``.

    For each world size, a process group of that many worker processes; every rank holds the
    r-th contiguous slice (float64, (2, 2, 3, 4) per rank) of one sequence's q, k and v and
    must return its slice of ``F.scaled_dot_product_attention`` over the whole sequence, to
    rounding, without a causal mask and with one. Collectives are refused: the blocks travel
    by ring steps.

    Args:
        fn: your loop (importable by worker processes) or
            ``"my_ring_attention:ring_attention_forward"``; None: not answered yet.
        world_sizes: numbers of processes to try (3 matters: many wrong loops are right for 2).
        timeout: seconds for each world size (a loop that hangs fails, it does not hang).
        strict: raise ``AssertionError`` on a wrong answer.
    """
    return check_in_ranks(
        _LOOP_NAME, fn, "my_ring_attention:ring_attention_forward", _loop_cases, (160,),
        world_sizes=world_sizes, timeout=timeout, hint=_LOOP_HINT,
        hang_hint="Does every rank make the same number of ring steps (cp - 1, or cp), each "
                  "posting its sends and receives together?",
        passed=f"every rank's output equals its slice of F.scaled_dot_product_attention over "
               f"the whole sequence, with and without a causal mask, for world sizes "
               f"{list(world_sizes)}.",
        missing="write ring_attention_forward to my_ring_attention.py and pass it here.",
        strict=strict)
