"""Checkers for the exercises of lesson 13 (after training).

``check_strip_prefix`` asks for ``strip_prefix(state_dict, prefix="module.")``: the state dict
of a wrapped model made loadable into the plain model. Its oracle is torch's
``consume_prefix_in_state_dict_if_present`` (through ``course_lib.deploy.strip_prefix``), and
the stripped dict must load, strictly, into the unwrapped model.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..deploy import strip_prefix
from ..models.lenet import LeNet
from ._core import ExerciseResult, call_bounded, failure, verdict

__all__ = ["check_strip_prefix"]

_NAME = "strip_prefix"
_HINT = ("remove the prefix only at the START of a key, and only from keys that have it; a "
         "'module.' in the middle of a key is part of the model's own names.")


class _Residual(nn.Module):
    """``x + module(x)``: a submodule that is really called ``module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X + self.module(X)


class _Tagger(nn.Module):
    """A small model whose names trip the usual shortcuts: ``embed``, ``linear`` (letters of
    "module."), ``block.module`` (a ``module.`` inside a key), batch-norm buffers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = _Residual(nn.Linear(8, 8))
        self.norm = nn.BatchNorm1d(8)
        self.linear = nn.Linear(8, 3)

    def forward(self, X: torch.Tensor) -> torch.Tensor:             # (B, 6)
        return self.linear(self.norm(self.block(self.embed(X))))    # (B, 3)


def _cases() -> list[tuple[str, nn.Module, dict, str, torch.Tensor]]:
    """(what, plain model, state dict to strip, prefix, an input for the outputs)."""
    torch.manual_seed(12)
    lenet, tagger = LeNet(), _Tagger()
    with torch.no_grad():
        tagger.train()(torch.randn(16, 6))   # running statistics that differ from the defaults
    tagger.eval()
    compiled = {"_orig_mod." + k: v for k, v in tagger.state_dict().items()}
    return [
        ("LeNet saved from nn.DataParallel (keys 'module.conv1.weight', ...)", lenet,
         nn.DataParallel(lenet).state_dict(), "module.", torch.rand(3, 1, 28, 28)),
        ("a model with layers named embed, block.module, norm, linear, saved from "
         "nn.DataParallel", tagger, nn.DataParallel(tagger).state_dict(), "module.",
         torch.randn(5, 6)),
        ("LeNet saved without a wrapper (no key has the prefix)", lenet, lenet.state_dict(),
         "module.", torch.rand(2, 1, 28, 28)),
        ("the same small model saved from torch.compile (prefix '_orig_mod.')", tagger,
         compiled, "_orig_mod.", torch.randn(4, 6)),
    ]


def _compare(got: object, want: Mapping, given: Mapping, prefix: str) -> str | None:
    """What is wrong with ``got`` against ``want`` (the oracle's dict), or None."""
    if not isinstance(got, Mapping):
        return f"expected a dict of tensors, received {type(got).__name__}"
    renamed = {k.removeprefix(prefix): k for k in given}   # oracle key -> where it came from
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    if missing or extra:
        wrong = extra[0] if extra else "(no such key)"
        example = (f"expected key {missing[0]!r} (from {renamed[missing[0]]!r})" if missing
                   else "every expected key is there")
        return (f"{example}; received keys such as {wrong!r} ({len(missing)} expected key(s) "
                f"missing, {len(extra)} unexpected)")
    for k in want:
        if not isinstance(got[k], torch.Tensor) or not torch.equal(got[k], want[k]):
            return f"the value under {k!r} is not the tensor of {renamed[k]!r}"
    return None


def check_strip_prefix(fn: Callable | None, *, strict: bool = False) -> ExerciseResult:
    """Exercise 12: ``fn(state_dict, prefix)`` returns the state dict without the prefix.

    Four real state dicts: LeNet and a small model with tricky names (``embed``,
    ``block.module.weight``, ``linear``, batch-norm buffers) saved from ``nn.DataParallel``
    (``module.``), LeNet saved plain (nothing to strip), and the small model's keys as
    torch.compile writes them (``_orig_mod.``). The answer's keys and tensors must equal
    torch's ``consume_prefix_in_state_dict_if_present``'s, and it must load (strictly) into the
    plain model and give its outputs. Returning None after changing ``state_dict`` in place
    (as torch's function does) is accepted too.

    Returns:
        The verdict (truthy when right); the first failing case is printed.
    """
    if fn is None:
        return verdict(_NAME, None, "define strip_prefix(state_dict, prefix='module.') and "
                       "pass it here.", strict)
    cases = _cases()
    for what, model, given, prefix, X in cases:
        want = strip_prefix(given, prefix)           # the oracle: torch's function
        mine = type(given)(given)                    # the learner may change it in place
        try:
            got = call_bounded(fn, mine, prefix)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: B036 - the learner's code failed: say how, where
            return verdict(_NAME, False, f"{failure(exc)} on {what}. {_HINT}", strict)
        got = mine if got is None else got
        wrong = _compare(got, want, given, prefix)
        if wrong is None:
            plain = type(model)()
            try:
                plain.load_state_dict(got)
            except RuntimeError as e:
                wrong = f"load_state_dict refused it: {' '.join(str(e).split())[:200]}"
            else:
                with torch.no_grad():
                    if not torch.equal(plain.eval()(X), model.eval()(X)):
                        wrong = "the loaded model's outputs differ from the saved model's"
        if wrong is not None:
            hint = f" {_HINT}" if wrong.startswith("expected key") else ""
            return verdict(_NAME, False, f"on {what}, prefix {prefix!r}: {wrong}.{hint}", strict)
    return verdict(_NAME, True, f"every key right on {len(cases)} state dicts (two wrappers, a "
                   "plain model, a 'module' inside the names), and each loads into its model.",
                   strict)
