"""The alpha-beta model of lesson 10 beyond the fit: NCCL's pipelined tree (latency in log2 p,
bytes independent of p) beside the textbook binomial tree, the fit at the low quantile (load only
adds time), the residuals kept per size, rails between nodes, and the launch cost of one thread
driving every device."""
import math
import random
import statistics

import pytest

from course_lib.bench import cost_model

KB, MB = 2**10, 2**20
SIZES = [4 * KB * 4**i for i in range(8)]  # 4 KB .. 64 MB


@pytest.mark.parametrize("p", [2, 3, 8, 64, 1000])
def test_pipelined_tree_bytes_do_not_grow_with_p(p):
    n, a, b = 1e8, 5e-6, 1e-10
    assert cost_model.tree_time(n, p, 0.0, b) == pytest.approx(2 * n * b)
    assert cost_model.tree_time(0.0, p, a, b) == pytest.approx(2 * math.ceil(math.log2(p)) * a)
    # the textbook binomial tree moves the whole message once per level
    assert cost_model.binomial_tree_time(n, p, 0.0, b) == pytest.approx(
        2 * math.ceil(math.log2(p)) * n * b)
    if p > 2:
        assert cost_model.tree_time(n, p, a, b) < cost_model.binomial_tree_time(n, p, a, b)


def test_tree_against_ring_small_and_large_messages():
    """NCCL's trade-off: the tree's fewer latencies win small messages at many ranks, the ring's
    2 (p - 1) / p n beta (< 2 n beta) wins large ones."""
    p, a, b = 64, 5e-6, 1 / 50e9
    assert cost_model.tree_time(4 * KB, p, a, b) < cost_model.ring_time(4 * KB, p, a, b)
    assert cost_model.ring_time(1e9, p, a, b) < cost_model.tree_time(1e9, p, a, b)


def test_every_algorithm_is_zero_on_one_rank_and_the_trees_agree_at_two():
    n, a, b = 1e6, 1e-5, 1e-9
    for name, f in cost_model.ALGORITHMS.items():
        assert f(n, 1, a, b) == 0.0, name
    assert cost_model.tree_time(n, 2, a, b) == pytest.approx(
        cost_model.binomial_tree_time(n, 2, a, b))


def test_low_quantile():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert cost_model.low_quantile(xs) == 1.0
    assert cost_model.low_quantile(xs, 0.5) == statistics.median(xs)
    assert cost_model.low_quantile([4.0, 1.0, 2.0, 3.0], 0.5) == 2.5
    assert cost_model.low_quantile(xs, 0.25) == 2.0
    with pytest.raises(ValueError, match="empty"):
        cost_model.low_quantile([])
    with pytest.raises(ValueError, match="between 0"):
        cost_model.low_quantile(xs, 0.9)


def _loaded_rows(alpha, beta, p, seed=0):
    """Rows as the collectives benchmark writes them, taken on a loaded machine: every sample is
    the true time times 1 + (a load that only ever adds), one sample in nine unloaded."""
    rng = random.Random(seed)
    rows = []
    for n in SIZES:
        true = cost_model.ring_time(n, p, alpha, beta)
        # small messages suffer more from the scheduler: up to +300 %, large ones up to +30 %
        worst = 3.0 if n < MB else 0.3
        seconds = [true] + [true * (1 + rng.uniform(0.2, 1.0) * worst) for _ in range(8)]
        rng.shuffle(seconds)
        rows.append({"world_size": p, "bytes": n, "op": "all_reduce", "seconds": seconds,
                     "min_s": min(seconds), "median_s": statistics.median(seconds)})
        rows.append({"world_size": p, "bytes": n, "op": "naive", "seconds": [1.0, 2.0],
                     "min_s": 1.0, "median_s": 1.5})
    return rows


@pytest.mark.parametrize("p", [2, 3])
def test_fit_at_the_minimum_recovers_the_hardware_and_the_median_does_not(p):
    alpha, beta = 50e-6, 1 / 2e9
    rows = _loaded_rows(alpha, beta, p)
    fit = cost_model.fit_results(rows, "all_reduce", p)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.sizes == tuple(SIZES) and len(fit.times) == len(fit.rel_errors) == len(SIZES)
    assert fit.max_rel_error < 1e-6
    mine = [r for r in rows if r["op"] == "all_reduce"]
    by_median = cost_model.fit_ring([r["bytes"] for r in mine], [r["median_s"] for r in mine], p)
    assert by_median.alpha > 1.5 * alpha        # the load, read as latency
    # a low quantile sits between the two
    q10 = cost_model.fit_results(rows, "all_reduce", p, q=0.1)
    assert fit.alpha <= q10.alpha <= by_median.alpha


def test_fit_results_falls_back_to_min_s_and_refuses_missing_rows():
    rows = [{"world_size": 2, "bytes": n, "op": "ring",
             "min_s": cost_model.ring_time(n, 2, 1e-4, 1e-9)} for n in SIZES]
    fit = cost_model.fit_results(rows, "ring", 2)
    assert fit.alpha == pytest.approx(1e-4) and fit.beta == pytest.approx(1e-9)
    with pytest.raises(ValueError, match="world_size=4"):
        cost_model.fit_results(rows, "ring", 4)


def test_bus_bandwidth_gbps():
    row = {"world_size": 4, "bytes": 10**9, "seconds": [2.0, 1.0, 100.0, 1.0, 1.0]}
    assert cost_model.bus_bandwidth_gbps(row) == pytest.approx(1.5)   # median 1 s, x 2 (p - 1) / p
    row = {"world_size": 2, "bytes": 10**9, "seconds": [0.5]}
    assert cost_model.bus_bandwidth_gbps(row) == pytest.approx(2.0)   # at p = 2, busbw = algbw
    with pytest.raises(ValueError, match="seconds"):
        cost_model.bus_bandwidth_gbps({"world_size": 2, "bytes": 1, "seconds": []})


def test_rails_between_nodes():
    by_name = {ic.name: ic for ic in cost_model.INTERCONNECTS}
    eight = by_name["2 nodes x 8 GPUs, IB NDR, 8 rails"]
    one = by_name["2 nodes x 8 GPUs, IB NDR, 1 rail"]
    nvlink = by_name["8 GPUs, NVLink 4 (H100 SXM)"]
    assert eight.bandwidth == pytest.approx(min(nvlink.bandwidth, 8 * 50e9))
    assert one.bandwidth == pytest.approx(50e9)
    assert eight.bandwidth == pytest.approx(8 * one.bandwidth)
    for ic in cost_model.INTERCONNECTS:
        assert ic.model().source.startswith("PROJECTION") and "assumed" in ic.source
    with pytest.raises(ValueError, match="rails"):
        _ = cost_model.Interconnect("x", 16, 1e9, 1e-6, "assumed", nodes=2).bandwidth


def test_one_thread_pays_every_device_launch():
    model = cost_model.AlphaBeta(alpha=1e-5, beta=1e-10, p=2)
    compute, launch, grads = 1e-3, 1e-3, [4e6, 4e3]    # launch-bound on two devices
    one = cost_model.data_parallel_step_time(compute, launch, grads, 1, model)
    assert one == pytest.approx(max(compute, launch))                # one device: no message
    thread = cost_model.data_parallel_step_time(compute, launch, grads, 2, model)
    procs = cost_model.data_parallel_step_time(compute, launch, grads, 2, model,
                                               one_thread=False)
    comm = sum(cost_model.naive_time(n, 2, 1e-5, 1e-10) for n in grads)
    assert procs == pytest.approx(launch + comm)                     # launches hide the compute
    assert thread == pytest.approx(2 * launch + comm)                # twice the launch cost
    assert cost_model.data_parallel_speedup(compute, launch, grads, 2, model) == \
        pytest.approx(one / thread)
    with pytest.raises(ValueError, match="k must be"):
        cost_model.data_parallel_step_time(compute, launch, grads, 0, model)


def test_launches_overlap_the_compute():
    """CUDA launches are asynchronous: the step is max(compute, launches) + communication, so
    a compute-bound step hides its launches; the sum (the wrong variant) would not."""
    model = cost_model.AlphaBeta(alpha=1e-5, beta=1e-10, p=2)
    compute, launch, grads = 0.01, 1e-3, [4e6, 4e3]
    comm = sum(cost_model.naive_time(n, 2, 1e-5, 1e-10) for n in grads)
    thread = cost_model.data_parallel_step_time(compute, launch, grads, 2, model)
    procs = cost_model.data_parallel_step_time(compute, launch, grads, 2, model,
                                               one_thread=False)
    assert thread == procs == pytest.approx(compute / 2 + comm)
    assert thread < compute / 2 + 2 * launch + comm                  # not the sum
    assert cost_model.data_parallel_step_time(compute, launch, grads, 1, model) == compute


def test_the_puzzle_in_the_model():
    """Little compute per step: two devices driven by one thread lose; much compute: they win;
    a larger batch (more compute, same launches) amortizes the launch cost."""
    model = cost_model.INTERCONNECTS[0].model()
    grads = [1e5] * 8
    small = cost_model.data_parallel_speedup(2e-4, 1e-4, grads, 2, model)
    large = cost_model.data_parallel_speedup(5e-2, 1e-4, grads, 2, model)
    assert small < 1 < large
    bigger_batch = cost_model.data_parallel_speedup(8e-4, 1e-4, grads, 2, model)
    assert small < bigger_batch


# ------------------------------------------------------------------------------------------------
# tensor parallelism: activations all-reduced inside every layer, on the critical path
# ------------------------------------------------------------------------------------------------

def test_tensor_parallel_comm_bytes_by_hand():
    """b = 2, s = 4, h = 8, 3 layers, t = 4, 2 bytes: each all-reduce is 2 * 4 * 8 * 2 = 128 bytes,
    of which a ring moves 2 * 3 / 4 * 128 = 192 per rank; 4 per layer, 3 layers."""
    assert cost_model.tensor_parallel_comm_bytes(2, 4, 8, 3, 4) == 4 * 3 * 192
    # plus the embedding's and the head's (128 bytes each) and the loss's three of b s numbers
    assert cost_model.tensor_parallel_comm_bytes(2, 4, 8, 3, 4, embedding_and_loss=True) == \
        4 * 3 * 192 + 2 * 192 + 3 * (2 * 3 / 4 * 16)
    # Narayanan et al.'s 8 b s h (t - 1) / t elements per layer
    assert cost_model.tensor_parallel_comm_bytes(2, 4, 8, 1, 4, 1) == 8 * 2 * 4 * 8 * 3 / 4
    assert cost_model.tensor_parallel_comm_bytes(2, 4, 8, 3, 1) == 0
    with pytest.raises(ValueError, match="t must be a positive integer"):
        cost_model.tensor_parallel_comm_bytes(2, 4, 8, 3, 0)


def test_tensor_parallel_step_time():
    model = cost_model.AlphaBeta(alpha=5e-6, beta=1 / 100e9, p=8)
    b, s, h, layers, compute = 4, 1024, 4096, 2, 0.1
    assert cost_model.tensor_parallel_step_time(compute, b, s, h, layers, 1, model) == compute
    n = b * s * h * 2
    for t in (2, 4, 8):
        step = cost_model.tensor_parallel_step_time(compute, b, s, h, layers, t, model)
        ring = cost_model.ring_time(n, t, model.alpha, model.beta)
        assert step == pytest.approx(compute / t + 4 * layers * ring)   # nothing hidden
    comm = [cost_model.tensor_parallel_step_time(compute, b, s, h, layers, t, model) - compute / t
            for t in (1, 2, 4, 8, 16)]
    assert comm == sorted(comm) and comm[0] == 0 and len(set(comm)) == len(comm)
    # data parallelism's all-reduce of gradients can hide behind backward; TP's cannot
    grads = [12 * h * h * 2] * layers
    assert cost_model.data_parallel_step_time(compute, 0.0, grads, 8, model, algorithm="ring",
                                              one_thread=False, overlap=1.0) == compute / 8
    with pytest.raises(ValueError, match="algorithm must be one of"):
        cost_model.tensor_parallel_step_time(compute, b, s, h, layers, 2, model, algorithm="x")


def test_tensor_parallel_stays_inside_the_node():
    """A GPT-3-sized layer (h = 12288, s = 2048, b = 1): over NVLink the all-reduces are a small
    share of the step even at t = 8; with the same group's ring through the network, a much
    larger one. A projection from the model, not a measurement."""
    by_name = {ic.name: ic for ic in cost_model.INTERCONNECTS}
    nvlink = by_name["8 GPUs, NVLink 4 (H100 SXM)"]
    network = by_name["2 nodes x 8 GPUs, IB NDR, 8 rails"]
    inside = cost_model.tensor_parallel_projection(nvlink, 1, 2048, 12288)
    across = cost_model.tensor_parallel_projection(network, 1, 2048, 12288)
    assert [r.t for r in inside] == [r.t for r in across] == [2, 4, 8]
    for row in inside + across:
        assert row.source.startswith("PROJECTION, not measured") and "assumed" in row.source
        assert row.comm_share == pytest.approx(row.comm_s / (row.comm_s + row.compute_s))
    for a, b in zip(inside, across):
        assert a.compute_s == b.compute_s and b.comm_share > 2 * a.comm_share
    assert inside[-1].comm_share < 0.2 < 0.5 < across[-1].comm_share
    # the share grows with t on every link: compute shrinks as 1/t, the bytes per rank do not
    for rows in (inside, across):
        shares = [r.comm_share for r in rows]
        assert shares == sorted(shares)
    # the network's per-GPU bandwidth: its node's 8 cards shared by its 8 GPUs
    assert across[0].bandwidth == pytest.approx(8 * 50e9 / 8)
    assert inside[0].bandwidth == nvlink.link_bandwidth
    # computed from the pieces: compute at the assumed rate, communication by the ring
    flops = cost_model.transformer_layer_flops(1, 2048, 12288)
    rate = cost_model.H100_BF16_FLOPS * cost_model.ASSUMED_UTILIZATION
    assert inside[-1].compute_s == pytest.approx(flops / rate / 8)
    n = 2048 * 12288 * 2
    assert inside[-1].comm_s == pytest.approx(
        4 * cost_model.ring_time(n, 8, nvlink.alpha, 1 / nvlink.link_bandwidth))


@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_sharded_parameter_server(p):
    """Li et al.'s sharded servers: one server is the strawman (2 p n beta), k = p servers leave
    each worker its own n bytes each way; a server receives p n / k."""
    n, a, b = 1e8, 5e-6, 1e-10
    assert cost_model.ps_time(n, p, a, b, servers=1) == cost_model.ps_time(n, p, a, b)
    assert cost_model.ps_time(n, p, a, b) == pytest.approx(2 * (a + p * n * b))
    assert cost_model.ps_time(n, p, a, b, servers=p) == pytest.approx(2 * (a + n * b))
    assert cost_model.ps_time(n, p, a, b, servers=2 * p) == pytest.approx(2 * (a + n * b))
    assert cost_model.ps_server_bytes(n, p, servers=p) == pytest.approx(n)
    assert cost_model.ps_server_bytes(n, p) == pytest.approx(p * n)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="servers must be a positive integer"):
            cost_model.ps_time(n, p, a, b, servers=bad)


@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_ring_meets_the_bandwidth_bound_the_naive_and_one_server_do_not(p):
    n, b = 1e8, 1e-10
    bound = cost_model.allreduce_bytes_lower_bound(n, p)
    assert bound == pytest.approx(2 * (p - 1) / p * n)
    assert cost_model.ring_time(n, p, 0.0, b) == pytest.approx(bound * b)
    for slower in (cost_model.naive_time(n, p, 0.0, b), cost_model.ps_time(n, p, 0.0, b)):
        assert slower > bound * b * (1 + 1e-9)
    curves = cost_model.allreduce_model_curves(n, [p], 1e-5, b)
    assert curves["ring"] == [cost_model.ring_time(n, p, 1e-5, b)]
    assert all(t[0] >= curves["bound 2(n-1)/n N beta"][0] for t in curves.values())


def test_model_curves_ring_flat_naive_linear_and_ring_latency_grows():
    """Lesson 02's figure: at large messages the ring's time barely moves from 8 to 64 devices
    while the naive one and one server grow about 8-fold; at small ones the ring's 2 (p - 1)
    alpha grows too, and NCCL's tree (2 log2 p alpha) pays less of it."""
    a, b = 10e-6, 1 / 32e9
    big = cost_model.allreduce_model_curves(256 * MB, [8, 64], a, b)
    assert big["ring"][1] / big["ring"][0] < 1.2
    assert big["naive (reduce to one + broadcast)"][1] / \
        big["naive (reduce to one + broadcast)"][0] > 7
    assert big["parameter server, 1 server"][1] / big["parameter server, 1 server"][0] > 7
    small = cost_model.allreduce_model_curves(4 * KB, [8, 64], a, b)
    assert small["ring"][1] / small["ring"][0] > 7
    assert small["tree (NCCL's pipelined)"][1] < small["ring"][1]


def test_nccl_tree_is_a_chain_inside_a_node_and_a_tree_between_nodes():
    a, b, n = 1e-5, 1e-9, 1e6
    # one node: a chain, the ring's latency and more bytes, so the ring wins at every size
    assert cost_model.nccl_tree_time(0.0, 8, a, b) == pytest.approx(2 * 7 * a)
    for size in (4e3, 1e6, 1e9):
        assert cost_model.ring_time(size, 8, a, b) < cost_model.nccl_tree_time(size, 8, a, b)
    # one GPU per node: the double binary tree over all ranks
    assert cost_model.nccl_tree_time(n, 16, a, b, nodes=16) == pytest.approx(
        cost_model.tree_time(n, 16, a, b))
    # 2 nodes x 8: 7 chain hops + 1 tree hop each way
    assert cost_model.nccl_tree_time(0.0, 16, a, b, nodes=2) == pytest.approx(2 * 8 * a)
    with pytest.raises(ValueError, match="split evenly"):
        cost_model.nccl_tree_time(n, 16, a, b, nodes=3)


def test_one_rank_schemes_get_one_card_not_every_rail():
    by_name = {ic.name: ic for ic in cost_model.INTERCONNECTS}
    eight = by_name["2 nodes x 8 GPUs, IB NDR, 8 rails"]
    one = by_name["2 nodes x 8 GPUs, IB NDR, 1 rail"]
    n = 40e6
    assert eight.rank_bandwidth == one.rank_bandwidth == eight.nic_bandwidth
    assert eight.bandwidth == 8 * eight.nic_bandwidth
    t8, t1 = eight.predict(n), one.predict(n)
    # the rings spread over the rails; naive and the parameter server funnel through one card
    assert t8["ring"] < t1["ring"] / 4
    for name in ("naive", "parameter server", "binomial tree"):
        assert t8[name] == pytest.approx(t1[name])
    # naive: 7 messages each way over NVLink, 8 through one card
    a, nv, nic = eight.alpha, eight.link_bandwidth, eight.nic_bandwidth
    assert t8["naive"] == pytest.approx(2 * (7 * (a + n / nv) + 8 * (a + n / nic)))
    assert t8["parameter server"] == pytest.approx(2 * (a + 16 * n / nic))
    # a wrong variant, every rail credited to the naive all-reduce, is much faster
    assert cost_model.naive_time(n, 16, a, 1 / eight.bandwidth) < t8["naive"] / 4
    # inside one node nothing changes: one beta, the link's
    pcie = cost_model.INTERCONNECTS[0]
    m = pcie.model()
    assert pcie.predict(n)["naive"] == pytest.approx(cost_model.naive_time(n, 8, m.alpha, m.beta))
    assert pcie.predict(n)["tree"] == pytest.approx(
        cost_model.nccl_tree_time(n, 8, m.alpha, m.beta))


def test_step_parts_make_the_step_and_name_each_term():
    model = cost_model.AlphaBeta(alpha=1e-5, beta=1e-10, p=2)
    grads = [4e5, 1e5]
    for k, one_thread in ((1, True), (2, True), (2, False)):
        parts = cost_model.data_parallel_step_parts(1e-3, 2e-4, grads, k, model,
                                                    one_thread=one_thread)
        step = cost_model.data_parallel_step_time(1e-3, 2e-4, grads, k, model,
                                                  one_thread=one_thread)
        assert step == max(parts["compute"], parts["launches"]) + parts["communication"]
        assert parts["compute"] == pytest.approx(1e-3 / k)
        assert parts["launches"] == pytest.approx(2e-4 * (k if one_thread else 1))
    assert cost_model.data_parallel_step_parts(1e-3, 2e-4, grads, 1, model)["communication"] == 0
    two = cost_model.data_parallel_step_parts(1e-3, 2e-4, grads, 2, model)
    assert two["communication"] == pytest.approx(
        sum(cost_model.naive_time(n, 2, 1e-5, 1e-10) for n in grads))


def test_assumed_gpu_classes_are_labelled_and_ordered():
    rates = [g.flops for g in cost_model.GPU_CLASSES]
    assert rates == sorted(rates) and len(rates) == 3
    for g in cost_model.GPU_CLASSES:
        assert g.flops == pytest.approx(g.peak_flops * g.utilization)
        assert "assumed" in g.source and "datasheet" in g.source
        assert 1e-6 <= g.launch_s <= 1e-4
