"""After training (course_lib.deploy, notebook 13): checkpoints loaded on any device and from a
real 2-process DDP run, fine-tuning that leaves frozen weights bitwise, int8 quantization within
a stated tolerance of the float model, and the lesson-13 checkers (load_matching, strip_prefix)."""
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.serialization
from torch import nn

from course_lib.checks.lesson13 import check_load_matching, check_strip_prefix
from course_lib.data import TensorBatches, load_fashion_mnist
from course_lib.deploy import (
    fit_state_dict,
    freeze_all_but,
    int8_layers,
    load_for_inference,
    load_matching,
    load_weights,
    match_keys,
    quantize_int8,
    state_dict_bytes,
    strip_prefix,
)
from course_lib.devices import cpu_threads, try_gpu
from course_lib.distributed import launch
from course_lib.examples.deploy_workers import save_wrapped_checkpoint
from course_lib.models.lenet import LeNet
from course_lib.models.resnet import resnet18
from course_lib.train import evaluate_accuracy
from solutions.lesson13 import load_matching as reference_load_matching
from solutions.lesson13 import strip_prefix as reference_strip_prefix

#: int8 accuracy may differ from float32's by at most this much (1 percentage point), the same
#: tolerance that notebook 13 states and asserts.
QUANT_TOL = 0.01


def _save_as_if_on(device: str, obj, path, monkeypatch) -> None:
    """torch.save ``obj`` as a run on ``device`` writes it: each tensor's stored location tag
    says ``device`` (set here because a CPU-only machine cannot hold a CUDA tensor)."""
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: device)
        torch.save(obj, path)


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------

def test_checkpoint_from_a_real_2_process_ddp_run_loads_into_a_plain_model(tmp_path):
    path = str(tmp_path / "wrapped.pt")
    ranks = launch(save_wrapped_checkpoint, 2, path, 5, timeout=120)
    keys = ranks[0]["keys"]
    assert keys and all(k.startswith("module.") for k in keys)           # DDP's prefix
    saved = torch.load(path, map_location="cpu", weights_only=True)
    with pytest.raises(RuntimeError, match="Missing key"):
        LeNet().load_state_dict(saved)                                 # what a plain load says
    model = load_for_inference(LeNet(), path, device=try_gpu())
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    _, test_iter = load_fashion_mnist(8, quick=True)
    X = test_iter.X[:8].float().div(255).to(try_gpu())                 # (8, 1, 28, 28)
    for r in ranks:                                                    # the same on both ranks
        # rtol, atol 1e-4: a GPU's float32 convolutions differ from the CPU's by about 1e-5
        torch.testing.assert_close(model(X).cpu(), r["logits"], rtol=1e-4, atol=1e-4)


def test_checkpoint_written_on_a_gpu_loads_on_this_device(tmp_path, monkeypatch):
    torch.manual_seed(0)
    trained = LeNet().eval()
    path = tmp_path / "from_gpu.pt"
    _save_as_if_on("cuda:1", {"model": trained.state_dict(), "epoch": 3}, path, monkeypatch)
    if not torch.cuda.is_available():                   # without map_location: torch refuses
        with pytest.raises(RuntimeError, match="map_location"):
            torch.load(path, weights_only=True)
    model = load_for_inference(LeNet(), path)                           # map_location=try_gpu()
    assert {p.device for p in model.parameters()} == {try_gpu()}
    X = torch.rand(4, 1, 28, 28)
    torch.testing.assert_close(model(X.to(try_gpu())).cpu(), trained(X), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_checkpoint_moves_between_cpu_and_gpu(tmp_path):
    torch.manual_seed(0)
    on_gpu = LeNet().to("cuda")
    torch.save(on_gpu.state_dict(), tmp_path / "gpu.pt")
    on_cpu = load_for_inference(LeNet(), tmp_path / "gpu.pt", device="cpu")
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    torch.save(on_cpu.state_dict(), tmp_path / "cpu.pt")
    back = load_for_inference(LeNet(), tmp_path / "cpu.pt", device="cuda")
    X = torch.rand(4, 1, 28, 28)
    torch.testing.assert_close(back(X.cuda()).cpu(), on_cpu(X), rtol=1e-4, atol=1e-4)


def test_checkpoint_mismatches_name_the_keys_and_the_fix(tmp_path):
    torch.save({"model": LeNet().state_dict()}, tmp_path / "lenet.pt")
    with pytest.raises(ValueError, match=r"does not fit Sequential.*not in the checkpoint.*"
                                         r"not in the model.*load_fitting_weights"):
        load_weights(resnet18(num_classes=10, in_channels=1), tmp_path / "lenet.pt",
                     device="cpu")
    narrow = LeNet()
    narrow.fc2 = nn.Linear(128, 2)                                      # a new 2-class head
    with pytest.raises(ValueError, match=r"fc2.weight: checkpoint \(10, 128\), model \(2, 128\)"):
        load_weights(narrow, tmp_path / "lenet.pt", device="cpu")
    with pytest.raises(FileNotFoundError, match="no file at"):
        load_weights(LeNet(), tmp_path / "missing.pt", device="cpu")


def test_checkpoint_prefixes_strip_only_at_the_start_as_torch_does():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)                  # a submodule named "module"

    wrapped = nn.DataParallel(Holder()).state_dict()       # "module.module.weight", ...
    stripped = strip_prefix(wrapped)
    assert list(stripped) == ["module.weight", "module.bias"]
    assert list(wrapped) == ["module.module.weight", "module.module.bias"]   # input unchanged
    assert stripped["module.weight"] is wrapped["module.module.weight"]     # no copies
    assert "" in stripped._metadata and "module" in stripped._metadata
    # load_weights strips only what EVERY key carries: DDP around torch.compile, say
    twice = {"module._orig_mod." + k: v for k, v in LeNet().state_dict().items()}
    load_weights(LeNet(), twice, device="cpu")


def test_a_models_own_module_attribute_is_not_taken_for_a_wrapper(tmp_path):
    """Every key of a plain Holder starts with "module." (its submodule's name): stripping it
    broke a valid checkpoint. Stripped only when that makes the keys fit the model."""
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    torch.manual_seed(0)
    saved = Holder()
    torch.save(saved.state_dict(), tmp_path / "plain.pt")               # module.weight
    torch.save(nn.DataParallel(saved).state_dict(), tmp_path / "dp.pt")  # module.module.weight
    saved.cpu()                     # with one GPU, DataParallel's constructor moved it there
    for name in ("plain.pt", "dp.pt"):
        model = load_weights(Holder(), tmp_path / name, device="cpu")
        assert torch.equal(model.module.weight, saved.module.weight), name
    fit = fit_state_dict(Holder(), tmp_path / "dp.pt")
    assert fit.prefix == "module." and fit.complete


def test_a_damaged_or_empty_file_is_named_as_such(tmp_path):
    torch.save(LeNet().state_dict(), tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 3])
    (tmp_path / "junk.pt").write_bytes(b"\x80\x02junk" * 20)
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, says in (("cut.pt", "is damaged"), ("junk.pt", "is damaged"),
                       ("empty.pt", "is empty")):
        with pytest.raises(ValueError, match=f"load_weights: .*{name} .*{says}") as err:
            load_weights(LeNet(), tmp_path / name, device="cpu")
        assert "weights_only=False" not in str(err.value), str(err.value)


class _WithNorm(nn.Module):
    """A model with batch-norm buffers and a submodule really called ``module``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = nn.Sequential()
        self.block.module = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)


def _seeded(build, seed):
    torch.manual_seed(seed)
    net = build()
    if isinstance(net, _WithNorm):
        with torch.no_grad():
            net.norm.train()(torch.randn(16, 8))        # running statistics off their defaults
    return net


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("wrap, prefixes", [
    (nn.DataParallel, ["module."]),                                         # DDP, DataParallel
    (torch.compile, ["_orig_mod."]),                                        # torch.compile
    (lambda m: nn.DataParallel(torch.compile(m)), ["module.", "_orig_mod."]),
    (lambda m: torch.compile(nn.DataParallel(m)), ["_orig_mod.", "module."]),
], ids=["ddp", "compile", "ddp-around-compile", "compile-around-ddp"])
@pytest.mark.parametrize("build", [LeNet, _WithNorm], ids=["lenet", "with-norm"])
def test_load_matching_loads_what_torchs_prefix_removal_and_strict_load_load(build, wrap,
                                                                               prefixes):
    """The oracle: torch's consume_prefix_in_state_dict_if_present (once per wrapper, outer
    first), then load_state_dict; the same tensors, the same (empty) missing/unexpected keys."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    saved = _seeded(build, 0)
    state = wrap(saved).state_dict()
    saved.cpu()                     # with one GPU, DataParallel's constructor moved it there
    keys = list(state)
    ours, theirs = _seeded(build, 1), _seeded(build, 1)
    result = load_matching(ours, state)
    assert list(state) == keys                                     # the caller's dict kept
    copy_ = type(state)(state)
    copy_._metadata = state._metadata
    for prefix in prefixes:
        consume_prefix_in_state_dict_if_present(copy_, prefix)
    want = theirs.load_state_dict(copy_, strict=True)
    assert _same_state(ours, theirs) and _same_state(ours, saved)
    assert (result.missing_keys, result.unexpected_keys) == (want.missing_keys,
                                                             want.unexpected_keys) == ([], [])


def test_load_matching_of_a_partial_file_reports_what_torchs_strict_false_reports():
    """A new head under a new name: torch's strict=False (after consume_prefix) loads the same
    tensors and reports the same keys; ours names the file's keys as written there."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    saved = _seeded(_WithNorm, 0)
    state = nn.DataParallel(saved).state_dict()
    del state["module.head.weight"], state["module.head.bias"]
    state["module.old_head.weight"] = torch.zeros(3, 8)

    def build():
        net = _WithNorm()
        net.classifier = net.head                                  # renamed: not in the file
        del net.head
        return net

    ours, theirs = _seeded(build, 1), _seeded(build, 1)
    result = load_matching(ours, state)
    plain = dict(state)
    consume_prefix_in_state_dict_if_present(plain, "module.")
    want = theirs.load_state_dict(plain, strict=False)
    assert _same_state(ours, theirs)
    assert result.missing_keys == want.missing_keys == ["classifier.weight", "classifier.bias"]
    assert want.unexpected_keys == ["old_head.weight"]
    assert result.unexpected_keys == ["module.old_head.weight"]


def test_load_matching_refuses_a_shape_before_copying_anything_where_torch_copies_first():
    torch.manual_seed(0)
    state = nn.DataParallel(LeNet()).state_dict()
    for load in (lambda m: load_matching(m, state),
                 lambda m: m.load_state_dict(strip_prefix(state), strict=False)):
        torch.manual_seed(1)
        model = LeNet()
        model.fc2 = nn.Linear(128, 2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises((ValueError, RuntimeError), match="fc2.weight") as err:
            load(model)
        kept = all(torch.equal(model.state_dict()[k], before[k]) for k in before)
        if err.type is ValueError:                                  # ours: nothing copied
            assert kept and "nothing was loaded" in str(err.value)
            assert "fc2.weight: file (10, 128), model (2, 128)" in str(err.value)
        else:                                                       # torch: a half-loaded model
            assert not kept


def test_load_matching_mixed_prefixes_and_a_real_module_name():
    """Fails on the reading before per-key matching (prefixes removed only when EVERY key
    carried them): a body saved from DDP merged with a head saved plainly did not load."""
    torch.manual_seed(0)
    saved = LeNet()
    mixed = {("module." + k if k.startswith("conv") else "_orig_mod." + k if k.startswith("fc1")
              else k): v for k, v in saved.state_dict().items()}
    model = LeNet()
    assert load_matching(model, mixed) == ([], [])
    assert _same_state(model, saved)
    # "block.module.weight" is a real name: its middle 'module.' stays
    named = match_keys(["module._orig_mod.block.module.weight", "block.module.bias",
                        "module.module.head"], _WithNorm().state_dict())
    assert named == {"module._orig_mod.block.module.weight": "block.module.weight",
                     "block.module.bias": "block.module.bias", "module.module.head": None}


def test_two_keys_naming_one_model_key_are_refused():
    state = LeNet().state_dict()
    state["module.fc2.bias"] = torch.zeros(10)
    with pytest.raises(ValueError, match="'fc2.bias' and 'module.fc2.bias'.*same key"):
        load_matching(LeNet(), state)


def test_renamed_metadata_keeps_the_models_own_module_versions():
    """load_state_dict reads each module's version from _metadata: after renaming, the inner
    model's entries sit under the model's own module names (the root: the innermost's)."""
    state = nn.DataParallel(torch.compile(_WithNorm())).state_dict()
    fit = fit_state_dict(_WithNorm(), state)
    assert fit.prefix == "module._orig_mod." and fit.complete
    assert {"", "embed", "block.module", "norm", "head"} <= set(fit.state._metadata)
    assert fit.state._metadata["norm"] == state._metadata["module._orig_mod.norm"]


# ------------------------------------------------------------------------------------------------
# fine-tuning
# ------------------------------------------------------------------------------------------------

def test_fine_tuning_the_head_leaves_frozen_weights_bitwise():
    torch.manual_seed(0)
    model = LeNet()
    model.fc2 = nn.Linear(128, 2)
    X, y = torch.rand(32, 1, 28, 28), torch.randint(0, 2, (32,))
    # a step taken before freezing: every parameter has a .grad and a momentum buffer, and
    # zero_grad(set_to_none=False) leaves zero tensors, which SGD would NOT skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    F.cross_entropy(model(X), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert freeze_all_but(model, "fc2") == ["fc2.weight", "fc2.bias"]
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("fc2."))
    # the same optimizer, all parameters, weight decay and momentum: the frozen ones have no
    # .grad, so SGD skips them (a zero .grad would still move them by weight decay + momentum)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(X), y).backward()
        opt.step()
    after = model.state_dict()
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed == ["fc2.bias", "fc2.weight"]
    with pytest.raises(ValueError, match=r"\['head'\] name nothing.*'fc1', 'fc2'"):
        freeze_all_but(model, "head")


# ------------------------------------------------------------------------------------------------
# int8 quantization (torchao)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_lenet():
    """LeNet after one epoch on the quick slice of Fashion-MNIST (about 0.64 test accuracy),
    and the quick test set in batches of 512."""
    train_iter, test_iter = load_fashion_mnist(32, quick=True, seed=0)
    torch.manual_seed(0)
    model = LeNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with cpu_threads(1):  # small steps: one thread is as fast, and much faster on a busy CPU
        for X, y in train_iter:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(X), y).backward()
            opt.step()
    return model.eval(), TensorBatches(test_iter.X, test_iter.y, 512, shuffle=False)


@pytest.mark.parametrize("dynamic", [True, False], ids=["int8-dynamic", "int8-weight-only"])
def test_quantized_model_accuracy_within_tolerance_of_float(trained_lenet, dynamic):
    model, test_iter = trained_lenet
    float_acc = evaluate_accuracy(model, test_iter, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = quantize_int8(model, dynamic_activations=dynamic)
        with torch.inference_mode():
            int8_acc = evaluate_accuracy(q, test_iter, "cpu")
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    assert float_acc > 0.6                                   # a trained model, not chance
    assert abs(int8_acc - float_acc) <= QUANT_TOL, (float_acc, int8_acc)
    assert int8_layers(q) == ["fc1", "fc2"] and int8_layers(model) == []
    assert q.conv2.weight.dtype == torch.float32             # convolutions stay float
    assert state_dict_bytes(q) < 0.45 * state_dict_bytes(model)  # the linears are 80% of it


def test_quantized_weights_are_per_row_int8_of_the_float_weights():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 16))
    W = layer[0].weight.detach().clone()                                # (16, 64)
    q = quantize_int8(layer)
    scale = W.abs().amax(dim=1, keepdim=True) / 127                     # one scale per row
    err = (q[0].weight.dequantize() - W).abs()
    assert (err <= scale / 2 + 1e-7).all()                              # rounding, no more
    assert torch.equal(layer[0].weight, W)                              # the original kept
    X = torch.randn(8, 64)
    torch.testing.assert_close(q(X), layer(X), atol=0.02, rtol=0.02)


def test_quantized_state_dict_reloads_and_a_model_without_linears_is_refused():
    torch.manual_seed(0)
    q = quantize_int8(LeNet())
    buffer = io.BytesIO()
    torch.save(q.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert type(state["fc1.weight"]) is type(q.fc1.weight)
    with pytest.raises(ValueError, match="has none"):
        quantize_int8(nn.Sequential(nn.Conv2d(1, 2, 3)))


# ------------------------------------------------------------------------------------------------
# the lesson-13 checkers
# ------------------------------------------------------------------------------------------------

_WRAPPERS = ("module.", "_orig_mod.")


def renames_the_callers_dict(model, state_dict):             # torch's function works in place
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    consume_prefix_in_state_dict_if_present(state_dict, "module.")
    return model.load_state_dict(state_dict, strict=False)


def strips_module_only(model, state_dict):                   # forgets torch.compile's prefix
    state = {k.removeprefix("module."): v for k, v in state_dict.items()}
    return model.load_state_dict(state, strict=False)


def strips_every_leading_wrapper(model, state_dict):         # also a model's own 'module.'
    def bare(k):
        while k.startswith(_WRAPPERS):
            k = k.split(".", 1)[1]
        return k
    return model.load_state_dict({bare(k): v for k, v in state_dict.items()}, strict=False)


def strips_only_when_every_key_has_it(model, state_dict):    # a file with mixed prefixes
    state, own = dict(state_dict), model.state_dict()
    while not any(k in own for k in state):
        common = [w for w in _WRAPPERS if all(k.startswith(w) for k in state)]
        if not common:
            break
        state = {k[len(common[0]):]: v for k, v in state.items()}
    return model.load_state_dict(state, strict=False)


def copies_before_checking_shapes(model, state_dict):        # torch raises after copying
    own = model.state_dict()
    state = {}
    for k, v in state_dict.items():
        while k not in own and k.startswith(_WRAPPERS):
            k = k.split(".", 1)[1]
        state[k] = v
    return model.load_state_dict(state, strict=False)


def skips_a_resized_head_silently(model, state_dict):        # no error: a silent partial load
    own = model.state_dict()
    state = {}
    for k, v in state_dict.items():
        while k not in own and k.startswith(_WRAPPERS):
            k = k.split(".", 1)[1]
        if k not in own or own[k].shape == v.shape:
            state[k] = v
    return model.load_state_dict(state, strict=False)


def test_load_matching_checker_unanswered():
    def scaffold(model, state_dict):
        raise NotImplementedError

    assert check_load_matching(None).ok is None
    assert check_load_matching(scaffold).ok is None


def test_load_matching_checker_accepts_the_reference_and_the_library(capsys):
    assert check_load_matching(reference_load_matching, strict=True)
    assert check_load_matching(load_matching)
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (renames_the_callers_dict, "the state dict passed in was changed"),
    (strips_module_only, "DDP around torch.compile"),
    (strips_every_leading_wrapper, "first submodule is called 'module', saved without"),
    (strips_only_when_every_key_has_it, "mixed prefixes"),
    (copies_before_checking_shapes, "already copied"),
    (skips_a_resized_head_silently, "no error"),
])
def test_load_matching_checker_rejects_wrong_answers_with_the_case(wrong, says):
    result = check_load_matching(wrong)
    assert result.ok is False and says in result.message, result.message
    with pytest.raises(AssertionError):
        check_load_matching(wrong, strict=True)


def test_load_matching_checker_hint_points_to_the_idea_not_the_code():
    message = check_load_matching(strips_module_only).message
    assert "Hint:" in message and "START of a key" in message, message
    assert not any(code in message for code in ("load_state_dict(", "ONE leading", "strict=False"))


def replaces_everywhere(state_dict, prefix="module."):       # also the middle of a key
    return {k.replace(prefix, ""): v for k, v in state_dict.items()}


def strips_characters(state_dict, prefix="module."):         # lstrip takes a set of characters
    return {k.lstrip(prefix): v for k, v in state_dict.items()}


def cuts_every_key(state_dict, prefix="module."):            # assumes every key has the prefix
    return {k[len(prefix):]: v for k, v in state_dict.items()}


def ignores_the_prefix_argument(state_dict, prefix="module."):
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


def test_strip_prefix_checker_unanswered():
    assert check_strip_prefix(None).ok is None


def test_strip_prefix_checker_accepts_the_reference_and_torchs_in_place_function(capsys):
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    assert check_strip_prefix(reference_strip_prefix, strict=True)
    assert check_strip_prefix(consume_prefix_in_state_dict_if_present)   # returns None
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (replaces_everywhere, "'block.module.weight'"),
    (strips_characters, "'bed.weight'"),
    (cuts_every_key, "saved without a wrapper"),
    (ignores_the_prefix_argument, "'_orig_mod.'"),
])
def test_strip_prefix_checker_rejects_wrong_answers_with_the_case(wrong, says):
    result = check_strip_prefix(wrong)
    assert result.ok is False and says in result.message and "expected" in result.message
    with pytest.raises(AssertionError):
        check_strip_prefix(wrong, strict=True)


def test_read_plan_figure_draws_each_piece_and_each_read():
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    from course_lib.deploy import read_plan
    from course_lib.plots import draw_read_plan

    pieces = [(0, 4), (4, 3)]                       # 7 rows saved on 2 ranks
    plan = read_plan(pieces, 3)                     # 3 + 3 + 1 rows on 3 ranks
    fig = draw_read_plan(pieces, plan)
    ax = fig.axes[0]
    assert len(ax.patches) == len(pieces) + sum(len(reads) for reads in plan) == 6
    texts = [t.get_text() for t in ax.texts]
    assert "piece 0 [3:4]" in texts and "piece 1 [0:2]" in texts    # rank 1 reads both pieces
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "new rank 2 reads"
    plt.close(fig)
