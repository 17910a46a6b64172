"""After training (course_lib.deploy, notebook 13): checkpoints loaded on any device and from a
real 2-process DDP run, fine-tuning that leaves frozen weights bitwise, int8 quantization within
a stated tolerance of the float model, and the lesson-12 checker."""
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.serialization
from torch import nn

from course_lib.checks.lesson13 import check_strip_prefix
from course_lib.data import TensorBatches, load_fashion_mnist
from course_lib.deploy import (
    fit_state_dict,
    freeze_all_but,
    int8_layers,
    load_for_inference,
    load_weights,
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
        torch.testing.assert_close(model(X).cpu(), r["logits"], rtol=1e-5, atol=1e-5)


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
    torch.testing.assert_close(model(X.to(try_gpu())).cpu(), trained(X))


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
    torch.testing.assert_close(back(X.cuda()).cpu(), on_cpu(X))


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
# the lesson-12 checker
# ------------------------------------------------------------------------------------------------

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
