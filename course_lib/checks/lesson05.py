"""Checkers for the exercises of lesson 05 (nn.DataParallel)."""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from ..devices import cpu_threads, devices
from ._core import ExerciseResult, call_or_failure, check_answer, refused, unanswered, verdict
from .harness import keeps_kernel_state

__all__ = ["check_bn_examples_seen", "check_data_parallel_fn", "check_module_calls"]

def check_bn_examples_seen(answer: int | None, batch: int = 7, n: int = 3, *,
                           strict: bool = False) -> ExerciseResult:
    """Exercise 05: examples a batch-norm layer's running statistics see in one train-mode
    forward of ``batch`` examples through ``DataParallel`` over n devices (replica 0's shard)."""
    seen = torch.chunk(torch.zeros(batch), n)[0].shape[0]
    return check_answer("BN examples seen", answer, seen,
                        hint="only replica 0 shares the module's buffers; torch.chunk gives its "
                        "shard.", strict=strict)


def check_module_calls(answer: int | None, batch: int = 1, n: int = 2, *,
                       strict: bool = False) -> ExerciseResult:
    """Exercise 05: calls of the module by ``DataParallel(net, devices(n))`` on a batch of
    ``batch`` examples, counted with a forward hook."""
    from ..models.lenet import LeNet
    from ..parallel.data_parallel import DataParallel

    devs = devices(n, warn=False)
    net = LeNet().to(devs[0])
    calls: list[int] = []
    net.register_forward_hook(lambda module, inputs, output: calls.append(1))
    with torch.no_grad():
        DataParallel(net, devs)(torch.rand(batch, 1, 28, 28, device=devs[0]))
    return check_answer("module calls", answer, len(calls),
                        hint="scatter cannot split one example over two devices.", strict=strict)


# ---- exercise: data_parallel(module, X, devices), the four parts as a function ---------------

_DP_NAME = "data_parallel"
#: The first failing check's hint: the idea, not the calls.
_DP_HINT = ("every shard needs its own copy of the module, one that autograd links back to the "
            "module's parameters, run in its own thread; the shards, not the devices, decide "
            "how many copies there are.")
#: From the second failing check on (in one kernel) the hint adds the recipe.
_DP_RECIPE = ("In order: scatter X over the devices, replicate the module onto "
              "devices[:len(shards)], parallel_apply the replicas to the shards, and gather the "
              "outputs onto devices[0].")
_dp_failures = 0   # failing checks so far in this kernel: the first one gets only _DP_HINT
#: (devices, batch size): 1 to 4 devices, batches they do not divide, and 3 examples over 4
#: devices (torch.chunk makes 3 shards).
_DP_CASES = ((1, 5), (2, 6), (2, 7), (3, 10), (4, 10), (4, 3))


def _dp_model(seed: int) -> nn.Module:
    """A small conv net without batch norm, float64: conv 1 -> 3 on 6x6, linear 48 -> 4."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(48, 4)).double()


def _dp_case(fn: Callable, k: int, B: int, seed: int) -> str | None:
    """``fn`` on one case; what differs from the plain module on the whole batch, or None."""
    devs = devices(k, warn=False)
    net, oracle = _dp_model(seed), _dp_model(seed)
    net.to(devs[0])
    calls: list[tuple[int, nn.Module, threading.Thread]] = []  # batch size, caller, its thread

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        calls.append((inputs[0].shape[0], module, threading.current_thread()))

    net.register_forward_hook(hook)   # replicas share the module's hooks: it fires on each
    X = torch.rand(B, 1, 6, 6, dtype=torch.float64,
                   generator=torch.Generator().manual_seed(seed + B))   # (B, 1, 6, 6)
    want = oracle(X)                                                       # (B, 4), one device
    want.square().sum().backward()
    shards = sorted(len(c) for c in torch.chunk(torch.zeros(B), k))
    where = f"{k} device(s), batch of {B}"
    got, error = call_or_failure(fn, net, X.to(devs[0]), devs,
                                 reraise=NotImplementedError)  # the scaffold: not answered
    if error is not None:
        return f"{where}: {error.rstrip('.')}."
    if not torch.is_tensor(got):
        return (f"{where}: expected one tensor of shape {tuple(want.shape)} on {devs[0]}, "
                f"received {type(got).__name__}" + (" (gather the outputs into one tensor)."
                                                    if isinstance(got, (list, tuple)) else "."))
    if tuple(got.shape) != tuple(want.shape):
        return (f"{where}: expected output shape {tuple(want.shape)}, received "
                f"{tuple(got.shape)}; the shards were {shards} examples: every example must "
                "be computed once, the last short shard too.")
    if got.device != devs[0]:
        return f"{where}: the output is on {got.device}; gather it onto devices[0] = {devs[0]}."
    if (sizes := sorted(size for size, _, _ in calls)) != shards:
        return (f"{where}: the module's copies were called on batches of {sizes}; "
                f"expected one call per shard, {shards} (torch.chunk sizes).")
    if len(shards) > 1 and (problem := _replicas_in_threads(calls, net, len(shards))):
        return f"{where}: {problem}"
    if not torch.allclose(got.detach().cpu(), want.detach(), rtol=1e-9, atol=1e-12):
        return f"{where}: the output differs from the module applied to the whole batch."
    if got.grad_fn is None:
        return (f"{where}: the output has no autograd history: the gradients cannot reach the "
                "module's parameters (use replicate, which makes differentiable copies).")
    got.square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), oracle.parameters()):
        if p.grad is None:
            return (f"{where}: after backward, the module's {name}.grad is None: the copies "
                    "were detached from the module's parameters (deepcopy or detach); "
                    "replicate makes copies whose gradients flow back.")
        if not torch.allclose(p.grad.cpu(), q.grad, rtol=1e-9, atol=1e-12):
            return (f"{where}: after backward, the module's {name}.grad differs from the "
                    "gradient of the plain module on the whole batch.")
    return None


def _replicas_in_threads(calls: list[tuple[int, nn.Module, threading.Thread]], net: nn.Module,
                         n_shards: int) -> str | None:
    """With several shards: each ran on its own replica (not the module), in its own thread."""
    if any(module is net for _, module, _ in calls):
        return ("the module itself was called on a shard; DataParallel calls one copy per "
                "shard, so that each device holds its own copy of the weights.")
    if len({id(module) for _, module, _ in calls}) < n_shards:
        return "one copy of the module ran several shards; replicate makes one copy per shard."
    # The Thread objects stay referenced in ``calls``, so distinct threads are distinct objects.
    if len({id(thread) for _, _, thread in calls}) < n_shards:
        return ("the replicas ran one after another in one thread; parallel_apply runs each "
                "replica in its own thread, so that the devices work at the same time.")
    return None


@keeps_kernel_state
def check_data_parallel_fn(fn: Callable | None, *,
                           cases: tuple[tuple[int, int], ...] = _DP_CASES,
                           strict: bool = False) -> ExerciseResult:
    """Exercise 05: ``fn(module, X, devices)`` is ``nn.parallel.data_parallel`` for one input.

    For each case (1 to 4 devices, batch sizes they do not divide, a batch smaller than the
    device count) the module must be called once per ``torch.chunk`` shard (a forward hook
    counts); with several shards each call must be made by its own replica (not the module
    itself) in its own thread (``replicate`` and ``parallel_apply``); the output must equal
    the plain module on the whole batch, on ``devices[0]``, and one backward through it must
    leave on the module's parameters the whole batch's gradient.
    The oracle is the plain module on one device (a small float64 conv net, no batch norm).
    ``fn`` None, or still raising ``NotImplementedError``, is not answered yet. The first failing
    check's hint gives the idea; later ones (in the same kernel) add the order of the calls.
    ``cases`` are ``(number of devices, batch size)`` pairs; ``strict`` raises
    ``AssertionError`` on a wrong answer. Returns the verdict (truthy when right); the first
    failing case is printed.
    """
    global _dp_failures
    missing = "define data_parallel(module, X, devices) and pass it here."
    if (refusal := refused(_DP_NAME, fn, missing, strict)) is not None:
        return refusal
    try:
        with cpu_threads(1):  # tiny tensors: one intra-op thread is faster, and never stalls
            problem = next((p for seed, (k, B) in enumerate(cases)
                            if (p := _dp_case(fn, k, B, seed)) is not None), None)
    except NotImplementedError:
        return unanswered(_DP_NAME, strict)
    if problem is not None:
        _dp_failures += 1
        hint = _DP_HINT if _dp_failures == 1 else f"{_DP_HINT} {_DP_RECIPE}"
        return verdict(_DP_NAME, False, f"{problem} Hint: {hint}", strict)
    return verdict(_DP_NAME, True, "outputs and gradients equal the plain module's on the whole "
                   f"batch for (devices, batch) in {list(cases)}.", strict)
