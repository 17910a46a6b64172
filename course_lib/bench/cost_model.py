"""The latency-bandwidth (alpha-beta) model of all-reduce: fitted, predicted, projected.

A message of n bytes between two ranks costs ``alpha + n * beta``: alpha is the fixed cost of a
message (latency, software overhead), beta the seconds per byte (1 / bandwidth). Counting the
messages each all-reduce sends in sequence gives its cost (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; for the ring,
Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC
2009). The reduction's own arithmetic (the gamma term of Thakur et al.) is left out: on a fit to
measured times it is folded into beta. PyTorch counterpart: none; NCCL's tuner uses the same
kind of model to choose between ring and tree. Notebook 09 draws it over the measurements.

Only plain functions: ``load_results`` reads a results JSON whose path it is given; nothing
else here reads or writes files.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ALGORITHMS",
    "INTERCONNECTS",
    "AlphaBeta",
    "Interconnect",
    "fit_ring",
    "load_results",
    "naive_time",
    "predict",
    "predicted_step_time",
    "ps_time",
    "ring_time",
    "tree_time",
]


# ------------------------------------------------------------------------------------------------
# the textbook costs of one all-reduce of n bytes over p ranks
# ------------------------------------------------------------------------------------------------

def ring_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: ``2 (p - 1)`` steps, each a message of ``n / p`` bytes.

    Reduce-scatter then all-gather, ``p - 1`` steps each; in every step all ranks send one chunk
    at once, so the steps, not the ranks, add up: ``2 (p - 1) alpha + 2 (p - 1) / p * n beta``
    (Patarasuk & Yuan 2009; Thakur et al. 2005, section 4.4).
    """
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes * beta


def tree_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce then binomial-tree broadcast, whole messages each round.

    ``ceil(log2 p)`` rounds each way, each a message of n bytes:
    ``2 ceil(log2 p) (alpha + n beta)`` (Thakur et al. 2005, the "binomial tree" reduce and
    broadcast). Few latencies, but every round moves the whole message.
    """
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return 2 * rounds * (alpha + n_bytes * beta)


def naive_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """Reduce to rank 0 by ``p - 1`` receives, then broadcast back by ``p - 1`` sends.

    Rank 0's link carries every message in turn: ``2 (p - 1) (alpha + n beta)``. Lesson 02's
    allreduce across devices and ``course_lib.bench.collectives.naive_allreduce`` across ranks.
    """
    return 2 * (p - 1) * (alpha + n_bytes * beta)


def ps_time(n_bytes: float, p: int, alpha: float, beta: float) -> float:
    """A parameter server outside the p workers: all push n bytes to it, then all pull the sum.

    The workers send at once, so their latencies overlap, but the server's one link carries
    ``p n`` bytes in and ``p n`` out: ``2 (alpha + p n beta)``. (With the server on one of the
    workers it is ``naive_time``; sharding the server over the p ranks gives the ring's bytes.)
    """
    return 2 * (alpha + p * n_bytes * beta) if p > 1 else 0.0


#: name -> cost function ``f(n_bytes, p, alpha, beta)``, in the order the notebook plots them.
ALGORITHMS = {"naive": naive_time, "ring": ring_time, "tree": tree_time,
              "parameter server": ps_time}


# ------------------------------------------------------------------------------------------------
# fitting alpha and beta to measured times
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlphaBeta:
    """A fitted (or assumed) alpha-beta model and how well it fits.

    Attributes:
        alpha: seconds per message.
        beta: seconds per byte (``1 / beta`` is the link's bandwidth in bytes per second).
        p: the ranks the fit was measured with.
        r2: coefficient of determination of the fitted times (on the times themselves).
        rel_errors: ``(model - measured) / measured`` for each point, in the order given.
        source: what was fitted (or where the figures come from).
    """

    alpha: float
    beta: float
    p: int
    r2: float = float("nan")
    rel_errors: tuple[float, ...] = ()
    source: str = ""

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link (``1 / beta``)."""
        return 1.0 / self.beta

    @property
    def max_rel_error(self) -> float:
        """The worst ``|model - measured| / measured`` of the fit."""
        return max((abs(e) for e in self.rel_errors), default=float("nan"))

    @property
    def median_rel_error(self) -> float:
        """The median ``|model - measured| / measured`` of the fit."""
        return statistics.median(abs(e) for e in self.rel_errors) if self.rel_errors else \
            float("nan")


def fit_ring(sizes: list[float], times: list[float], p: int, source: str = "") -> AlphaBeta:
    """Fit ``ring_time`` to measured (bytes, seconds) of one all-reduce over p ranks.

    The ring model is a straight line in n: ``t = a + b n`` with ``a = 2 (p - 1) alpha`` and
    ``b = 2 (p - 1) / p * beta``. It is fitted by weighted least squares on the *relative*
    error, minimising ``sum(((a + b n_i) - t_i) / t_i) ** 2``: the sizes span four orders of
    magnitude, and an ordinary least-squares line would fit the 64 MB points and ignore the
    4 KB ones (whose times are a thousand times smaller). Then ``alpha = a / (2 (p - 1))`` and
    ``beta = b p / (2 (p - 1))``.

    Args:
        sizes: message sizes in bytes (at least two distinct).
        times: the measured seconds of one all-reduce of each size (a median, say).
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
                     source=source)


def predict(model: AlphaBeta, n_bytes: float, p: int) -> dict[str, float]:
    """Seconds of one all-reduce of ``n_bytes`` over p ranks, for each of ``ALGORITHMS``."""
    return {name: f(n_bytes, p, model.alpha, model.beta) for name, f in ALGORITHMS.items()}


def predicted_step_time(compute_s: float, message_bytes: list[float], p: int, model: AlphaBeta,
                        algorithm: str = "ring", overlap: float = 0.0) -> float:
    """A data-parallel step: computing, plus the all-reduces not hidden behind backward.

    ``compute_s + (1 - overlap) * sum(cost(n) for n in message_bytes)``: one all-reduce per
    message (a bucket, or a parameter for the naive strategy), one after another.

    Args:
        compute_s: the step without communication (forward, backward, update), measured.
        message_bytes: the size of each all-reduce of the step.
        p: ranks.
        model: alpha and beta.
        algorithm: a name from ``ALGORITHMS``.
        overlap: the fraction of the communication hidden behind backward (0: none).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"predicted_step_time: algorithm must be one of {list(ALGORITHMS)}, "
                         f"got {algorithm!r}.")
    comm = sum(ALGORITHMS[algorithm](n, p, model.alpha, model.beta) for n in message_bytes)
    return compute_s + (1.0 - overlap) * comm


# ------------------------------------------------------------------------------------------------
# interconnects we do not have: public figures and labelled assumptions
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interconnect:
    """Figures for a projection: where they come from, and which parts are assumed."""

    name: str
    p: int
    bandwidth: float        # bytes per second per direction of the slowest link on the ring
    alpha: float            # seconds per message (an assumption: a few microseconds)
    source: str

    def model(self) -> AlphaBeta:
        """The interconnect as an ``AlphaBeta`` (assumed, not fitted)."""
        return AlphaBeta(alpha=self.alpha, beta=1.0 / self.bandwidth, p=self.p,
                         source=f"PROJECTION, not measured: {self.source}")


GB = 1e9
#: Projections only. Bandwidths are the vendors' peak figures per direction (a ring sends and
#: receives at once on every link); real all-reduces reach perhaps 70-90 % of them. Latencies
#: are assumptions (a few microseconds per message, as NCCL's documentation and nccl-tests
#: small-message times suggest), not measurements.
INTERCONNECTS = [
    Interconnect("8 GPUs, PCIe 4.0 x16", 8, 32 * GB, 10e-6,
                 "PCIe 4.0 x16 ~32 GB/s per direction (PCI-SIG, 16 GT/s x 16 lanes); "
                 "alpha 10 us assumed"),
    Interconnect("8 GPUs, NVLink 4 (H100 SXM)", 8, 450 * GB, 3e-6,
                 "NVLink 4: 900 GB/s total per H100 GPU, i.e. 450 GB/s per direction (NVIDIA "
                 "H100 datasheet); alpha 3 us assumed"),
    Interconnect("2 nodes x 8 GPUs, InfiniBand NDR", 16, 50 * GB, 5e-6,
                 "InfiniBand NDR 400 Gb/s = 50 GB/s per port, one port per GPU (NVIDIA "
                 "ConnectX-7 datasheet, DGX H100 layout); the ring's slowest links cross the "
                 "network; alpha 5 us assumed"),
]


def load_results(path: str | Path) -> dict:
    """The JSON of a benchmark run (``results/NAME-MACHINE.json``), as a dict."""
    return json.loads(Path(path).read_text())
