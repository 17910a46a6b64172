"""course_lib.distributed.tensor.experimental (ring attention) against one process.

The oracle: ``F.scaled_dot_product_attention`` on the whole sequence in one process. At 2, 3 and
4 ranks, causal and not, contiguous and zigzag, in float64: each rank's output and the gradients
of its q, k and v must equal the matching positions of the one-process ones to rounding (float32
to 1e-5). The point-to-point calls are recorded (``P2PTrace``): every one inside a
``batch_isend_irecv`` that sends to the next rank and receives from the previous one, the same
operations in the same order on every rank, one tag. A layout given the other layout's shards
must come out wrong (the comparison can fail). A group of one rank is plain attention. One
launch per world size runs every case.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from p2p_trace import P2PTrace

from course_lib.distributed import launch
from course_lib.distributed.tensor.experimental import (
    merge_partial_attention,
    ring_attention,
    ring_attention_work,
    sequence_chunks,
    zigzag_gather,
    zigzag_split,
)
from course_lib.distributed.tensor.experimental._checks import check_qkv

F64 = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=1e-5, atol=1e-5)
B, H, D = 2, 2, 3


def _shard(x, rank, world, layout):
    return x.chunk(world, dim=2)[rank] if layout == "contiguous" else zigzag_split(x, rank, world)


def _close(failures, where, got, want, tol):
    try:
        torch.testing.assert_close(got, want, **tol)
    except AssertionError as e:
        failures.append(f"{where}: {str(e).splitlines()[-1]}")


def _against_sdpa(failures, rank, world, *, is_causal, layout, dtype=torch.float64, tol=F64,
                  group=None, shard_layout=None, seed=0):
    """ring_attention on this rank's shard against SDPA on the whole sequence (float64)."""
    gen = torch.Generator().manual_seed(seed)
    S = 4 * world                                          # 2*cp divides it
    Q, K, V, dO = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
                   for _ in range(4))
    full = [t.clone().requires_grad_() for t in (Q, K, V)]
    out = F.scaled_dot_product_attention(*full, is_causal=is_causal)
    out.backward(dO)
    cut = shard_layout or layout
    mine = [_shard(t, rank, world, cut).to(dtype).requires_grad_() for t in (Q, K, V)]
    got = ring_attention(*mine, is_causal=is_causal, group=group, layout=layout)
    got.backward(_shard(dO, rank, world, cut).to(dtype))
    where = f"world {world} rank {rank} causal={is_causal} {layout} {dtype}"
    if got.dtype != dtype:
        failures.append(f"{where}: output dtype {got.dtype}")
    _close(failures, f"{where} out", got.double(), _shard(out.detach(), rank, world, layout), tol)
    for name, m, f in zip("qkv", mine, full):
        _close(failures, f"{where} d{name}", m.grad.double(), _shard(f.grad, rank, world, layout),
               tol)


def _trace(rank, world):
    """The P2P calls of one forward and backward: batches (op, peer, tag, numel) per batch."""
    failures = []
    with P2PTrace() as trace:
        _against_sdpa(failures, rank, world, is_causal=True, layout="zigzag")
    batches = [[(c["op"], c["peer"], c["tag"], c["numel"]) for c in b] for b in trace.batches()]
    alone = [(c["op"], c["peer"]) for c in trace.posts() if c["batch"] is None]
    return {"failures": failures, "batches": batches, "alone": alone,
            "overlaps": trace.unbatched_overlaps()}


def _errors(rank, world):
    """Refusals made before any communication: the same on every rank."""
    said = {}
    q = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    for name, call in {
        "odd zigzag": lambda: ring_attention(q, q, q, layout="zigzag"),
        "layout": lambda: ring_attention(q, q, q, layout="striped"),
        "shapes": lambda: ring_attention(q, q[..., :1], q),
    }.items():
        try:
            call()
            said[name] = "no error"
        except (ValueError, TypeError) as e:
            said[name] = str(e)
    return said


def all_cases(_unused=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for is_causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            _against_sdpa(failures, rank, world, is_causal=is_causal, layout=layout)
    _against_sdpa(failures, rank, world, is_causal=True, layout="zigzag", dtype=torch.float32,
                  tol=F32)
    wrong = []                                             # a layout fed the other one's shards
    _against_sdpa(wrong, rank, world, is_causal=True, layout="zigzag", shard_layout="contiguous")
    alone = [dist.new_group([r]) for r in range(world)][rank]   # a group of this rank alone
    for layout in ("contiguous", "zigzag"):
        _against_sdpa(failures, 0, 1, is_causal=True, layout=layout, group=alone)
    result = {"failures": failures, "wrong_layout_caught": bool(wrong),
              "trace": _trace(rank, world), "errors": _errors(rank, world)}
    if world == 3:                                         # a group of ranks 1 and 2 alone
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            _against_sdpa(failures, rank - 1, 2, is_causal=True, layout="zigzag", group=sub)
        else:
            try:
                ring_attention(*(torch.ones(1, 1, 2, 2) for _ in range(3)), group=sub)
                result["outsider"] = "no error"
            except ValueError as e:
                result["outsider"] = str(e)
    return result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_equals_one_process_and_is_nccl_safe(world):
    results = launch(all_cases, world, timeout=180)
    for rank, r in enumerate(results):
        assert r["failures"] == [], r["failures"][:6]
        assert r["wrong_layout_caught"], "zigzag on contiguous shards should be wrong"
        t = r["trace"]
        assert t["failures"] == [] and t["alone"] == [] and t["overlaps"] == []
        right, left = (rank + 1) % world, (rank - 1) % world
        n = B * H * 4 * world // world * D                 # elements of one rank's k
        # forward: world-1 steps of (send k, v; receive k, v); backward: the same, plus
        # world steps of (send dk, dv; receive dk, dv): every batch pairs sends and receives
        kv = [("isend", right, 0, n)] * 2 + [("irecv", left, 0, n)] * 2
        assert t["batches"] == [kv] * (3 * (world - 1) + 1), t["batches"]
        e = r["errors"]
        assert "its sequence length must be even, got 3" in e["odd zigzag"]
        assert "layout must be 'contiguous'" in e["layout"] and "'striped'" in e["layout"]
        assert "q, k and v must have the same shape" in e["shapes"]
    # every rank posted the same operations in the same order (peers aside)
    orders = [[[(op, tag, k) for op, _, tag, k in b] for b in r["trace"]["batches"]]
              for r in results]
    assert all(o == orders[0] for o in orders)
    if world == 3:
        assert "is not a member of the group given" in results[0]["outsider"]


# ---- one process ---------------------------------------------------------------------------


def _partial(scores, values):
    """Attention over one key set: (out, lse); a row with every key masked: (0, -inf)."""
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ values, lse


def test_merge_equals_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64)
    s[..., 0, 3:] = float("-inf")                          # query 0 sees no key of set b
    s[..., 1, :] += 1000.0                                 # large logits: exp would overflow
    want = torch.softmax(s, dim=-1) @ v
    a, b = _partial(s[..., :3], v[..., :3, :]), _partial(s[..., 3:], v[..., 3:, :])
    out, lse = merge_partial_attention(*a, *b)
    torch.testing.assert_close(out, want, **F64)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), **F64)
    # from the empty state (0, -inf), one key set at a time, as the ring does
    acc = torch.zeros_like(want), torch.full(lse.shape, float("-inf"), dtype=torch.float64)
    for cut in ((0, 2), (2, 3), (3, 7)):
        acc = merge_partial_attention(*acc, *_partial(s[..., cut[0]:cut[1]],
                                                      v[..., cut[0]:cut[1], :]))
    torch.testing.assert_close(acc[0], want, **F64)
    both = merge_partial_attention(torch.zeros(3, 2), torch.full((3,), float("-inf")),
                                   torch.zeros(3, 2), torch.full((3,), float("-inf")))
    assert torch.equal(both[0], torch.zeros(3, 2)) and torch.isneginf(both[1]).all()
    # an average of the two outputs is not the merge: the test can fail
    assert not torch.allclose((a[0] + b[0]) / 2, want)
    with pytest.raises(ValueError, match="one value per query"):
        merge_partial_attention(a[0], a[0], b[0], b[0])


def test_zigzag_split_and_gather():
    for world in (2, 3, 4):
        x = torch.arange(4 * world).view(1, 1, -1, 1).float()
        shards = [zigzag_split(x, r, world) for r in range(world)]
        assert torch.equal(zigzag_gather(shards), x)
        c = 2                                               # positions per chunk
        for r, s in enumerate(shards):
            want = [p for ch in (r, 2 * world - 1 - r) for p in range(ch * c, (ch + 1) * c)]
            assert s.flatten().tolist() == want
        assert sequence_chunks(world - 1, world, "zigzag") == [world - 1, world]
    with pytest.raises(ValueError, match="not divisible by 6"):
        zigzag_split(torch.zeros(1, 1, 9, 1), 0, 3)


def test_work_per_rank_balanced_by_zigzag():
    S = 48
    for world in (2, 3, 4):
        naive = ring_attention_work(S, world, layout="contiguous")
        zig = ring_attention_work(S, world, layout="zigzag")
        total = S * (S + 1) // 2                            # unmasked scores of causal attention
        assert sum(naive.per_rank()) == total == sum(zig.per_rank())
        assert naive.per_rank() == sorted(set(naive.per_rank()))    # rank r does more than r-1
        assert len(set(zig.per_rank())) == 1 and zig.imbalance() == 1.0
        assert naive.imbalance() > 1.0
        assert zig.critical_path() < naive.critical_path()
        c = S // world                                       # the last rank: full blocks only
        assert naive.elements[world - 1] == (c * (c + 1) // 2,) + (c * c,) * (world - 1)
        dense = ring_attention_work(S, world, layout="contiguous", is_causal=False)
        assert dense.per_rank() == [S * S // world] * world


def test_bad_inputs_say_what_to_do():
    q = torch.zeros(1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"must be 4-D .* got shape \(2, 4, 3\)"):
        check_qkv(q[0], q, q, "contiguous", "ring_attention")
    with pytest.raises(TypeError, match="must be floating point .* got torch.int64"):
        check_qkv(q.long(), q, q, "contiguous", "ring_attention")
    with pytest.raises(TypeError, match="one dtype, got torch.float64, torch.float32"):
        check_qkv(q.double(), q, q, "contiguous", "ring_attention")
    with pytest.raises(RuntimeError, match="needs a process group"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="seq_len = 10 is not divisible by 4"):
        ring_attention_work(10, 2, layout="zigzag")
    assert math.isclose(ring_attention_work(8, 1).imbalance(), 1.0)
