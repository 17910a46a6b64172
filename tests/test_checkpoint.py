"""course_lib.utils.checkpoint against running without it and against torch's own checkpoint;
the bytes saved for backward measured against Korthikanti et al.'s formula.

In float64 the gradients of a checkpointed block equal the plain block's and
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``'s to rounding (1e-12), dropout
included: the random state is restored before recomputing, so the same mask is drawn
(with ``preserve_rng_state=False`` it is not, and the gradients differ).

Memory. The paper counts sbh(34 + 5as/h) bytes per layer for 16-bit activations and 1-byte
dropout masks. The course GPT (``course_lib.models.gpt.Block``) has no dropout, so the terms it
lacks are the two 1-byte dropout masks after attention and after the MLP (2sbh) and the softmax
dropout's mask and output (as^2b + 2as^2b): sbh(32 + 2as/h) bytes at 2 bytes an element, i.e.
e * (16sbh + as^2b) at e bytes an element. What it saves beyond the paper: each LayerNorm's mean
and 1/std (2sb elements each, 4sb in all) and the (s, s) boolean causal mask (s^2 bytes). The
measured count must equal adapted formula + these exactly, and the formula alone within 2%
(here 4sb e + s^2 over e(16sbh + as^2b) is 0.9%).
"""
import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from course_lib.models import GPT, GPTConfig
from course_lib.models.gpt import Block
from course_lib.utils import (
    activation_memory_per_layer,
    checkpoint,
    saved_tensor_bytes,
    selective_attention,
    selective_recompute,
)

F64 = dict(rtol=1e-12, atol=1e-12)
S, B, H, A = 16, 3, 24, 6                  # sequence, batch, width, heads
E = 8                                      # bytes of a float64


class DropoutBlock(nn.Module):
    """A GPT block with dropout on both residual branches, as GPT-2 has."""

    def __init__(self, config, p=0.3):
        super().__init__()
        self.block, self.p = Block(config), p

    def forward(self, x):
        b = self.block
        x = x + nn.functional.dropout(b.attn(b.ln_1(x)), self.p, training=True)
        return x + nn.functional.dropout(b.mlp(b.ln_2(x)), self.p, training=True)


def _config():
    return GPTConfig(n_embd=H, n_head=A, block_size=S)


def _grads(module, x_data, run, seed=7):
    """Input and parameter gradients of sum(run(module, x) * w), dropout drawn from ``seed``;
    and a number drawn after backward (the caller's random stream must not be disturbed)."""
    module.zero_grad(set_to_none=True)
    x = x_data.clone().requires_grad_()
    w = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)
    torch.manual_seed(seed)
    y = run(module, x)
    torch.rand(5)                          # draw between forward and backward
    (y * w).sum().backward()
    after = torch.rand(3)
    return [x.grad, *(p.grad for p in module.parameters())], after


def _assert_all_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **F64)


@pytest.fixture
def block_and_input():
    torch.manual_seed(0)
    return DropoutBlock(_config()).double(), torch.randn(B, S, H, dtype=torch.float64)


def test_checkpoint_equals_plain_and_torch_with_dropout(block_and_input):
    block, x = block_and_input
    plain, plain_after = _grads(block, x, lambda m, x: m(x))
    ours, ours_after = _grads(block, x, lambda m, x: checkpoint(m, x))
    theirs, _ = _grads(block, x, lambda m, x: torch_checkpoint.checkpoint(m, x,
                                                                          use_reentrant=False))
    _assert_all_close(ours, plain)
    _assert_all_close(ours, theirs)
    assert all(g.abs().sum() > 0 for g in ours)
    torch.testing.assert_close(ours_after, plain_after, rtol=0, atol=0)   # stream untouched


def test_without_rng_restore_dropout_draws_another_mask(block_and_input):
    block, x = block_and_input
    plain, _ = _grads(block, x, lambda m, x: m(x))
    ours, _ = _grads(block, x, lambda m, x: checkpoint(m, x, preserve_rng_state=False))
    assert not torch.allclose(ours[0], plain[0])


def test_checkpoint_tuple_outputs_and_non_tensor_arguments():
    torch.manual_seed(1)
    lin = nn.Linear(4, 4).double()
    x0 = torch.randn(2, 4, dtype=torch.float64)

    def f(x, scale, y):
        h = lin(x) * scale
        return h.tanh(), h * y

    grads = []
    for wrap in (lambda *a: f(*a), lambda *a: checkpoint(f, *a)):
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y = torch.full((2, 4), 3.0, dtype=torch.float64)        # needs no gradient
        a, b = wrap(x, 2.5, y)
        (a.sum() + (b * b).sum()).backward()
        grads.append([x.grad, lin.weight.grad, lin.bias.grad])
    _assert_all_close(grads[1], grads[0])


def test_checkpoint_recomputes_under_the_callers_autocast():
    """Backward runs on autograd's thread: the recompute must re-enter bfloat16 autocast, or
    it would run in float32 and the gradients would differ from the plain run's."""
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x0 = torch.randn(4, 8)
    grads = []
    for wrap in (lambda x: mlp(x), lambda x: checkpoint(mlp, x)):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = wrap(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append([x.grad, *(p.grad for p in mlp.parameters())])
    for g, w in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_selective_recompute_gpt_gradients_equal_plain():
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=48, block_size=S, n_layer=2, n_head=A, n_embd=H)).double()
    idx = torch.randint(0, 48, (B, S))
    results = []
    for enabled in (False, True):
        selective_recompute(model, enabled)
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, idx)
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    assert all(a.core_attention is selective_attention for a in
               (b.attn for b in model.blocks))
    _assert_all_close(results[1], results[0])


def _paper_adapted(s, b, h, a, recompute="none"):
    """The paper's bytes per layer, without the terms the course GPT lacks (dropout), at E
    bytes an element instead of 2."""
    paper = activation_memory_per_layer(s, b, h, a, recompute=recompute)
    if recompute == "none":
        paper -= 2 * s * b * h + 3 * a * s * s * b     # dropout masks; softmax dropout
    elif recompute == "selective":
        paper -= 2 * s * b * h                         # dropout masks
    return paper * E / 2


def test_saved_bytes_per_layer_beside_the_formula():
    torch.manual_seed(3)
    block = Block(_config()).double()
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    layer_norm_stats, mask = 4 * S * B * E, S * S
    cases = {
        "none": (lambda x: block(x), layer_norm_stats + mask),
        "selective": (lambda x: selective_recompute(block)(x), layer_norm_stats),
        "full": (lambda x: checkpoint(block, x), 0),
    }
    for recompute, (run, extra) in cases.items():
        measured = saved_tensor_bytes(run, x, exclude=block.parameters())
        formula = _paper_adapted(S, B, H, A, recompute)
        assert measured == formula + extra, (recompute, measured, formula, extra)
        assert abs(measured - formula) <= 0.02 * formula, (recompute, measured, formula)
    assert saved_tensor_bytes(lambda x: checkpoint(block, x), x) == x.nbytes   # inputs only


def test_formula_matches_the_paper_table():
    s, b, h, a, t = 2048, 1, 12288, 96, 8                     # GPT-3 175B, t = 8
    sbh = s * b * h
    assert activation_memory_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_memory_per_layer(s, b, h, a, t=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert activation_memory_per_layer(s, b, h, a, t=t, sequence_parallel=True) == \
        pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert activation_memory_per_layer(s, b, h, a, t=t, sequence_parallel=True,
                                       recompute="selective") == pytest.approx(34 * sbh / t)
    assert activation_memory_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    with pytest.raises(ValueError, match="recompute must be one of"):
        activation_memory_per_layer(s, b, h, a, recompute="some")


def test_clear_errors():
    lin = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="none of the 1 tensor arguments requires grad"):
        checkpoint(lin, torch.randn(2, 3))
    with torch.no_grad():                                      # evaluation: allowed
        torch.testing.assert_close(checkpoint(lin, torch.randn(2, 3).fill_(1.0)),
                                   lin(torch.ones(2, 3)))
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        checkpoint(lambda x: {"y": x}, torch.randn(2, requires_grad=True))
    with pytest.raises(TypeError, match="holds no"):
        selective_recompute(lin)


def test_checkpoint_refuses_autograd_grad_like_torch_reentrant():
    """Reached through torch.autograd.grad (or backward(inputs=...)), the recomputation cannot
    return its gradients: refused with a message, as torch's use_reentrant=True refuses."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(checkpoint(layer, x).sum(), x)
    with pytest.raises(RuntimeError, match="backward"):
        checkpoint(layer, x).sum().backward(inputs=[x])
    with pytest.raises(RuntimeError):          # torch's own reentrant checkpoint, the same
        torch.autograd.grad(torch_checkpoint.checkpoint(layer, x, use_reentrant=True).sum(), x)
    checkpoint(layer, x).sum().backward()      # the supported call still works
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, 4))
