"""course_lib.models.gpt against torch's own attention, and the lesson-14 text found offline."""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import course_lib.data_text as data_text
from course_lib.data_text import ByteTokenizer, find_text, load_text, text_batch
from course_lib.devices import cpu_threads
from course_lib.models import GPT, GPTConfig
from course_lib.models.gpt import CausalSelfAttention


def _sdpa_attention(attn, x):
    """The same attention from F.scaled_dot_product_attention(is_causal=True)."""
    B, T, C = x.shape
    nh, hs = C // attn.head_dim, attn.head_dim
    qkv = F.linear(x, attn.qkv.weight, attn.qkv.bias).view(B, T, nh, 3, hs)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))      # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # (B, nh, T, hs)
    return attn.out_proj(y.transpose(1, 2).reshape(B, T, C))


def _mha_attention(attn, x):
    """The same attention from nn.MultiheadAttention (its in_proj rows are [Q; K; V])."""
    C = x.shape[-1]
    nh, hs = C // attn.head_dim, attn.head_dim
    mha = torch.nn.MultiheadAttention(C, nh, batch_first=True, dtype=x.dtype)
    # ours: rows grouped (head, q/k/v, hs); torch's: (q/k/v, head, hs)
    w = attn.qkv.weight.detach().view(nh, 3, hs, C).transpose(0, 1).reshape(3 * C, C)
    b = attn.qkv.bias.detach().view(nh, 3, hs).transpose(0, 1).reshape(3 * C)
    with torch.no_grad():
        mha.in_proj_weight.copy_(w)
        mha.in_proj_bias.copy_(b)
        mha.out_proj.weight.copy_(attn.out_proj.weight)
        mha.out_proj.bias.copy_(attn.out_proj.bias)
    T = x.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)   # True: not allowed to attend
    return mha(x, x, x, attn_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("n_head", [1, 3, 12])
def test_attention_equals_torch(n_head):
    torch.manual_seed(0)
    config = GPTConfig(n_head=n_head, n_embd=4 * n_head * 3)
    attn = CausalSelfAttention(config).double()
    x = torch.randn(2, 7, config.n_embd, dtype=torch.float64, requires_grad=True)
    ours = attn(x)
    torch.testing.assert_close(ours, _sdpa_attention(attn, x))
    torch.testing.assert_close(ours, _mha_attention(attn, x))
    # causal: changing a later position leaves earlier outputs alone
    x2 = x.detach().clone()
    x2[:, 4:] += 1.0
    torch.testing.assert_close(attn(x2)[:, :4], ours[:, :4].detach())
    assert not torch.allclose(attn(x2)[:, 4:], ours[:, 4:].detach())


def test_gpt_forward_loss_and_config():
    torch.manual_seed(0)
    config = GPTConfig()
    assert config.n_head % 2 == config.n_head % 3 == config.n_head % 4 == 0
    assert config.vocab_size % 12 == 0 and config.vocab_size >= ByteTokenizer.vocab_size
    model = GPT(config)
    idx = torch.randint(256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, config.vocab_size)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), idx.flatten()))
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1   # small init: near uniform
    torch.testing.assert_close(model(idx), logits)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, config.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_head=5, n_embd=96)
    with pytest.raises(ValueError, match="positive integer"):
        GPTConfig(n_layer=0)


def test_gpt_learns_a_repeated_text():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    tokens = ByteTokenizer().encode("abcdefgh" * 20)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with cpu_threads(1):   # tiny tensors: a second thread only waits (70x slower on a busy machine)
        for _ in range(25):
            X, Y = text_batch(tokens, 8, 8, generator=gen)
            _, loss = model(X, Y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert loss.item() < 1.0, loss.item()   # from log(264) = 5.6


def test_text_loads_offline_and_round_trips():
    tokens = load_text(max_bytes=10_000)
    assert tokens.dtype == torch.long and tokens.numel() == 10_000
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
    text = ByteTokenizer().decode(tokens)
    assert text.count(" ") > 1000 and any(w in text for w in ("the ", "The "))
    assert torch.equal(ByteTokenizer().encode(text), tokens)
    X, Y = text_batch(tokens, 4, 32, generator=torch.Generator().manual_seed(1))
    assert X.shape == Y.shape == (4, 32)
    assert torch.equal(X[:, 1:], Y[:, :-1])


def test_text_lookup_order_and_errors(tmp_path, monkeypatch):
    mine = tmp_path / "mine.txt"
    mine.write_text("Hello, world.\n")
    assert find_text(mine) == mine
    assert find_text(tmp_path) == mine
    monkeypatch.setenv(data_text.TEXT_ENV, str(mine))
    assert find_text() == mine
    with pytest.raises(FileNotFoundError, match="root argument .* does not exist"):
        find_text(tmp_path / "nope.txt")
    monkeypatch.setenv(data_text.TEXT_ENV, str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\$COURSE_TEXT .* holds no \*.txt"):
        find_text()
    monkeypatch.delenv(data_text.TEXT_ENV)
    monkeypatch.setattr(data_text, "REPO_TEXT", tmp_path / "repo")
    monkeypatch.setattr(data_text, "_CACHE_TEXT", tmp_path / "cache")
    monkeypatch.setattr(data_text, "_BIBLE_PROGRAM", "no-such-program-here")
    with pytest.raises(FileNotFoundError) as err:
        find_text()
    for option in ("root=", "COURSE_TEXT", "data", "bible-kjv"):
        assert option in str(err.value)
    with pytest.raises(ValueError, match="ids in 0..255"):
        ByteTokenizer().decode([65, 300])


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian package bible-kjv not installed")
def test_text_from_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.delenv(data_text.TEXT_ENV, raising=False)
    monkeypatch.setattr(data_text, "REPO_TEXT", tmp_path / "repo")
    monkeypatch.setattr(data_text, "_CACHE_TEXT", tmp_path / "cache")
    path = find_text()
    assert path == tmp_path / "repo" / "kjv.txt"
    text = path.read_text()
    assert len(text) > 4_000_000 and "In the beginning God created the heaven" in text
    assert find_text() == path   # the second time: the file written the first time
