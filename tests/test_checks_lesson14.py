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

from course_lib import checks
from course_lib.checks import (
    check_conjugates,
    check_megatron_mlp,
    check_parallel_linears,
    check_vocab_parallel_cross_entropy,
)
from course_lib.checks import lesson14 as L
from course_lib.checks.harness import UNANSWERED, first_failure_in_ranks, verdicts_as_expected
from course_lib.distributed.tensor.parallel import vocab_parallel_cross_entropy
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
# wrong vocabulary-parallel cross-entropies
# ------------------------------------------------------------------------------------------------


def _vocab_loss(logits_shard, targets, group=None, *, shift="max", owner="block", sums="g",
                target_sum="g", divide="positions", ranks_of=None):
    """``S.vocab_parallel_cross_entropy`` with one step done wrong (each keyword's default is the
    right way): ``shift`` "max" (the largest of the vocabulary, all-reduced), "none", "local"
    (this block's largest), "batch" (one largest for the whole batch) or "tracked" (the max
    all-reduced with its gradient); ``owner`` "block" (targets in this block), "every" (the
    index masked, the value not: every rank adds a logit) or "one-sided" (rank 0 holds the
    targets below its end, every other rank those from its start on: right with two ranks);
    ``sums`` "g", "direct" (dist.all_reduce on the tensor autograd follows) or "detached" (on a
    detached copy: no gradient through the sum); ``target_sum`` "g" or "none" (each rank its
    own share); ``divide`` "positions" or "first" (by the first dimension only); ``ranks_of``
    None (the group) or "world"."""
    g_group = None if ranks_of == "world" else group
    rank = dist.get_rank(g_group)
    per = logits_shard.shape[-1]
    start = rank * per
    if shift == "none":
        shifted = logits_shard
    else:
        m = logits_shard.amax(dim=-1) if shift == "tracked" else logits_shard.detach().amax(-1)
        if shift == "batch":
            m = m.amax().expand_as(m).clone()
        if shift != "local":
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=g_group)
        shifted = logits_shard - m.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    if sums == "g":
        sum_exp = S.g(sum_exp, g_group)
    else:
        if sums == "detached":
            sum_exp = sum_exp.detach().clone()
        dist.all_reduce(sum_exp, group=g_group)
    if owner == "one-sided":
        here = targets < start + per if rank == 0 else targets >= start
    else:
        here = (targets >= start) & (targets < start + per)
    local = (targets - start).clamp(0, per - 1) if owner == "one-sided" else \
        (targets - start).masked_fill(~here, 0)
    target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    if owner != "every":
        target = target.masked_fill(~here, 0.0)
    if target_sum == "g":
        target = S.g(target, g_group)
    losses = sum_exp.log() - target
    return losses.sum() / logits_shard.shape[0] if divide == "first" else losses.mean()


def loss_without_shift(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, shift="none")


def loss_shifted_by_its_own_max(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, shift="local")


def loss_one_shift_for_the_batch(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, shift="batch")


def loss_max_with_its_gradient(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, shift="tracked")


def loss_target_from_every_rank(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, owner="every")


def loss_of_one_sided_blocks(logits_shard, targets, group=None):
    """Right with two ranks, wrong with three (rank 1 then also claims rank 2's targets)."""
    return _vocab_loss(logits_shard, targets, group, owner="one-sided")


def loss_summed_by_dist_all_reduce(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, sums="direct")


def loss_summed_as_a_detached_copy(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, sums="detached")


def loss_target_left_on_its_rank(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, target_sum="none")


def loss_divided_by_the_first_dimension(logits_shard, targets, group=None):
    """Right for (N, V/t), wrong for (B, T, V/t)."""
    return _vocab_loss(logits_shard, targets, group, divide="first")


def loss_of_the_world(logits_shard, targets, group=None):
    return _vocab_loss(logits_shard, targets, group, ranks_of="world")


def loss_of_gathered_logits(logits_shard, targets, group=None):
    """Right values and gradients, but every rank receives every logit."""
    logits = _GatherLast.apply(logits_shard, group)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss_scaffold(logits_shard, targets, group=None):  # notebook 14's scaffold, not yet written
    raise NotImplementedError("vocab_parallel_cross_entropy")


# ------------------------------------------------------------------------------------------------
# the verdicts expected, world size by world size
# ------------------------------------------------------------------------------------------------

_F_AND_G = "_conjugate_cases"
_LINEARS = "_linear_cases"
_MLP = "_mlp_cases"
_LOSS = "_loss_cases"
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
    ("column keeps a view", _LINEARS, (KeepsView, _ROW), {2: "a shard must own its memory"}),
    ("column keeps the nn.Linear", _LINEARS, (KeepsLinear, _ROW),
     {2: "did it keep the whole nn.Linear"}),
    ("linear scaffolds", _LINEARS, (ColumnScaffold, RowScaffold), {2: UNANSWERED}),
    ("MLP gathers between fc and proj", _MLP, mlp_gathers,
     {3: "all_gather of 96 elements, all_reduce of 72 elements in forward and all_reduce of "
         "72 elements in backward. That communicates more than Megatron's MLP"}),
    ("MLP left whole", _MLP, mlp_unchanged, {2: "It is the whole weight's shape"}),
    ("MLP scaffold", _MLP, mlp_scaffold, {2: UNANSWERED}),
    ("the course's loss", _LOSS, vocab_parallel_cross_entropy, {2: None, 3: None}),
    ("loss without the shift", _LOSS, loss_without_shift,
     {2: "rank 0, vocab_parallel_cross_entropy(logits_shard (6, 12), targets (6,)): the loss "
         "is inf, expected"}),
    ("loss shifted by each rank's own max", _LOSS, loss_shifted_by_its_own_max,
     {2: "shifting each rank's block by its own largest logit",
      3: "shifting each rank's block by its own largest logit"}),
    ("loss with one shift for the whole batch", _LOSS, loss_one_shift_for_the_batch,
     {2: "targets (2, 3)): the loss is -inf"}),
    ("loss with the max's gradient", _LOSS, loss_max_with_its_gradient,
     {2: "forward handed an all-reduce (MAX) a tensor that requires grad"}),
    ("loss with a target logit from every rank", _LOSS, loss_target_from_every_rank,
     {2: "adding up a target logit from every rank"}),
    ("loss of one-sided blocks", _LOSS, loss_of_one_sided_blocks,
     {2: None, 3: "world_size=3, rank 0, vocab_parallel_cross_entropy(logits_shard (6, 8), "
                  "targets (6,)): the loss is"}),
    ("loss summed by dist.all_reduce", _LOSS, loss_summed_by_dist_all_reduce,
     {2: "forward handed all_reduce a tensor that requires grad"}),
    ("loss summed as a detached copy", _LOSS, loss_summed_as_a_detached_copy,
     {2: "has the target's part (-1/N at the target) but not the softmax's"}),
    ("loss with the target left on its rank", _LOSS, loss_target_left_on_its_rank,
     {3: "the ranks returned different losses"}),
    ("loss divided by the first dimension", _LOSS, loss_divided_by_the_first_dimension,
     {2: "targets (2, 3)): the loss is", 3: "divided by 2 instead of 6"}),
    ("loss of the whole world", _LOSS, loss_of_the_world,
     {2: "With a group of one rank the shard is the whole vocabulary"}),
    ("loss of the gathered logits", _LOSS, loss_of_gathered_logits,
     {2: "That sends the logits themselves: V/t = 12 numbers per position instead of 3"}),
    ("loss scaffold", _LOSS, loss_scaffold, {2: UNANSWERED}),
]
_ROWS = [(what, getattr(L, worker), answers, expected)
         for what, worker, answers, expected in _VERDICTS]


# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------


def test_solutions_pass_the_four_checkers():
    assert check_conjugates(S.f, S.g)
    assert check_parallel_linears(S.ColumnParallelLinear, S.RowParallelLinear)
    assert check_megatron_mlp(S.parallel_mlp)
    assert check_vocab_parallel_cross_entropy(S.vocab_parallel_cross_entropy)


def test_wrong_answers_get_their_reasons():
    found = first_failure_in_ranks(verdicts_as_expected, _ROWS, (2, 3), (14,),
                                   timeout=120.0, hang_hint="", hint="")
    assert found is None, found


def test_a_wrong_answer_gets_its_world_size_and_the_hint(capsys):
    result = check_conjugates(f_reduces_forward, S.g, world_sizes=(2,))
    assert result.ok is False
    assert result.message.startswith("world_size=2, rank 0, f(x): forward returned")
    assert "Hint: f and g are there for autograd" in result.message
    assert "[conjugates f and g] not yet right" in capsys.readouterr().out


def test_not_answered_yet():
    assert check_conjugates(None, "my_conjugate:g").ok is None
    assert check_conjugates("my_conjugate:f", None).ok is None
    assert check_parallel_linears(None, None).ok is None
    assert check_megatron_mlp(None).ok is None
    assert check_vocab_parallel_cross_entropy(None).ok is None
    assert checks.check_vocab_parallel_cross_entropy is check_vocab_parallel_cross_entropy


def test_scaffolds_are_not_answered_yet():
    assert check_conjugates(f_scaffold, g_scaffold, world_sizes=(2,)).ok is None
    assert check_parallel_linears(ColumnScaffold, RowScaffold, world_sizes=(2,)).ok is None


@pytest.mark.parametrize("call, file", [
    (lambda fn: check_conjugates(fn, S.g), "my_conjugate"),
    (lambda fn: check_conjugates(S.f, fn), "my_conjugate"),
    (lambda cls: check_parallel_linears(S.ColumnParallelLinear, cls), "my_linears"),
    (lambda fn: check_megatron_mlp(fn), "my_mlp"),
    (lambda fn: check_vocab_parallel_cross_entropy(fn), "my_loss"),
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


#: what a hint may not print: the code of an answer (the reviewer's rule: the idea, not the fix)
_CODE = ("F.linear", "view_as", ".clone", ".apply", "ColumnParallelLinear(", "RowParallelLinear(",
         "get_rank(", "get_world_size(", "all_reduce(", "ReduceOp", "nn.Parameter(", "masked_fill",
         "amax", "logsumexp", "detach", "f(x", "g(x", "g(F", "mlp.fc =", "mlp.proj =")


@pytest.mark.parametrize("hint", ["_CONJUGATES_HINT", "_LINEARS_HINT", "_MLP_HINT", "_LOSS_HINT"])
def test_hints_point_at_the_idea_without_the_code(hint):
    text = getattr(L, hint)
    assert not [c for c in _CODE if c in text], text
