"""Model and pipeline parallelism (lesson 12): splits, one-process model parallelism, schedules,
and the pipeline across gloo processes against its oracle (one process, the whole model, the
whole batch: gradients and the weights after an SGD step)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.checks.lesson12 import max_in_flight
from course_lib.devices import devices
from course_lib.distributed import launch
from course_lib.distributed.pipelining import (
    ActivationMeter,
    ModelParallel,
    PipelineStage,
    balance_stages,
    bubble_fraction,
    flatten_sequential,
    gpipe_order,
    idle_fraction,
    layer_costs,
    one_f_one_b_order,
    simulate_schedule,
    split_microbatches,
    split_sequential,
)
from course_lib.examples import pipeline_workers as W
from course_lib.models.lenet import LeNet
from course_lib.models.resnet import resnet18


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
])
def test_pipeline_bad_splits_are_refused_clearly(call, error, says):
    with pytest.raises(error) as info:
        call()
    assert says in str(info.value)


def test_pipeline_model_parallel_in_one_process_equals_the_whole_model():
    net, oracle = W.sequential_model("mlp"), W.sequential_model("mlp")
    X, y = _batch(6, (7,), 3)
    mp = ModelParallel(net, devices(3, warn=False), balance=[2, 4, 1])
    assert [len(s) for s in mp.stages] == [2, 4, 1]
    out = mp(X)
    torch.testing.assert_close(out, oracle(X))
    F.cross_entropy(out, y).backward()
    F.cross_entropy(oracle(X), y).backward()
    torch.testing.assert_close([p.grad for p in net.parameters()],
                               [p.grad for p in oracle.parameters()])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_pipeline_schedules_bubble_and_activations_in_flight(p):
    for m in (1, 2, 3, 8):
        for order in (gpipe_order, one_f_one_b_order):
            events = simulate_schedule(order, p, m, forward_time=1, backward_time=1)
            assert idle_fraction(events) == pytest.approx(bubble_fraction(p, m))
        for s in range(p):
            held = max_in_flight(one_f_one_b_order(s, p, m))
            assert held == min(p - s, m) and max_in_flight(gpipe_order(s, p, m)) == m


def test_pipeline_simulation_finds_a_deadlock():
    backwards_first = lambda s, p, m: one_f_one_b_order(p - 1 - s, p, m)  # warm-up reversed
    with pytest.raises(ValueError, match="deadlock: stage 0 waits"):
        simulate_schedule(backwards_first, 2, 4)


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
        (W.activation_peaks, X16, y16, (1, 4), ("gpipe", "1f1b"), None, "mlp"),
    ], timeout=120)
    results, seed, peaks = zip(*ranks)                   # each: rank 0's, rank 1's
    for rank in results:      # every rank asserted; here the sizes of what it found
        assert all(r["grad_diff"] < 1e-5 and r["weight_diff"] < 1e-5 for r in rank)
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


def test_pipeline_gradient_oracle_three_ranks_gloo():
    cases = [("mlp", "1f1b", 1, None), ("mlp", "1f1b", 3, [2, 2, 3]), ("mlp", "gpipe", 6, None),
             ("mlp", "1f1b", 6, [1, 1, 5])]
    results = launch(W.check_pipeline, 3, cases, {"mlp": _batch(12, (7,), 3)}, timeout=120)
    assert [r["balance"] for r in results[0]] == [[1, 2, 4], [2, 2, 3], [1, 2, 4], [1, 1, 5]]


def test_pipeline_timeline_drawing():
    import matplotlib

    matplotlib.use("agg")
    from course_lib.plots import draw_pipeline_timeline

    fig = draw_pipeline_timeline(simulate_schedule(one_f_one_b_order, 3, 4), unit="steps",
                                 title="1F1B")
    assert len(fig.axes[0].patches) == 3 * 4 * 2
