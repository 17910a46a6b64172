"""Count the bytes that autograd keeps for backward: the activation memory of a pipeline stage.

PyTorch counterpart: ``torch.autograd.graph.saved_tensors_hooks`` (used here to watch, not to
change, what is saved) and, on a GPU, ``torch.cuda.max_memory_allocated``. On a CPU there is no
allocator statistic to read, so the meter counts the storage of every tensor saved for backward
while it is alive (each tensor once, parameters excluded), and whatever else it is told is held
(a pipeline stage's buffers waiting to be sent). Read more:
https://pytorch.org/tutorials/intermediate/autograd_saved_tensors_hooks_tutorial.html. Lesson 12.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["ActivationMeter"]


class _Saved:
    """A saved tensor, wrapped: tells the meter when autograd lets go of it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: tuple):
        self.tensor, self.meter, self.key = tensor, meter, key
        meter._hold(key, tensor.nbytes, saved=True)

    def __del__(self) -> None:
        self.meter._release(self.key, saved=True)


def _key(t: torch.Tensor) -> tuple:
    """Which bytes ``t`` holds: (address, elements, element size); views of them differ."""
    return (t.data_ptr(), t.numel(), t.element_size())


class ActivationMeter:
    """Inside ``with ActivationMeter(exclude=model.parameters()) as meter:``, ``meter.alive``
    is the number of bytes of tensors saved for backward that are still held, and
    ``meter.peak`` the largest it has been.

    A tensor saved by several operations (a ReLU's output, saved by the ReLU and by the next
    layer) counts once; a view counts its own bytes (a micro-batch of a batch, not the batch);
    parameters (``exclude``) do not count: they are not activations. Tensors held for another
    reason, such as a pipeline stage's buffers waiting to be sent, count too between ``hold``
    and ``release`` (once, if autograd saved them as well); ``saved_peak`` is the peak of the
    tensors saved for backward alone.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        # (address, numel, size) -> [references by autograd, other references, bytes]
        self._held: dict[tuple, list[int]] = {}
        self.alive, self.peak = 0, 0
        self.saved_alive, self.saved_peak = 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in self._excluded:
            return t  # a parameter (or a view of one): not an activation
        return _Saved(t, self, _key(t))

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _hold(self, key: tuple, nbytes: int, saved: bool) -> None:
        entry = self._held.setdefault(key, [0, 0, nbytes])
        if entry[0] + entry[1] == 0:
            self.alive += nbytes
            self.peak = max(self.peak, self.alive)
        if saved and entry[0] == 0:
            self.saved_alive += nbytes
            self.saved_peak = max(self.saved_peak, self.saved_alive)
        entry[0 if saved else 1] += 1

    def _release(self, key: tuple, saved: bool) -> None:
        entry = self._held[key]
        entry[0 if saved else 1] -= 1
        if saved and entry[0] == 0:
            self.saved_alive -= entry[2]
        if entry[0] + entry[1] == 0:
            self.alive -= entry[2]
            del self._held[key]

    def hold(self, t: torch.Tensor) -> None:
        """Count ``t``'s bytes as held (outside autograd) until ``release(t)``."""
        self._hold(_key(t), t.nbytes, saved=False)

    def release(self, t: torch.Tensor) -> None:
        """``t``, counted by ``hold``, is let go."""
        self._release(_key(t), saved=False)

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
