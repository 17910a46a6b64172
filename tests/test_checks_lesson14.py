"""Lesson 14's checkers: the reference answers pass, realistic wrong answers fail with a reason.

The wrong answers are small variations of ``solutions/lesson14.py`` defined here, at module
level, so that worker processes can import them by name. A launch per wrong answer would cost a
second or more on a loaded machine: one launch (a group of 2 ranks, then of 3) runs every wrong
answer through its checker's worker in turn and compares each verdict with the one expected
(``_VERDICTS``); the public checkers are called for the reference answers, the scaffolds and one
wrong answer.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.checks import check_conjugates, check_megatron_mlp, check_parallel_linears
from course_lib.checks import lesson14 as L
from course_lib.checks._launch import UNANSWERED, first_failure_in_ranks
from solutions import lesson14 as S

# ------------------------------------------------------------------------------------------------
# wrong f and g
# ------------------------------------------------------------------------------------------------


def f_reduces_forward(x, group=None):
    """f written as g: the all-reduce in forward instead of backward."""
    return S.Reduce.apply(x, group)


class _AverageBackward(torch.autograd.Function):
    forward = staticmethod(S.Copy.forward)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / dist.get_world_size(ctx.group), None


def f_averages(x, group=None):
    """The gradient averaged over the ranks instead of summed."""
    return _AverageBackward.apply(x, group)


class _CopyIgnoringGroup(torch.autograd.Function):
    forward = staticmethod(S.Copy.forward)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)                      # over the whole world, whatever the group
        return grad, None


def f_ignores_group(x, group=None):
    return _CopyIgnoringGroup.apply(x, group)


class _ReduceInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)            # into the tensor autograd saved
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def g_in_place(x, group=None):
    return _ReduceInPlace.apply(x, group)


class _ReduceBothWays(torch.autograd.Function):
    forward = staticmethod(S.Reduce.forward)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


def g_reduces_both_ways(x, group=None):
    return _ReduceBothWays.apply(x, group)


def f_scaffold(x, group=None):  # notebook 14's scaffold, not yet written
    raise NotImplementedError("f: identity forward, all-reduce of the gradient backward")


def g_scaffold(x, group=None):
    raise NotImplementedError("g: all-reduce forward, identity backward")


# ------------------------------------------------------------------------------------------------
# wrong parallel linears
# ------------------------------------------------------------------------------------------------


class BiasBeforeReduce(S.RowParallelLinear):
    """Every rank adds the bias before the all-reduce: t*b."""

    def forward(self, x):
        return S.g(F.linear(x, self.weight, self.bias), self.group)


class BiasShared(S.RowParallelLinear):
    """Every rank adds b/t before the all-reduce: the right output, 1/t of the bias gradient."""

    def forward(self, x):
        share = self.bias / dist.get_world_size(self.group)
        return S.g(F.linear(x, self.weight, share), self.group)


class _Column(S.ColumnParallelLinear):
    """A column-parallel layer whose shards ``blocks(linear, group)`` chooses."""

    def __init__(self, linear, group=None):
        nn.Module.__init__(self)
        self.group = group
        weight, bias = self.blocks(linear, group)
        self.weight = nn.Parameter(weight.clone())
        self.bias = None if bias is None else nn.Parameter(bias.clone())


class SlicesColumns(_Column):
    """Keeps a block of columns of the weight (and no check of sizes)."""

    @staticmethod
    def blocks(linear, group):
        per = linear.in_features // dist.get_world_size(group)
        r = dist.get_rank(group)
        bias = None if linear.bias is None else linear.bias.detach()
        return linear.weight.detach()[:, r * per:(r + 1) * per], bias


class HardCodedTwo(_Column):
    """Splits the rows in two halves, whatever the world size: right on 2 ranks only."""

    @staticmethod
    def blocks(linear, group):
        if linear.out_features % dist.get_world_size(group):
            raise ValueError("out_features is not divisible by the world size")
        per, r = linear.out_features // 2, dist.get_rank(group)
        rows = slice(r * per, (r + 1) * per)
        return linear.weight.detach()[rows], \
            None if linear.bias is None else linear.bias.detach()[rows]


class ChunkFromTheEnd(_Column):
    """Takes chunk -r, counting from the wrong end: right on 1 and 2 ranks only."""

    @staticmethod
    def blocks(linear, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % t:
            raise ValueError("out_features is not divisible by the world size")
        return linear.weight.detach().chunk(t)[-r], \
            None if linear.bias is None else linear.bias.detach().chunk(t)[-r]


class NoSizeCheck(_Column):
    """Floors out/t: never refuses a size the world size does not divide."""

    @staticmethod
    def blocks(linear, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        per = linear.out_features // t
        rows = slice(r * per, (r + 1) * per)
        return linear.weight.detach()[rows], \
            None if linear.bias is None else linear.bias.detach()[rows]


class ChecksInFeatures(S.ColumnParallelLinear):
    """Refuses an in_features the world size does not divide: the size it does not split."""

    def __init__(self, linear, group=None):
        if linear.in_features % dist.get_world_size(group):
            raise ValueError(f"in_features = {linear.in_features} is not divisible by the "
                             "world size.")
        super().__init__(linear, group)


class WorldNotGroup(_Column):
    """Takes the rank and size of the whole world, not of the group."""

    @staticmethod
    def blocks(linear, group):
        return S.ColumnParallelLinear(linear).weight.detach(), \
            None if linear.bias is None else S.ColumnParallelLinear(linear).bias.detach()


class NoF(S.ColumnParallelLinear):
    """Forgets f: the input's gradient is this rank's part only."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class KeepsView(S.ColumnParallelLinear):
    """Its shard is a view of the full weight: the whole weight stays in memory."""

    def __init__(self, linear, group=None):
        super().__init__(linear, group)
        per, r = self.weight.shape[0], dist.get_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[r * per:(r + 1) * per])


class KeepsLinear(S.ColumnParallelLinear):
    """Keeps the whole nn.Linear as a submodule besides its shard."""

    def __init__(self, linear, group=None):
        super().__init__(linear, group)
        self.linear = linear


class ColumnScaffold(S.ColumnParallelLinear):  # notebook 14's scaffold, not yet written
    def __init__(self, linear, group=None):
        nn.Module.__init__(self)
        raise NotImplementedError("ColumnParallelLinear.__init__")


class RowScaffold(S.RowParallelLinear):
    def __init__(self, linear, group=None):
        nn.Module.__init__(self)
        raise NotImplementedError("RowParallelLinear.__init__")


# ------------------------------------------------------------------------------------------------
# wrong Megatron MLPs
# ------------------------------------------------------------------------------------------------


class _GatherLast(torch.autograd.Function):
    """All-gather of the last dimension forward, this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        r, w = dist.get_rank(ctx.group), grad.shape[-1] // dist.get_world_size(ctx.group)
        return grad[..., r * w:(r + 1) * w].contiguous(), None


class _GatheringMLP(nn.Module):
    """fc with gather_output: the full hidden layer on every rank, then proj on this rank's
    block of it. Right values, one all-gather too many."""

    def __init__(self, mlp, group):
        super().__init__()
        self.group = group
        self.fc = S.ColumnParallelLinear(mlp.fc, group)
        self.proj = S.RowParallelLinear(mlp.proj, group)

    def forward(self, x):
        h = F.gelu(_GatherLast.apply(self.fc(x), self.group))       # (B, T, 4C)
        r, w = dist.get_rank(self.group), h.shape[-1] // dist.get_world_size(self.group)
        return self.proj(h[..., r * w:(r + 1) * w])


def mlp_gathers(mlp, group=None):
    return _GatheringMLP(mlp, group)


def mlp_of_chunks_from_the_end(mlp, group=None):
    """fc split by ChunkFromTheEnd: right on 2 ranks, wrong on 3."""
    mlp.fc = ChunkFromTheEnd(mlp.fc, group)
    mlp.proj = S.RowParallelLinear(mlp.proj, group)
    return mlp


def mlp_unchanged(mlp, group=None):
    """Returns the MLP as it came: every rank computes all of it."""
    return mlp


def mlp_scaffold(mlp, group=None):  # notebook 14's scaffold, not yet written
    raise NotImplementedError("parallel_mlp")


# ------------------------------------------------------------------------------------------------
# the verdicts expected, world size by world size
# ------------------------------------------------------------------------------------------------

_F_AND_G = "_conjugate_cases"
_LINEARS = "_linear_cases"
_MLP = "_mlp_cases"
_ROW, _COLUMN = S.RowParallelLinear, S.ColumnParallelLinear

#: (what, the checker's worker, the answers it gets, {world size: a part of the verdict, or
#: None for "right", or UNANSWERED})
_VERDICTS = [
    ("f all-reduces forward", _F_AND_G, (f_reduces_forward, S.g),
     {2: "f's forward is the identity; its all-reduce belongs in its backward"}),
    ("f averages", _F_AND_G, (f_averages, S.g),
     {3: "the average of the ranks' gradients, not their sum"}),
    ("f ignores the group", _F_AND_G, (f_ignores_group, S.g),
     {2: "f(x, group=a group of this rank alone): the input's gradient"}),
    ("g in place", _F_AND_G, (S.f, g_in_place), {2: "g changed its input in place"}),
    ("g reduces both ways", _F_AND_G, (S.f, g_reduces_both_ways),
     {3: "g's backward is the identity"}),
    ("f and g scaffolds", _F_AND_G, (f_scaffold, g_scaffold), {2: UNANSWERED}),
    ("row adds the bias before g", _LINEARS, (_COLUMN, BiasBeforeReduce),
     {2: "It holds the bias 2 times (t*b instead of b)", 3: "It holds the bias 3 times"}),
    ("row shares the bias before g", _LINEARS, (_COLUMN, BiasShared),
     {3: "self.bias.grad is", 2: "It is 1/2 of it"}),
    ("column slices columns", _LINEARS, (SlicesColumns, _ROW),
     {2: "You kept every row and split the columns"}),
    ("column hard-codes two ranks", _LINEARS, (HardCodedTwo, _ROW),
     {2: "group=a group of this rank alone): self.weight has shape (12, 7), expected (24, 7)",
      3: "rank 0, ColumnParallelLinear(nn.Linear(7, 24)): self.weight has shape (12, 7), "
         "expected (8, 7)"}),
    ("column counts chunks from the end", _LINEARS, (ChunkFromTheEnd, _ROW),
     {2: None, 3: "rank 1, ColumnParallelLinear(nn.Linear(7, 24)): self.weight is"}),
    ("MLP of chunks from the end", _MLP, mlp_of_chunks_from_the_end,
     {2: None, 3: "rank 1, MLP(GPTConfig(n_embd=12)), fc: self.weight is"}),
    ("column forgets f", _LINEARS, (NoF, _ROW), {2: "It is this rank's part only"}),
    ("column refuses nothing", _LINEARS, (NoSizeCheck, _ROW),
     {3: "ColumnParallelLinear(nn.Linear(7, 19)) did not raise"}),
    ("column refuses the size it does not split", _LINEARS, (ChecksInFeatures, _ROW),
     {2: "the constructor raised ValueError: in_features = 7 is not divisible by the world "
         "size. Here out_features = 24 is divisible by the world size"}),
    ("column ignores the group", _LINEARS, (WorldNotGroup, _ROW),
     {2: "With a group of one rank the layer is the whole nn.Linear"}),
    ("column keeps a view", _LINEARS, (KeepsView, _ROW), {2: "keep a copy of the slice"}),
    ("column keeps the nn.Linear", _LINEARS, (KeepsLinear, _ROW),
     {2: "did it keep the whole nn.Linear"}),
    ("linear scaffolds", _LINEARS, (ColumnScaffold, RowScaffold), {2: UNANSWERED}),
    ("MLP gathers between fc and proj", _MLP, mlp_gathers,
     {3: "all_gather of 96 elements, all_reduce of 72 elements in forward and all_reduce of "
         "72 elements in backward. That communicates more than Megatron's MLP"}),
    ("MLP left whole", _MLP, mlp_unchanged, {2: "It is the whole weight's shape"}),
    ("MLP scaffold", _MLP, mlp_scaffold, {2: UNANSWERED}),
]


def _verdicts_as_expected(table: list, seed: int) -> str | None:
    """In every rank of a group: each wrong answer of ``table`` through its checker's worker
    (the ranks agree on every verdict, so they stay in step); what differed, or None."""
    world = dist.get_world_size()
    differ = []
    for what, worker, answers, expected in table:
        if world not in expected:
            continue
        got, want = getattr(L, worker)(answers, seed), expected[world]
        right = got is None if want is None else got is not None and want in got
        if not right:
            differ.append(f"{what}, world_size={world}: expected {want!r}, got {got!r}")
    return "\n".join(differ) or None


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------


def test_solutions_pass_the_three_checkers():
    assert check_conjugates(S.f, S.g)
    assert check_parallel_linears(S.ColumnParallelLinear, S.RowParallelLinear)
    assert check_megatron_mlp(S.parallel_mlp)


def test_wrong_answers_get_their_reasons():
    found = first_failure_in_ranks(_verdicts_as_expected, _VERDICTS, (2, 3), (14,),
                                   timeout=120.0, hang_hint="", hint="")
    assert found is None, found


def test_a_wrong_answer_gets_its_world_size_and_the_hint(capsys):
    result = check_conjugates(f_reduces_forward, S.g, world_sizes=(2,))
    assert result.ok is False
    assert result.message.startswith("world_size=2, rank 0, f(x): forward returned")
    assert "Hint: write each as a torch.autograd.Function" in result.message
    assert "[conjugates f and g] not yet right" in capsys.readouterr().out


def test_not_answered_yet():
    assert check_conjugates(None, "my_conjugate:g").ok is None
    assert check_conjugates("my_conjugate:f", None).ok is None
    assert check_parallel_linears(None, None).ok is None
    assert check_megatron_mlp(None).ok is None


def test_scaffolds_are_not_answered_yet():
    assert check_conjugates(f_scaffold, g_scaffold, world_sizes=(2,)).ok is None
    assert check_parallel_linears(ColumnScaffold, RowScaffold, world_sizes=(2,)).ok is None


@pytest.mark.parametrize("call, file", [
    (lambda fn: check_conjugates(fn, S.g), "my_conjugate"),
    (lambda fn: check_conjugates(S.f, fn), "my_conjugate"),
    (lambda cls: check_parallel_linears(S.ColumnParallelLinear, cls), "my_linears"),
    (lambda fn: check_megatron_mlp(fn), "my_mlp"),
])
def test_an_answer_defined_in_the_notebook_is_refused_with_what_to_do(call, file):
    def answer(x, group=None):
        return x

    answer.__module__ = "__main__"
    result = call(answer)
    assert result.ok is False
    assert f"%%writefile {file}.py" in result.message, result.message


def test_a_string_without_a_colon_is_refused():
    result = check_megatron_mlp("my_mlp.parallel_mlp")
    assert result.ok is False and "'my_mlp:parallel_mlp'" in result.message
