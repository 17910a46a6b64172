"""Lesson 15's checkers: the reference answers pass, realistic wrong answers fail with a reason.

The wrong answers are small variations of ``solutions/lesson15.py`` defined here, at module
level, so that worker processes can import the sequence-parallel ones by name. The single-process
checkers (``check_checkpoint``, ``check_scaler_update``) are called directly on each. For the
sequence-parallel pair one launch (a group of 2 ranks, then of 3) runs every wrong answer
through the checker's worker in turn and compares each verdict with the one expected
(``_VERDICTS``); the public checker is called for the reference answers (2, 3 and 4 ranks).
"""
import pytest
import torch
import torch.distributed as dist

from course_lib.checks import check_checkpoint, check_scaler_update, check_sequence_parallel_block
from course_lib.checks import lesson15 as L
from course_lib.checks.harness import UNANSWERED, first_failure_in_ranks, verdicts_as_expected
from solutions import lesson15 as S

# ------------------------------------------------------------------------------------------------
# wrong checkpoints
# ------------------------------------------------------------------------------------------------


def checkpoint_saves_everything(function, *args):
    """No recomputation: the function's graph, and every activation it saves, kept."""
    return function(*args)


class _NoRandomState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.save_for_backward(*args)
        return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.function(*inputs)                # dropout draws a fresh mask
        torch.autograd.backward(out, grads)
        return (None, *(x.grad for x in inputs))


def checkpoint_without_random_state(function, *args):
    return _NoRandomState.apply(function, *args)


class _NoEnableGrad(torch.autograd.Function):
    forward = staticmethod(S.Checkpoint.forward)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng_state)
            out = ctx.function(*inputs)                # grad mode is off here: no graph
        torch.autograd.backward(out, grads)
        return (None, *(x.grad for x in inputs))


def checkpoint_without_enable_grad(function, *args):
    return _NoEnableGrad.apply(function, *args)


class _NoFork(torch.autograd.Function):
    forward = staticmethod(S.Checkpoint.forward)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        torch.set_rng_state(ctx.rng_state)             # and never put the caller's back
        with torch.enable_grad():
            out = ctx.function(*inputs)
        torch.autograd.backward(out, grads)
        return (None, *(x.grad for x in inputs))


def checkpoint_without_fork_rng(function, *args):
    return _NoFork.apply(function, *args)


def checkpoint_scaffold(function, *args):  # notebook 15's scaffold, not yet written
    raise NotImplementedError("Checkpoint.forward")


@pytest.mark.parametrize("answer, reason", [
    (checkpoint_saves_everything,
     "on x of shape (2, 5, 8): 5760 bytes were saved for backward, as many as without "
     "checkpoint; the inputs, 640 bytes, are all a checkpoint may keep, and the function ran "
     "once: nothing was recomputed"),
    (checkpoint_without_random_state,
     "with function an MLP with dropout(p=0.5) after its GELU, on x of shape (2, 5, 8): the "
     "input's gradient is"),
    (checkpoint_without_random_state, "the recomputation drew a different dropout mask"),
    (checkpoint_without_enable_grad,
     "backward raised RuntimeError: element 0 of tensors does not require grad"),
    (checkpoint_without_enable_grad, "Backward runs with grad mode off"),
    (checkpoint_without_fork_rng, "after backward the random stream is not where it was "
     "without checkpoint. It was rewound to where forward left it"),
])
def test_wrong_checkpoints_get_their_reasons(answer, reason):
    result = check_checkpoint(answer)
    assert result.ok is False
    assert reason in result.message, result.message
    assert "Hint: recomputation keeps only what running the function again needs" in \
        result.message


def test_checkpoint_right_none_and_scaffold():
    assert check_checkpoint(S.checkpoint).ok is True
    assert check_checkpoint(None).ok is None
    assert check_checkpoint(checkpoint_scaffold).ok is None
    with pytest.raises(AssertionError, match="not yet right"):
        check_checkpoint(checkpoint_saves_everything, strict=True)


def test_checkpoint_checker_leaves_the_random_stream_alone():
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    check_checkpoint(S.checkpoint)
    torch.testing.assert_close(torch.rand(4), want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# wrong update rules
# ------------------------------------------------------------------------------------------------


def update_grows_early(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                       backoff_factor=0.5, growth_interval=2000):
    """Grows on the step the tracker reaches growth_interval - 1."""
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval - 1:
        return scale * growth_factor, 0
    return scale, growth_tracker


def update_keeps_tracker(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                         backoff_factor=0.5, growth_interval=2000):
    """Backs off on an overflow but keeps counting good steps across it."""
    if found_inf:
        return scale * backoff_factor, growth_tracker
    return S.update_scale(scale, growth_tracker, False, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval)


def update_always_backs_off(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                            backoff_factor=0.5, growth_interval=2000):
    """The backoff meant for `if found_inf:` indented one level too little."""
    scale = scale * backoff_factor
    if found_inf:
        return scale, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker


def update_hard_coded(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                      backoff_factor=0.5, growth_interval=2000):
    """Ignores the factors it is given: right with the defaults only."""
    return S.update_scale(scale, growth_tracker, found_inf, growth_interval=growth_interval)


def update_grows_late(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                      backoff_factor=0.5, growth_interval=2000):
    """Compares the tracker with the interval before counting this step."""
    if found_inf:
        return scale * backoff_factor, 0
    if growth_tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, growth_tracker + 1


def update_returns_a_fraction(scale, growth_tracker, found_inf, **factors):
    new_scale, tracker = S.update_scale(scale, growth_tracker, found_inf, **factors)
    return new_scale, float(tracker) + 0.5


def update_scaffold(scale, growth_tracker, found_inf, *, growth_factor=2.0,
                    backoff_factor=0.5, growth_interval=2000):
    raise NotImplementedError("update_scale")


@pytest.mark.parametrize("answer, reason", [
    (update_grows_early, "growth_interval=3, from scale=65536 and growth_tracker=0, with the "
     "overflow flags ok ×2: step 2, update(65536.0, 1, found_inf=False, growth_factor=2.0, "
     "backoff_factor=0.5, growth_interval=3) returned (131072.0, 0); torch's rule gives "
     "(65536.0, 2). The scale grew after 2 good step(s) in a row"),
    (update_keeps_tracker, "with the overflow flags ok ×3, inf, ok ×4, inf: step 9, "
     "update(131072.0, 1, found_inf=True, growth_factor=2.0, backoff_factor=0.5, "
     "growth_interval=3) returned (65536.0, 1); torch's rule gives (65536.0, 0)"),
    (update_keeps_tracker, "On an overflow the tracker goes back to 0"),
    (update_always_backs_off, "step 1, update(65536.0, 0, found_inf=False"),
    (update_always_backs_off, "The scale shrank on a step without overflow"),
    (update_hard_coded, "growth_interval=1, growth_factor=4.0, backoff_factor=0.125"),
    (update_hard_coded, "It doubled, but growth_factor is 4.0."),
    (update_grows_late, "flags ok ×3: step 3"),
    (update_grows_late, "This is good step number 3 in a row, and growth_interval is 3: the "
     "scale grows now"),
    (update_returns_a_fraction, "it is a count of good steps, an integer"),
])
def test_wrong_update_rules_get_their_reasons(answer, reason):
    result = check_scaler_update(answer)
    assert result.ok is False
    assert reason in result.message, result.message


def test_update_rule_right_none_scaffold_and_the_long_default_run():
    assert check_scaler_update(S.update_scale).ok is True
    assert check_scaler_update(None).ok is None
    assert check_scaler_update(update_scaffold).ok is None


def test_the_two_oracles_agree():
    """torch's kernel and a torch.amp.GradScaler driven step by step: the same states."""
    for _, factors, flags in L._SCALER_CASES[:3]:
        kernel = L._oracle_sequence(flags, factors)
        scaler = L._oracle_with_grad_scaler(flags, factors["growth_factor"],
                                            factors["backoff_factor"],
                                            factors["growth_interval"])
        assert kernel == scaler


# ------------------------------------------------------------------------------------------------
# wrong sequence-parallel pairs (module level: the workers import them)
# ------------------------------------------------------------------------------------------------


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the features (tensor parallelism's gather), not the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        r, w = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(w, dim=-1)[r].contiguous(), None


def gather_last_dim(x, group=None):
    return _GatherLastDim.apply(x, group)


class _GatherSplitBack(torch.autograd.Function):
    """Backward keeps this rank's block of its own gradient: no sum over the ranks."""

    forward = staticmethod(S.EnterTPRegion.forward)

    @staticmethod
    def backward(ctx, grad):
        r, w = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(w, dim=1)[r].contiguous(), None


def gather_splits_backward(x, group=None):
    return _GatherSplitBack.apply(x, group)


class _GatherGatherBack(torch.autograd.Function):
    """Backward all-gathers instead of reduce-scattering."""

    forward = staticmethod(S.EnterTPRegion.forward)

    @staticmethod
    def backward(ctx, grad):
        return S._gather(grad, ctx.group), None


def gather_gathers_backward(x, group=None):
    return _GatherGatherBack.apply(x, group)


class _GatherFromTheEnd(torch.autograd.Function):
    """Joins block -r at position r: rank order at 2 ranks, not at 3."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        w = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat([parts[-r] for r in range(w)], dim=1)

    backward = staticmethod(S.EnterTPRegion.backward)


def gather_from_the_end(x, group=None):
    return _GatherFromTheEnd.apply(x, group)


class _ScatterByAllReduce(torch.autograd.Function):
    """All-reduce the whole tensor, keep this rank's block: right values, twice the bytes."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        r, w = dist.get_rank(group), dist.get_world_size(group)
        if x.shape[1] % w:
            raise ValueError("the sequence length is not divisible by the world size")
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(w, dim=1)[r].contiguous()

    backward = staticmethod(S.LeaveTPRegion.backward)


def scatter_by_all_reduce(x, group=None):
    return _ScatterByAllReduce.apply(x, group)


class _ScatterPadsBack(torch.autograd.Function):
    """Backward puts this rank's gradient at its block and zeros elsewhere (a split's adjoint)."""

    forward = staticmethod(S.LeaveTPRegion.forward)

    @staticmethod
    def backward(ctx, grad):
        r, w = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        full = torch.zeros(grad.shape[0], grad.shape[1] * w, *grad.shape[2:], dtype=grad.dtype)
        full.chunk(w, dim=1)[r].copy_(grad)
        return full, None


def scatter_pads_backward(x, group=None):
    return _ScatterPadsBack.apply(x, group)


class _ScatterNoCheck(torch.autograd.Function):
    """Takes T // t positions per rank: drops the rest instead of refusing."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        w = dist.get_world_size(group)
        per = x.shape[1] // w
        blocks = torch.stack([x[:, k * per:(k + 1) * per] for k in range(w)])
        out = torch.empty_like(blocks[0])
        dist.reduce_scatter(out, list(blocks.unbind(0)), group=group)
        return out

    backward = staticmethod(S.LeaveTPRegion.backward)


def scatter_without_size_check(x, group=None):
    return _ScatterNoCheck.apply(x, group)


class _GatherIgnoresGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return S._gather(x, None)                    # the whole world, whatever the group

    @staticmethod
    def backward(ctx, grad):
        return S._reduce_scatter(grad, None), None


def gather_ignores_group(x, group=None):
    return _GatherIgnoresGroup.apply(x, group)


def gather_scaffold(x, group=None):  # notebook 15's scaffold, not yet written
    raise NotImplementedError("EnterTPRegion.forward")


def scatter_scaffold(x, group=None):
    raise NotImplementedError("LeaveTPRegion.forward")


_G, _R = S.enter_tp_region, S.leave_tp_region

#: (what, (enter_tp_region, leave_tp_region), {world size: a part of the verdict, or None for
#: "right", or UNANSWERED})
_VERDICTS = [
    ("gathers along the features", (gather_last_dim, _R),
     {2: "enter_tp_region(x of shape (2, 6, 5)): returned a tensor of shape (2, 6, 10), expected "
         "(2, 12, 5). The blocks were joined along the last dimension"}),
    ("backward splits instead of reduce-scatter", (gather_splits_backward, _R),
     {3: "It is this rank's block of its own upstream gradient only"}),
    ("backward all-gathers instead of reduce-scatter", (gather_gathers_backward, _R),
     {2: "backward raised RuntimeError: Function _GatherGatherBackBackward returned an invalid "
         "gradient at index 0"}),
    ("blocks counted from the end", (gather_from_the_end, _R),
     {2: None, 3: "Its blocks along the sequence are those of ranks [0, 2, 1]"}),
    ("reduce-scatter by all-reduce", (_G, scatter_by_all_reduce),
     {2: "forward made all_reduce of 120 elements; expected exactly one reduce-scatter. An "
         "all-reduce moves twice the bytes"}),
    ("reduce-scatter pads its gradient", (_G, scatter_pads_backward),
     {3: "Only this rank's positions got a gradient (its own), zeros elsewhere"}),
    ("reduce-scatter refuses nothing", (_G, scatter_without_size_check),
     {2: "leave_tp_region(x) with x of shape (2, 7, 5) did not raise"}),
    ("gather ignores the group", (gather_ignores_group, _R),
     {2: "group=a group of this rank alone): returned a tensor of shape (2, 12, 5), expected "
         "(2, 6, 5). The group given has this rank alone"}),
    ("scaffolds", (gather_scaffold, scatter_scaffold), {2: UNANSWERED}),
]
_ROWS = [(what, L._sequence_cases, answers, expected) for what, answers, expected in _VERDICTS]


def test_sequence_parallel_solution_passes():
    assert check_sequence_parallel_block(S.enter_tp_region, S.leave_tp_region)


def test_wrong_sequence_parallel_pairs_get_their_reasons():
    found = first_failure_in_ranks(verdicts_as_expected, _ROWS, (2, 3), (15,),
                                   timeout=120.0, hang_hint="", hint="")
    assert found is None, found


def test_sequence_parallel_not_answered_and_refused():
    assert check_sequence_parallel_block(None, "my_sequence:leave_tp_region").ok is None
    assert check_sequence_parallel_block("my_sequence:enter_tp_region", None).ok is None

    def answer(x, group=None):
        return x

    answer.__module__ = "__main__"
    result = check_sequence_parallel_block(answer, S.leave_tp_region)
    assert result.ok is False and "%%writefile my_sequence.py" in result.message


_CODE = ("save_for_backward", "get_rng_state", "set_rng_state", "fork_rng", "enable_grad",
         "no_grad", ".apply", "detach", "requires_grad_", "autograd.backward", ".grad",
         "* backoff_factor", "* growth_factor", "tracker + 1", "tracker = 0", "torch.stack",
         "chunk(", "torch.cat", "all_gather_into_tensor(", "reduce_scatter_tensor(", "get_rank(",
         "get_world_size(", "dim=1")


@pytest.mark.parametrize("hint", ["_CKPT_HINT", "_SCALER_HINT", "_SEQ_HINT"])
def test_hints_point_at_the_idea_without_the_code(hint):
    text = getattr(L, hint)
    assert not [c for c in _CODE if c in text], text
