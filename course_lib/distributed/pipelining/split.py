"""Cut an ``nn.Sequential`` into consecutive stages, balanced by parameter count or measured time.

PyTorch counterpart: ``torch.distributed.pipelining.pipeline`` with ``SplitPoint`` (which traces
any model), and torchgpipe's ``balance_by_size`` / ``balance_by_time`` (which this follows: a
model that is a sequence of layers, cut into contiguous groups). Read more: Huang et al., "GPipe"
(2019), and https://pytorch.org/docs/stable/distributed.pipelining.html. Lesson 12.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ...timing import benchmark

__all__ = ["balance_stages", "flatten_sequential", "layer_costs", "split_sequential",
           "stage_costs"]


def _check_sequential(model: nn.Module, who: str) -> None:
    """Raise TypeError unless ``model`` is an ``nn.Sequential`` with at least one layer."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"{who} expects an nn.Sequential (its layers are cut in order), got "
                        f"{type(model).__name__}. Write the model as nn.Sequential(layer1, "
                        "layer2, ...), or pass its layers: nn.Sequential(*model.children()) "
                        "when forward() just calls them in order.")
    if len(model) == 0:
        raise ValueError(f"{who} expects an nn.Sequential with at least one layer, got an "
                         "empty one.")


def flatten_sequential(model: nn.Sequential) -> nn.Sequential:
    """One flat ``nn.Sequential``: every nested ``nn.Sequential`` replaced by its layers.

    The layers are shared, not copied: ResNet-18's 9 children (stem conv, batch norm, ReLU, four
    stages of two residual blocks, pool, head) become 14 layers a split can cut between: 3, the
    8 residual blocks, the pool, and the head's flatten and linear layer.
    """
    _check_sequential(model, "flatten_sequential")
    layers: list[nn.Module] = []

    def add(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):
            for child in module:
                add(child)
        else:
            layers.append(module)

    add(model)
    return nn.Sequential(*layers)


def layer_costs(model: nn.Sequential, by: str = "params", example: torch.Tensor | None = None,
                *, repeat: int = 5) -> list[float]:
    """The cost of each layer: its parameter count, or its measured forward + backward time.

    Args:
        model: the layers, in order.
        by: ``"params"`` (elements of its parameters; a layer without any costs 0) or
            ``"time"``: each layer timed as a stage of its own, by ``stage_costs(model,
            [1] * len(model), example)``, so that layer and stage times are measured the same
            way (the first layer's input does not require grad, every later layer's does).
        example: a batch of inputs for the first layer (needed for ``by="time"``).
        repeat: timed calls per layer (``by="time"``).

    Returns:
        One number per layer.
    """
    _check_sequential(model, "layer_costs")
    if by == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if by != "time":
        raise ValueError(f"layer_costs expects by='params' or by='time', got by={by!r}.")
    if not isinstance(example, torch.Tensor):
        raise ValueError("layer_costs(by='time') measures each layer on real inputs: pass "
                         "example=a batch of inputs for the first layer (found "
                         f"{type(example).__name__}).")
    return stage_costs(model, [1] * len(model), example, repeat=repeat)  # each layer a stage


def stage_costs(model: nn.Sequential, balance: Sequence[int], example: torch.Tensor, *,
                repeat: int = 5) -> list[float]:
    """Each stage's measured forward + backward time, every stage timed as one piece.

    Times the stages of a given split as the pipeline runs them: stage 0 on ``example``
    without input gradient, every later stage on the previous stage's output with one, each
    backward from a gradient of ones of its output's shape (on a copy of the model, so its
    gradients and batch-norm statistics stay untouched); one untimed call first. Per-layer
    times (``layer_costs(by="time")``) are this with one layer per stage. On a CPU, call
    ``course_lib.timing.keep_freed_memory()`` first: otherwise a call may page-fault its
    fresh tensors in from the OS, or not, depending on what ran before.

    Args:
        model: the layers, in order.
        balance: layers per stage (as for ``split_sequential``).
        example: a batch of inputs for the first layer.
        repeat: timed calls per stage (median).

    Returns:
        One median time in seconds per stage.
    """
    _check_sequential(model, "stage_costs")
    if not isinstance(example, torch.Tensor):
        raise ValueError("stage_costs measures each stage on real inputs: pass example=a batch "
                         f"of inputs for the first layer (found {type(example).__name__}).")
    stages = split_sequential(copy.deepcopy(model), balance=balance)
    costs, X = [], example
    for k, stage in enumerate(stages):
        X_in = X.detach().requires_grad_(k > 0 and X.is_floating_point())
        with torch.no_grad():
            out = stage(X_in)
        grad = torch.ones_like(out)

        def fwd_bwd(stage=stage, X_in=X_in, grad=grad) -> None:
            X_in.grad = None   # a fresh input each call, as in a pipeline: no accumulation
            y = stage(X_in)
            if y.requires_grad:
                y.backward(grad)

        costs.append(benchmark(fwd_bwd, warmup=1, repeat=repeat, device=X.device).median)
        X = out
    return costs


def _partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage: contiguous groups of >= 1 layer whose largest total cost is smallest."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest stage cost for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # stage k holds layers j .. i-1
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balance_stages(model: nn.Sequential, num_stages: int, by: str = "params",
                   example: torch.Tensor | None = None, *, repeat: int = 5) -> list[int]:
    """How many consecutive layers each of ``num_stages`` stages gets, balancing a cost.

    The split minimises the largest stage's total cost (``layer_costs``): by parameter count
    (memory per device) or by measured time (the slowest stage sets a pipeline's pace).

    Args:
        model: an ``nn.Sequential``.
        num_stages: stages wanted (between 1 and the number of layers).
        by: ``"params"`` or ``"time"`` (needs ``example``).
        example: a batch of inputs for the first layer, for ``by="time"``.
        repeat: timed calls per layer, for ``by="time"``.

    Returns:
        A list of ``num_stages`` positive layer counts that sums to ``len(model)``.
    """
    _check_sequential(model, "balance_stages")
    _check_num_stages(model, num_stages, "balance_stages")
    return _partition(layer_costs(model, by, example, repeat=repeat), num_stages)


def _check_num_stages(model: nn.Sequential, num_stages: int, who: str) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"{who} expects an integer num_stages >= 1, got {num_stages!r}.")
    if num_stages > len(model):
        raise ValueError(f"{who}: cannot cut {len(model)} layer(s) into {num_stages} stages "
                         "(every stage needs at least one layer). Use at most "
                         f"{len(model)} stages, or flatten nested blocks first "
                         "(flatten_sequential) to get more layers to cut between.")


def split_sequential(model: nn.Sequential, num_stages: int | None = None, *,
                     balance: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive stages: stage i runs layers ``sum(balance[:i])`` onward.

    The stages share the model's layers (nothing is copied): running them one after the other
    is the model's forward.

    Args:
        model: an ``nn.Sequential``.
        num_stages: how many stages; the layer counts then come from
            ``balance_stages(model, num_stages)`` (by parameter count).
        balance: the layer count of each stage, instead of ``num_stages``; must be positive and
            sum to ``len(model)``.

    Returns:
        A list of ``nn.Sequential`` stages.
    """
    _check_sequential(model, "split_sequential")
    if balance is None:
        if num_stages is None:
            raise ValueError("split_sequential needs num_stages or balance (the layer count of "
                             "each stage); got neither.")
        _check_num_stages(model, num_stages, "split_sequential")
        balance = balance_stages(model, num_stages)
    balance = list(balance)
    if num_stages is not None and len(balance) != num_stages:
        raise ValueError(f"split_sequential: num_stages={num_stages} but balance has "
                         f"{len(balance)} entries ({balance}); give one layer count per stage.")
    if not balance or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                          for b in balance):
        raise ValueError(f"split_sequential expects a balance of positive integer layer "
                         f"counts, one per stage, got {balance}.")
    if sum(balance) != len(model):
        raise ValueError(f"split_sequential: the balance {balance} sums to {sum(balance)} but "
                         f"the model has {len(model)} layers. Give counts that sum to "
                         f"{len(model)}, or let balance_stages(model, {len(balance)}) choose.")
    stages, start = [], 0
    for count in balance:
        stages.append(model[start:start + count])  # an nn.Sequential sharing the layers
        start += count
    return stages
