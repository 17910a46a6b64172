"""After training: a trained model loaded on any device, partly frozen for fine-tuning, shrunk.

PyTorch counterparts: ``torch.load(..., map_location=...)``, ``Module.load_state_dict``
(``strict=False``: ``load_matching``), ``consume_prefix_in_state_dict_if_present`` (the
``module.`` of DDP or DataParallel; ``match_keys`` also takes torch.compile's ``_orig_mod.``,
nested and mixed), ``requires_grad_`` for freezing, and int8 quantization with torchao
(``torchao.quantization.quantize_``; ``torch.ao.quantization.quantize_dynamic`` is deprecated).
Re-exported here: ``_quantize`` (``state_dict_bytes``, ``quantize_int8``, ``int8_layers``) and
``_reshard`` (``shard_rows`` / ``read_plan`` / ``reshard``: the rows ``fully_shard`` gives each
rank, what each rank of a new layout reads, as DCP's load planner does, and a checkpoint of N
ranks laid out for M; ``save_sharded`` / ``resume_sharded``: a sharded model and its optimizer
with DCP). Read more: https://pytorch.org/tutorials/beginner/saving_loading_models.html,
https://docs.pytorch.org/ao/stable/ and notebook 13.

A foundation (it imports only ``course_lib.devices``): serving a model needs none of the
training recipe, whose ``load_checkpoint`` restores a whole training state to resume.
"""
from __future__ import annotations

import collections
import copy
import itertools
import os
import pickle
import zipfile
from collections.abc import Container, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from ._quantize import int8_layers, quantize_int8, state_dict_bytes  # noqa: F401 - public here
from ._reshard import read_plan, reshard, resume_sharded, save_sharded, shard_rows  # noqa: F401
from .devices import Device, as_device, try_gpu

__all__ = ["WRAPPER_PREFIXES", "IncompatibleKeys", "StateDictFit", "fit_state_dict",
           "freeze_all_but", "int8_layers", "load_file", "load_for_inference", "load_matching",
           "load_weights", "match_keys", "quantize_int8", "read_plan", "reshard", "resume_sharded",
           "save_sharded", "shard_rows", "state_dict_bytes", "strip_prefix"]

#: What wrappers put in front of every key: DDP and DataParallel (``module.``), torch.compile
#: (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# --- Loading: any checkpoint, onto any device -----------------------------------------------------

def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """A copy of ``state_dict`` (not of its tensors) with the leading ``prefix`` removed from
    every key that has it, by torch's ``consume_prefix_in_state_dict_if_present``: other keys,
    and a ``module.`` mid-key, stay as they are; ``_metadata`` is renamed too."""
    out = copy.copy(state_dict)  # an OrderedDict keeps its _metadata attribute
    if hasattr(state_dict, "_metadata"):
        out._metadata = copy.copy(state_dict._metadata)
    consume_prefix_in_state_dict_if_present(out, prefix)
    return out


class StateDictFit(NamedTuple):
    """How a state dict fits a model, key by key (``fit_state_dict``'s answer)."""

    state: Mapping[str, Any]            # the state dict, each key renamed to the model key it names
    fitting: dict[str, Any]             # keys of the model whose tensor has the model's shape
    missing: list[str]                  # keys of the model not in the state dict
    unexpected: list[str]               # keys of the state dict (as in the file) in no model key
    mismatched: list[tuple[str, tuple, tuple]]  # (key, its shape in the file, in the model)
    prefix: str                         # the wrapper prefix(es) removed ("" if none), " and "
    #                                     between different ones (a file with mixed prefixes)

    @property
    def complete(self) -> bool:
        """Every key of the model found, with its shape, and nothing else."""
        return not (self.missing or self.unexpected or self.mismatched)


class IncompatibleKeys(NamedTuple):
    """What ``load_matching`` did not load: torch's ``load_state_dict(strict=False)`` answer."""

    missing_keys: list[str]             # keys of the model that kept their values
    unexpected_keys: list[str]          # keys of the file (as written there) that name none


def _model_key(key: str, own: Container[str]) -> str | None:
    """The key of the model that the file's ``key`` names, or None: ``key`` itself if the model
    has it, else less its leading ``WRAPPER_PREFIXES``, one at a time (nested in either order).
    Only the START is removed: a submodule really called ``module`` (``block.module.weight``)
    keeps its name, and a model whose first submodule is ``module`` loads a plain file as is.
    """
    while key not in own:
        prefix = next((w for w in WRAPPER_PREFIXES if key.startswith(w)), None)
        if prefix is None:
            return None
        key = key[len(prefix):]
    return key


def match_keys(keys: Iterable[str], own: Container[str]) -> dict[str, str | None]:
    """File key -> the model key it names (``None`` for a key that names none).

    Each key is matched on its own (``_model_key``), so a file whose keys carry different
    prefixes (a DDP-saved backbone merged with a plainly saved head) matches too.

    Raises:
        ValueError: two keys of the file name the same key of the model (``fc.weight`` and
            ``module.fc.weight``): which one to load is a guess, so none is made.
    """
    named: dict[str, str | None] = {}
    seen: dict[str, str] = {}
    for key in keys:
        target = named[key] = _model_key(key, own)
        if target is not None and target in seen:
            raise ValueError(f"the state dict holds both {seen[target]!r} and {key!r}, which "
                             f"name the same key {target!r} of the model; keep one of them "
                             f"(drop the other from the dict) and load again.")
        if target is not None:
            seen[target] = key
    return named


def _renamed(state: Mapping[str, Any], own: Mapping[str, Any]) -> tuple[dict, str]:
    """``state`` with each key (and its ``_metadata``: module versions) renamed to the model key
    it names, others kept; and the prefixes removed, ``" and "`` between different ones."""
    named = match_keys(state, own)
    out = collections.OrderedDict((named[k] or k, v) for k, v in state.items())
    removed = sorted({k[: len(k) - len(t)] for k, t in named.items() if t and t != k})
    metadata = getattr(state, "_metadata", None)
    own_meta = getattr(own, "_metadata", None)
    if metadata is not None and own_meta is not None:
        # module paths, written with a trailing dot so that prefixes strip alike ("" the root);
        # later (inner) modules win: the model's own root, not the wrapper's
        modules = {m + "." if m else "" for m in own_meta}
        out._metadata = collections.OrderedDict()
        for m, version in metadata.items():
            found = _model_key(m + "." if m else "", modules)
            out._metadata[m if found is None else found.removesuffix(".")] = version
    return out, " and ".join(removed)


def _load_file(path: str | os.PathLike, map_location, what: str, fix: str) -> Any:
    """``torch.load(path, map_location, weights_only=True)`` with errors that say what is wrong;
    never torch's advice to retry with ``weights_only=False`` (arbitrary code execution enabled
    on a damaged or foreign file is never the fix)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no file at {path}; {fix}.")
    size, fix = os.path.getsize(path), fix[0].upper() + fix[1:]
    if size == 0:
        raise ValueError(f"{what}: {path} is empty (0 bytes): a write was cut short or "
                         f"the file was truncated. {fix}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if zipfile.is_zipfile(path) and "weights only load failed" in str(e).lower():
            raise ValueError(
                f"{what}: {path} holds Python objects other than tensors and plain "
                f"containers (a whole model or optimizer object?), which a safe load "
                f"(weights_only=True) refuses. Save a state dict instead "
                f"(torch.save(model.state_dict(), path)).") from None
        detail = type(e).__name__
    except Exception as e:  # noqa: BLE001 - whatever torch's reader trips on: the file is bad
        detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"
    raise ValueError(f"{what}: {path} ({size} bytes) is damaged or is not a file that "
                     f"torch.save wrote ({detail}). {fix}.")


def load_file(path: str | os.PathLike, *, map_location: Device | None = "cpu",
              what: str = "load_file", fix: str | None = None) -> Any:
    """What ``torch.save`` wrote to ``path``, read safely (``weights_only=True``) onto
    ``map_location`` (default the CPU, whatever device wrote it); a missing, empty or damaged
    file raises an error that says which, naming ``what`` asked (``"--resume"``, say) and
    ``fix``, what to do about it."""
    return _load_file(path, map_location, what, fix or "pass the path of a file written "
                      "with torch.save (a checkpoint or a state dict)")


def _state_dict_of(source: str | os.PathLike | Mapping, device: torch.device,
                   what: str = "load_weights") -> Mapping:
    """The model's state dict from a file, a state dict, or a checkpoint holding ``"model"``."""
    if isinstance(source, str | os.PathLike):
        # map_location: every tensor straight onto `device`, whatever device saved it (a file
        # written on cuda:3 loads on a CPU-only machine); weights_only: no arbitrary code.
        source = _load_file(source, device, what, "pass the path of a checkpoint written with "
                            "torch.save (or the state dict itself)")
    if not isinstance(source, Mapping):
        raise TypeError(f"{what} expects a path, a state dict or a checkpoint dict, got "
                        f"{type(source).__name__}.")
    inner = source.get("model")
    return inner if isinstance(inner, Mapping) else source   # the recipe's checkpoints


def fit_state_dict(model: nn.Module, source: str | os.PathLike | Mapping, *,
                   device: Device | None = "cpu", what: str = "fit_state_dict"
                   ) -> StateDictFit:
    """How the weights of ``source`` fit ``model``: the one reading behind every loader.

    ``source`` is a file written by ``torch.save`` (read with ``weights_only=True`` onto
    ``device``), a state dict, or a checkpoint dict whose ``"model"`` is the state dict. Each
    key is matched on its own (``match_keys``): as it is, or less the wrapper prefixes at its
    start (``module.`` from DDP or DataParallel, ``_orig_mod.`` from torch.compile, nested), so
    a file with mixed prefixes fits too. Nothing is loaded.

    Raises:
        ValueError: two keys of the file name the same key of the model; or the file is
            missing, empty or damaged.
    """
    device = try_gpu() if device is None else as_device(device)
    own = model.state_dict()
    given = _state_dict_of(source, device, what)
    state, prefix = _renamed(given, own)
    mismatched = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in own
                  if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    shapes = {k for k, _, _ in mismatched}
    return StateDictFit(state=state,
                        fitting={k: v for k, v in state.items() if k in own and k not in shapes},
                        missing=[k for k in own if k not in state],
                        unexpected=[k for k in given if _model_key(k, own) is None],
                        mismatched=mismatched, prefix=prefix)


def load_weights(model: nn.Module, source: str | os.PathLike | Mapping, *,
                 device: Device | None = None) -> nn.Module:
    """Load the weights of ``source`` into ``model``, on ``device``; every key must fit.

    Args:
        model: the plain (unwrapped) model, built as the checkpoint's model was.
        source: a file (read with ``map_location=device``), a state dict or a checkpoint
            holding ``"model"``; wrapper prefixes removed as ``fit_state_dict`` does.
        device: where the model goes (default ``try_gpu()``).

    Returns:
        ``model``, moved to ``device``, with the weights loaded.

    Raises:
        ValueError: keys or shapes do not fit, or the file is empty or damaged (says which).
    """
    device = try_gpu() if device is None else as_device(device)
    fit = fit_state_dict(model, source, device=device, what="load_weights")
    if not fit.complete:
        def few(names: list[str]) -> str:
            return ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4
                                           else "")
        shapes = [f"{k}: checkpoint {a}, model {b}" for k, a, b in fit.mismatched]
        found = [f"{len(fit.missing)} key(s) of the model not in the checkpoint "
                 f"({few(fit.missing)})" if fit.missing else "",
                 f"{len(fit.unexpected)} key(s) of the checkpoint not in the model "
                 f"({few(fit.unexpected)})" if fit.unexpected else "",
                 f"{len(shapes)} shape(s) differ ({few(shapes)})" if shapes else ""]
        raise ValueError(
            f"load_weights: the checkpoint does not fit {type(model).__name__}: "
            + "; ".join(f for f in found if f) + ". Build the model the checkpoint was "
            "trained as (same class and sizes); to take only the tensors that fit (a new "
            "head, say), use course_lib.train_ddp.load_fitting_weights.")
    model.load_state_dict(fit.state)
    return model.to(device)


def load_matching(model: nn.Module, source: str | os.PathLike | Mapping
                  ) -> IncompatibleKeys:
    """Load the tensors of ``source`` that name a key of ``model``; report the others.

    What fine-tuning needs (a pretrained body, a new head) from any checkpoint: each key of
    ``source`` (as ``fit_state_dict`` takes it; never changed) is matched on its own
    (``match_keys``); the tensors that match are copied into the model (which stays on its
    device), its other tensors keep their values. Torch's ``load_state_dict(strict=False)``
    after ``consume_prefix_in_state_dict_if_present``, except that mixed and nested prefixes
    match too, and a shape that differs is refused BEFORE anything is copied (torch copies what
    fits, then raises: a half-loaded model).

    Returns:
        ``(missing_keys, unexpected_keys)``: the model's keys that kept their values, and the
        file's keys (as written there) that name no key of the model.

    Raises:
        ValueError: a matched tensor's shape differs (each named, with both shapes; the model
            is unchanged), or two keys of the file name the same key of the model.
    """
    where = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    fit = fit_state_dict(model, source, device=where, what="load_matching")
    if fit.mismatched:
        shapes = ", ".join(f"{k}: file {a}, model {b}" for k, a, b in fit.mismatched)
        raise ValueError(
            f"load_matching: {len(fit.mismatched)} tensor(s) of the file do not have the shape "
            f"of the {type(model).__name__} key they name ({shapes}); nothing was loaded. A "
            f"layer rebuilt with another size (a new head) must not be loaded from the file: "
            f"drop its keys from the state dict, or name it differently in the model.")
    model.load_state_dict(fit.fitting, strict=False)
    return IncompatibleKeys(fit.missing, fit.unexpected)


def load_for_inference(model: nn.Module, source: str | os.PathLike | Mapping, *,
                       device: Device | None = None) -> nn.Module:
    """``load_weights``, then ``eval()`` mode (dropout off, batch norm on its running
    statistics: as much a part as the weights) and no gradients (no graph kept)."""
    model = load_weights(model, source, device=device)
    return model.eval().requires_grad_(False)


# --- Fine-tuning: train a part, keep the rest bitwise ---------------------------------------------

def freeze_all_but(model: nn.Module, *keep: str) -> list[str]:
    """Freeze every parameter except those of the submodules or parameters named in ``keep``;
    return the names of the parameters left trainable.

    ``freeze_all_but(net, "fc2")`` leaves ``fc2.weight`` and ``fc2.bias`` trainable. A frozen
    parameter gets ``requires_grad=False`` AND ``.grad = None``: optimizers skip a parameter
    whose ``.grad`` is ``None``, not one whose ``.grad`` is a zero tensor (left by an earlier
    backward and ``zero_grad(set_to_none=False)``), which weight decay and momentum still move.
    So any optimizer, even one given every parameter, leaves the frozen ones bitwise unchanged.
    """
    names = [name for name, _ in model.named_parameters()]

    def kept(name: str) -> bool:
        return any(name == k or name.startswith(k + ".") for k in keep)

    unknown = [k for k in keep if not any(n == k or n.startswith(k + ".") for n in names)]
    if not keep or unknown:
        modules = sorted({n.rpartition(".")[0] for n in names} - {""})
        raise ValueError(f"freeze_all_but expects names of {type(model).__name__}'s submodules "
                         f"or parameters to keep trainable, got {list(keep) or 'none'}"
                         f"{f' ({unknown} name nothing)' if unknown else ''}; its submodules "
                         f"with parameters: {modules}.")
    for name, p in model.named_parameters():
        p.requires_grad_(kept(name))
        if not kept(name):
            p.grad = None  # a zero .grad still moves under weight decay and momentum
    return [name for name in names if kept(name)]
