"""check_reshard (lesson 13) accepts the reference answer and refuses near misses."""
import torch

from course_lib.checks.lesson13 import check_reshard
from solutions.lesson13 import reshard


def _even_split(shards, world_size):
    # torch.tensor_split: the right rows for 2 ranks, not fully_shard's for 3
    out = [{} for _ in range(world_size)]
    for key in shards[0]:
        full = torch.cat([s[key] for s in shards])
        for rank, piece in enumerate(torch.tensor_split(full, world_size)):
            out[rank][key] = piece
    return out


def _no_empty(shards, world_size):
    # torch.chunk without the empty shards of ranks past the end
    out = [{} for _ in range(world_size)]
    for key in shards[0]:
        for rank, piece in enumerate(torch.chunk(torch.cat([s[key] for s in shards]),
                                                 world_size)):
            out[rank][key] = piece
    return out


def _in_place(shards, world_size):
    result = reshard(shards, world_size)
    shards[0][next(iter(shards[0]))].zero_()
    return result


def test_check_reshard():
    assert check_reshard(reshard)
    for wrong in (_even_split, _no_empty, _in_place):
        assert not check_reshard(wrong), wrong.__name__
    assert check_reshard(None).ok is None


def test_check_reshard_hint_gives_the_layout_not_the_code():
    # the first failure points to the idea (which rows each rank holds), not to a solution
    message = check_reshard(_even_split).message
    assert "Hint:" in message and "ceil(rows / world_size)" in message, message
    assert not any(code in message for code in ("torch.cat", "torch.chunk", "back together"))
