"""The dynamic loss scaler of float16 training, written from scratch.

PyTorch counterpart: ``torch.amp.GradScaler`` (``torch/amp/grad_scaler.py``), whose decisions and
scale this one equals step by step. Read more: Micikevicius et al. (2018), "Mixed Precision
Training", and lesson 15.

float16 cannot hold gradients below about 6e-8: they flush to zero. So the loss is multiplied by a
large scale S before backward (every gradient is then S times too large, and representable), and
the gradients are divided by S before the optimizer uses them (``unscale_``; call it yourself
before clipping). If any gradient came out inf or NaN the scale was too large: the step is skipped
and S shrinks (``backoff_factor``). After ``growth_interval`` steps in a row without overflow,
S grows (``growth_factor``), to find again the largest scale that fits.
"""
from __future__ import annotations

import torch

from ._checks import check_factors, check_stage, check_state_dict

__all__ = ["GradScaler"]

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"


class GradScaler:
    """``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``.

    The scale is a float32 tensor on the device of the first loss scaled, as in torch.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        check_factors(init_scale, growth_factor, backoff_factor, growth_interval)
        self._init_scale, self._growth_factor = float(init_scale), float(growth_factor)
        self._backoff_factor, self._growth_interval = float(backoff_factor), growth_interval
        self._enabled = enabled
        self._scale: torch.Tensor | None = None   # created by the first scale()
        self._growth_tracker = 0                  # good steps in a row since the last change
        self._per_optimizer: dict[int, dict] = {}

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs):
        """``outputs`` (a tensor, or an iterable of them) times the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._scale = torch.full((), self._init_scale, dtype=torch.float32,
                                         device=outputs.device)
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        return map(self.scale, outputs)

    def _state(self, optimizer) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": READY, "found_inf": None})

    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and note whether any is inf
        or NaN. At most once per optimizer between two ``update``s (``step`` calls it if you
        did not)."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        check_stage(state["stage"], "unscale_", self._scale)
        inv_scale = self._scale.double().reciprocal().float()    # as torch: 1/S in float64
        found_inf = None
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if found_inf is None:
                    found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
                if p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients: keep the master "
                                     "weights (the parameters the optimizer holds) in float32 "
                                     "and compute in float16 under torch.autocast.")
                if not torch.isfinite(p.grad).all():             # checked before dividing
                    found_inf.fill_(1.0)
                p.grad.mul_(inv_scale.to(p.grad.device))
        state["found_inf"], state["stage"] = found_inf, UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` on unscaled gradients, unless one of them is inf
        or NaN: then the step is skipped and ``None`` returned."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled: compute the loss and backward before calling step.")
        state = self._state(optimizer)
        check_stage(state["stage"], "step", self._scale)
        if state["stage"] == READY:
            self.unscale_(optimizer)
        if state["found_inf"] is None:
            raise AssertionError("No inf checks were recorded for this optimizer: none of its "
                                 "parameters has a gradient; call backward before step.")
        result = None if state["found_inf"].item() else optimizer.step(*args, **kwargs)
        state["stage"] = STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """After the step(s) of an iteration: back off on an overflow in any optimizer, grow
        after ``growth_interval`` good iterations in a row; or set ``new_scale``."""
        if not self._enabled:
            return
        check_stage(READY, "update", self._scale)
        if new_scale is not None:
            self._scale.fill_(float(new_scale))
        else:
            found = [s["found_inf"] for s in self._per_optimizer.values()
                     if s["found_inf"] is not None]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update: call "
                                     "scaler.step(optimizer) (or unscale_) before update().")
            if sum(float(f) for f in found):
                self._scale.mul_(self._backoff_factor)
                self._growth_tracker = 0
            elif self._growth_tracker + 1 == self._growth_interval:
                grown = self._scale * self._growth_factor
                if torch.isfinite(grown):
                    self._scale.copy_(grown)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
        self._per_optimizer.clear()

    def get_scale(self) -> float:
        """The current scale (``init_scale`` before the first ``scale``; 1.0 if disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def state_dict(self) -> dict:
        """torch's keys: ``scale``, the three factors and ``_growth_tracker`` ({} if disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what ``state_dict`` (this class's or torch's) returned."""
        if not self._enabled:
            return
        check_state_dict(state_dict)
        self._init_scale = float(state_dict["scale"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
