"""Argument checks and error texts of ``course_lib.amp``: what was expected, what was found and
what to do (torch's wording where torch has one)."""
from __future__ import annotations

import math


def check_factors(init_scale, growth_factor, backoff_factor, growth_interval) -> None:
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale)
            and init_scale > 0):
        raise ValueError(f"GradScaler: init_scale must be a finite number > 0, got "
                         f"{init_scale!r}; the default is 2.0**16.")
    if not growth_factor > 1.0:
        raise ValueError(f"GradScaler: growth_factor must be > 1.0 (the scale grows), got "
                         f"{growth_factor!r}; the default is 2.0.")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"GradScaler: backoff_factor must lie in (0, 1) (the scale shrinks), "
                         f"got {backoff_factor!r}; the default is 0.5.")
    if not isinstance(growth_interval, int) or isinstance(growth_interval, bool) \
            or growth_interval < 1:
        raise ValueError(f"GradScaler: growth_interval must be a positive integer, got "
                         f"{growth_interval!r}; the default is 2000.")


_ORDER = "Per iteration: scaler.scale(loss).backward(), [scaler.unscale_(opt)], " \
         "scaler.step(opt), scaler.update()."


def check_stage(stage: str, call: str, scale) -> None:
    """``call`` is allowed at ``stage`` of this optimizer's iteration (torch's messages)."""
    if scale is None:
        raise RuntimeError(f"GradScaler.{call}: no scale yet; this may indicate that "
                           f"scaler.scale(loss) was not called this iteration. {_ORDER}")
    if call == "unscale_" and stage == "unscaled":
        raise RuntimeError("unscale_() has already been called on this optimizer since the "
                           f"last update(). {_ORDER}")
    if call == "unscale_" and stage == "stepped":
        raise RuntimeError(f"unscale_() is being called after step(). {_ORDER}")
    if call == "step" and stage == "stepped":
        raise RuntimeError(f"step() has already been called since the last update(). {_ORDER}")


def check_state_dict(state_dict) -> None:
    keys = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    if not state_dict:
        raise RuntimeError("The source state dict is empty, possibly because it was saved from "
                           "a disabled instance of GradScaler.")
    missing = keys - set(state_dict)
    if missing:
        raise KeyError(f"GradScaler.load_state_dict: missing keys {sorted(missing)}; pass what "
                       "GradScaler.state_dict() returned.")
