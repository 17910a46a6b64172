"""The code-writing checkers of lessons 02, 03 and 06 (and 00's faked GPUs): each accepts the
reference answer of ``solutions/`` and rejects realistic wrong ones, several of them right for
two devices or ranks, with the failing case in the message."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib import checks
from course_lib.checks.lesson02 import _ring_sends
from course_lib.checks.lesson03 import _SPLIT_CASES as checker_cases
from course_lib.distributed.collectives import ring_chunk_bounds
from course_lib.parallel.comm import allreduce, ps_allreduce, ring_allreduce, scatter, split_batch
from solutions import lesson02, lesson03, lesson06

# ---- lesson 00: an answer right on this machine only fails ----------------------------------


def test_try_all_gpus_is_judged_with_0_1_and_4_faked_gpus():
    cpu = torch.device("cpu")
    assert checks.check_try_all_gpus(lambda: [cpu]).ok is False     # right with no GPU only
    d2l = lambda: [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]  # noqa: E731
    result = checks.check_try_all_gpus(d2l)
    assert result.ok is False and "0 GPU(s)" in result.message
    count_before = torch.cuda.device_count()
    from solutions.lesson00 import try_all_gpus
    assert checks.check_try_all_gpus(try_all_gpus)
    assert torch.cuda.device_count() == count_before                # restored


# ---- lesson 02 -------------------------------------------------------------------------------

def rebinding(tensors):  # the classic: new list entries, the caller's tensors unchanged
    total = sum(t.cpu() for t in tensors)
    for i in range(len(tensors)):
        tensors[i] = total.clone()


def first_two_only(tensors):  # right for two devices
    total = tensors[0] + tensors[1] if len(tensors) > 1 else tensors[0].clone()
    for t in tensors:
        t.copy_(total)


def ring_off_by_one(tensors):  # the all-gather forwards the chunk it just received, one too early
    n, flats = len(tensors), [t.view(-1) for t in tensors]
    bounds = ring_chunk_bounds(flats[0].numel(), n)

    def chunk(i, c):
        return flats[i % n][bounds[c % n][0]:bounds[c % n][1]]

    for s in range(n - 1):
        for i in range(n):
            chunk(i + 1, i - s).add_(chunk(i, i - s))
    for s in range(n - 1):
        for i in range(n):
            chunk(i + 1, i - s).copy_(chunk(i, i - s))         # should be chunk i + 1 - s


def ring_even_chunks(tensors):  # chunks of numel // n: the remainder is never reduced
    n = len(tensors)
    size = tensors[0].numel() // n
    flats = [t.view(-1) for t in tensors]
    for c in range(n):
        total = sum(f[c * size:(c + 1) * size] for f in flats)
        for f in flats:
            f[c * size:(c + 1) * size] = total


def butterfly_writes_before_reading(tensors):
    n, d = len(tensors), 1
    while d < n:
        for i in range(n):
            tensors[i] += tensors[i ^ d]                       # the partner reads a sum already
        d *= 2


def test_check_allreduce_fn():
    assert checks.check_allreduce_fn(None).ok is None
    assert checks.check_allreduce_fn(allreduce)
    assert checks.check_allreduce_fn(lesson02.ring_allreduce)
    result = checks.check_allreduce_fn(rebinding)
    assert result.ok is False and "No tensor changed" in result.message
    result = checks.check_allreduce_fn(first_two_only)
    assert result.ok is False and "3 device(s)" in result.message and "expected" in result.message
    with pytest.raises(AssertionError):
        checks.check_allreduce_fn(rebinding, strict=True)


def ring_backwards(tensors):  # chunk c starts at device c but travels to i - 1: right for n = 2
    n, flats = len(tensors), [t.view(-1) for t in tensors]
    bounds = ring_chunk_bounds(flats[0].numel(), n)

    def chunk(i, c):
        return flats[i % n][bounds[c % n][0]:bounds[c % n][1]]

    for s in range(n - 1):
        for i in range(n):
            chunk(i - 1, i + s).add_(chunk(i, i + s))
    for s in range(n - 1):
        for i in range(n):
            chunk(i - 1, i - 1 + s).copy_(chunk(i, i - 1 + s))


def ring_torch_chunk_sizes(tensors):  # the ring's schedule on torch.chunk's chunks
    n, flats = len(tensors), [t.view(-1) for t in tensors]
    sizes = [c.numel() for c in torch.chunk(flats[0], n)]
    sizes += [0] * (n - len(sizes))
    starts = [sum(sizes[:c]) for c in range(n)]

    def chunk(i, c):
        return flats[i % n][starts[c % n]:starts[c % n] + sizes[c % n]]

    for s in range(n - 1):
        for i in range(n):
            chunk(i + 1, i - s).add_(chunk(i, i - s))
    for s in range(n - 1):
        for i in range(n):
            chunk(i + 1, i + 1 - s).copy_(chunk(i, i + 1 - s))


def not_written_yet(tensors):  # the notebook's scaffold
    raise NotImplementedError


def test_check_ring_allreduce_accepts_the_ring():
    assert checks.check_ring_allreduce(None).ok is None
    assert checks.check_ring_allreduce(not_written_yet).ok is None
    assert checks.check_ring_allreduce(lesson02.ring_allreduce)
    assert checks.check_ring_allreduce(ring_allreduce)             # with receive buffers


def test_check_ring_allreduce_rejects_wrong_sums():
    for wrong in (ring_off_by_one, ring_even_chunks, first_two_only):
        result = checks.check_ring_allreduce(wrong)
        assert result.ok is False and "received" in result.message, wrong.__name__


def test_check_ring_allreduce_judges_the_schedule_not_only_the_sums():
    # right sums (the first check passes them), another order of additions: rejected
    for other in (allreduce, ps_allreduce, ring_backwards, ring_torch_chunk_sizes):
        assert checks.check_allreduce_fn(other, device_counts=(1, 2, 3, 4, 8)), other.__name__
        result = checks.check_ring_allreduce(other)
        assert result.ok is False and "ring's order" in result.message, other.__name__
        if other is not ring_torch_chunk_sizes:   # its chunks differ from 3 devices' by 1 element
            assert "3 devices" in result.message, (other.__name__, result.message)
    with pytest.raises(AssertionError):
        checks.check_ring_allreduce(allreduce, strict=True)


def test_check_butterfly_checks_the_structure_not_just_the_sum():
    assert checks.check_butterfly(None).ok is None
    assert checks.check_butterfly(lesson02.butterfly_allreduce)
    for other_allreduce in (allreduce, ring_allreduce):      # right sums, other order: rejected
        result = checks.check_butterfly(other_allreduce)
        assert result.ok is False and "butterfly order" in result.message
    assert checks.check_butterfly(butterfly_writes_before_reading).ok is False
    with pytest.raises(ValueError, match="powers of two"):
        checks.check_butterfly(lesson02.butterfly_allreduce, device_counts=(3,))


def test_ring_sends_reference_and_wrong_answers():
    assert checks.check_ring_sends(lesson02.ring_traffic, n=4, numel=1001)
    assert not hasattr(checks, "ring_sends")                    # the oracle is not one call away
    assert not checks.check_ring_sends([1501.5] * 4, n=4, numel=1001)   # 2 (n-1)/n * numel
    assert not checks.check_ring_sends([1500] * 4, n=4, numel=1001)


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(0, 40), n=st.integers(1, 9))
def test_ring_sends_matches_the_trace_for_any_size(numel, n):
    assert _ring_sends(numel, n) == lesson02.ring_sends_from_trace(numel, n)


# ---- lesson 03 -------------------------------------------------------------------------------

def duplicates_an_example(tensor, devices):  # overlapping slices: each boundary example twice
    size = -(-tensor.shape[0] // len(devices))
    return [tensor[max(0, i * size - 1):(i + 1) * size].to(d) for i, d in enumerate(devices)
            if i * size < tensor.shape[0]]


def drops_the_remainder(tensor, devices):  # B // n each: the last B % n examples are lost
    size = tensor.shape[0] // len(devices)
    return [tensor[i * size:(i + 1) * size].to(d) for i, d in enumerate(devices)]


def labels_split_differently(X, y, devices):  # balanced X, torch.chunk's y
    return lesson03.balanced_scatter(X, devices), scatter(y, devices)


def test_check_scatter():
    assert checks.check_scatter(None).ok is None
    assert checks.check_scatter(scatter)                              # the course's: torch.chunk
    assert checks.check_scatter(lesson03.balanced_scatter, balanced=True)
    assert not checks.check_scatter(scatter, balanced=True)           # leaves devices idle
    for wrong, says in [(duplicates_an_example, "are in more than one chunk"),
                        (drops_the_remainder, "are in no chunk")]:
        result = checks.check_scatter(wrong)
        assert result.ok is False and says in result.message and "10 over 4" in result.message


def test_check_split_batch():
    assert checks.check_split_batch(None).ok is None
    assert checks.check_split_batch(lesson03.balanced_split_batch)
    assert not checks.check_split_batch(split_batch)                 # torch.chunk's sizes
    with pytest.warns(UserWarning, match="without examples"):        # ... leave devices idle
        assert checks.check_split_batch(split_batch, sizes="chunk")
    result = checks.check_split_batch(labels_split_differently)
    assert result.ok is False and "same sizes" in result.message
    result = checks.check_split_batch(lambda X, y, d: (drops_the_remainder(X, d),
                                                       drops_the_remainder(y, d)))
    assert result.ok is False
    with pytest.raises(AssertionError):
        checks.check_split_batch(labels_split_differently, strict=True)
    with pytest.raises(ValueError, match="sizes must be one of"):
        checks.check_split_batch(split_batch, sizes="even")


# ---- exercise 1: split_batch with torch.chunk's shards (nn.parallel.scatter's), any devices ----

def split_batch_scaffold(X, y, devices):  # the notebook's cell as committed
    raise NotImplementedError


def drops_the_short_shard(X, y, devices):  # keeps only full-size chunks: the tail is lost
    Xs, ys = torch.chunk(X, len(devices)), torch.chunk(y, len(devices))
    keep = [i for i in range(len(Xs)) if len(Xs[i]) == len(Xs[0])]
    return [Xs[i].to(devices[i]) for i in keep], [ys[i].to(devices[i]) for i in keep]


def along_dim_1(X, y, devices):  # the features cut, not the examples
    n = len(devices)
    return ([c.to(d) for c, d in zip(torch.chunk(X, n, dim=1), devices)],
            [c.to(d) for c, d in zip(torch.chunk(y, n), devices)])


def labels_tensor_split(X, y, devices):  # images by torch.chunk, labels by tensor_split
    n = len(devices)
    return ([c.to(d) for c, d in zip(torch.chunk(X, n), devices)],
            [c.to(d) for c, d in zip(torch.tensor_split(y, n), devices)])


def torchs_scatter(X, y, devices):  # nn.parallel.scatter: GPUs only
    return list(torch.nn.parallel.scatter(X, devices)), list(torch.nn.parallel.scatter(y, devices))


def swapped(X, y, devices):  # (y_shards, X_shards)
    X_shards, y_shards = lesson03.split_batch(X, y, devices)
    return y_shards, X_shards


def test_split_batch_exercise_accepts_the_reference_and_the_course_version():
    assert checks.check_split_batch(split_batch_scaffold, sizes="chunk").ok is None
    assert checks.check_split_batch(lesson03.split_batch, sizes="chunk")
    with pytest.warns(UserWarning, match="without examples"):        # 5 over 4 leaves one idle
        assert checks.check_split_batch(split_batch, sizes="chunk")   # course_lib's own


@pytest.mark.parametrize("wrong, says", [
    (drops_the_short_shard, "are in no chunk"),
    (lambda X, y, d: (drops_the_remainder(X, d), drops_the_remainder(y, d)), "are in no chunk"),
    (along_dim_1, "split along dim 0"),
    (labels_tensor_split, "split X and y with the same sizes"),
    (lesson03.balanced_split_batch, "shard sizes [3, 3, 2, 2]: expected [3, 3, 3, 1]"),
    (swapped, "return the images' shards first"),
])
def test_split_batch_exercise_names_the_usual_mistakes(wrong, says):
    result = checks.check_split_batch(wrong, sizes="chunk")
    assert result.ok is False and says in result.message, result.message
    assert "10 over 4" in result.message


def balanced_on_eight_devices(X, y, devices):  # torch.chunk's shards, except on 8 devices
    if len(devices) == 8:
        return lesson03.balanced_split_batch(X, y, devices)
    return lesson03.split_batch(X, y, devices)


def test_split_batch_failure_on_eight_devices_keeps_exercise_5_unanswered():
    # Exercise 5 asks how many of 8 devices torch.chunk uses for 9 and 17 examples: the checker's
    # 8-device batch, and the sizes its failure message prints, must be another one.
    assert not {(9, 8), (17, 8)} & set(checker_cases)
    result = checks.check_split_batch(balanced_on_eight_devices, sizes="chunk")
    assert result.ok is False and "a batch of 13 over 8 devices" in result.message, result.message
    assert "expected [2, 2, 2, 2, 2, 2, 1]" in result.message
    for B in (9, 17):
        answer = str([c.shape[0] for c in torch.chunk(torch.empty(B), 8)])
        assert answer not in result.message and f"{B} over 8" not in result.message


def never_moves_its_shards(X, y, devices):  # torch.chunk's shards, left where X and y are
    n = len(devices)
    return list(torch.chunk(X, n)), list(torch.chunk(y, n))


def all_on_the_first_device(X, y, devices):  # every shard on devices[0]
    n = len(devices)
    return ([c.to(devices[0]) for c in torch.chunk(X, n)],
            [c.to(devices[0]) for c in torch.chunk(y, n)])


def labels_never_move(X, y, devices):  # the images' shards moved, the labels' not
    n = len(devices)
    return [c.to(d) for c, d in zip(torch.chunk(X, n), devices)], list(torch.chunk(y, n))


def balanced_all_on_the_first_device(X, y, devices):  # balanced sizes, every shard on devices[0]
    return (lesson03.balanced_scatter(X, devices[:1] * len(devices)),
            lesson03.balanced_scatter(y, devices[:1] * len(devices)))


@pytest.mark.parametrize("wrong, sizes, says", [
    (never_moves_its_shards, "chunk", "X shard 0 is on cpu, expected on devices[0] = meta"),
    (all_on_the_first_device, "chunk", "X shard 1 is on meta, expected on devices[1] = cpu"),
    (labels_never_move, "chunk", "y shard 0 is on cpu, expected on devices[0] = meta"),
    (balanced_all_on_the_first_device, "balanced", "X shard 1 is on meta"),
])
def test_split_batch_exercise_sees_where_each_shard_lands(wrong, sizes, says):
    # On a list of CPUs alone (what devices(n) is without GPUs) these give the right shards ...
    cpus = [torch.device("cpu")] * 4
    X, y = torch.arange(10.0).reshape(10, 1), torch.arange(10)
    reference = lesson03.split_batch if sizes == "chunk" else lesson03.balanced_split_batch
    right = reference(X, y, cpus)
    for got, want in zip(wrong(X, y, cpus), right):
        assert all(torch.equal(g, w) and g.device == w.device for g, w in zip(got, want))
    # ... so only the list mixing 'cpu' and 'meta' catches them (on a machine with a GPU, the
    # checker's case on the real GPUs comes first and catches those that leave shards on the CPU)
    result = checks.check_split_batch(wrong, sizes=sizes)
    if torch.cuda.is_available() and "is on cpu" in says:
        says = "is on cpu, expected on cuda:0"
    assert result.ok is False and says in result.message, result.message
    assert "10 over 4" in result.message
    assert "meta" in result.message or torch.cuda.is_available(), result.message


def test_scatter_checker_sees_where_each_chunk_lands():
    result = checks.check_scatter(lambda t, devices: list(torch.chunk(t, len(devices))))
    assert result.ok is False
    says = ("chunk 0 is on cpu, expected on cuda:0" if torch.cuda.is_available()   # real GPUs first
            else "chunk 0 is on cpu, expected on devices[0] = meta")
    assert says in result.message, result.message
    assert checks.check_scatter(scatter)                              # moves every chunk


@pytest.mark.skipif(torch.cuda.is_available(), reason="nn.parallel.scatter works on GPUs")
def test_split_batch_exercise_explains_torchs_scatter_on_a_cpu():
    result = checks.check_split_batch(torchs_scatter, sizes="chunk")
    assert result.ok is False and "GPUs only" in result.message


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 300), n=st.integers(1, 9))
def test_balanced_reference_for_any_batch(B, n):
    sizes = lesson03.balanced_sizes(B, n)
    assert sum(sizes) == B and set(sizes) <= {B // n, B // n + 1} and len(sizes) == n
    assert lesson03.devices_used(B, n) == len(scatter(torch.zeros(B), [torch.device("cpu")] * n))


def test_devices_used_reference():
    assert checks.check_devices_used(9, 8, lesson03.devices_used(9, 8))
    assert checks.check_devices_used(17, 8, lesson03.devices_used(17, 8))
    assert not checks.check_devices_used(9, 8, 8)                     # "each device gets one"
    hint = checks.check_devices_used(5, 4, 4).message    # exercise 1, before split_batch:
    assert "ceil(B / n)" in hint and "torch.chunk" not in hint   # the rule, not the function


# ---- lesson 06: an allreduce in real processes -------------------------------------------------

def returns_the_sum(tensor):  # sends and receives right, but the caller's tensor is unchanged
    total = tensor.clone()
    lesson06.allreduce(total)
    return total


def swaps_with_a_neighbour(tensor):  # right for 2 ranks only
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    requests = [dist.isend(tensor, (rank + 1) % world), dist.irecv(received, (rank - 1) % world)]
    for r in requests:
        r.wait()
    tensor += received


def uses_torchs_all_reduce(tensor):  # refused when the exercise asks for send / recv
    dist.all_reduce(tensor)


def rank_0_keeps_it(tensor):  # rank 0 never sends back: the others wait forever
    if dist.get_rank() == 0:
        received = torch.empty_like(tensor)
        for src in range(1, dist.get_world_size()):
            dist.recv(received, src=src)
            tensor += received
    else:
        dist.send(tensor, dst=0)
        dist.recv(tensor, src=0)


def test_check_dist_allreduce_accepts_the_reference_for_2_and_3_ranks():
    assert checks.check_dist_allreduce(None).ok is None
    assert checks.check_dist_allreduce(lesson06.allreduce, world_sizes=(2, 3), p2p_only=True)


def test_check_dist_allreduce_rejects_realistic_wrong_answers():
    result = checks.check_dist_allreduce(returns_the_sum, world_sizes=(2,), p2p_only=True)
    assert result.ok is False and "instead of writing it in place" in result.message
    result = checks.check_dist_allreduce(swaps_with_a_neighbour, world_sizes=(3,))
    assert result.ok is False and "world_size=3" in result.message
    result = checks.check_dist_allreduce(uses_torchs_all_reduce, world_sizes=(2,), p2p_only=True)
    assert result.ok is False and "dist.all_reduce is not allowed" in result.message


@pytest.mark.slow
def test_check_dist_allreduce_reports_a_hang_in_bounded_time():
    result = checks.check_dist_allreduce(rank_0_keeps_it, world_sizes=(2,), timeout=3)
    assert result.ok is False and "no result within 3 s" in result.message
