"""Checkers for the exercises of lesson 02 (replicate and allreduce).

The learner's allreduce ``fn(tensors)`` gets one tensor per device and must leave every one of
them holding the elementwise sum, in place. The checkers try several numbers of devices
(including odd ones: many wrong answers are right for two) and shapes whose size the number of
devices does not divide, and print the first failing case with what was expected and received.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from ..devices import devices
from ..distributed.collectives import ring_chunk_bounds
from ._core import ExerciseResult, call_or_failure, check_answer, unanswered, verdict
from .harness import describe

__all__ = ["check_allreduce_fn", "check_butterfly", "check_ring_allreduce", "check_ring_sends"]

#: (number of devices, shape) tried by check_allreduce_fn: sizes 15, 7 and 24.
_ALLREDUCE_CASES = [(n, shape) for n in (1, 2, 3, 4, 8) for shape in [(3, 5), (7,), (2, 3, 4)]]
#: ... and by check_ring_allreduce: chunks of unequal size, and empty ones (numel < n).
_RING_CASES = [(n, shape) for n in (1, 2, 3, 4, 5, 8)
               for shape in [(1,), (3,), (10,), (7, 3), (1001,)]]


def _first_wrong_sum(fn: Callable, cases: Sequence[tuple[int, tuple[int, ...]]], seed: int = 0,
                     reraise: type[BaseException] | tuple = ()) -> str | None:
    """Run ``fn`` on each (n devices, shape) case; the first case whose tensors do not all hold
    the sum afterwards, described (input, expected, received), or None. An exception of type
    ``reraise`` (a scaffold's NotImplementedError) is raised instead of described."""
    for n, shape in cases:
        devs = devices(n, warn=False)
        gen = torch.Generator().manual_seed(seed)
        held = [torch.randn(shape, generator=gen, dtype=torch.float64).to(d) for d in devs]
        before = [t.clone() for t in held]
        expected = sum(t.cpu() for t in before)                # the oracle: a plain sum
        where = f"{n} device(s), tensors of shape {shape}"
        _, error = call_or_failure(fn, list(held), reraise=reraise)  # fn may rebind entries
        if error is not None:
            return f"with {where}: {error}."
        untouched = n > 1 and all(torch.equal(t, b) for t, b in zip(held, before))
        for i, t in enumerate(held):
            if t.shape != expected.shape or not torch.allclose(t.cpu(), expected):
                why = (" No tensor changed: write into the tensors (t.copy_(...), t += ...), do "
                       "not rebind list entries (tensors[i] = ...)." if untouched else "")
                return (f"with {where}: expected device {i}'s tensor to hold the sum "
                        f"{describe(expected)}, received {describe(t)}.{why}")
    return None


def check_allreduce_fn(fn: Callable | None, *, device_counts: tuple[int, ...] = (1, 2, 3, 4, 8),
                       strict: bool = False) -> ExerciseResult:
    """Exercise 02: ``fn(tensors)`` is an in-place allreduce, for each number of devices.

    The issue's ``check_allreduce``: that name already belongs to
    ``course_lib.parallel.comm.check_allreduce``, the raising oracle the unit tests and the
    notebook use, and a public name is defined once in ``course_lib``; this is its verdict-
    printing form for exercises. Shapes of 15, 7 and 24 elements on each number of devices.
    """
    name = getattr(fn, "__name__", "allreduce")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    cases = [(n, shape) for n, shape in _ALLREDUCE_CASES if n in device_counts]
    cases += [(n, (3, 5)) for n in device_counts if n not in {c[0] for c in cases}]
    wrong = _first_wrong_sum(fn, cases)
    if wrong is not None:
        return verdict(name, False, wrong, strict)
    return verdict(name, True, f"every tensor holds the sum, for {list(device_counts)} "
                   f"devices ({len(cases)} cases).", strict)


def _ring_sums(xs: list[torch.Tensor]) -> torch.Tensor:
    """What the ring leaves on every device: chunk c starts at device c and collects devices
    c + 1, c + 2, ... in turn (reduce-scatter step s: device i sends chunk (i - s) mod n to
    device i + 1, which adds it to its own), so its sum is x[c - 1] + (... + (x[c + 1] + x[c])),
    an order of additions no other schedule shares (floating-point addition is not associative).
    """
    n, flats = len(xs), [x.reshape(-1) for x in xs]
    out = torch.empty_like(flats[0])
    for c, (start, end) in enumerate(ring_chunk_bounds(out.numel(), n)):
        acc = flats[c][start:end].clone()
        for k in range(1, n):
            acc = flats[(c + k) % n][start:end] + acc            # the receiver adds its own
        out[start:end] = acc
    return out.reshape(xs[0].shape)


def _call_on_spread_values(fn: Callable, gen: torch.Generator, n: int,
                           numel: int) -> tuple[list, list, str | None]:
    """``fn`` on n devices' float32 tensors of values 1e-4 to 1e4 in magnitude (another order of
    additions rounds differently): (the values, the tensors given, how it failed or None)."""
    devs = devices(n, warn=False)
    xs = [torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-4, 5, (numel,),
                                                                    generator=gen)
          for _ in range(n)]                                              # (numel,) float32
    held = [x.to(d, copy=True) for x, d in zip(xs, devs)]
    return xs, held, call_or_failure(fn, list(held))[1]


def _first_wrong_schedule(fn: Callable, device_counts: Sequence[int]) -> str | None:
    """On float32 values of very different magnitudes, the first (devices, size) case whose
    result is not, bit for bit, the ring's order of additions; None if there is none."""
    gen = torch.Generator().manual_seed(3)
    for n in device_counts:
        numel = 400 * n + 1                                  # n does not divide it (n > 1)
        xs, held, error = _call_on_spread_values(fn, gen, n, numel)
        if error is not None:
            return f"with {n} device(s), float32, {numel} elements: {error}."
        want = _ring_sums(xs)
        for i, t in enumerate(held):
            got = t.detach().cpu()
            if torch.equal(got, want):
                continue
            bounds = ring_chunk_bounds(numel, n)
            c = next(c for c, (a, b) in enumerate(bounds) if not torch.equal(got[a:b], want[a:b]))
            a, b = bounds[c]
            return (f"with {n} devices and {numel} elements: the sums are right to rounding, but "
                    f"device {i}'s chunk {c} (elements {a}:{b}) was not added up in the ring's "
                    f"order, which starts at device {c} and goes {c} -> {(c + 1) % n} -> ... -> "
                    f"{(c - 1) % n}. In reduce-scatter step s, device i sends chunk (i - s) mod "
                    "n to device (i + 1) mod n, which adds it to its own; cut the chunks with "
                    "ring_chunk_bounds(numel, n).")
    return None


def check_ring_allreduce(fn: Callable | None, *, device_counts: Sequence[int] = (1, 2, 3, 4, 5, 8),
                         strict: bool = False) -> ExerciseResult:
    """Exercise 02: ``fn(tensors)`` is the ring allreduce, in place: the sums *and* the schedule.

    First the sums, on the hard cases of a ring: 1 to 8 devices, odd counts included; tensors
    of 1, 3, 10, 21 and 1001 elements, so that chunks differ in size and some are empty. Then
    the schedule: on float32 values of magnitudes 1e-4 to 1e4 and sizes no device count divides,
    every device must hold, bit for bit, each chunk c added up around the ring starting at
    device c (reduce-scatter step s: device i sends chunk (i - s) mod n to device i + 1, which
    adds it to its own), as ``comm.ring_allreduce`` does. The naive allreduce (everything onto
    device 0), a parameter server and a butterfly get the sums right and fail here from 3
    devices on.
    """
    name = getattr(fn, "__name__", "ring_allreduce")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    cases = [(n, shape) for n, shape in _RING_CASES if n in device_counts]
    try:
        wrong = _first_wrong_sum(fn, cases, seed=1, reraise=NotImplementedError)
        if wrong is not None:
            return verdict(name, False, f"{wrong} Hint: step s of the reduce-scatter sends chunk "
                           "(i - s) mod n from device i to i + 1; chunk bounds from "
                           "ring_chunk_bounds(numel, n).", strict)
        wrong = _first_wrong_schedule(fn, [n for n in device_counts if n > 1])
    except NotImplementedError:
        return unanswered(name, strict)
    if wrong is not None:
        return verdict(name, False, wrong, strict)
    return verdict(name, True, f"the sums on {len(cases)} cases (1 to 1001 elements) and, bit "
                   f"for bit, the ring's order of additions on {list(device_counts)} devices.",
                   strict)


# ---- the butterfly: the structure, not only the sum -------------------------------------------

def _butterfly_sums(xs: list[torch.Tensor], order: Sequence[int]) -> list[torch.Tensor]:
    """What each device holds after butterfly rounds pairing i with i XOR d, d in ``order``."""
    for d in order:
        xs = [xs[i] + xs[i ^ d] for i in range(len(xs))]      # both partners: the same sum
    return xs


def check_butterfly(fn: Callable | None, *, device_counts: tuple[int, ...] = (1, 2, 4, 8),
                    strict: bool = False) -> ExerciseResult:
    """Exercise 02: ``fn(tensors)`` is a butterfly allreduce (n a power of two).

    First the sum, as ``check_allreduce_fn``. Then the structure: floating-point addition is
    not associative, so the order of the additions shows in the last bits. On float32 values of
    very different magnitudes, each device must end with exactly (bit for bit) the sums of
    log2(n) rounds that pair device i with i XOR d, for d = 1, 2, 4, ... (rounds in any order).
    A naive, parameter-server or ring allreduce adds in another order and fails, although its
    sums are right to rounding.
    """
    name = getattr(fn, "__name__", "butterfly_allreduce")
    if fn is None:
        return verdict(name, None, "define your function and pass it here.", strict)
    bad = [n for n in device_counts if n < 1 or n & (n - 1)]
    if bad:
        raise ValueError(f"check_butterfly: device counts must be powers of two, got {bad}.")
    try:
        wrong = _first_wrong_sum(fn, [(n, (3, 5)) for n in device_counts] +
                                 [(n, (33,)) for n in device_counts], reraise=NotImplementedError)
    except NotImplementedError:
        return unanswered(name, strict)
    if wrong is not None:
        return verdict(name, False, wrong, strict)
    gen = torch.Generator().manual_seed(2)
    for n in device_counts:
        xs, held, error = _call_on_spread_values(fn, gen, n, 1000)
        if error is not None:
            return verdict(name, False, f"with {n} device(s), float32: {error}.", strict)
        got = [t.cpu() for t in held]
        distances = [2 ** r for r in range(n.bit_length() - 1)]
        if not any(all(torch.equal(g, w) for g, w in zip(got, _butterfly_sums(xs, order)))
                   for order in itertools.permutations(distances)):
            return verdict(name, False, f"with {n} devices: the sums are right to rounding, but "
                           "not added in butterfly order: in each round, device i must add the "
                           f"tensor of device i XOR d (d = {distances}) to its own, every "
                           "device reading its partner's tensor before either writes.", strict)
    return verdict(name, True, f"the sums, added in butterfly order, for {list(device_counts)} "
                   "devices.", strict)


# ---- counting what the ring sends -------------------------------------------------------------

def _ring_sends(numel: int, n: int) -> list[int]:
    """Elements each device sends in ``comm.ring_allreduce`` of ``numel`` elements over n
    (private: the exercise's answer is not one call away)."""
    size = [end - start for start, end in ring_chunk_bounds(numel, n)]
    # step s of 2 (n - 1): device i sends chunk (i - s) mod n to its right neighbour
    return [sum(size[(i - s) % n] for s in range(2 * (n - 1))) for i in range(n)]


def check_ring_sends(sent: list[int] | None, n: int = 4, numel: int = 1000, *,
                     strict: bool = False) -> ExerciseResult:
    """Exercise 02: the elements each of ``n`` devices sends in a ring allreduce of ``numel``."""
    expected = _ring_sends(numel, n)
    try:
        sent = None if sent is None else [int(s) for s in sent]
    except (TypeError, ValueError):
        return verdict("ring traffic", False, f"expected a list of {n} integers, got {sent!r}.",
                       strict)
    return check_answer("ring traffic", sent,
                        expected, hint=f"each device sends 2 (n - 1) = {2 * (n - 1)} chunks; "
                        f"ring_chunk_bounds({numel}, {n}) gives their sizes.", strict=strict)
