"""Oracle tests for course_lib.parallel.comm: plain sums, torch.chunk and torch.cat are oracles."""
import collections
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close as _assert_close

from course_lib.devices import devices as make_devices
from course_lib.parallel.comm import (
    allreduce,
    broadcast,
    check_allreduce,
    gather,
    get_params,
    ps_allreduce,
    replicate_params,
    ring_allreduce,
    ring_chunk_bounds,
    scatter,
    split_batch,
)

ALLREDUCES = [allreduce, ring_allreduce, ps_allreduce]


def assert_close(actual, expected, **kw):
    """Values compared wherever they are: on a GPU machine the devices here are GPUs."""
    _assert_close(actual, expected, check_device=False, **kw)


def devs(n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_devices(n)


def rebinding_allreduce(tensors):
    """The classic bug: rebinding list entries instead of writing into the tensors."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t.to(total.device)
    for i in range(len(tensors)):
        tensors[i] = total.to(tensors[i].device)   # only the list entry changes


def per_device(shape, n, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).to(d) for d in devs(n)]


def check_sum(fn, tensors):
    """Each caller-held tensor holds the plain sum after ``fn`` (on the given tensors)."""
    held = list(tensors)                                 # what the caller keeps
    expected = sum(t.cpu() for t in tensors)             # the oracle: a plain sum
    fn(list(held))                                       # give the function its own list
    for t in held:
        assert_close(t.cpu(), expected)


# --- replicate_params --------------------------------------------------------------------------

def test_get_params_copies_and_requires_grad():
    params = [torch.randn(3, 2, requires_grad=True), torch.zeros(4, requires_grad=True)]
    new = get_params(params, "cpu")
    for p, q in zip(params, new):
        assert q.is_leaf and q.requires_grad
        assert q.data_ptr() != p.data_ptr()             # a copy, even on the same device
        assert_close(q, p.detach())


def test_replicate_gives_independent_copies():
    params = [torch.ones(3, requires_grad=True)]
    reps = replicate_params(params, devs(3))
    assert len(reps) == 3
    with torch.no_grad():
        reps[0][0] += 1
    assert_close(reps[1][0], torch.ones(3))
    assert_close(params[0].detach(), torch.ones(3))


# --- allreduce ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ALLREDUCES)
@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4), (13,)])
def test_allreduce_equals_plain_sum(fn, n, shape):
    check_sum(fn, per_device(shape, n, seed=n))


@pytest.mark.parametrize("fn", ALLREDUCES)
def test_allreduce_small_integers_exact(fn):
    tensors = [torch.full((2, 3), float(i + 1)).to(d) for i, d in enumerate(devs(4))]
    fn(tensors)
    for t in tensors:
        assert torch.equal(t.cpu(), torch.full((2, 3), 10.0))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), shape=st.lists(st.integers(0, 6), min_size=1, max_size=3),
       which=st.integers(0, len(ALLREDUCES) - 1), seed=st.integers(0, 2**16))
def test_allreduce_hypothesis(n, shape, which, seed):
    check_sum(ALLREDUCES[which], per_device(tuple(shape), n, seed=seed))


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_fewer_elements_than_devices(n):
    check_sum(ring_allreduce, per_device((n - 1,), n))


def test_ring_non_contiguous_tensor():
    base = per_device((4, 6), 3)
    tensors = [t.T for t in base]                        # (6, 4) views, not contiguous
    expected = sum(t.clone() for t in tensors)
    ring_allreduce(tensors)
    for t, b in zip(tensors, base):
        assert_close(t, expected)
        assert_close(b.T, expected)                      # written through to the storage


def test_ring_trace_has_2_n_minus_1_steps():
    trace = []
    ring_allreduce(per_device((8,), 4), trace=trace)
    assert [r["phase"] for r in trace] == ["reduce-scatter"] * 3 + ["all-gather"] * 3
    assert all(len(r["sends"]) == 4 for r in trace)
    assert trace[0]["sends"] == [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 0, 3)]


def test_ring_chunk_bounds_cover_everything():
    for numel in range(0, 20):
        for n in range(1, 9):
            b = ring_chunk_bounds(numel, n)
            sizes = [e - s for s, e in b]
            assert len(b) == n and sum(sizes) == numel and max(sizes) - min(sizes) <= 1
            assert all(b[i][1] == b[i + 1][0] for i in range(n - 1))


@pytest.mark.parametrize("fn", ALLREDUCES)
def test_allreduce_shape_mismatch_names_shapes(fn):
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        fn([torch.zeros(2, 3), torch.zeros(3, 2)])


@pytest.mark.parametrize("fn", ALLREDUCES)
def test_allreduce_empty_list(fn):
    with pytest.raises(ValueError, match="at least one"):
        fn([])


def test_ring_refuses_shared_memory():
    t = torch.ones(4)
    with pytest.raises(ValueError, match="share memory"):
        ring_allreduce([t, t])


def test_naive_allreduce_refuses_the_same_tensor_twice():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="share memory"):  # replicas must own their buffers
        allreduce([t, t, t])
    assert_close(t, torch.ones(3))                          # untouched


@pytest.mark.parametrize("n", range(2, 9))
def test_rebinding_bug_fails_the_check_the_real_one_passes(n):
    for fn in ALLREDUCES:
        check_allreduce(fn, devs(n), shape=(5,))                  # the library's check...
    with pytest.raises(AssertionError, match="rebind list entries"):
        check_allreduce(rebinding_allreduce, devs(n), shape=(5,))  # ...fails the bug
    with pytest.raises(AssertionError):
        check_sum(rebinding_allreduce, per_device((5,), n))        # and so does the oracle


def test_allreduce_on_gradients_in_place():
    reps = replicate_params([torch.ones(3, requires_grad=True)], devs(2))
    for k, (p,) in enumerate(reps):
        (p * (k + 1)).sum().backward()
    allreduce([p.grad for (p,) in reps])
    for (p,) in reps:
        assert_close(p.grad, torch.full((3,), 3.0))


# --- broadcast, scatter, gather, split_batch -------------------------------------------------

def test_broadcast_copies():
    t = torch.arange(4.0)
    out = broadcast(t, devs(3))
    assert len(out) == 3
    for o in out:
        assert_close(o, t)
        assert o.data_ptr() != t.data_ptr()


@settings(max_examples=60, deadline=None)
@given(B=st.integers(0, 20), n=st.integers(1, 8), rest=st.lists(st.integers(1, 3), max_size=2))
def test_scatter_sizes_match_torch_chunk(B, n, rest):
    X = torch.randn(B, *rest)
    chunks = scatter(X, devs(n))
    expected = torch.chunk(X, n)
    assert [c.shape for c in chunks] == [e.shape for e in expected]
    for c, e in zip(chunks, expected):
        assert_close(c, e)
    assert_close(gather(chunks, "cpu"), X)


def test_scatter_uneven_example():
    assert [c.shape[0] for c in scatter(torch.arange(5), devs(4))] == [2, 2, 1]
    assert [c.shape[0] for c in scatter(torch.arange(7), devs(3))] == [3, 3, 1]


def test_scatter_gather_are_differentiable():
    X = torch.randn(6, 2, requires_grad=True)
    out = gather([c * 2 for c in scatter(X, devs(3))], "cpu")
    out.sum().backward()
    assert_close(X.grad, torch.full((6, 2), 2.0))


def test_scatter_errors():
    with pytest.raises(ValueError, match="at least one device"):
        scatter(torch.zeros(3), [])
    with pytest.raises(ValueError, match="0-d"):
        scatter(torch.tensor(1.0), devs(2))
    # a namedtuple raised AttributeError: 'P' object has no attribute 'dim'
    with pytest.raises(TypeError, match="got a P; for tuples, namedtuples.*use scatter_kwargs"):
        scatter(collections.namedtuple("P", "x")(torch.zeros(4)), devs(2))


def test_gather_dim_and_errors():
    assert gather([torch.zeros(2, 3), torch.zeros(2, 1)], "cpu", dim=1).shape == (2, 4)
    with pytest.raises(ValueError, match="at least one tensor"):
        gather([], "cpu")


@pytest.mark.parametrize("B,n", [(8, 2), (7, 3), (5, 4), (4, 4), (9, 8)])
def test_split_batch_keeps_pairs_together(B, n):
    X = torch.arange(B * 2.0).reshape(B, 2)
    y = torch.arange(B)
    Xs, ys = split_batch(X, y, devs(n))
    assert len(Xs) == len(ys)
    for Xi, yi in zip(Xs, ys):
        assert_close(Xi[:, 0] / 2, yi.to(Xi.dtype))     # row j of X belongs with label j


def test_split_batch_warns_when_chunks_leave_devices_idle():
    idle = r"9 over 8 devices leaves 3 of them .*devices \[5, 6, 7\]"
    with pytest.warns(UserWarning, match=idle):
        Xs, _ = split_batch(torch.zeros(9, 2), torch.zeros(9), devs(8))
    assert [len(x) for x in Xs] == [2, 2, 2, 2, 1]
    # the batch size it names fills every device, and none between does (10 to 14 leave some idle)
    with pytest.warns(UserWarning, match=r"next batch size that fills all 8 is 15"):
        split_batch(torch.zeros(9, 2), torch.zeros(9), devs(8))
    assert len(torch.chunk(torch.zeros(15), 8)) == 8
    assert all(len(torch.chunk(torch.zeros(b), 8)) < 8 for b in range(10, 15))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # every device used: no warning
        for B, n in [(10, 4), (256, 3), (8, 8), (7, 1)]:
            split_batch(torch.zeros(B, 2), torch.zeros(B), devs(n))


def test_split_batch_too_small_says_what_to_change():
    with pytest.raises(ValueError, match=r"3 examples over 4 devices: fewer examples than "
                       r"devices.*batch size of at least 4 that torch.chunk spreads over all 4"):
        split_batch(torch.zeros(3, 2), torch.zeros(3), devs(4))


def test_split_batch_mismatched_labels():
    with pytest.raises(ValueError, match="4 examples but y has 3"):
        split_batch(torch.zeros(4, 2), torch.zeros(3), devs(2))

