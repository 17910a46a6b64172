"""The latency-bandwidth (alpha-beta) model of all-reduce: fitted, predicted, projected.

A message of n bytes between two ranks costs ``alpha + n * beta``: alpha the fixed cost of a
message (latency, software), beta the seconds per byte (1 / bandwidth). Counting the messages an
all-reduce sends in sequence gives its cost (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005; the ring: Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009; NCCL's
pipelined double binary tree: Jeaugey, "Massively Scale Your Deep Learning Training with NCCL
2.4", NVIDIA blog 2019). The reduction's arithmetic (Thakur et al.'s gamma) is left out: a fit
folds it into beta. Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``: algbw ``bytes /
time``, busbw ``algbw * 2 (p - 1) / p`` for all-reduce). PyTorch counterpart: none; NCCL's tuner
(``src/graph/tuning.cc``) uses the same kind of model to choose ring or tree. Lesson 10 fits and
projects it; the Ultra-Scale Playbook (Hugging Face, 2025) does the same for large clusters.

Tensor parallelism (Shoeybi et al., "Megatron-LM", 2019, section 3; Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021,
section 3.2): each layer all-reduces its (b, s, h) activations twice forward and twice backward,
mid-layer, so they add to the step instead of hiding behind backward as DP's gradients can.

Only ``load_results`` reads a file (the results JSON at the path it is given).
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .allreduce import bus_bandwidth

__all__ = ["ALGORITHMS", "ASSUMED_UTILIZATION", "GPU_CLASSES", "H100_BF16_FLOPS", "INTERCONNECTS",
           "AlphaBeta", "AssumedGPU", "Interconnect", "TensorParallelProjection",
           "allreduce_bytes_lower_bound", "allreduce_model_curves", "binomial_tree_time",
           "bus_bandwidth_gbps", "data_parallel_speedup", "data_parallel_step_parts",
           "data_parallel_step_time", "fit_results", "fit_ring", "load_results", "low_quantile",
           "naive_time", "nccl_tree_time", "predict", "predicted_comm", "predicted_step_time",
           "ps_server_bytes", "ps_time", "ring_time", "tensor_parallel_comm_bytes",
           "tensor_parallel_projection", "tensor_parallel_step_time", "transformer_layer_flops",
           "tree_time"]


# ---- the costs of one all-reduce of n bytes over p ranks ----

def ring_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: ``2 (p - 1)`` steps, each a message of ``n / p`` bytes.

    Reduce-scatter then all-gather, ``p - 1`` steps each; in every step all ranks send one chunk
    at once, so the steps, not the ranks, add up: ``2 (p - 1) alpha + 2 (p - 1) / p * n beta``
    (Patarasuk & Yuan 2009; Thakur et al. 2005, section 4.4).
    """
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta


def tree_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """NCCL's pipelined tree with one rank per node: ``2 ceil(log2 p) alpha + 2 n beta``.

    A reduce up a tree, then a broadcast down, the message cut into chunks that follow one
    another (a pipeline): ``ceil(log2 p)`` hops of latency each way, the bytes not multiplied
    by the depth. NCCL's two complementary binary trees carry half the message each, so every
    rank sends and receives about n bytes each way: ``2 n beta`` whatever p, close to the ring's
    ``2 (p - 1) / p n beta`` (Jeaugey 2019). The chunks' own latency is left out (small against
    n beta). NCCL builds these trees between nodes, chaining the GPUs inside each node:
    ``nccl_tree_time``.
    """
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * alpha + 2 * n_bytes * beta


def nccl_tree_time(n_bytes: float, p: int, alpha: float, beta: float, nodes: int = 1) -> float:
    """NCCL's tree algorithm on ``nodes`` machines of ``p / nodes`` GPUs each, pipelined.

    A double binary tree between *nodes*, a chain of GPUs inside each (Jeaugey 2019; NCCL's
    ``src/graph/tuning.cc`` counts ``2 ((nRanks / nNodes - 1) intraLat + log2(nNodes)
    interLat)``, one alpha for both here): ``2 ((p / nodes - 1) + ceil(log2 nodes)) alpha + 2 n
    beta``. One GPU per node: ``tree_time``. One node: a chain with the ring's latency and more
    bytes per link (``2 n`` against ``2 (p - 1) / p n``), so the ring wins there (NVLink SHARP,
    where the switches add, is not modelled).
    """
    if p <= 1:
        return 0.0
    if nodes < 1 or p % nodes:
        raise ValueError(f"nccl_tree_time: p={p} ranks must split evenly over nodes={nodes} "
                         f"(GPUs per node = p / nodes).")
    hops = (p // nodes - 1) + math.ceil(math.log2(nodes))
    return 2 * hops * alpha + 2 * n_bytes * beta


def binomial_tree_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce then broadcast, whole messages each round (Thakur et al. 2005).

    ``ceil(log2 p)`` rounds each way of n bytes: ``2 ceil(log2 p) (alpha + n beta)``. Few
    latencies, but every round moves the whole message: the textbook tree, not NCCL's
    pipelined one (``tree_time``).
    """
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return 2 * rounds * (alpha + n_bytes * beta)


def naive_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Reduce to rank 0 by ``p - 1`` receives, then broadcast back by ``p - 1`` sends.

    Rank 0's link carries every message in turn: ``2 (p - 1) (alpha + n beta)``. Lesson 02's
    allreduce across devices and ``course_lib.bench.collectives.naive_allreduce`` across ranks.
    """
    return 2 * (p - 1) * (alpha + n_bytes * beta)


def ps_time(n_bytes: float, p: int, alpha: float, beta: float, servers: int = 1) -> float:
    """A parameter server outside the p workers: all push n bytes to it, then all pull the sum.

    The workers' latencies overlap (generous: a real server pays a software cost per message),
    but the server's link carries ``p n`` bytes each way: ``2 (alpha + p n beta)``. (A server
    on one of the workers moves what ``naive_time`` moves; sharded over the p ranks themselves,
    the ring's bytes.) With ``servers = k``, k shards, one per server machine (Li et al.,
    "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014): a worker
    pushes n / k bytes to each server, a server receives ``p n / k`` and sends as much back; the
    busier link sets the pace: ``2 (alpha + max(n, p n / k) beta)`` (from ``k = p``: n each way).
    """
    if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
        raise ValueError(f"ps_time: servers must be a positive integer (the number of server "
                         f"machines the parameters are sharded over), got {servers!r}.")
    return 2 * (alpha + max(1.0, p / servers) * n_bytes * beta) if p > 1 else 0.0


def ps_server_bytes(n_bytes: float, p: int, servers: int = 1) -> float:
    """Bytes one of k parameter servers receives (and sends back) per all-reduce: ``p n / k``,
    n / k from each of the p workers; both directions together ``2 p n / k``."""
    if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
        raise ValueError(f"ps_server_bytes: servers must be a positive integer, got "
                         f"{servers!r}.")
    return p * n_bytes / servers


def allreduce_bytes_lower_bound(n_bytes: float, p: int) -> float:
    """The fewest bytes some device must send (and receive) in an all-reduce among p devices
    that do the reduction themselves: ``2 (p - 1) / p * n``.

    Patarasuk & Yuan (2009) prove it and show that the ring meets it (``ring_time``'s bandwidth
    term). Machines that only add (sharded parameter servers, switches that reduce) are outside
    the bound: a worker then sends its n bytes once and receives the sum once.
    """
    return 2 * (p - 1) / p * n_bytes if p > 1 else 0.0


def allreduce_model_curves(n_bytes: float, ps: Sequence[int], alpha: float,
                           beta: float) -> dict[str, list[float]]:
    """Modelled seconds of one all-reduce of ``n_bytes`` for each device count in ``ps``.

    Lesson 02's comparison: naive (reduce to one device, broadcast back), a parameter server
    with one server and with one per worker (``ps_time``), the ring, NCCL's pipelined tree
    (``tree_time``), and the ring's bandwidth bound in seconds (``allreduce_bytes_lower_bound *
    beta``, no latency). Returns name -> one time per p.
    """
    curves = {"naive (reduce to one + broadcast)": naive_time,
              "parameter server, 1 server": ps_time,
              "parameter server, k = n servers": lambda n, p, a, b: ps_time(n, p, a, b, servers=p),
              "ring": ring_time, "tree (NCCL's pipelined)": tree_time,
              "bound 2(n-1)/n N beta": lambda n, p, a, b: allreduce_bytes_lower_bound(n, p) * b}
    return {name: [f(n_bytes, p, alpha, beta) for p in ps] for name, f in curves.items()}


#: name -> cost function ``f(n_bytes, p, alpha, beta)``, in the order the notebook plots them.
ALGORITHMS = {"naive": naive_time, "ring": ring_time, "tree": tree_time,
              "binomial tree": binomial_tree_time, "parameter server": ps_time}


# ---- reading measured rows: bandwidths, and the fastest times ----

def bus_bandwidth_gbps(row: dict) -> float:
    """Bus bandwidth, in GB/s (1e9 bytes per second), of one row of a collectives results file.

    nccl-tests' definition (``doc/PERFORMANCE.md``): algbw ``bytes / time``; an all-reduce's
    busbw ``algbw * 2 (p - 1) / p``, the bytes per second each rank's link carries in a ring,
    comparable across rank counts and with the link's speed. ``row``: a dict with ``bytes``,
    ``world_size`` and ``seconds`` (a non-empty list, seconds per operation), whose median is
    the time.
    """
    missing = [k for k in ("bytes", "world_size", "seconds") if k not in row]
    if missing or not row["seconds"]:
        raise ValueError(f"bus_bandwidth_gbps needs a row with 'bytes', 'world_size' and a "
                         f"non-empty 'seconds' list; missing or empty: "
                         f"{missing or ['seconds']} (keys found: {sorted(row)}).")
    return bus_bandwidth(row["bytes"], statistics.median(row["seconds"]),
                         row["world_size"]) / 1e9


def low_quantile(seconds: Sequence[float], q: float = 0.0) -> float:
    """The ``q`` quantile of a list of times (``q = 0``: the minimum), linearly interpolated.

    Other work only ever adds time, so the fastest samples are closest to the hardware (a median
    absorbs the load); a small q (0.1) keeps one lucky outlier from setting the answer.
    """
    if not seconds:
        raise ValueError("low_quantile needs at least one time, got an empty list.")
    if not 0.0 <= q <= 0.5:
        raise ValueError(f"low_quantile: q must be between 0 (the minimum) and 0.5 (the "
                         f"median), got {q!r}.")
    xs = sorted(seconds)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


# ---- fitting alpha and beta to measured times ----

@dataclass(frozen=True)
class AlphaBeta:
    """A fitted (or assumed) alpha-beta model and how well it fits."""

    alpha: float                      # seconds per message
    beta: float                       # seconds per byte (1 / beta: the link's bytes per second)
    p: int                            # the ranks the fit was measured with
    r2: float = float("nan")          # coefficient of determination, on the times themselves
    rel_errors: tuple[float, ...] = ()  # (model - measured) / measured per point, in order
    source: str = ""                  # what was fitted (or where the figures come from)
    sizes: tuple[float, ...] = ()     # the message sizes fitted, bytes (empty: assumed)
    times: tuple[float, ...] = ()     # the measured seconds fitted, one per size

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link (``1 / beta``)."""
        return 1.0 / self.beta

    @property
    def max_rel_error(self) -> float:
        """The worst ``|model - measured| / measured`` of the fit."""
        return max((abs(e) for e in self.rel_errors), default=float("nan"))


def fit_ring(sizes: list[float], times: list[float], p: int, source: str = "") -> AlphaBeta:
    """Fit ``ring_time`` to measured (bytes, seconds) of one all-reduce over p ranks.

    The ring model is a straight line in n: ``t = a + b n`` with ``a = 2 (p - 1) alpha`` and
    ``b = 2 (p - 1) / p * beta``. It is fitted by weighted least squares on the *relative*
    error, minimising ``sum(((a + b n_i - t_i) / t_i) ** 2)``: the largest message takes many
    times as long as the smallest, and an ordinary least-squares line would follow the largest
    messages and ignore the smallest, where alpha shows. Then ``alpha = a / (2 (p - 1))`` and
    ``beta = b p / (2 (p - 1))``.

    Args:
        sizes: message sizes in bytes (at least two distinct).
        times: the measured seconds of one all-reduce of each size, one number per size (a
            median of the samples, or a low quantile of them: the caller chooses).
        p: ranks (>= 2).
        source: a label kept with the result.

    Returns:
        The fitted ``AlphaBeta``, with R^2 (on the times) and each point's relative error.
    """
    if p < 2:
        raise ValueError(f"fit_ring needs p >= 2 ranks (one rank sends nothing), got p={p}.")
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError(f"fit_ring needs as many times as sizes and at least two distinct "
                         f"sizes, got {len(sizes)} sizes ({len(set(sizes))} distinct) and "
                         f"{len(times)} times.")
    if min(times) <= 0:
        raise ValueError(f"fit_ring needs positive times, got min {min(times)!r}.")
    # weighted normal equations, weights w_i = 1 / t_i ** 2
    w = [1.0 / t ** 2 for t in times]
    s0 = sum(w)
    s1 = sum(wi * n for wi, n in zip(w, sizes))
    s2 = sum(wi * n * n for wi, n in zip(w, sizes))
    y0 = sum(wi * t for wi, t in zip(w, times))
    y1 = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = s0 * s2 - s1 * s1
    a = (s2 * y0 - s1 * y1) / det
    b = (s0 * y1 - s1 * y0) / det
    model = [a + b * n for n in sizes]
    mean = statistics.fmean(times)
    ss_res = sum((m - t) ** 2 for m, t in zip(model, times))
    ss_tot = sum((t - mean) ** 2 for t in times)
    return AlphaBeta(alpha=a / (2 * (p - 1)), beta=b * p / (2 * (p - 1)), p=p,
                     r2=1 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
                     rel_errors=tuple((m - t) / t for m, t in zip(model, times)),
                     source=source, sizes=tuple(sizes), times=tuple(times))


def fit_results(rows: list[dict], op: str = "all_reduce", p: int = 2, q: float = 0.0,
                source: str | None = None) -> AlphaBeta:
    """Fit ``ring_time`` to the rows of a collectives results file, at the low quantile.

    Each size's time is ``low_quantile(row["seconds"], q)`` (default the minimum; the row's
    ``min_s`` without samples): the hardware's alpha and beta, not the load's.
    ``rows``: the ``results`` of a ``bench collectives`` file, of which those of operation
    ``op`` at world size ``p`` are fitted; ``source``: a label (default: op, p and q).
    """
    mine = sorted((r for r in rows if r["op"] == op and r["world_size"] == p),
                  key=lambda r: r["bytes"])
    if len(mine) < 2:
        found = sorted({(r["op"], r["world_size"]) for r in rows})
        raise ValueError(f"fit_results: need rows of op={op!r} at world_size={p} for at least "
                         f"two sizes, found {len(mine)}; (op, world_size) present: {found}.")
    times = [low_quantile(r["seconds"], q) if r.get("seconds") else r["min_s"] for r in mine]
    label = source or f"{op}, {p} ranks, " + ("minimum" if q == 0 else f"{q:g} quantile")
    return fit_ring([r["bytes"] for r in mine], times, p, source=label)


def _check_algorithm(where: str, algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{where}: algorithm must be one of {list(ALGORITHMS)}, "
                         f"got {algorithm!r}.")


def predict(model: AlphaBeta, n_bytes: float, p: int) -> dict[str, float]:
    """Seconds of one all-reduce of ``n_bytes`` over p ranks, for each of ``ALGORITHMS``."""
    return {name: f(n_bytes, p, model.alpha, model.beta) for name, f in ALGORITHMS.items()}


def predicted_comm(message_bytes: Sequence[float], p: int, alpha: float, beta: float) -> float:
    """Seconds of a step's all-reduces by the alpha-beta model: one ring all-reduce per message,
    one after another, ``sum(ring_time(n, p, alpha, beta) for n in message_bytes)``. Every
    message pays its own ``2 (p - 1) alpha``, so the same bytes in fewer messages cost less."""
    return sum(ring_time(n, p, alpha, beta) for n in message_bytes)


def predicted_step_time(compute_s: float, message_bytes: list[float], p: int, model: AlphaBeta,
                        algorithm: str = "ring", overlap: float = 0.0) -> float:
    """A data-parallel step: computing, plus the all-reduces not hidden behind backward.

    ``compute_s + (1 - overlap) * sum(cost(n) for n in message_bytes)``: ``compute_s`` the
    measured step without communication; one all-reduce per message (a bucket, or a parameter
    for the naive strategy), one after another, each ``ALGORITHMS[algorithm]`` over p ranks;
    ``overlap`` the fraction hidden behind backward (0: none).
    """
    _check_algorithm("predicted_step_time", algorithm)
    comm = sum(ALGORITHMS[algorithm](n, p, model.alpha, model.beta) for n in message_bytes)
    return compute_s + (1.0 - overlap) * comm


def data_parallel_step_time(compute_s: float, launch_s: float, message_bytes: list[float],
                            k: int, model: AlphaBeta, *, algorithm: str = "naive",
                            one_thread: bool = True, overlap: float = 0.0) -> float:
    """A projected step of data parallelism over k devices, launch costs included.

    ``max(compute_s / k, launches) + (1 - overlap) * communication``: ``compute_s`` is the whole
    batch's arithmetic on one device, ``launch_s`` what one device's step costs the host
    whatever its batch (Python, kernel launches). The host issues kernels while the devices run
    earlier ones, so the step lasts as long as the slower of the two (ideal overlap); the
    all-reduces not hidden behind backward come on top. ``one_thread`` (d2l's loop over GPUs):
    one Python thread launches on every device in turn, ``k * launch_s``; one process per device
    (DDP): ``launch_s``. ``nn.DataParallel`` lies between (a thread per replica, but they share
    the interpreter lock). A *launch-bound* step (launches above compute) is not shortened by a
    larger batch, which only gives the devices more to compute in its shadow; fewer launches
    (CUDA graphs, ``torch.compile``) or more launching threads (a process per device) shorten it.
    ``message_bytes``: a step's all-reduces (``predicted_step_time``; k = 1: none).
    """
    parts = data_parallel_step_parts(compute_s, launch_s, message_bytes, k, model,
                                     algorithm=algorithm, one_thread=one_thread, overlap=overlap)
    return max(parts["compute"], parts["launches"]) + parts["communication"]


def data_parallel_step_parts(compute_s: float, launch_s: float, message_bytes: list[float],
                             k: int, model: AlphaBeta, *, algorithm: str = "naive",
                             one_thread: bool = True, overlap: float = 0.0) -> dict[str, float]:
    """``data_parallel_step_time``'s terms: ``compute`` (``compute_s / k``), ``launches`` and
    the exposed ``communication``, in seconds; the same arguments. The step is
    ``max(compute, launches) + communication``, not their sum: the host launches while the
    devices compute."""
    if k < 1:
        raise ValueError(f"data_parallel_step_time: k must be >= 1 device, got {k}.")
    comm = predicted_step_time(0.0, message_bytes if k > 1 else [], k, model, algorithm, overlap)
    return {"compute": compute_s / k, "launches": launch_s * (k if one_thread else 1),
            "communication": comm}


def data_parallel_speedup(compute_s: float, launch_s: float, message_bytes: list[float],
                          k: int, model: AlphaBeta, **options) -> float:
    """One device's projected step over k devices' (``data_parallel_step_time`` for both)."""
    one = data_parallel_step_time(compute_s, launch_s, message_bytes, 1, model, **options)
    return one / data_parallel_step_time(compute_s, launch_s, message_bytes, k, model, **options)


# ---- tensor parallelism: all-reduces of activations on the critical path ----

def _tp_messages(batch_size: int, seq_len: int, hidden: int, n_layer: int, t: int,
                 bytes_per_element: float, embedding_and_loss: bool, where: str) -> list[float]:
    """The size in bytes of each all-reduce of one tensor-parallel step (forward and backward)."""
    for name, value in {"batch_size": batch_size, "seq_len": seq_len, "hidden": hidden,
                        "n_layer": n_layer, "t": t}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}.")
    if bytes_per_element <= 0:
        raise ValueError(f"{where}: bytes_per_element must be > 0, got {bytes_per_element!r}.")
    activation = batch_size * seq_len * hidden * bytes_per_element
    messages = [activation] * (4 * n_layer)     # per layer: attention and MLP, forward, backward
    if embedding_and_loss:                      # wte forward, lm_head's input backward; the loss
        messages += [activation] * 2 + [batch_size * seq_len * bytes_per_element] * 3
    return messages


def tensor_parallel_comm_bytes(batch_size: int, seq_len: int, hidden: int, n_layer: int, t: int,
                               bytes_per_element: float = 2, *,
                               embedding_and_loss: bool = False) -> int:
    """Bytes each rank sends in one step of t-way tensor parallelism (and receives as many).

    Per layer, Megatron's split (Shoeybi et al. 2019, figure 3) all-reduces the b s h activations
    4 times: after the row-parallel ``out_proj`` and ``proj`` forward (g), before the
    column-parallel ``qkv`` and ``fc`` backward (f). A ring moves ``2 (t - 1) / t * n`` per rank,
    so a layer ``8 b s h (t - 1) / t`` elements (Narayanan et al. 2021, section 3.2). With
    ``embedding_and_loss``, also the vocabulary-parallel embedding (forward) and the head's
    input gradient (backward), b s h each, and the loss's three all-reduces of b s numbers.
    ``bytes_per_element``: of the activations (2: 16-bit, as in the papers); t = 1 sends
    nothing. Returns bytes per rank per step, rounded up to a whole byte.
    """
    messages = _tp_messages(batch_size, seq_len, hidden, n_layer, t, bytes_per_element,
                            embedding_and_loss, "tensor_parallel_comm_bytes")
    return math.ceil(sum(messages) * 2 * (t - 1) / t)


def tensor_parallel_step_time(compute_s: float, batch_size: int, seq_len: int, hidden: int,
                              n_layer: int, t: int, model: AlphaBeta, *,
                              bytes_per_element: float = 2, algorithm: str = "ring",
                              embedding_and_loss: bool = False) -> float:
    """A projected step of t-way tensor parallelism: ``compute_s / t`` plus every all-reduce.

    Each rank computes 1/t of every product; the all-reduces (``tensor_parallel_comm_bytes``'s
    messages, each ``ALGORITHMS[algorithm]`` over t ranks) feed the next product, so none is
    hidden (overlap 0), unlike ``data_parallel_step_time``'s, whose bytes do not grow with b s.
    ``compute_s``: the whole model's arithmetic on one device; ``model``: the link between
    the t ranks; the other arguments as in ``tensor_parallel_comm_bytes``.
    """
    _check_algorithm("tensor_parallel_step_time", algorithm)
    messages = _tp_messages(batch_size, seq_len, hidden, n_layer, t, bytes_per_element,
                            embedding_and_loss, "tensor_parallel_step_time")
    return predicted_step_time(compute_s / t, messages if t > 1 else [], t, model, algorithm)


def transformer_layer_flops(batch_size: int, seq_len: int, hidden: int) -> float:
    """Floating-point operations of one transformer layer's forward and backward (no
    recomputation): ``3 (24 b s h^2 + 4 b s^2 h)``.

    The forward's matrix products are ``24 b s h^2 + 4 b s^2 h`` (Narayanan et al. 2021,
    section 5.1, whose 96 b s h^2 (1 + s / (6 h)) counts a fourth pass for recomputation);
    backward costs twice the forward.
    """
    return 3 * (24 * batch_size * seq_len * hidden ** 2 + 4 * batch_size * seq_len ** 2 * hidden)


# ---- interconnects we do not have: public figures and labelled assumptions ----

@dataclass(frozen=True)
class Interconnect:
    """Figures for a projection: where they come from, and which parts are assumed."""

    name: str
    p: int                   # ranks (GPUs) in all
    link_bandwidth: float    # bytes per second per direction of each GPU's link inside a node
    alpha: float             # seconds per message (an assumption: a few microseconds)
    source: str              # the datasheets used and what is assumed
    nodes: int = 1           # machines (1: everything inside one node)
    nic_bandwidth: float = 0.0   # bytes per second per direction of one network card (rail)
    rails: int = 0           # network cards per node

    @property
    def bandwidth(self) -> float:
        """The bytes per second each rank's ring traffic gets (the model's ``1 / beta``).

        Inside one node, the GPU's link. Across nodes NCCL runs several rings (channels), each
        crossing through a different network card, so a node's ``rails`` cards act as one link
        of ``rails * nic_bandwidth``; the slower of that and the GPU's link sets the pace (8
        rails on 8 GPUs nearly keep up with NVLink; one card per node is eight times slower).
        """
        if self.nodes <= 1:
            return self.link_bandwidth
        if self.rails < 1 or self.nic_bandwidth <= 0:
            raise ValueError(f"Interconnect {self.name!r}: {self.nodes} nodes need rails >= 1 "
                             f"and nic_bandwidth > 0, got rails={self.rails}, "
                             f"nic_bandwidth={self.nic_bandwidth}.")
        return min(self.link_bandwidth, self.rails * self.nic_bandwidth)

    @property
    def rank_bandwidth(self) -> float:
        """The bytes per second of *one* rank's own path to the others, where one rank (or one
        server) carries everything (naive, parameter server): the GPU's link inside a node,
        across nodes one card (its rail), whatever the number of rails."""
        if self.nodes <= 1:
            return self.link_bandwidth
        _ = self.bandwidth   # the same checks of rails and cards
        return min(self.link_bandwidth, self.nic_bandwidth)

    def predict(self, n_bytes: float) -> dict[str, float]:
        """PROJECTED seconds of one all-reduce of ``n_bytes`` for each of ``ALGORITHMS``, each
        on the path it really uses: ``ring`` and ``tree`` (``nccl_tree_time``) over every rail
        (``bandwidth``); ``naive``: rank 0's ``p - 1`` whole messages in turn, its node's over
        its GPU link, the others through its one card (``rank_bandwidth``); ``binomial tree``:
        ``log2`` rounds of whole messages, those between nodes through one card; ``parameter
        server``: one server outside the workers, ``p n`` bytes each way through one link.
        """
        g = self.p // self.nodes                       # GPUs per node
        a, link, one = self.alpha, 1.0 / self.link_bandwidth, 1.0 / self.rank_bandwidth
        inside, across = g - 1, self.p - g             # the ranks rank 0 meets by each path
        rounds_in = math.ceil(math.log2(g)) if g > 1 else 0
        rounds_across = math.ceil(math.log2(self.nodes)) if self.nodes > 1 else 0
        return {
            "naive": 2 * (inside * (a + n_bytes * link) + across * (a + n_bytes * one)),
            "ring": ring_time(n_bytes, self.p, a, 1.0 / self.bandwidth),
            "tree": nccl_tree_time(n_bytes, self.p, a, 1.0 / self.bandwidth, self.nodes),
            "binomial tree": 2 * (rounds_in * (a + n_bytes * link)
                                  + rounds_across * (a + n_bytes * one)),
            "parameter server": ps_time(n_bytes, self.p, a, one),
        }

    def model(self) -> AlphaBeta:
        """The interconnect as an assumed ``AlphaBeta`` (``1 / beta = bandwidth``): right for
        rings and trees, too generous across nodes for one-rank funnels (use ``predict``)."""
        return AlphaBeta(alpha=self.alpha, beta=1.0 / self.bandwidth, p=self.p,
                         source=f"PROJECTION, not measured: {self.source}")


GB = 1e9
_NVLINK4 = 450 * GB     # per direction per H100 SXM GPU (900 GB/s both ways, NVIDIA datasheet)
_NDR = 50 * GB          # InfiniBand NDR, 400 Gb/s per port (NVIDIA ConnectX-7 datasheet)
#: Projections only. Bandwidths are the vendors' peak figures per direction (a ring sends and
#: receives at once on every link); nccl-tests' measured bus bandwidths stay below them. The
#: latencies are assumptions (a few microseconds per message, as nccl-tests' small-message times
#: suggest), not measurements.
INTERCONNECTS = [
    Interconnect("8 GPUs, PCIe 4.0 x16", 8, 32 * GB, 10e-6,
                 "PCIe 4.0 x16 ~32 GB/s per direction (PCI-SIG, 16 GT/s x 16 lanes); "
                 "alpha 10 us assumed"),
    Interconnect("8 GPUs, NVLink 4 (H100 SXM)", 8, _NVLINK4, 3e-6,
                 "NVLink 4: 900 GB/s total per H100 GPU, i.e. 450 GB/s per direction (NVIDIA "
                 "H100 datasheet); alpha 3 us assumed"),
    Interconnect("2 nodes x 8 GPUs, IB NDR, 8 rails", 16, _NVLINK4, 5e-6,
                 "NVLink 4 inside each node; between nodes 8 InfiniBand NDR cards per node, "
                 "400 Gb/s = 50 GB/s each, one per GPU (NVIDIA ConnectX-7 datasheet, DGX H100 "
                 "layout): the rings' crossings spread over 8 x 50 GB/s; alpha 5 us assumed",
                 nodes=2, nic_bandwidth=_NDR, rails=8),
    Interconnect("2 nodes x 8 GPUs, IB NDR, 1 rail", 16, _NVLINK4, 5e-6,
                 "as the line above but one 400 Gb/s card per node: every ring crossing "
                 "shares 50 GB/s; alpha 5 us assumed",
                 nodes=2, nic_bandwidth=_NDR, rails=1),
]


@dataclass(frozen=True)
class AssumedGPU:
    """A GPU class for PROJECTIONS, not measurements: the vendor's peak times an assumed
    utilisation, and an assumed cost of launching one kernel."""

    name: str
    peak_flops: float      # the vendor's float32 peak, FLOP/s
    launch_s: float        # assumed seconds to issue one eager operation (Python, dispatch, CUDA)
    source: str
    utilization: float = 0.25   # assumed share of the peak small convolutions sustain

    @property
    def flops(self) -> float:
        """The effective FLOP/s assumed: ``peak_flops * utilization``."""
        return self.peak_flops * self.utilization


_LAUNCH = ("launch 10 us assumed: an eager PyTorch operation's host-side dispatch and CUDA "
           "launch, the order commonly measured; host work, so the same on each GPU")
#: Three GPU classes for lesson 10's projection. float32 peaks without tensor cores (d2l trains
#: in float32; PyTorch lets cuDNN use TF32 for convolutions by default, so an A100 or H100 may
#: compute faster than this); a quarter of the peak assumed; the launch cost assumed.
GPU_CLASSES = [
    AssumedGPU("V100-class", 15.7e12, 10e-6,
               "NVIDIA V100 datasheet (SXM2): 15.7 TFLOP/s FP32; 25 % assumed; " + _LAUNCH),
    AssumedGPU("A100-class", 19.5e12, 10e-6,
               "NVIDIA A100 datasheet: 19.5 TFLOP/s FP32; 25 % assumed; " + _LAUNCH),
    AssumedGPU("H100-class", 67e12, 10e-6,
               "NVIDIA H100 datasheet (SXM): 67 TFLOP/s FP32; 25 % assumed; " + _LAUNCH),
]


#: NVIDIA H100 SXM, dense BF16 Tensor Core peak: 989 TFLOP/s (NVIDIA H100 datasheet; 1,979
#: "with sparsity").
H100_BF16_FLOPS = 989e12
#: An assumed share of that peak a large layer's products sustain: Narayanan et al. (2021)
#: report 52% of peak (163 of 312 TFLOP/s per A100) for their 1-trillion-parameter model.
ASSUMED_UTILIZATION = 0.5


@dataclass(frozen=True)
class TensorParallelProjection:
    """One line of ``tensor_parallel_projection``: a PROJECTION from the model, not measured."""

    t: int                # tensor-parallel ranks
    compute_s: float      # seconds of arithmetic per rank (layers' FLOPs / t / flops_per_second)
    comm_s: float         # seconds of all-reduces per rank (none hidden)
    comm_share: float     # comm_s / (compute_s + comm_s): the share of the step communicating
    bandwidth: float      # bytes per second each rank's ring traffic gets
    source: str           # the interconnect and the assumptions


def tensor_parallel_projection(interconnect: Interconnect, batch_size: int, seq_len: int,
                               hidden: int, *, n_layer: int = 1, ts: Sequence[int] = (2, 4, 8),
                               flops_per_second: float = H100_BF16_FLOPS * ASSUMED_UTILIZATION,
                               bytes_per_element: float = 2,
                               algorithm: str = "ring") -> list[TensorParallelProjection]:
    """The share of a tensor-parallel step spent in all-reduces, over ``interconnect``: a
    PROJECTION from the alpha-beta model and public peak figures, not a measurement.

    Compute: ``transformer_layer_flops`` per layer at ``flops_per_second`` (assumed: half an
    H100's dense BF16 peak), divided by t; communication: ``tensor_parallel_step_time``'s
    all-reduces, none hidden. Inside one node the ring runs at the GPU's link. Across nodes the
    projection takes the placement Megatron avoids: every ring hop crosses the network, every
    GPU of a node in such a group, all groups communicating at once, so each GPU gets ``rails *
    nic_bandwidth / (p / nodes)``. Hence Megatron keeps tensor parallelism inside a node
    (Narayanan et al. 2021, section 3.2, takeaway 1) and lets data (or pipeline) parallelism,
    whose traffic is per step, not per layer, cross nodes.
    ``interconnect``: one of ``INTERCONNECTS`` or your own; ``n_layer`` does not change the
    share. Returns one ``TensorParallelProjection`` per t of ``ts``, in order.
    """
    if flops_per_second <= 0:
        raise ValueError(f"tensor_parallel_projection: flops_per_second must be > 0, got "
                         f"{flops_per_second!r}.")
    if interconnect.nodes <= 1:
        bandwidth = interconnect.link_bandwidth
        where = "ring inside one node"
    else:
        _ = interconnect.bandwidth                 # a clear error without network cards
        per_node = interconnect.p // interconnect.nodes
        bandwidth = min(interconnect.link_bandwidth,
                        interconnect.rails * interconnect.nic_bandwidth / per_node)
        where = (f"every ring hop between nodes, each of the {per_node} GPUs of a node at "
                 f"1/{per_node} of its {interconnect.rails} network card(s)")
    model = AlphaBeta(alpha=interconnect.alpha, beta=1.0 / bandwidth, p=interconnect.p,
                      source=f"PROJECTION, not measured: {interconnect.source}")
    compute = n_layer * transformer_layer_flops(batch_size, seq_len, hidden) / flops_per_second
    rows = []
    for t in ts:
        step = tensor_parallel_step_time(compute, batch_size, seq_len, hidden, n_layer, t, model,
                                         bytes_per_element=bytes_per_element,
                                         algorithm=algorithm)
        comm = step - compute / t
        rows.append(TensorParallelProjection(
            t=t, compute_s=compute / t, comm_s=comm, comm_share=comm / step,
            bandwidth=bandwidth,
            source=(f"PROJECTION, not measured: {interconnect.name}, {where}; compute at "
                    f"{flops_per_second / 1e12:g} TFLOP/s assumed; {interconnect.source}")))
    return rows


def load_results(path: str | Path) -> dict:
    """The JSON of a benchmark run (``results/NAME-MACHINE.json``), as a dict."""
    return json.loads(Path(path).read_text())
