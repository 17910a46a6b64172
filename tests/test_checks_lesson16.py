"""Lesson 16's checkers: the reference answers pass, realistic wrong answers fail with a reason.

The wrong answers are small variations of ``solutions/lesson16.py`` defined here, at module
level, so that worker processes can import the ring steps by name. ``check_merge`` is called
directly on each wrong merge. For the ring step one launch (a group of 2 ranks, then of 3) runs
every wrong answer through the checker's worker in turn and compares each verdict with the one
expected (``_VERDICTS``); the public checker is called for the reference answer.
"""
import pytest
import torch
import torch.distributed as dist

from course_lib.checks import check_merge, check_ring_attention, check_ring_step
from course_lib.checks import lesson16 as L
from course_lib.checks.harness import UNANSWERED, first_failure_in_ranks, verdicts_as_expected
from solutions import lesson16 as S

# ------------------------------------------------------------------------------------------------
# wrong merges
# ------------------------------------------------------------------------------------------------


def merge_average(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_max_lse(out_a, lse_a, out_b, lse_b):
    out, _ = S.merge(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def merge_overflows(out_a, lse_a, out_b, lse_b):
    """The textbook formula with plain exponentials: right until exp(lse) overflows."""
    mass_a, mass_b = torch.exp(lse_a), torch.exp(lse_b)
    total = mass_a + mass_b
    out = (mass_a / total).unsqueeze(-1) * out_a + (mass_b / total).unsqueeze(-1) * out_b
    return out, torch.log(total)


def merge_nan_when_no_key(out_a, lse_a, out_b, lse_b):
    """Log space, but -inf - (-inf) left as nan for a row that sees no key at all."""
    lse = torch.logaddexp(lse_a, lse_b)
    return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
            + torch.exp(lse_b - lse).unsqueeze(-1) * out_b), lse


def merge_swapped(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_b - lse).unsqueeze(-1) * out_a + \
        torch.exp(lse_a - lse).unsqueeze(-1) * out_b, lse


def merge_in_place(out_a, lse_a, out_b, lse_b):
    out, lse = S.merge(out_a, lse_a, out_b, lse_b)
    out_a.copy_(out)
    return out_a, lse


def merge_scaffold(out_a, lse_a, out_b, lse_b):  # notebook 16's scaffold, not yet written
    raise NotImplementedError("merge")


@pytest.mark.parametrize("answer, reason", [
    (merge_average, "It is the plain average of out_a and out_b"),
    (merge_max_lse, "It is the larger of lse_a and lse_b"),
    (merge_overflows, "with large logits (lse around 1000: exp(lse) overflows even in float64)"),
    (merge_overflows, "exp of an lse around 1000 overflows to inf"),
    (merge_nan_when_no_key, "with row 1 sees no key of either set (both lse -inf)"),
    (merge_nan_when_no_key, "-inf minus -inf is nan"),
    (merge_swapped, "The two weights are swapped"),
    (merge_in_place, "changed out_a in place"),
])
def test_wrong_merges_get_their_reasons(answer, reason):
    result = check_merge(answer)
    assert result.ok is False
    assert reason in result.message, result.message
    assert "Hint: a partial attention is a softmax over some keys" in result.message


def test_merge_right_none_and_scaffold():
    assert check_merge(S.merge).ok is True
    assert check_merge(None).ok is None
    assert check_merge(merge_scaffold).ok is None
    with pytest.raises(AssertionError, match="not yet right"):
        check_merge(merge_average, strict=True)


def test_the_library_merge_passes_the_checker():
    from course_lib.distributed.tensor.experimental import merge_partial_attention

    assert check_merge(merge_partial_attention).ok is True


# ------------------------------------------------------------------------------------------------
# wrong ring steps (module level: the workers import them)
# ------------------------------------------------------------------------------------------------


def _peers(group, step=1):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + step) % world, (rank - step) % world
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    return nxt, prev


def ring_wrong_neighbour(k, v, group=None):
    """Sends to the previous rank and receives from the next: right at 2 ranks only."""
    prev, nxt = _peers(group)
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    ops = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
           dist.P2POp(dist.irecv, k_in, prev, group), dist.P2POp(dist.irecv, v_in, prev, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return k_in, v_in


def ring_unpaired(k, v, group=None):
    """isend then irecv, each on its own: fine on gloo, a deadlock on NCCL."""
    nxt, prev = _peers(group)
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    works = [dist.isend(k, nxt, group), dist.isend(v, nxt, group)]
    works += [dist.irecv(k_in, prev, group), dist.irecv(v_in, prev, group)]
    for work in works:
        work.wait()
    return k_in, v_in


def ring_in_place(k, v, group=None):
    """Receives into the very tensors it sends."""
    nxt, prev = _peers(group)
    ops = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
           dist.P2POp(dist.irecv, k, prev, group), dist.P2POp(dist.irecv, v, prev, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return k, v


def ring_group_ranks_as_peers(k, v, group=None):
    """Uses ranks of the group as P2POp peers: right for the whole world only."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    ops = [dist.P2POp(dist.isend, k, nxt, group), dist.P2POp(dist.isend, v, nxt, group),
           dist.P2POp(dist.irecv, k_in, prev, group), dist.P2POp(dist.irecv, v_in, prev, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return k_in, v_in


def ring_swapped(k, v, group=None):
    k_in, v_in = S.ring_step(k, v, group)
    return v_in, k_in


def ring_two_batches(k, v, group=None):
    """Sends in one batch, receives in another."""
    nxt, prev = _peers(group)
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, k, nxt, group),
                                    dist.P2POp(dist.isend, v, nxt, group)])
    recvs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, k_in, prev, group),
                                    dist.P2POp(dist.irecv, v_in, prev, group)])
    for work in sends + recvs:
        work.wait()
    return k_in, v_in


def ring_by_all_gather(k, v, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k, group=group)
    dist.all_gather(vs, v, group=group)
    return ks[(rank - 1) % world], vs[(rank - 1) % world]


def ring_copies_into_k(k, v, group=None):
    """Receives into new buffers, then copies them over the caller's k and v."""
    k_in, v_in = S.ring_step(k, v, group)
    k.copy_(k_in)
    v.copy_(v_in)
    return k, v


def ring_scaffold(k, v, group=None):  # notebook 16's scaffold, not yet written
    raise NotImplementedError("ring_step")


#: (what, answer, {world size: a part of the verdict, or None for "right", or UNANSWERED})
_VERDICTS = [
    ("wrong neighbour", ring_wrong_neighbour,
     {3: "world_size=3, rank 0, ring_step(k, v): global rank 0 sends to global rank(s) [2], "
         "expected global rank 1. That is the other neighbour"}),
    ("unpaired isend and irecv", ring_unpaired,
     {2: "called dist.isend on its own, outside dist.batch_isend_irecv. On NCCL"}),
    ("receives into the buffer it sends", ring_in_place,
     {2: "it receives into a tensor this batch is sending (or memory shared with it): the "
         "incoming block would overwrite the outgoing one"}),
    ("group ranks as peers", ring_group_ranks_as_peers,
     {2: None, 3: "group=a group of global ranks 1 and 2): global rank 1 sends to global "
                  "rank(s) [1], expected global rank 2. That is this rank itself"}),
    ("k and v swapped", ring_swapped, {2: "k and v are swapped"}),
    ("two batches", ring_two_batches,
     {2: "a batch_isend_irecv holds 2 send(s) and 0 receive(s)"}),
    ("all_gather", ring_by_all_gather, {2: "ring_step called all_gather"}),
    ("copies over k", ring_copies_into_k, {2: "ring_step changed k or v in place"}),
    ("scaffold", ring_scaffold, {2: UNANSWERED}),
]
_ROWS = [(what, L._ring_cases, answer, expected) for what, answer, expected in _VERDICTS]


def test_ring_step_solution_passes():
    assert check_ring_step(S.ring_step)


def test_wrong_ring_steps_get_their_reasons():
    found = first_failure_in_ranks(verdicts_as_expected, _ROWS, (2, 3), (16,),
                                   timeout=60.0, hang_hint="", hint="")
    assert found is None, found


def test_ring_step_not_answered_and_refused():
    assert check_ring_step(None).ok is None

    def answer(k, v, group=None):
        return k, v

    answer.__module__ = "__main__"
    result = check_ring_step(answer)
    assert result.ok is False and "%%writefile my_ring.py" in result.message


# ------------------------------------------------------------------------------------------------
# wrong forward ring loops (module level: the workers import them)
# ------------------------------------------------------------------------------------------------


def _loop(q, k, v, group, is_causal, *, source_of, merging=True, skip=True, mask=True):
    """The reference loop with one thing changed: which rank's block is held at each step,
    whether blocks are merged (or replace the result), future blocks skipped, the diagonal
    masked."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for step in range(world):
        source = source_of(rank, step, world)
        if not is_causal or source <= rank or not skip:
            o, s = S.partial(q, k, v, causal=mask and is_causal and source == rank)
            out, lse = S.merge(out, lse, o, s) if merging else (o, s)
        if step < world - 1:
            k, v = S.ring_step(k, v, group)
    return out


def loop_right(q, k, v, group=None, is_causal=False):
    return _loop(q, k, v, group, is_causal, source_of=lambda r, i, w: (r - i) % w)


def loop_replaces(q, k, v, group=None, is_causal=False):
    """Each block replaces the result instead of merging into it."""
    return _loop(q, k, v, group, is_causal, source_of=lambda r, i, w: (r - i) % w,
                 merging=False)


def loop_wrong_direction(q, k, v, group=None, is_causal=False):
    """Thinks the block held at step i is rank + i's: right at 2 ranks, and without a mask."""
    return _loop(q, k, v, group, is_causal, source_of=lambda r, i, w: (r + i) % w)


def loop_off_by_one(q, k, v, group=None, is_causal=False):
    """Thinks the block held at step i is rank - i - 1's."""
    return _loop(q, k, v, group, is_causal, source_of=lambda r, i, w: (r - i - 1) % w)


def loop_no_skip(q, k, v, group=None, is_causal=False):
    """Computes the blocks of later ranks too, unmasked."""
    return _loop(q, k, v, group, is_causal, source_of=lambda r, i, w: (r - i) % w, skip=False)


def loop_by_all_gather(q, k, v, group=None, is_causal=False):
    world = dist.get_world_size(group)
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k, group=group)
    dist.all_gather(vs, v, group=group)
    return loop_right(q, k, v, group, is_causal)


def loop_scaffold(q, k, v, group=None, is_causal=False):  # notebook 16's scaffold
    raise NotImplementedError("ring_attention_forward")


#: (what, answer, {world size: a part of the verdict, None for "right", or UNANSWERED})
_LOOP_VERDICTS = [
    ("right", loop_right, {2: None, 3: None}),
    ("replaces", loop_replaces, {2: "It is attention over one block alone"}),
    ("wrong direction", loop_wrong_direction,
     {2: None, 3: "world_size=3, rank 1, ring_attention_forward(q, k, v, is_causal=True): out "
                  "is"}),
    ("off by one", loop_off_by_one, {2: "is_causal=True): out is"}),
    ("no skip", loop_no_skip, {2: "It attends to the keys of later ranks too"}),
    ("all_gather", loop_by_all_gather, {2: "called all_gather"}),
    ("scaffold", loop_scaffold, {2: UNANSWERED}),
]
_LOOP_ROWS = [(what, L._loop_cases, answer, expected)
              for what, answer, expected in _LOOP_VERDICTS]


def test_ring_attention_solution_passes_and_none_is_unanswered():
    assert check_ring_attention(S.ring_attention_forward)
    assert check_ring_attention(None).ok is None


def test_wrong_ring_loops_get_their_reasons():
    found = first_failure_in_ranks(verdicts_as_expected, _LOOP_ROWS, (2, 3), (160,),
                                   timeout=60.0, hang_hint="", hint="")
    assert found is None, found


_CODE = ("P2POp", "batch_isend_irecv(", "isend", "irecv", "get_global_rank(", "empty_like",
         "logaddexp", "torch.where", "exp(", ".wait()")


@pytest.mark.parametrize("hint", ["_MERGE_HINT", "_RING_HINT", "_LOOP_HINT"])
def test_hints_point_at_the_idea_without_the_code(hint):
    text = getattr(L, hint)
    assert not [c for c in _CODE if c in text], text
