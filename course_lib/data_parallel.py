"""``nn.DataParallel`` rebuilt from its four parts: scatter, replicate, parallel_apply, gather.

PyTorch counterpart: ``torch.nn.DataParallel`` and ``torch.nn.parallel.replicate``,
``parallel_apply`` and ``gather`` (read ``torch/nn/parallel/data_parallel.py``: its ``forward``
is the same four lines as ``DataParallel.forward`` below). Source: d2l's "Concise
Implementation for Multiple GPUs" chapter. ``scatter`` comes from ``course_lib.comm``.

Unlike torch's, every part also works on a CPU-only machine with *logical* devices
(``course_lib.devices.devices(2)`` is ``[cpu, cpu]``): the batch is really split and each replica
runs in its own thread. That proves correctness, not speed: both "devices" share the same cores.

How the replicas relate to the module (the same rules as torch's ``replicate``):

- Parameters: replica j's parameters are differentiable copies of the module's (replica 0 on the
  module's own device holds views of them, the others real copies), so ``backward`` through the
  replicas sums every replica's gradient into the module's ``.grad``. For a model without
  batch norm (or in ``eval()`` mode) the gradients equal those of the plain module on the whole
  batch.
- Buffers (batch-norm running statistics): copied without gradient. Replica 0 on the module's own
  device holds the module's very buffer tensors, so its in-place updates land on the module; the
  other replicas update copies that are thrown away after the step.

Two consequences, as with ``nn.DataParallel``: in ``train()`` mode each replica's batch norm
normalizes with the mean and variance of *its own shard*, so the outputs and gradients differ
from the plain module on the whole batch (``nn.SyncBatchNorm`` is the fix, in the multi-process
lessons); and the running statistics track only the shard of replica 0.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .bench import Timer
from .comm import gather as gather_tensors
from .comm import scatter
from .devices import synchronize, try_all_gpus
from .plots import TrainingPlot
from .train import evaluate_accuracy

__all__ = [
    "DataParallel",
    "gather",
    "parallel_apply",
    "recalibrate_batch_norm",
    "replicate",
    "scatter_inputs",
    "step_breakdown",
    "train_module",
]

Device = torch.device | str | int


def _as_device(d: Device) -> torch.device:
    """An int means a GPU index (as in ``nn.DataParallel(device_ids=[0, 1])``)."""
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cuda", d)
    return torch.device(d)


# --- replicate -------------------------------------------------------------------------------

def _copy_param(p: torch.Tensor, j: int, device: torch.device) -> torch.Tensor:
    """Replica j's copy of parameter ``p``: differentiable, so gradients flow back to ``p``."""
    if j == 0 and device == p.device:
        return p.view_as(p)                 # no copy: a view of the module's own parameter
    return p.to(device, copy=True)          # a real copy, even on a repeated (logical) device


def _copy_buffer(b: torch.Tensor, j: int, device: torch.device) -> torch.Tensor:
    """Replica j's copy of buffer ``b``: replica 0 on ``b``'s device shares it, others copy."""
    if j == 0 and device == b.device:
        return b                            # the module's own tensor: updates land on the module
    return b.detach().to(device, copy=True)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing everything but its parameter, buffer and child tables.

    Forward hooks are shared too, so a hook on the module also fires on every replica.
    (``nn.Module._replicate_for_data_parallel`` does the same.)
    """
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = {}                # the copies become plain attributes (not leaves)
    replica._buffers = replica._buffers.copy()
    replica._modules = replica._modules.copy()
    replica._is_replica = True              # torch's flag: zero_grad() on a replica warns
    return replica


def replicate(module: nn.Module, devices: Sequence[Device]) -> list[nn.Module]:
    """One copy of ``module`` per device whose parameters are differentiable copies of its own.

    Backward through any replica accumulates gradients into ``module``'s parameters. Replica 0
    shares the module's parameters (as views) and buffers when ``devices[0]`` is the module's
    device; the other replicas own copies, also when a device is repeated (logical CPU devices).
    See the module docstring for what this means for batch norm.

    Args:
        module: the network to copy (left unchanged).
        devices: one device per replica; ints are GPU indices; repeats allowed.

    Returns:
        ``[replica_0, ..., replica_{k-1}]``, replica j on ``devices[j]``.
    """
    devices = [_as_device(d) for d in devices]
    if not devices:
        raise ValueError("replicate needs at least one device, got an empty list.")
    params = list(module.parameters())       # each shared parameter once
    buffers = list(module.buffers())
    param_copies = {id(p): [_copy_param(p, j, d) for j, d in enumerate(devices)] for p in params}
    buffer_copies = {id(b): [_copy_buffer(b, j, d) for j, d in enumerate(devices)]
                     for b in buffers}

    modules = list(module.modules())          # each shared submodule once, root first
    index = {id(m): i for i, m in enumerate(modules)}
    copies = [[_shallow_copy(m) for m in modules] for _ in devices]  # copies[j][i]
    for i, m in enumerate(modules):
        for j in range(len(devices)):
            replica = copies[j][i]
            for name, child in m._modules.items():
                replica._modules[name] = None if child is None else copies[j][index[id(child)]]
            for name, p in m._parameters.items():
                if p is None:
                    replica._parameters[name] = None
                else:
                    setattr(replica, name, param_copies[id(p)][j])  # a plain tensor attribute
            for name, b in m._buffers.items():
                replica._buffers[name] = None if b is None else buffer_copies[id(b)][j]
    return [copies[j][0] for j in range(len(devices))]


# --- parallel_apply --------------------------------------------------------------------------

def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = _first_tensor(x)
        if t is not None:
            return t
    return None


def parallel_apply(replicas: Sequence[Callable], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict[str, Any]] | None = None) -> list[Any]:
    """``[replicas[i](*inputs[i], **kwargs_tup[i]) for each i]``, one thread per replica.

    Each thread runs with the caller's grad mode (it is per thread in PyTorch) and, for a GPU
    input, with that GPU as the current device. PyTorch releases the GIL inside its kernels, so
    GPUs work at the same time while Python code (module calls, hooks) still runs one thread at
    a time. With one replica there is no thread. An exception in a thread is re-raised here,
    with a note naming the replica.

    Args:
        replicas: callables, usually from ``replicate``.
        inputs: one entry per replica: a tuple of positional arguments, or a single argument.
        kwargs_tup: optional keyword arguments per replica.

    Returns:
        The outputs in replica order.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"parallel_apply got {len(replicas)} replicas but {len(inputs)} "
                         "inputs; pass one input (or tuple of inputs) per replica.")
    if kwargs_tup is None:
        kwargs_tup = [{}] * len(replicas)
    if len(kwargs_tup) != len(replicas):
        raise ValueError(f"parallel_apply got {len(replicas)} replicas but {len(kwargs_tup)} "
                         "kwargs dicts; pass one per replica or none.")
    grad_enabled = torch.is_grad_enabled()
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def worker(i: int) -> None:
        args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
        t = _first_tensor(args)
        try:
            with torch.set_grad_enabled(grad_enabled):
                if t is not None and t.device.type == "cuda":
                    with torch.cuda.device(t.device):
                        results[i] = replicas[i](*args, **kwargs_tup[i])
                else:
                    results[i] = replicas[i](*args, **kwargs_tup[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            e.add_note(f"(raised in replica {i} on {t.device if t is not None else '?'}, "
                       "inside course_lib.data_parallel.parallel_apply)")
            errors[i] = e

    if len(replicas) == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), name=f"replica-{i}")
                   for i in range(len(replicas))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for e in errors:
        if e is not None:
            raise e
    return results


# --- scatter and gather of (nested) arguments and outputs ------------------------------------

def _scatter_obj(obj: Any, devices: list[torch.device]) -> list[Any]:
    """Tensors are split along dim 0; tuples, lists and dicts are split element by element;
    anything else is given to every device. Like torch's ``scatter_gather.scatter``."""
    if isinstance(obj, torch.Tensor):
        return scatter(obj, devices)
    if isinstance(obj, (tuple, list)) and obj:
        return [type(obj)(parts) for parts in zip(*[_scatter_obj(x, devices) for x in obj])]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        return [dict(zip(keys, parts))
                for parts in zip(*[_scatter_obj(obj[k], devices) for k in keys])]
    return [obj] * len(devices)


def scatter_inputs(inputs: tuple, kwargs: dict[str, Any],
                   devices: Sequence[Device]) -> tuple[list[tuple], list[dict[str, Any]]]:
    """Split the positional and keyword arguments of a forward call over ``devices``.

    Every tensor is split along dim 0 (``course_lib.comm.scatter``: sizes of ``torch.chunk``,
    so a small batch may use fewer devices); other values go to every device unchanged.

    Returns:
        ``(inputs_per_device, kwargs_per_device)``, of equal length k <= ``len(devices)``.
    """
    devices = [_as_device(d) for d in devices]
    if not inputs and not kwargs:             # nothing to split: one call on devices[0]
        return [()], [{}]
    ins = _scatter_obj(tuple(inputs), devices) if inputs else []
    kws = _scatter_obj(dict(kwargs), devices) if kwargs else []
    k = min(len(ins) if inputs else len(devices), len(kws) if kwargs else len(devices))
    ins = list(ins[:k]) if inputs else [()] * k
    kws = list(kws[:k]) if kwargs else [{}] * k
    return ins, kws


def gather(outputs: Sequence[Any], device: Device) -> Any:
    """Concatenate the replicas' outputs along dim 0 on ``device`` (differentiable).

    Tensors are concatenated (``course_lib.comm.gather``); tuples, lists and dicts of tensors
    element by element; ``None`` stays ``None``.

    Raises:
        ValueError: for 0-d tensors (e.g. a loss computed inside ``forward``): there is no batch
            dimension to join along. Return per-example values and reduce after the gather.
    """
    device = _as_device(device)
    if not outputs:
        raise ValueError("gather needs the outputs of at least one replica, got none.")
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError("gather joins outputs along dim 0 but got 0-d tensors; return a "
                             "tensor with a batch dimension (e.g. reduction='none') and reduce "
                             "after the gather.")
        return gather_tensors(list(outputs), device)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], device)) for k in first)
    if isinstance(first, (tuple, list)):
        return type(first)(gather(parts, device) for parts in zip(*outputs))
    raise TypeError(f"gather expects tensors or tuples/lists/dicts of tensors, got "
                    f"{type(first).__name__}.")


# --- DataParallel ------------------------------------------------------------------------------

class DataParallel(nn.Module):
    """Split each batch over devices, run a replica of ``module`` on each shard, join the outputs.

    ``forward`` reads like torch's: scatter, replicate, parallel_apply, gather. The module must
    live on ``device_ids[0]``; the output lands there; ``backward`` puts the summed gradients on
    the module's parameters, so an optimizer over ``module.parameters()`` works as usual.

    Differences from ``nn.DataParallel``: devices may be CPUs (also repeated, as logical
    devices), where torch's keeps ``device_ids=[]`` and just calls the module; only dim 0.

    Args:
        module: the network, on ``device_ids[0]``.
        device_ids: devices (ints are GPU indices). Default ``try_all_gpus()``: every GPU, or
            ``[cpu]`` (one device, no split) on a CPU-only machine; pass
            ``course_lib.devices.devices(2)`` to split over two logical CPU devices.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Device] | None = None):
        super().__init__()
        if device_ids is None:
            device_ids = try_all_gpus()
        self.module = module
        self.device_ids = [_as_device(d) for d in device_ids]
        if not self.device_ids:
            raise ValueError("DataParallel needs at least one device; got device_ids=[]. "
                             "Pass e.g. course_lib.devices.devices(2).")
        self.output_device = self.device_ids[0]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_module_device()
        inputs, kwargs_tup = self.scatter(inputs, kwargs, self.device_ids)
        if len(inputs) == 1:                  # one device (or a batch of one): no replicas
            return self.module(*inputs[0], **kwargs_tup[0])
        replicas = self.replicate(self.module, self.device_ids[:len(inputs)])
        outputs = self.parallel_apply(replicas, inputs, kwargs_tup)
        return self.gather(outputs, self.output_device)

    # The four parts, as methods (like torch's) so that a subclass can change one of them.
    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[torch.device]):
        return scatter_inputs(inputs, kwargs, device_ids)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device]) -> list[nn.Module]:
        return replicate(module, device_ids)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                       kwargs_tup: Sequence[dict]) -> list[Any]:
        return parallel_apply(replicas, inputs, kwargs_tup)

    def gather(self, outputs: Sequence[Any], output_device: torch.device) -> Any:
        return gather(outputs, output_device)

    def _check_module_device(self) -> None:
        src = self.device_ids[0]
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if not _same_device(t.device, src):
                raise RuntimeError(
                    f"DataParallel expects the module on device_ids[0] = {src}, but found a "
                    f"parameter or buffer on {t.device}. Move it first: module.to({str(src)!r}).")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 name the same device when cuda:0 is current."""
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None
                                                             else cur)
    return True


# --- training a module (notebook 05) ---------------------------------------------------------

def train_module(net: nn.Module, train_iter: Iterable, test_iter: Iterable, *, num_epochs: int,
                 lr: float, device: Device | None = None, plot: bool | None = None,
                 title: str | None = None) -> dict:
    """Train an ``nn.Module`` (plain, ``DataParallel`` or ``nn.DataParallel``) with SGD.

    The module-based twin of ``course_lib.train.train_single``: cross-entropy, ``torch.optim.SGD``,
    and after each epoch the test accuracy in ``eval()`` mode.

    Args:
        net: the network; its parameters are updated in place.
        train_iter, test_iter: iterables of ``(X, y)`` batches.
        num_epochs, lr: epochs and learning rate.
        device: where batches are moved (for a data-parallel net: ``device_ids[0]``); None:
            where the net's first parameter lives.
        plot: draw the live plot (default: inside a notebook only).

    Returns:
        ``{"train_loss", "train_acc", "test_acc", "epoch_time"}`` lists, one value per epoch;
        ``epoch_time`` counts training only, not the evaluation.
    """
    device = _as_device(device) if device is not None else next(net.parameters()).device
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    live = TrainingPlot(title=title, live=plot)
    history = {"train_loss": [], "train_acc": [], "test_acc": [], "epoch_time": []}
    for epoch in range(1, num_epochs + 1):
        net.train()
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        total = 0
        with Timer() as timer:                # synchronizes every GPU
            for X, y in train_iter:
                X, y = X.to(device), y.to(device)
                opt.zero_grad(set_to_none=True)
                y_hat = net(X)                               # (B, 10) on device
                loss = F.cross_entropy(y_hat, y)             # mean over the whole batch
                loss.backward()
                opt.step()
                loss_sum += loss.detach() * y.numel()        # no sync per step
                correct += (y_hat.argmax(dim=1) == y).sum()
                total += y.numel()
        net.eval()
        test_acc = evaluate_accuracy(net, test_iter, device)
        values = (float(loss_sum) / total, int(correct) / total, test_acc, timer.elapsed)
        for key, v in zip(history, values):
            history[key].append(v)
        live.update(epoch, train_loss=values[0], train_acc=values[1], test_acc=test_acc)
    net.train()
    live.close()
    return history


def recalibrate_batch_norm(net: nn.Module, batches: Iterable, device: Device | None = None
                           ) -> nn.Module:
    """Recompute every batch-norm layer's running statistics with the current weights.

    During training the running mean and variance follow the weights with momentum 0.1, so
    after few steps they still describe earlier weights, and ``eval()`` mode suffers. This runs
    the model over ``batches`` in train mode without gradients, with ``momentum=None`` (the
    cumulative average over the batches), then restores each layer's momentum. Parameters do
    not change. Known as "precise BN" (Wu and Johnson, 2021, "Rethinking batch in BatchNorm").

    Args:
        net: the model (changed in place and returned, left in train mode).
        batches: ``(X, y)`` batches, typically training data.
        device: where to move each X (None: leave it where it is).

    Returns:
        ``net``.
    """
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: every batch weighs the same
    net.train()
    try:
        with torch.no_grad():
            for X, _ in batches:
                net(X if device is None else X.to(device))
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
    return net


def step_breakdown(module: nn.Module, X: torch.Tensor, y: torch.Tensor,
                   devices: Sequence[Device], *, repeat: int = 3) -> dict[str, float]:
    """Median seconds of each phase of one data-parallel training step (no optimizer step).

    Phases: ``scatter``, ``replicate``, ``forward`` (``parallel_apply``), ``gather`` (outputs
    onto ``devices[0]`` and the loss), ``backward`` (through every replica into ``module``).
    GPUs are synchronized around each phase, which removes the overlap a real step would have:
    the sum is an upper bound of the step. The module's gradients are left set.
    """
    devices = [_as_device(d) for d in devices]
    phases = ("scatter", "replicate", "forward", "gather", "backward")
    times: dict[str, list[float]] = {p: [] for p in phases}
    sync_all = lambda: [synchronize(d) for d in set(devices)]  # noqa: E731
    for _ in range(repeat):
        module.zero_grad(set_to_none=True)
        t = Timer()
        sync_all()
        with t:
            X_shards, kw = scatter_inputs((X,), {}, devices)
            y_shards = scatter(y, devices[:len(X_shards)])
            sync_all()
        times["scatter"].append(t.elapsed)
        with t:
            replicas = replicate(module, devices[:len(X_shards)])
            sync_all()
        times["replicate"].append(t.elapsed)
        with t:
            outs = parallel_apply(replicas, X_shards, kw)
            sync_all()
        times["forward"].append(t.elapsed)
        with t:
            y_hat = gather(outs, devices[0])                              # (B, C) on devices[0]
            loss = F.cross_entropy(y_hat, gather(y_shards, devices[0]))
            sync_all()
        times["gather"].append(t.elapsed)
        with t:
            loss.backward()
            sync_all()
        times["backward"].append(t.elapsed)
    return {p: sorted(ts)[len(ts) // 2] for p, ts in times.items()}
