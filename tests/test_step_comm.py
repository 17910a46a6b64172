"""Lesson 10's same-run measurement: a DDP step's all-reduces beside the step
(``course_lib.bench.step_comm``). One launch of 2 ranks, LeNet at its quick batch, 2 samples."""
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from ddp_oracle import torch_buckets

from course_lib.bench.step_comm import (
    STRATEGIES_TIMED,
    bootstrap_median,
    measure_bucket_caps,
    measure_step_comm,
    slower_rank_wait,
)
from course_lib.models.lenet import LeNet


def test_bootstrap_median_brackets_the_median():
    xs = [0.9, 1.0, 1.1, 1.3, 5.0, 1.05, 0.95]
    med, lo, hi = bootstrap_median(xs)
    assert med == statistics.median(xs) and lo <= med <= hi
    assert hi < 5.0                         # one outlier does not carry the median's interval
    assert bootstrap_median([2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_median([])


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="models must be"):
        measure_step_comm(["gpt"])
    with pytest.raises(ValueError, match="samples must be"):
        measure_step_comm(["lenet"], samples=1)


def test_lenet_steps_and_their_messages_at_two_ranks():
    run = measure_step_comm(["lenet"], quick=True, samples=2, min_sample_s=0.001, timeout=120)
    e = run["models"]["lenet"]
    grads = [p.numel() * 4 for p in LeNet().parameters()]
    naive, bucketed = e["messages"]["naive"], e["messages"]["bucketed"]
    assert sorted(naive) == sorted(grads)              # one all-reduce per parameter
    assert sum(bucketed) == sum(grads) and 1 < len(bucketed) < len(naive)   # 0.1 MiB buckets
    theirs = torch_buckets(list(LeNet().parameters()), [int(0.1 * 2**20)],   # last layer first
                           order=list(reversed(range(len(grads)))))
    assert sorted(bucketed) == sorted(sum(grads[i] for i in b) for b in theirs)
    assert set(e["step"]) == {"local", *STRATEGIES_TIMED,
                              *(s + "_nosend" for s in STRATEGIES_TIMED)}
    assert set(e["alone"]) == set(STRATEGIES_TIMED)
    for samples in (*e["step"].values(), *e["alone"].values()):
        assert len(samples) == 2 and all(s > 0 for s in samples)
    # the met local steps: every rank's duration of each step, 3 per sample
    assert len(e["local_met"]) == 2 and all(len(d) == 6 and min(d) > 0 for d in e["local_met"])
    assert slower_rank_wait(e["local_met"]) >= 0
    # bucketed's calls stamped: 4 steps and 4 rounds alone (samples // 2 blocks of 4), both
    # ranks, one stamp pair per message, each call starting after its round began and ending
    # after it started, in launch order; in a step, backward's end (its last gradient made)
    # comes after the first bucket (the last layers) started and before the last one did: the
    # last bucket holds that gradient, and is launched only once DDP's hook has taken it
    for what in ("step", "alone"):
        rounds = e["bucketed_calls"][what]
        assert len(rounds) == 4 and all(len(ranks) == 2 for ranks in rounds)
        for ranks in rounds:
            assert min(r["begin"] for r in ranks) == 0
            for r in ranks:
                assert len(r["calls"]) == len(bucketed)
                starts = [c[0] for c in r["calls"]]
                assert r["begin"] <= starts[0] and starts == sorted(starts)
                assert all(s < e_ for s, e_ in r["calls"])
                if what == "step":
                    assert starts[0] < r["backward_end"] <= starts[-1]
                else:
                    assert r["backward_end"] is None
            # an all-reduce ends on no rank before the other rank started it
            for a, b in zip(*(r["calls"] for r in ranks)):
                assert min(a[1], b[1]) >= max(a[0], b[0])
    assert run["threads_per_worker"] >= 1 and torch.get_num_threads() >= 1


def test_bucket_cap_arguments_are_checked():
    for bad in [(), (1.0, 1.0), (0.0,), (-1.0,), ("25",), (True,)]:
        with pytest.raises(ValueError, match="caps must be"):
            measure_bucket_caps("lenet", bad)
    with pytest.raises(ValueError, match="model must be"):
        measure_bucket_caps("gpt")
    with pytest.raises(ValueError, match="samples must be"):
        measure_bucket_caps("lenet", samples=1)
    with pytest.raises(ValueError, match="link_caps must be"):
        measure_bucket_caps("lenet", link=(0.01, 0.0), link_caps=(0.0,))
    for bad in [(0.01,), (0.01, -1e-9), ("1", 0.0), (float("nan"), 0.0), (0.01, float("inf"))]:
        with pytest.raises(ValueError, match="link must be"):
            measure_bucket_caps("lenet", link=bad)


def test_lenet_bucket_caps_at_two_ranks():
    caps = (0.01, 0.1, 1.0)
    run = measure_bucket_caps("lenet", caps, quick=True, samples=2, min_sample_s=0.001,
                              timeout=120)
    grads = [p.numel() * 4 for p in LeNet().parameters()]
    assert run["caps_mb"] == list(caps)
    assert set(run["step"]) == {"local", "cap 0.01", "cap 0.1", "cap 1"}
    assert all(len(v) == 2 and min(v) > 0 for v in run["step"].values())
    counts = []
    for cap in caps:
        b = run["buckets"][cap]
        # every gradient in one bucket; a bucket closes once it holds the cap or more
        assert sum(b["bytes"]) == sum(grads)
        assert all(n >= cap * 2**20 for n in b["bytes"][:-1])
        assert len(b["ready"]) == len(b["bytes"]) and min(b["ready"]) > 0
        # the bucket launched last holds the gradient accumulated last: backward's end
        assert b["ready"][-1] == max(b["ready"]) == run["backward_end"]
        counts.append(len(b["bytes"]))
    assert counts[0] > counts[1] > counts[2] == 1     # 0.49 MiB: one bucket under 1 MiB


def _three_messages_over_a_priced_link() -> tuple[float, list[float]]:
    """In a rank: three 400 KB buckets sent at once over a link of 30 ms per message and
    100 ns per byte (40 ms of bytes each); the seconds until the last is delivered, and what
    the first holds (the average over the ranks of rank + 1)."""
    from course_lib.bench.step_comm import SlowLink, _priced_link_hook

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    link = SlowLink(0.0)
    buffers = [torch.full((100_000,), dist.get_rank() + 1.0) for _ in range(3)]   # 400 KB each
    dist.barrier()
    start = time.perf_counter()
    futures = [_priced_link_hook((link, 0.03, 1e-7), Bucket(b)) for b in buffers]
    first = futures[0].wait()
    for f in futures[1:]:
        f.wait()
    elapsed = time.perf_counter() - start
    link.close()
    return elapsed, first[:2].tolist()


def test_a_priced_link_queues_each_message_and_prices_its_bytes():
    from course_lib.distributed import launch
    for elapsed, first in launch(_three_messages_over_a_priced_link, 2, timeout=120):
        # one at a time, 30 ms + 40 ms each: never under 210 ms (parallel: 70; no bytes: 90)
        assert 3 * (0.03 + 4e5 * 1e-7) * 0.99 <= elapsed < 3.0
        assert first == [1.5, 1.5]                            # the real all-reduce, averaged


def test_lenet_over_a_priced_link():
    # LeNet quick, a link of 50 ms per message: a step lasts at least its messages' time on it
    run = measure_bucket_caps("lenet", (1.0,), link=(0.05, 4e-8), link_caps=(0.01, 1.0),
                              quick=True, samples=2, min_sample_s=0.001, timeout=180)
    assert set(run["step"]) == {"local", "cap 1", "link cap 0.01", "link cap 1"}
    assert run["link"] == [0.05, 4e-8] and run["link_caps_mb"] == [0.01, 1.0]
    tiny = run["buckets"][0.01]["bytes"]
    assert len(tiny) >= 3 and sum(tiny) == sum(p.numel() * 4 for p in LeNet().parameters())
    assert min(run["step"]["link cap 0.01"]) >= 0.99 * (len(tiny) * 0.05 + sum(tiny) * 4e-8)
    assert min(run["step"]["link cap 1"]) >= 0.99 * (0.05 + sum(tiny) * 4e-8)


def test_slower_rank_wait():
    # rank 1 slower at every step: meeting every step costs nothing over meeting once
    assert slower_rank_wait([[1.0, 1.0], [2.0, 3.0]]) == pytest.approx(0.0)
    # the slower rank alternates: each step waits 1 s over the slower rank's mean, 2 s
    assert slower_rank_wait([[1.0, 3.0], [3.0, 1.0]]) == pytest.approx(1.0)
    # three ranks, each the slowest once: per-step max 3, slowest mean (3 + 1 + 1) / 3
    assert slower_rank_wait([[3, 1, 1], [1, 3, 1], [1, 1, 3]]) == pytest.approx(3 - 5 / 3)
    with pytest.raises(ValueError, match="same number"):
        slower_rank_wait([[1.0], [1.0, 2.0]])
    with pytest.raises(ValueError, match="same number"):
        slower_rank_wait([[], []])


def test_divide_only_hook_divides_and_sends_nothing(monkeypatch):
    from course_lib.bench.step_comm import divide_only_hook

    class OneBucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)   # no process group
    t = torch.tensor([2.0, 4.0], dtype=torch.float64)
    out = divide_only_hook(None, OneBucket(t)).wait()
    assert out is t and t.tolist() == [1.0, 2.0]       # divided in place, nothing sent


def _pinned_cores():
    import os

    from course_lib.distributed.env import _pin_to_cores
    return _pin_to_cores(), sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no affinity call")
def test_benchmark_ranks_are_pinned_to_cores_of_their_own():
    """_pin_to_cores: each rank on its own slice of the cores (disjoint, covering them), and
    nothing bound where there are more ranks than cores."""
    import os

    from course_lib.distributed import launch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    got = launch(_pinned_cores, 2, timeout=120)
    assert [g[0] for g in got] == [g[1] for g in got]                 # what it says it did
    share = len(cores) // 2
    assert got[0][0] == cores[:share] and got[1][0] == cores[share:2 * share]
    too_many = launch(_pinned_cores, len(cores) + 1, timeout=120)
    assert all(g[0] is None and g[1] == cores for g in too_many)
