"""check_read_plan, check_reshard and check_sharded_resume (lesson 13) accept the reference
answers and refuse near misses; the course's read plan equals DCP's own planner's.

The wrong save_sharded / resume_sharded answers live here at module level, so that worker
processes import them by name; one launch (2 ranks, then 3) runs them all through the
checker's worker (``verdicts_as_expected``)."""
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from course_lib import deploy
from course_lib.checks.harness import UNANSWERED, first_failure_in_ranks, verdicts_as_expected
from course_lib.checks.lesson13 import (
    _RP_CASES,
    _sr_cases,
    check_read_plan,
    check_reshard,
    check_sharded_resume,
)
from course_lib.examples.checkpoint_workers import dcp_read_plan
from solutions.lesson13 import read_plan, reshard, resume_sharded, save_sharded


def test_read_plan_equals_dcp_planner():
    # every case the checker asks, and more: torch's create_read_items_for_chunk_list decides
    cases = [(pieces, m) for _, pieces, m in _RP_CASES]
    cases += [(_pieces_as_chunks(rows, n), m)
              for rows in (1, 5, 8) for n in (2, 3, 4) for m in (1, 2, 3, 5)]
    for pieces, m in cases:
        assert deploy.read_plan(pieces, m) == dcp_read_plan(pieces, m) == read_plan(pieces, m), \
            (pieces, m)


def _blocks(rows, n):
    # fully_shard's blocks of rows on n ranks, from torch.chunk itself
    index = torch.arange(rows)
    starts = [int(p[0]) if len(p) else rows for p in deploy.shard_rows(index, n)]
    return [(s, s + len(p)) for s, p in zip(starts, deploy.shard_rows(index, n))]


def _even_split(pieces, world_size):
    # torch.tensor_split's blocks: right for 2 new ranks, not fully_shard's for 3
    rows = max(o + n for o, n in pieces)
    out = []
    for block in torch.tensor_split(torch.arange(rows), world_size):
        a, b = (int(block[0]), int(block[-1]) + 1) if len(block) else (rows, rows)
        out.append([(i, max(a, o) - o, min(b, o + n) - o) for i, (o, n) in enumerate(pieces)
                    if max(a, o) < min(b, o + n)])
    return out


def _absolute_rows(pieces, world_size):
    # rows counted in the whole tensor, not within the piece
    return [[(i, a + pieces[i][0], b + pieces[i][0]) for i, a, b in reads]
            for reads in read_plan(pieces, world_size)]


def _empty_reads_kept(pieces, world_size):
    # every piece listed, even where nothing overlaps
    plan = read_plan(pieces, world_size)
    return [reads + [(i, 0, 0) for i in range(len(pieces)) if i not in {r[0] for r in reads}]
            for reads in plan]


def _assumes_chunked_pieces(pieces, world_size):
    # takes the saved pieces to be torch.chunk's blocks too: wrong for any other layout
    rows = max(o + n for o, n in pieces)
    return read_plan(_pieces_as_chunks(rows, len(pieces)), world_size)


def _pieces_as_chunks(rows, n):
    return [(a, b - a) for a, b in _blocks(rows, n)]


def _in_place(pieces, world_size):
    result = read_plan(pieces, world_size)
    pieces.reverse()
    return result


def test_check_read_plan():
    assert check_read_plan(read_plan)
    assert check_read_plan(deploy.read_plan)
    for wrong in (_even_split, _absolute_rows, _empty_reads_kept, _assumes_chunked_pieces,
                  _in_place):
        assert not check_read_plan(wrong), wrong.__name__
    assert check_read_plan(None).ok is None


def test_check_read_plan_hint_names_the_idea_not_the_code():
    message = check_read_plan(_even_split).message
    assert "Hint:" in message and "overlap" in message, message
    assert not any(code in message for code in ("ceil", "max(", "min(", "//"))


def _even_split_shards(shards, world_size):
    # torch.tensor_split: the right rows for 2 ranks, not fully_shard's for 3
    out = [{} for _ in range(world_size)]
    for key in shards[0]:
        full = torch.cat([s[key] for s in shards])
        for rank, piece in enumerate(torch.tensor_split(full, world_size)):
            out[rank][key] = piece
    return out


def test_check_reshard():
    # kept for learners' copies of an earlier version of the lesson
    assert check_reshard(reshard) and check_reshard(deploy.reshard)
    assert not check_reshard(_even_split_shards)
    assert check_reshard(None).ok is None


# ---- save_sharded / resume_sharded ------------------------------------------------------------

def save_model_only(model, optimizer, path):
    """The model's state dict alone: Adam's moments are lost."""
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def save_optimizer_by_number(model, optimizer, path):
    """optimizer.state_dict(): Adam's state keyed by parameter number, not by name."""
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)


def resume_model_only(model, optimizer, path):
    """The model loaded, the optimizer left fresh."""
    dcp.load({"model": model.state_dict()}, checkpoint_id=path)


def resume_without_set_state_dict(model, optimizer, path):
    """dcp.load into get_state_dict's dicts, never handed back with set_state_dict."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def resume_into_fresh_state_dict(model, optimizer, path):
    """A fresh optimizer's own state_dict() to fill: it has no state for dcp.load to fill."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    optimizer.load_state_dict(state["optim"])


def save_scaffold(model, optimizer, path):  # notebook 13's scaffold, not yet written
    raise NotImplementedError


_MISSING_OPTIM = "the directory your save_sharded wrote does not resume a model and its Adam"
_NO_STATE = "after your resume_sharded the optimizer holds no state at all"
_SR_ROWS = [
    ("the solutions", _sr_cases, (save_sharded, resume_sharded), {2: None, 3: None}),
    ("the course's own pair", _sr_cases, (deploy.save_sharded, deploy.resume_sharded),
     {2: None, 3: None}),
    ("model.state_dict() only", _sr_cases, (save_model_only, resume_sharded),
     {2: None, 3: _MISSING_OPTIM}),
    ("optimizer.state_dict() saved", _sr_cases, (save_optimizer_by_number, resume_sharded),
     {2: None, 3: _MISSING_OPTIM}),
    ("a fresh optimizer on resume", _sr_cases, (save_sharded, resume_model_only),
     {2: None, 3: _NO_STATE}),
    ("a fresh optimizer's state_dict() filled", _sr_cases,
     (save_sharded, resume_into_fresh_state_dict), {2: None, 3: _NO_STATE}),
    ("no set_state_dict", _sr_cases, (save_sharded, resume_without_set_state_dict),
     {2: None, 3: "the optimizer's learning rate is 0.001, the saved run's is 0.05"}),
    ("the scaffold", _sr_cases, (save_scaffold, resume_sharded), {2: UNANSWERED}),
]


def test_check_sharded_resume_verdicts():
    # one launch: every pair saved on 2 ranks, resumed on 3, each verdict the one expected
    folder = tempfile.mkdtemp(prefix="test_dcp_")
    try:
        found = first_failure_in_ranks(verdicts_as_expected, _SR_ROWS, (2, 3), (folder,),
                                       timeout=240.0, hang_hint="", hint="")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert found is None, found


def test_check_sharded_resume_without_answers():
    assert check_sharded_resume(None, "my_dcp:resume_sharded").ok is None
    refused = check_sharded_resume(lambda m, o, p: None, resume_sharded)   # a notebook's cell
    assert refused.ok is False and "%%writefile" in refused.message
