"""Model and pipeline parallelism (lesson 12): splits, one-process model parallelism, schedules,
and the pipeline across gloo processes against its oracle (one process, the whole model, the
whole batch: gradients and the weights after an SGD step). The stages' point-to-point calls are
recorded (``P2PTrace``) and must be NCCL-safe and equal what ``simulate_schedule`` plays."""
import math
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from p2p_trace import P2PTrace
from torch import nn

from course_lib.checks.lesson12 import max_in_flight
from course_lib.devices import devices
from course_lib.distributed import launch
from course_lib.distributed.pipelining import (
    ActivationMeter,
    ModelParallel,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    balance_stages,
    bubble_fraction,
    check_order,
    flatten_sequential,
    gpipe_order,
    idle_fraction,
    layer_costs,
    one_f_one_b_order,
    p2p_program,
    simulate_schedule,
    split_microbatches,
    split_sequential,
    stage_costs,
)
from course_lib.examples import pipeline_workers as W
from course_lib.models.lenet import LeNet
from course_lib.models.resnet import resnet18
from course_lib.timing import bootstrap_ratio


def _batch(n, shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_pipeline_split_balances_params_and_time():
    net = W.sequential_model("mlp")        # Linear 7->9 (72), 9->6 (60), 6->8 (56), 8->3 (27), tanh
    assert layer_costs(net) == [72, 0, 60, 0, 56, 0, 27]
    assert balance_stages(net, 2) == [3, 4] and balance_stages(net, 3) == [1, 2, 4]
    stages = split_sequential(net, 3)
    assert [len(s) for s in stages] == [1, 2, 4] and stages[0][0] is net[0]  # shared layers
    X, _ = _batch(16, (7,), 3)
    costs = layer_costs(net, "time", X, repeat=1)
    assert len(costs) == 7 and all(c > 0 for c in costs)
    assert sum(balance_stages(net, 4, "time", X, repeat=1)) == 7
    assert len(flatten_sequential(resnet18())) == 14
    said = re.search(r"become (\d+) layers", flatten_sequential.__doc__)
    assert said and int(said.group(1)) == 14          # the docstring counts what the code does


class _Seen(nn.Module):
    """A linear layer that notes whether each input it gets requires grad."""

    seen: list = []   # a class attribute: shared by the copies layer_costs makes

    def __init__(self, index: int):
        super().__init__()
        self.index, self.linear = index, nn.Linear(4, 4)

    def forward(self, x):
        _Seen.seen.append((self.index, x.requires_grad))
        return self.linear(x)


def test_layer_costs_by_time_runs_each_layer_as_the_pipeline_does():
    _Seen.seen.clear()
    costs = layer_costs(nn.Sequential(_Seen(0), _Seen(1), _Seen(2)), "time", torch.randn(8, 4),
                        repeat=2)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    timed = {}
    for index, requires_grad in _Seen.seen:
        timed.setdefault(index, set()).add(requires_grad)
    # the model's input needs no gradient (no stage computes it); later layers' inputs do
    assert timed == {0: {False}, 1: {True}, 2: {True}}


class _GradProbe(nn.Module):
    """Records, per call, whether its input already carries a gradient from an earlier call."""
    stale: list = []   # class-level: the timed copy (deepcopy) appends here too

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if torch.is_grad_enabled():   # a timed call (not the no_grad pass for the next input)
            _GradProbe.stale.append(x.grad is not None)
        return self.linear(x)


@pytest.mark.parametrize("measure", [
    lambda net, X: layer_costs(net, "time", X, repeat=3),
    lambda net, X: stage_costs(net, [1, 1], X, repeat=3)])
def test_layer_and_stage_costs_time_each_call_without_gradient_accumulation(measure):
    # each timed call must be a pipeline's fresh backward, not one that adds to an input's
    # .grad left by the call before (an extra accumulation per repeat: a bias in the time)
    _GradProbe.stale.clear()
    measure(nn.Sequential(nn.Linear(4, 4), _GradProbe()), torch.randn(8, 4))
    assert len(_GradProbe.stale) >= 3 and not any(_GradProbe.stale)


class _GradSeen(nn.Module):
    """A linear layer that notes, per backward, whether the gradient of its output was dense."""
    dense: list = []   # class-level: the timed copy (deepcopy) appends here too

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        out = self.linear(x)
        if out.requires_grad:
            out.register_hook(lambda g: _GradSeen.dense.append(g.is_contiguous()
                                                               and 0 not in g.stride()))
        return out


@pytest.mark.parametrize("measure", [
    lambda net, X: layer_costs(net, "time", X, repeat=2),
    lambda net, X: stage_costs(net, [1, 1], X, repeat=2)])
def test_layer_and_stage_costs_are_measured_the_same_way(measure):
    # both backward from a dense gradient of ones, as a received gradient is: sum().backward()
    # would hand the layer an expanded (stride 0) one, and conv backward then copies it each call
    _GradSeen.dense.clear()
    measure(nn.Sequential(nn.Linear(4, 4), _GradSeen()), torch.randn(8, 4))
    assert len(_GradSeen.dense) >= 2 and all(_GradSeen.dense)


_REUSE = """
import torch
from course_lib.timing import keep_freed_memory, page_faults
assert keep_freed_memory() is True                  # glibc on Linux, as CI runs


def step():                                         # three 16 MiB tensors, all freed at the end
    a, b = torch.ones(4 * 2**20), torch.ones(4 * 2**20)
    (a + b).sum()


for _ in range(10):                                 # the heap grows for a while ...
    step()
faults = []
for _ in range(9):                                  # ... then the freed blocks are reused
    before = page_faults()
    step()
    faults.append(page_faults() - before)
print(sorted(faults)[4])                            # the median step (one may still grow it)
"""


def test_keep_freed_memory_stops_page_faults_on_reuse():
    # a fresh process: how malloc treats a block depends on what the process did before
    done = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    # glibc's default faults in all three tensors every step here (3 x 4096 pages)
    assert float(done.stdout.split()[-1]) < 2048


def _fake_runs(control=(1.0,) * 6, m2=(1.0,) * 6) -> dict:
    """Simulated two-stage steps for both schedules at m = 1, 2, six rounds: 1F1B's op times
    scaled in round i by ``control[i]`` at m = 1 and by ``m2[i]`` at m = 2 (GPipe's unscaled)."""
    runs = {}
    for name, order in (("gpipe", gpipe_order), ("1f1b", one_f_one_b_order)):
        for m, scales in ((1, control), (2, m2)):
            runs[name, m] = [list(simulate_schedule(order, 2, m, forward_time=k,
                                                    backward_time=2 * k))
                             for k in (scales if name == "1f1b" else (1.0,) * len(scales))]
    return runs


def test_bubble_table_and_compare_to_control(capsys):
    medians = W.bubble_table(_fake_runs(), "title")
    assert medians == {(s, m): pytest.approx(bubble_fraction(2, m))
                       for s in ("gpipe", "1f1b") for m in (1, 2)}
    ratios = W.compare_to_control(_fake_runs(), (1, 2))
    assert ratios[1] == pytest.approx((1, 1, 1)) and ratios[2] == pytest.approx((1, 1, 1))
    assert "no difference measurable" in capsys.readouterr().out
    # a control offset from 1 (a bias) and the same offset at m = 2: no difference, although
    # m = 2's own interval excludes 1 (a rule that compares m = 2's ratio with 1 fails here)
    near = (0.88, 0.89, 0.9, 0.9, 0.91, 0.92)
    ratios = W.compare_to_control(_fake_runs(control=(0.9,) * 6, m2=near), (1, 2))
    assert ratios[1] == pytest.approx((0.9, 0.9, 0.9))
    assert ratios[2][1] < 1 < ratios[2][2]
    assert "no difference measurable" in capsys.readouterr().out
    # a noisy control around 1 and a tight m = 2 ratio below the control's median: the old
    # rule (m = 2's interval excludes the control's median) called "1F1B faster"; the ratio
    # over the control carries the control's spread, includes 1, and calls nothing
    noisy, tight = (0.8, 0.9, 1.0, 1.0, 1.1, 1.2), (0.93, 0.94, 0.95, 0.95, 0.96, 0.97)
    runs = _fake_runs(control=noisy, m2=tight)
    control = W.compare_to_control(runs, (1,))[1]
    capsys.readouterr()
    m2_alone = bootstrap_ratio(W.step_spans(runs["1f1b", 2]), W.step_spans(runs["gpipe", 2]))
    assert m2_alone[2] < control[0]                  # the old rule's "difference"
    ratios = W.compare_to_control(runs, (1, 2))
    assert ratios[2][1] < 1 < ratios[2][2]
    assert "no difference measurable" in capsys.readouterr().out
    # rounds resampled together: a load that slows round i at m = 1 and m = 2 alike cancels,
    # so 0.9 of the control in every round is a difference, however noisy the control
    ratios = W.compare_to_control(_fake_runs(control=noisy, m2=[0.9 * k for k in noisy]),
                                  (1, 2))
    assert ratios[2] == pytest.approx((0.9, 0.9, 0.9))
    out = capsys.readouterr().out   # each verdict names the rounds it rests on
    assert "over 6 rounds" in out and "1F1B faster in these 6 rounds" in out
    W.compare_to_control(_fake_runs(control=noisy, m2=[1.1 * k for k in noisy]), (1, 2))
    assert "1F1B slower in these 6 rounds" in capsys.readouterr().out
    # a bound just below 1 next to "below 1" must not print as 1 (it did at 3 decimals)
    W.compare_to_control(_fake_runs(control=noisy, m2=[0.99999 * k for k in noisy]), (1, 2))
    line = capsys.readouterr().out.splitlines()[-1]
    assert "below 1" in line and "[< 1, < 1]" in line and "1.000" not in line, line
    W.compare_to_control(_fake_runs(control=noisy, m2=[1.00001 * k for k in noisy]), (1, 2))
    line = capsys.readouterr().out.splitlines()[-1]
    assert "above 1" in line and "[> 1, > 1]" in line, line
    # resampled apart (an unpaired interval), the same data would call nothing
    a = [0.9 * k for k in noisy]
    shuffled = W.ratio_over_control(a, [1.0] * 6, noisy[::-1], [1.0] * 6)
    assert shuffled[1] < 1 < shuffled[2]
    with pytest.raises(ValueError, match="m = 1 first"):
        W.compare_to_control(_fake_runs(), (2,))
    with pytest.raises(ValueError, match="equally long"):
        W.ratio_over_control([1.0], [1.0, 1.0], [1.0], [1.0])


def test_round_order_alternates_and_shuffles():
    configs = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8)]
    orders = [W.round_order(configs, i) for i in range(8)]
    assert all(sorted(o) == sorted(configs) for o in orders)
    for i, o in enumerate(orders):   # each m's two schedules back to back, leader alternating
        assert all(o[k][1] == o[k + 1][1] for k in range(0, 8, 2))
        assert {o[k][0] for k in range(0, 8, 2)} == {"gpipe" if i % 2 == 0 else "1f1b"}
    assert len({tuple(key[1] for key in o) for o in orders}) > 1       # the m's shuffled
    assert orders == [W.round_order(configs, i) for i in range(8)]      # seeded: every rank


class _Slow(nn.Module):
    """Sleeps ``seconds`` per forward: a layer whose cost is known."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.linear = seconds, nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def test_stage_costs_times_each_stage_whole_as_the_pipeline_runs_it():
    _Seen.seen.clear()
    net = nn.Sequential(_Seen(0), _Seen(1), _Seen(2))
    before = [p.detach().clone() for p in net.parameters()]
    costs = stage_costs(net, [1, 2], torch.randn(8, 4), repeat=2)
    assert len(costs) == 2 and all(c > 0 for c in costs)
    timed = {}
    for index, requires_grad in _Seen.seen:
        timed.setdefault(index, set()).add(requires_grad)
    # stage 0 gets the model's input without gradient, stage 1 its input with one
    assert timed[0] == {False} and timed[1] == {True} and True in timed[2]
    assert all(p.grad is None for p in net.parameters())          # timed on a copy
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    # a stage holding the slow layer costs at least its sleep; the other stage far less
    slow = nn.Sequential(nn.Linear(4, 4), _Slow(0.02), nn.Linear(4, 4))
    fast_stage, slow_stage = stage_costs(slow, [1, 2], torch.randn(8, 4), repeat=2)
    assert slow_stage >= 0.02 > 4 * fast_stage
    with pytest.raises(ValueError, match="example="):
        stage_costs(slow, [1, 2], None)


@pytest.mark.parametrize("call, error, says", [
    (lambda: split_sequential(LeNet(), 2), TypeError, "expects an nn.Sequential"),
    (lambda: split_sequential(W.sequential_model("mlp"), 8), ValueError, "at most 7 stages"),
    (lambda: split_sequential(W.sequential_model("mlp"), balance=[3, 3]), ValueError,
     "sums to 6 but the model has 7 layers"),
    (lambda: split_sequential(W.sequential_model("mlp"), balance=[7, 0]), ValueError,
     "positive integer layer counts"),
    (lambda: split_sequential(W.sequential_model("mlp"), 3, balance=[3, 4]), ValueError,
     "one layer count per stage"),
    (lambda: split_sequential(W.sequential_model("mlp")), ValueError, "num_stages or balance"),
    (lambda: balance_stages(W.sequential_model("mlp"), 2, by="time"), ValueError, "example="),
    (lambda: balance_stages(W.sequential_model("mlp"), 2, by="flops"), ValueError, "by='params'"),
    (lambda: split_microbatches(torch.zeros(10, 3), 4), ValueError, "do not divide a batch of 10"),
    (lambda: split_microbatches(torch.zeros(3, 3), 4), ValueError, "use at most 3"),
    (lambda: split_microbatches(torch.zeros(4), 0), ValueError, ">= 1"),
    (lambda: ModelParallel(W.sequential_model("mlp"), []), ValueError, "one device per stage"),
    (lambda: PipelineStage(nn.Linear(2, 2), 0, 2), RuntimeError, "init_process_group"),
    (lambda: PipelineStage(nn.Linear(2, 2), 2, 2), ValueError, "stage_index in 0 ... 1"),
    (lambda: bubble_fraction(-1, 4), ValueError, "num_stages >= 1, got -1"),
    (lambda: bubble_fraction(2, 0), ValueError, "num_microbatches >= 1, got 0"),
    (lambda: bubble_fraction(2.5, 4), ValueError, "integer num_stages"),
    (lambda: gpipe_order(2, 2, 4), ValueError, "stage in 0 ... 1"),
    (lambda: one_f_one_b_order(0, 0, 3), ValueError, "num_stages >= 1, got 0"),
    (lambda: one_f_one_b_order(-1, 2, 3), ValueError, "stage in 0 ... 1"),
    (lambda: check_order([], 0, 0), ValueError, "num_microbatches >= 1, got 0"),
    (lambda: simulate_schedule(gpipe_order, 0, 2), ValueError, "num_stages >= 1, got 0"),
    (lambda: simulate_schedule(gpipe_order, 2, 2, forward_time=-1), ValueError,
     "forward_time to be a finite number >= 0, got -1"),
    (lambda: simulate_schedule(gpipe_order, 2, 2, comm_time=math.nan), ValueError, "comm_time"),
    (lambda: simulate_schedule(gpipe_order, 2, 2, forward_time=[1.0, 2.0, 3.0]), ValueError,
     "one number or one per stage (2), got 3 values"),
    (lambda: simulate_schedule(gpipe_order, 2, 2, backward_time=[1.0, -2.0]), ValueError,
     "backward_time to be a finite number >= 0, got -2.0 (one number, or one per stage)"),
    (lambda: idle_fraction([]), ValueError, "got none"),
])
def test_pipeline_bad_splits_are_refused_clearly(call, error, says):
    with pytest.raises(error) as info:
        call()
    assert says in str(info.value)


def test_equal_blocks_cut_in_half_makes_equal_stages():
    net = W.sequential_model("blocks", width=5, blocks=4)      # LayerNorm, then 4 blocks
    first, second = split_sequential(net, balance=[3, 2])
    linear = [[q.numel() for q in s.parameters() if q.dim() == 2] for s in (first, second)]
    assert linear == [[25, 25], [25, 25]]                     # the same matmuls on each stage
    assert net(torch.randn(3, 5)).shape == (3, 5)
    with pytest.raises(ValueError, match="for 'blocks' only"):
        W.sequential_model("mlp", width=5)


def test_pipeline_model_parallel_in_one_process_equals_the_whole_model():
    net, oracle = W.sequential_model("mlp"), W.sequential_model("mlp")
    X, y = _batch(6, (7,), 3)
    mp = ModelParallel(net, devices(3, warn=False), balance=[2, 4, 1])
    assert [len(s) for s in mp.stages] == [2, 4, 1]
    out = mp(X)
    torch.testing.assert_close(out, oracle(X), check_device=False)
    F.cross_entropy(out, y.to(out.device)).backward()   # the last stage's device
    F.cross_entropy(oracle(X), y).backward()
    torch.testing.assert_close([p.grad for p in net.parameters()],
                               [p.grad for p in oracle.parameters()], check_device=False)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_pipeline_schedules_bubble_and_activations_in_flight(p):
    for m in (1, 2, 3, 8):
        for order in (gpipe_order, one_f_one_b_order):
            events = simulate_schedule(order, p, m, forward_time=1, backward_time=1)
            assert idle_fraction(events) == pytest.approx(bubble_fraction(p, m))
        for s in range(p):
            held = max_in_flight(one_f_one_b_order(s, p, m))
            assert held == min(p - s, m) and max_in_flight(gpipe_order(s, p, m)) == m


def test_pipeline_simulation_with_unequal_stages():
    # one micro-batch, stage 1 twice as slow: F0 [0, 1], F1 [1, 3], B1 [3, 7], B0 [7, 9]
    events = simulate_schedule(gpipe_order, 2, 1, forward_time=[1, 2], backward_time=[2, 4])
    assert [(e.stage, e.kind, e.start, e.end) for e in events] == [
        (0, "F", 0, 1), (1, "F", 1, 3), (1, "B", 3, 7), (0, "B", 7, 9)]
    assert idle_fraction(events) == pytest.approx(1 - 9 / 18)
    # equal stages given per stage are the scalar case; unequal ones idle more than theory
    for m in (1, 4):
        same = simulate_schedule(one_f_one_b_order, 3, m, forward_time=[1, 1, 1])
        assert same == simulate_schedule(one_f_one_b_order, 3, m)
        slow = simulate_schedule(one_f_one_b_order, 3, m, forward_time=[1, 3, 1],
                                 backward_time=[2, 6, 2])
        assert idle_fraction(slow) > bubble_fraction(3, m)


def _fake_step(idle_gap: float) -> list:
    """Two stages, one micro-batch, stage 1 starting idle_gap after stage 0's forward."""
    from course_lib.distributed.pipelining import PipeEvent
    return [PipeEvent(0, "F", 0, 0.0, 1.0), PipeEvent(1, "F", 0, 1 + idle_gap, 2 + idle_gap),
            PipeEvent(1, "B", 0, 2 + idle_gap, 3 + idle_gap),
            PipeEvent(0, "B", 0, 3 + 2 * idle_gap, 4 + 2 * idle_gap)]


def test_pipeline_measurement_helpers_median_step_and_spread():
    runs = [_fake_step(0.5), _fake_step(0.0), _fake_step(2.0), _fake_step(1.0), _fake_step(0.2)]
    spread = W.step_bubbles(runs)
    assert spread == [idle_fraction(r) for r in runs] and len(set(spread)) == 5
    assert W.median_step(runs) == runs[0]                  # gaps 0, 0.2, [0.5], 1, 2
    assert W.median_step(runs[:4]) == runs[0]              # even count: the lower middle
    assert W.bubbles(runs) == idle_fraction(runs[0])
    assert W.median_step(runs) != runs[-1]                 # not simply the last step
    assert sorted(W.handoff_seconds(runs[:1])) == [0.5, 0.5]   # F0 on stage 1, B0 on stage 0
    assert W.op_seconds(runs) == {(0, "B"): 1.0, (0, "F"): 1.0, (1, "B"): 1.0, (1, "F"): 1.0}


@pytest.mark.parametrize("order", [gpipe_order, one_f_one_b_order])
@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_gap_accounting_recovers_a_known_pipeline(order, p):
    """Op times and the hand-off read back from a simulated run (per-stage times, messages
    costing 0.5) rebuild that run's bubble: the accounting the lesson does on measured steps."""
    fwd, bwd, comm = [1.0, 1.5, 0.75][:p], [2.0, 3.5, 1.5][:p], 0.5   # exact in binary
    events = simulate_schedule(order, p, 4, forward_time=fwd, backward_time=bwd, comm_time=comm)
    ops = W.op_seconds([events])
    assert [ops[s, "F"] for s in range(p)] == fwd and [ops[s, "B"] for s in range(p)] == bwd
    lags = W.handoff_seconds([events])
    assert min(lags) == comm and sorted(lags)[len(lags) // 2] == comm   # the header: 2 messages
    rebuilt = simulate_schedule(order, p, 4, forward_time=[ops[s, "F"] for s in range(p)],
                                backward_time=[ops[s, "B"] for s in range(p)], comm_time=comm)
    assert idle_fraction(rebuilt) == pytest.approx(idle_fraction(events))
    assert idle_fraction(events) > bubble_fraction(p, 4)


def test_pipeline_simulation_finds_a_deadlock():
    backwards_first = lambda s, p, m: one_f_one_b_order(p - 1 - s, p, m)  # warm-up reversed
    with pytest.raises(ValueError, match="deadlock: stage 0 waits"):
        simulate_schedule(backwards_first, 2, 4)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_simulation_models_nccl_unfused_1f1b_deadlocks(p):
    # NCCL runs a stage's sends and receives in order, a send done only when the peer reaches
    # the receive: 1F1B's "send activation" then "receive gradient" as separate operations,
    # against the next stage's "send gradient" then "receive activation", wait for each other
    for m in (2, 4, 8):
        with pytest.raises(ValueError, match="deadlock: ") as info:
            simulate_schedule(one_f_one_b_order, p, m, fused=False)
        assert re.search(r"stage \d waits in B\(0\) for stage \d to receive F\(\d\)'s "
                         "activation", str(info.value))
        simulate_schedule(gpipe_order, p, m, fused=False)   # GPipe's order survives unfused
    # fused, as PipelineStage posts them: every schedule of the course finishes, with the bubble
    # of theory and no extra wait (forward and backward of equal length)
    for m in range(1, 9):
        for order in (gpipe_order, one_f_one_b_order):
            events = simulate_schedule(order, p, m, forward_time=1, backward_time=1)
            assert idle_fraction(events) == pytest.approx(bubble_fraction(p, m))
            assert len(events) == 2 * p * m


def test_pipeline_p2p_program_fuses_the_send_with_the_next_receive():
    F0 = ("F", 0, "data")
    first = p2p_program(one_f_one_b_order(0, 2, 2), 0, 2)
    assert first == [
        ("compute", "F", 0),
        ("post", 1, [("send", 1, ("F", 0, "shape")), ("send", 1, F0)]),   # alone: no receive
        ("compute", "F", 1),
        ("wait", 1),                                                      # released first
        ("post", 4, [("send", 1, ("F", 1, "data")), ("recv", 1, ("B", 0, "data"))]),  # fused
        ("wait", 4),
        ("compute", "B", 0),
        ("post", 7, [("recv", 1, ("B", 1, "data"))]),
        ("wait", 7),
        ("compute", "B", 1)]
    last = p2p_program(one_f_one_b_order(1, 2, 2), 1, 2)
    assert ("post", 6, [("send", 0, ("B", 0, "data")), ("recv", 0, ("F", 1, "data"))]) in last
    assert last[-2:] == [("post", 10, [("send", 0, ("B", 1, "data"))]), ("wait", 10)]


def stage_p2p(schedule: str, m: int) -> dict:
    """Runs in every rank: one step of the MLP pipeline with its point-to-point calls recorded;
    the calls as ``p2p_program``'s entries (computes left out; a message as its kind and part:
    nothing on the wire names its micro-batch), their tags, and the NCCL overlaps found."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stages, stage = W._this_ranks_stage("mlp", None)
    sched = W.SCHEDULES[schedule](stage, m, loss_fn=F.cross_entropy)
    X, y = _batch(2 * m, (7,), 3)
    with P2PTrace() as trace:
        W._run_step(sched, stage, X, y)
    batch_of, post_of, recorded = {}, {}, []   # trace batch -> post number; op id -> post
    for call in trace.calls:
        if "op" in call:
            direction = "send" if call["op"] == "isend" else "recv"
            forward = call["peer"] == (rank + 1 if direction == "send" else rank - 1)
            message = ("F" if forward else "B",   # the shape header is the one int64 message
                       "shape" if call["dtype"] == torch.int64 else "data")
            if call["batch"] not in batch_of:
                batch_of[call["batch"]] = len(batch_of)
                recorded.append(("post", batch_of[call["batch"]], []))
            recorded[-1][2].append((direction, call["peer"], message))
            post_of[call["id"]] = batch_of[call["batch"]]
        else:
            wait = ("wait", post_of[call["wait"][0]])
            if recorded[-1] != wait:    # one wait per work: several for a batch
                recorded.append(wait)
    order = W.SCHEDULES[schedule].order(rank, p, m)
    program = [a for a in p2p_program(order, rank, p) if a[0] != "compute"]
    posts = {a[1]: k for k, a in enumerate(a for a in program if a[0] == "post")}
    program = [("wait", posts[a[1]]) if a[0] == "wait" else
               ("post", posts[a[1]], [(d, peer, (k, part)) for d, peer, (k, _, part) in a[2]])
               for a in program]
    return {"recorded": recorded, "program": program, "overlaps": trace.unbatched_overlaps(),
            "alone": [c for c in trace.posts() if c["batch"] is None],
            "tags": sorted({c["tag"] for c in trace.posts()})}


def _check_stage_p2p(per_rank: list[dict]) -> None:
    for rank in per_rank:
        assert rank["overlaps"] == [] and rank["alone"] == []   # every op in a batch
        assert rank["recorded"] == rank["program"]             # what the simulator plays
        assert rank["tags"] == [0]      # one tag: gloo pairs a link's messages in posting order


def test_pipeline_activation_meter_counts_saved_tensors_once():
    net = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))
    X = torch.randn(32, 10)
    with ActivationMeter(exclude=net.parameters()) as meter:
        out = net(X)
        assert meter.alive == (32 * 10 + 32 * 100) * 4   # the input; the ReLU output once
        out.sum().backward()
    assert meter.alive == 0 and meter.peak == (32 * 10 + 32 * 100) * 4


def test_pipeline_gradient_oracle_two_ranks_gloo_seed_example_and_activation_peaks():
    data = {"mlp": _batch(12, (7,), 3), "lenet": _batch(8, (1, 28, 28), 10, seed=1)}
    cases = [("mlp", s, m, None) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 12)]
    cases.append(("lenet", "1f1b", 4, [3, 7]))
    Xi, yi = _batch(8, (1, 28, 28), 10)
    X16, y16 = _batch(16, (7,), 3)
    ranks = launch(W.in_sequence, 2, [
        (W.check_pipeline, cases, data),
        (W.two_rank_example, Xi, yi),
        (W.activation_peaks, X16, y16, (1, 4, 8), ("gpipe", "1f1b"), None, "mlp"),
        (stage_p2p, "1f1b", 4),
        (stage_p2p, "gpipe", 3),
        (W.pipeline_timelines, X16, y16, (1, 4), ("gpipe", "1f1b"), None, 3, 1, "mlp"),
        (W.pipeline_timelines, torch.randn(8, 6), torch.randint(0, 6, (8,)), (2,), ("1f1b",),
         [2, 1], 1, 1, "blocks", {"width": 6, "blocks": 2}),
        (W.torch_pipeline_step, "mlp", "gpipe", 4, *data["mlp"]),
        (W.torch_pipeline_step, "mlp", "1f1b", 3, *data["mlp"], [2, 5]),
    ], timeout=180)
    results, seed, peaks, p2p_1f1b, p2p_gpipe, timed, timed_blocks, *torchs = zip(*ranks)
    # torch.distributed.pipelining, float64: the course's schedule and one process, to rounding
    for ranks_result in torchs:
        assert [r["stage"] for r in ranks_result] == [0, 1]
        assert all(r["vs_course"] < 1e-12 and r["vs_one_process"] < 1e-12 for r in ranks_result)
    assert [r["layers"] for r in torchs[1]] == [2, 5] and "output_diff" in torchs[1][1]
    # the equal-stage model runs through the same workers: 2 micro-batches, F and B each
    blocks = W.merge_ranks(timed_blocks)
    assert list(blocks) == [("1f1b", 2)] and len(blocks["1f1b", 2][0]) == 2 * 2 * 2
    # timelines: every configuration's steps, interleaved (round i of each in round_order's
    # order, then round i + 1; the first round, i = 0, was the warm-up)
    runs = W.merge_ranks(timed)
    configs = [("gpipe", 1), ("gpipe", 4), ("1f1b", 1), ("1f1b", 4)]
    assert list(runs) == configs and all(len(runs[c]) == 3 for c in configs)
    assert all(len(step) == 2 * 2 * c[1] for c in configs for step in runs[c])
    ran = [c for i in range(3) for c in W.round_order(configs, i + 1)]
    seen = {c: 0 for c in configs}
    starts = []
    for c in ran:
        starts.append(min(e.start for e in runs[c][seen[c]]))
        seen[c] += 1
    assert starts == sorted(starts)
    _check_stage_p2p(p2p_1f1b)
    _check_stage_p2p(p2p_gpipe)
    for rank in results:      # every rank asserted; here the sizes of what it found: float64
        assert all(r["grad_diff"] < 1e-12 and r["weight_diff"] < 1e-12 for r in rank)
    assert results[1][0]["balance"] == [3, 4] and results[1][-1]["balance"] == [3, 7]
    assert all("output_diff" in r for r in results[1])
    # the seed: rank 0 sends the activation, rank 1 its gradient back; both match one process
    assert seed[0]["activation sent"] == seed[1]["gradient sent"] == [8, 128]
    assert seed[0]["grad_diff"] < 1e-6 and seed[1]["grad_diff"] < 1e-6
    # activations held: GPipe the whole batch for any m; 1F1B min(p - s, m) of m micro-batches
    first, last = peaks
    assert first[("gpipe", 1)]["saved"] == first[("1f1b", 1)]["saved"] > 0
    assert first[("gpipe", 4)]["saved"] == first[("gpipe", 1)]["saved"]
    assert first[("1f1b", 4)]["saved"] * 2 == first[("gpipe", 4)]["saved"]   # 2 of 4 in flight
    assert last[("1f1b", 4)]["saved"] * 4 == last[("gpipe", 4)]["saved"]     # 1 of 4
    # with the buffers held for sends: stage 0 sends its output, (B/m, 6) float32 per micro-batch
    sent = 16 * 6 * 4
    assert first[("gpipe", 1)]["held"] == first[("gpipe", 1)]["saved"] + sent
    for m in (4, 8):
        # 1F1B releases each sent activation once its send is done: 2 micro-batches' worth
        assert first[("1f1b", m)]["held"] * m == 2 * first[("gpipe", 1)]["held"]
        assert first[("1f1b", m)]["held"] < first[("gpipe", m)]["held"]
        # GPipe: the whole batch saved, two micro-batches' sends (one in flight, one queued)
        assert first[("gpipe", m)]["held"] == first[("gpipe", 1)]["saved"] + 2 * sent // m


def test_pipeline_gradient_oracle_three_ranks_gloo():
    cases = [("mlp", "1f1b", 1, None), ("mlp", "1f1b", 3, [2, 2, 3]), ("mlp", "gpipe", 6, None),
             ("mlp", "1f1b", 6, [1, 1, 5])]
    mlp = _batch(12, (7,), 3)
    ranks = launch(W.in_sequence, 3, [(W.check_pipeline, cases, {"mlp": mlp}),
                                      (stage_p2p, "1f1b", 5), (stage_p2p, "gpipe", 2),
                                      (W.torch_pipeline_step, "mlp", "1f1b", 6, *mlp)],
                   timeout=180)
    results, p2p_1f1b, p2p_gpipe, torchs = zip(*ranks)
    assert all(r["vs_course"] < 1e-12 and r["vs_one_process"] < 1e-12 for r in torchs)
    assert [r["balance"] for r in results[0]] == [[1, 2, 4], [2, 2, 3], [1, 2, 4], [1, 1, 5]]
    _check_stage_p2p(p2p_1f1b)
    _check_stage_p2p(p2p_gpipe)


def test_pipeline_gradient_oracle_four_ranks_gloo():
    cases = [("mlp", "1f1b", 4, None), ("mlp", "gpipe", 6, [1, 2, 2, 2]),
             ("mlp", "1f1b", 2, [2, 1, 1, 3])]
    ranks = launch(W.in_sequence, 4, [(W.check_pipeline, cases, {"mlp": _batch(12, (7,), 3)}),
                                      (stage_p2p, "1f1b", 6)], timeout=180)
    results, p2p = zip(*ranks)
    assert [r["balance"] for r in results[0]] == [[1, 2, 2, 2], [1, 2, 2, 2], [2, 1, 1, 3]]
    assert all("output_diff" in r for r in results[3])
    _check_stage_p2p(p2p)


# ---- messages pair up in the order posted (no tags, as on NCCL); one program on every rank ----

def _swapped_order(stage: int, p: int, m: int) -> list:
    """GPipe, but the last stage runs the forwards of micro-batches 1 and 2 the other way round:
    it receives in another order than the stage before it sends."""
    order = gpipe_order(stage, p, m)
    if stage == p - 1:
        order[1], order[2] = order[2], order[1]
    return order


class ScheduleSwapped(ScheduleGPipe):
    order = staticmethod(_swapped_order)


class ScheduleTunable(ScheduleGPipe):
    """GPipe, or (``reverse_backwards``) with every stage's backwards in reverse order."""

    reverse_backwards = False

    def order(self, stage: int, p: int, m: int) -> list:
        order = gpipe_order(stage, p, m)
        return order[:m] + order[m:][::-1] if self.reverse_backwards else order


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_simulation_finds_messages_out_of_order(p):
    # NCCL pairs the k-th send of a link with its k-th receive: receiving F(2) before F(1) would
    # run F(2) on F(1)'s activation; the simulator says so, it does not wait for a match
    with pytest.raises(ValueError, match="messages out of order") as info:
        simulate_schedule(_swapped_order, p, 4)
    assert (f"stage {p - 1}'s receive no. 3 from stage {p - 2} expects F(2)'s activation, but "
            f"stage {p - 2}'s send no. 3 to stage {p - 1} carries F(1)'s activation"
            in str(info.value)), str(info.value)
    assert f"stage {p - 1}'s F(2) would silently run on F(1)'s activation" in str(info.value)
    def backwards_reversed(on_stages):
        def order(s, p, m):
            ops = gpipe_order(s, p, m)
            return ops[:m] + (ops[m:][::-1] if s in on_stages else ops[m:])
        return order
    with pytest.raises(ValueError, match="stage 0's receive no. 1 from stage 1 expects B.3.'s "
                       "gradient, but stage 1's send no. 1 to stage 0 carries B.0.'s gradient"):
        simulate_schedule(backwards_reversed({0}), p, 4)
    everywhere = backwards_reversed(range(p))      # every stage reversed: the orders match
    assert len(simulate_schedule(everywhere, p, 4)) == 2 * p * 4


class _Inputs(nn.Module):
    """A float64 linear layer that keeps every input it computes on, in order."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.linear, self.seen = nn.Linear(4, 4, dtype=torch.float64), []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return self.linear(x)


def receive_out_of_order(m: int) -> dict:
    """Runs in every rank: the forwards of m micro-batches driven by hand (no schedule, so no
    check), stage 1 taking micro-batches 1 and 2 the other way round, the others in order.
    Returns the micro-batches in the order run, the input each computed on and its output."""
    rank, p = dist.get_rank(), dist.get_world_size()
    order = list(range(m))
    if rank == 1:
        order[1], order[2] = order[2], order[1]
    layer = _Inputs(rank)
    stage = PipelineStage(layer, rank, p)
    X = torch.randn(m, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    outputs = [stage.forward_one(i, X[i] if rank == 0 else None).detach() for i in order]
    stage.wait_sends()
    return {"order": order, "inputs": layer.seen, "outputs": outputs}


def run_swapped_schedule(m: int) -> dict:
    """Runs in every rank: one step of ``ScheduleSwapped``; the error it raised, how long it
    took, and the warnings seen."""
    _, stage = W._this_ranks_stage("mlp", None)
    sched = ScheduleSwapped(stage, m, loss_fn=F.cross_entropy)
    X, y = _batch(2 * m, (7,), 3)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            W._run_step(sched, stage, X, y)
            error = None
        except ValueError as e:
            error = str(e)
    return {"error": error, "seconds": time.perf_counter() - start,
            "warnings": [str(w.message) for w in seen]}


@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_messages_pair_up_in_posting_order_and_a_misordered_schedule_fails(p):
    m = 4
    cases = [(kind, n, None) for kind in ("gpipe", "1f1b") for n in (1, 4)]
    ranks = launch(W.in_sequence, p, [
        (receive_out_of_order, m),
        (run_swapped_schedule, m),
        (W.check_pipeline, [("mlp", *case) for case in cases], {"mlp": _batch(12, (7,), 3)}),
    ], timeout=60)
    by_hand, swapped, oracle = zip(*ranks)
    # by hand, no check: the k-th receive of a link gets the k-th send, whatever its micro-batch
    # (gloo now pairs them as NCCL does), so stage 1 runs F(2) on F(1)'s activation
    for s in range(1, p):
        sender, receiver = by_hand[s - 1], by_hand[s]
        assert len(receiver["inputs"]) == len(sender["outputs"]) == m
        for k in range(m):
            assert torch.equal(receiver["inputs"][k], sender["outputs"][k]), (s, k)
        assert receiver["order"][1] != sender["order"][1]
        meant = sender["outputs"][sender["order"].index(receiver["order"][1])]
        assert not torch.equal(receiver["inputs"][1], meant)   # visibly the wrong activation
    assert by_hand[0]["order"] == [0, 1, 2, 3] and by_hand[1]["order"] == [0, 2, 1, 3]
    # through step: refused on every rank at once, before any message, saying what pairs wrong
    for rank in swapped:
        assert rank["error"] is not None and rank["seconds"] < 10 and rank["warnings"] == []
        assert rank["error"].startswith(f"ScheduleSwapped with {m} micro-batches on {p} stages "
                                        "cannot run: messages out of order: "), rank["error"]
        assert (f"stage {p - 1}'s receive no. 3 from stage {p - 2} expects F(2)'s activation"
                in rank["error"])
    # the course's schedules still equal one process on the whole batch (asserted in workers)
    for rank in oracle:
        assert [r["case"][1:] for r in rank] == [case[:2] for case in cases]
        assert all(r["grad_diff"] < 1e-5 and r["weight_diff"] < 1e-5 for r in rank)


def different_programs(m: int) -> dict:
    """Runs in every rank: steps in which the ranks disagree (the schedule; the number of
    micro-batches; the order of a schedule of one name), then one in which they agree. Each
    disagreement's error on this rank, how long it took, and the warnings seen."""
    rank, p = dist.get_rank(), dist.get_world_size()
    stages, stage = W._this_ranks_stage("mlp", None)
    tunable = ScheduleTunable(stage, m, loss_fn=F.cross_entropy)
    tunable.reverse_backwards = rank == 0
    scheds = {"schedule": (Schedule1F1B if rank == 1 else ScheduleGPipe)(stage, m,
                                                                           F.cross_entropy),
              "microbatches": ScheduleGPipe(stage, m // 2 if rank == p - 1 else m,
                                            F.cross_entropy),
              "order": tunable}
    X, y = _batch(2 * m, (7,), 3)
    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for case, sched in scheds.items():
            start = time.perf_counter()
            try:
                W._run_step(sched, stage, X, y)
                out[case] = None
            except RuntimeError as e:
                out[case] = (str(e), time.perf_counter() - start)
        tunable.reverse_backwards = True                    # now every rank runs the same
        W._run_step(tunable, stage, X, y)
    out["warnings"] = [str(w.message) for w in seen]
    out["grads"] = all(q.grad is not None for q in stages[rank].parameters())
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_ranks_running_different_programs_fail_fast_on_every_rank(p):
    m = 4
    ranks = launch(different_programs, p, m, timeout=60)
    others = ", ".join(map(str, range(2, p)))
    want = {
        "schedule": ("rank 0 runs ScheduleGPipe with 4 micro-batches on 2 stages; rank 1 runs "
                     "Schedule1F1B with 4 micro-batches on 2 stages") if p == 2 else
                    (f"ranks 0, {others} run ScheduleGPipe with 4 micro-batches on {p} stages; "
                     f"rank 1 runs Schedule1F1B with 4 micro-batches on {p} stages"),
        "microbatches": (f"{'rank 0 runs' if p == 2 else 'ranks 0, 1 run'} ScheduleGPipe with 4 "
                         f"micro-batches on {p} stages; rank {p - 1} runs ScheduleGPipe with 2 "
                         f"micro-batches on {p} stages"),
    }
    for rank, out in enumerate(ranks):
        for case in ("schedule", "microbatches", "order"):
            error, seconds = out[case]
            assert seconds < 10, (case, seconds)       # not the process group's timeout
            assert error.startswith("the pipeline's ranks run different programs: "), error
            assert f"(this is rank {rank})" in error
            if case in want:
                assert want[case] in error, error
        digests = re.findall(r"ScheduleTunable \(order digest ([0-9a-f]{8})\) with 4 "
                             f"micro-batches on {p} stages", out["order"][0])
        assert len(digests) == 2 and digests[0] != digests[1], out["order"][0]
        assert f"rank 0 runs ScheduleTunable (order digest {digests[0]})" in out["order"][0]
        assert out["warnings"] == [] and out["grads"]          # the same program: it ran


def test_pipeline_timeline_drawing():
    import matplotlib

    matplotlib.use("agg")
    from course_lib.plots import draw_pipeline_timeline

    fig = draw_pipeline_timeline(simulate_schedule(one_f_one_b_order, 3, 4), unit="steps",
                                 title="1F1B")
    assert len(fig.axes[0].patches) == 3 * 4 * 2


def test_a_called_difference_says_whether_it_is_in_computing_or_in_waiting(capsys):
    """GPipe's steps at m = 2 wait on slow hand-offs, 1F1B's do not; the ops take as long in
    both: the verdict "1F1B faster" must say busy 1.00 and idle below 1."""
    jitter = (0.97, 0.98, 0.99, 1.0, 1.01, 1.02)
    runs = {}
    for name, order in (("gpipe", gpipe_order), ("1f1b", one_f_one_b_order)):
        for m, comm in ((1, 0.0), (2, 0.5 if name == "gpipe" else 0.0)):
            runs[name, m] = [list(simulate_schedule(order, 2, m, forward_time=k,
                                                    backward_time=2 * k, comm_time=comm * k))
                             for k in jitter]
    W.compare_to_control(runs, (1, 2))
    line = capsys.readouterr().out.splitlines()[-1]
    assert "1F1B faster" in line and "busy 1.00, idle 0." in line, line
    # no difference called: no busy / idle part
    W.compare_to_control(_fake_runs(), (1, 2))
    assert "busy" not in capsys.readouterr().out
