import gzip
import socket
import struct

import pytest
import torch
from torch.testing import assert_close

from course_lib import data as D
from course_lib.config import QUICK_TEST_SIZE, QUICK_TRAIN_SIZE


def _write_idx(folder, n_train=6, n_test=4, gz=True):
    """A tiny but real set of IDX files (the format of the original Fashion-MNIST files)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.arange(n, dtype=torch.uint8) % 10
        blobs = {
            f"{prefix}-images-idx3-ubyte": struct.pack(">IIII", 2051, n, 28, 28)
            + images.numpy().tobytes(),
            f"{prefix}-labels-idx1-ubyte": struct.pack(">II", 2049, n) + labels.numpy().tobytes(),
        }
        for name, blob in blobs.items():
            if gz:
                with gzip.open(folder / f"{name}.gz", "wb") as f:
                    f.write(blob)
            else:
                (folder / name).write_bytes(blob)


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """No Fashion-MNIST anywhere: empty repo data/, Debian dir and cache; no env variable."""
    for attr in ("REPO_DATA", "DEBIAN_DIR", "_CACHE_DATA"):
        monkeypatch.setattr(D, attr, tmp_path / attr)
    monkeypatch.delenv("FASHION_MNIST_DIR", raising=False)
    return tmp_path


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails, as on a machine without internet."""
    def refuse(*args, **kwargs):
        raise OSError("network is unreachable (blocked by the test)")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_clear_error_when_nothing_is_found(nowhere, offline):
    with pytest.raises(FileNotFoundError) as err:
        D.find_fashion_mnist(download=True)
    msg = str(err.value)
    for option in ("root=", "FASHION_MNIST_DIR", str(D.REPO_DATA), "internet", "download",
                   "apt-get install dataset-fashion-mnist"):
        assert option in msg, option


def test_clear_error_without_download(nowhere):
    with pytest.raises(FileNotFoundError, match="download=False"):
        D.find_fashion_mnist(download=False)


@pytest.mark.parametrize("layout", ["flat", "raw", "FashionMNIST/raw"])
@pytest.mark.parametrize("gz", [True, False])
def test_root_argument_in_any_layout(nowhere, tmp_path, layout, gz):
    src = tmp_path / "mine"
    _write_idx(src if layout == "flat" else src / layout, gz=gz)
    root = D.find_fashion_mnist(src, download=False)
    import torchvision

    ds = torchvision.datasets.FashionMNIST(str(root), train=True, download=False)
    assert len(ds) == 6 and ds.data.shape == (6, 28, 28)


def test_search_order_env_then_repo_then_debian(nowhere, tmp_path, monkeypatch):
    _write_idx(D.DEBIAN_DIR)  # gzipped, read-only in real life: prepared into the repo's data/
    assert D.find_fashion_mnist(download=False) == D.REPO_DATA
    assert (D.REPO_DATA / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file()
    assert not (D.DEBIAN_DIR / "FashionMNIST").exists()  # nothing written next to the package

    env_dir = tmp_path / "env"
    _write_idx(env_dir / "FashionMNIST" / "raw", gz=False)
    monkeypatch.setenv("FASHION_MNIST_DIR", str(env_dir))
    assert D.find_fashion_mnist(download=False) == env_dir  # the variable beats data/

    arg_dir = tmp_path / "arg"
    _write_idx(arg_dir / "FashionMNIST" / "raw", gz=False)
    assert D.find_fashion_mnist(arg_dir, download=False) == arg_dir  # root= beats both


# ---- the real files (make setup installs them; found offline) ----------------------------------

def test_real_data_found_offline(offline):
    root = D.find_fashion_mnist(download=False)
    assert (root / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").is_file()


def test_fast_path_batches(offline):
    train_iter, test_iter = D.load_fashion_mnist(256, quick=False, seed=0, download=False)
    assert len(train_iter) == 235 and len(test_iter) == 40  # 60000 and 10000 examples
    X, y = next(iter(train_iter))
    assert X.shape == (256, 1, 28, 28) and X.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= X.min() and X.max() <= 1.0
    # one epoch visits every test example exactly once, in order when not shuffled
    labels = torch.cat([y for _, y in test_iter])
    assert labels.shape == (10000,) and torch.bincount(labels).tolist() == [1000] * 10
    # the training set is reshuffled at every pass
    first = [next(iter(train_iter))[1] for _ in range(2)]
    assert not torch.equal(first[0], first[1])


def test_fast_path_equals_dataloader_path(offline):
    _, fast_test = D.load_fashion_mnist(100, quick=True, download=False)
    _, slow_test = D.load_fashion_mnist(100, quick=True, fast=False, download=False)
    for (Xf, yf), (Xs, ys) in zip(fast_test, slow_test):
        assert_close(Xf, Xs)
        assert torch.equal(yf, ys)


def test_quick_slice_and_resize(offline, monkeypatch):
    monkeypatch.setenv("COURSE_QUICK", "1")
    train_iter, test_iter = D.load_fashion_mnist(512, resize=32, download=False)
    assert sum(len(y) for _, y in train_iter) == QUICK_TRAIN_SIZE
    assert sum(len(y) for _, y in test_iter) == QUICK_TEST_SIZE
    assert next(iter(test_iter))[0].shape == (512, 1, 32, 32)


def test_text_labels():
    assert D.get_fashion_mnist_labels(torch.tensor([0, 9])) == ["t-shirt", "ankle boot"]


def test_d2l_loader_reads_the_prepared_folder(offline, monkeypatch):
    """d2l's loader reads root='../data': from notebooks/ that is the repository's data/."""
    from d2l import torch as d2l

    monkeypatch.delenv("FASHION_MNIST_DIR", raising=False)
    assert D.find_fashion_mnist(download=False) == D.REPO_DATA
    monkeypatch.chdir(D.REPO_DATA.parent / "notebooks")
    monkeypatch.setattr(d2l, "get_dataloader_workers", lambda: 0)
    train_iter, test_iter = d2l.load_data_fashion_mnist(64)
    X, y = next(iter(test_iter))
    assert X.shape == (64, 1, 28, 28) and y.shape == (64,)
    assert len(train_iter.dataset) == 60000 and len(test_iter.dataset) == 10000


def test_tensor_batches_rejects_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        D.TensorBatches(torch.zeros(4, 28, 28), torch.zeros(4), 0, shuffle=False)
    with pytest.raises(ValueError, match="must match"):
        D.TensorBatches(torch.zeros(4, 28, 28), torch.zeros(3), 2, shuffle=False)


def test_a_replaced_source_file_is_prepared_again(nowhere, tmp_path):
    """The prepared copy of the first load used to win for ever over a replaced .gz."""
    import os

    src = tmp_path / "mine"
    _write_idx(src, n_train=6)
    train_iter, _ = D.load_fashion_mnist(4, root=src, quick=False, download=False, seed=0)
    assert len(train_iter.y) == 6
    _write_idx(src, n_train=8)                       # the user replaces the .gz files
    train_iter, _ = D.load_fashion_mnist(4, root=src, quick=False, download=False, seed=0)
    assert len(train_iter.y) == 8
    # the same size, other contents: the modification time tells
    labels = src / "train-labels-idx1-ubyte.gz"
    with gzip.open(labels, "wb") as f:
        f.write(struct.pack(">II", 2049, 8) + bytes([9] * 8))
    st = labels.stat()
    os.utime(labels, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    train_iter, _ = D.load_fashion_mnist(4, root=src, quick=False, download=False, seed=0)
    assert train_iter.y.tolist() == [9] * 8
    # a source that is gone leaves the prepared copy in use
    for p in src.glob("*.gz"):
        p.unlink()
    train_iter, _ = D.load_fashion_mnist(4, root=src, quick=False, download=False, seed=0)
    assert train_iter.y.tolist() == [9] * 8


def test_a_replaced_debian_file_is_prepared_again_into_data(nowhere):
    _write_idx(D.DEBIAN_DIR, n_train=6)
    assert len(D.load_fashion_mnist(4, quick=False, download=False)[0].y) == 6
    _write_idx(D.DEBIAN_DIR, n_train=7)  # apt-get install --reinstall with another release
    assert len(D.load_fashion_mnist(4, quick=False, download=False)[0].y) == 7
    assert not (D.DEBIAN_DIR / "FashionMNIST").exists()


# ---- damaged files: refused with their name, their source and where to fetch a genuine one ----

from course_lib import _data_checks as C  # noqa: E402

GENUINE = D.REPO_DATA / "FashionMNIST" / "raw"  # the real files (captured before monkeypatching)
needs_genuine = pytest.mark.skipif(
    not all((GENUINE / n).is_file() for n in D.FILES) or any(
        (GENUINE / n).stat().st_size != s for n, s in (("train-images-idx3-ubyte", 47040016),
                                                        ("t10k-labels-idx1-ubyte", 10008))),
    reason="the real Fashion-MNIST files are not prepared in data/ (make setup)")


def _copy_with(folder, damaged=None, change=None, gz=False):
    """``folder`` holding the four genuine files (links), ``damaged`` a changed real copy
    (``change(bytes) -> bytes``), gzipped when ``gz``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in D.FILES:
        if name == damaged:
            blob = change((GENUINE / name).read_bytes())
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(blob, compresslevel=1))
            else:
                (folder / name).write_bytes(blob)
        else:
            (folder / name).symlink_to(GENUINE / name)
    return folder


def _set(offset, value):
    return lambda b: b[:offset] + bytes([value]) + b[offset + 1:]


def _fetch_advice_in(msg, name):
    assert "apt-get install --reinstall dataset-fashion-mnist" in msg
    assert f"{C.MIRROR}{name}.gz" in msg and C.PUBLISHED[name][2] in msg


@needs_genuine
def test_the_genuine_files_pass_the_checks():
    for name in D.FILES:
        assert C.idx_problem((GENUINE / name).read_bytes(), name) is None
    train_iter, test_iter = D.load_fashion_mnist(1000, quick=False, download=False)
    assert len(train_iter.y) == 60000 and len(test_iter.y) == 10000


@needs_genuine
@pytest.mark.parametrize("name, change, words", [
    ("train-labels-idx1-ubyte", _set(8 + 123, 200),
     r"label 200 of example 123 is outside the classes 0\.\.9"),
    ("t10k-images-idx3-ubyte", lambda b: b[:5_000_000],
     r"its header announces 10000 examples \(7840016 bytes\) but it holds 5000000 bytes "
     r"\(truncated\)"),
    ("train-images-idx3-ubyte", lambda b: _set(16 + 1000, (b[16 + 1000] + 1) % 256)(b),
     r"its md5 is [0-9a-f]{32}, not f4a8712d7a061bf5bd6d2ca38dc4d50a.*altered"),
    ("t10k-labels-idx1-ubyte", _set(3, 3),  # an image file's magic number on a label file
     r"its header starts with 0x00000803, not 0x00000801, the IDX magic number of a label "
     r"file"),
])
def test_a_damaged_file_is_refused_naming_it(nowhere, tmp_path, name, change, words):
    """A label byte of 200 used to load and fail much later as 'Target 200 is out of bounds'."""
    raw = _copy_with(tmp_path / "mine" / "FashionMNIST" / "raw", name, change)
    with pytest.raises(D.DamagedDataError, match=rf"{raw / name} is damaged: {words}") as err:
        D.load_fashion_mnist(64, root=tmp_path / "mine", download=False)
    msg = str(err.value)
    _fetch_advice_in(msg, name)
    assert "only copy" in msg and "run again" not in msg


@needs_genuine
def test_a_damaged_source_is_named_and_never_copied(nowhere, tmp_path):
    """A damaged .gz used to be prepared, and the advice 'delete the copies and run again'
    prepared the same damage again."""
    src = _copy_with(tmp_path / "src", "train-labels-idx1-ubyte", _set(8, 200), gz=True)
    for _ in range(2):  # the advice, if followed, would not help: the error says so each time
        with pytest.raises(D.DamagedDataError,
                           match=rf"{src / 'train-labels-idx1-ubyte.gz'} is damaged: label 200 "
                                 r"of example 0") as err:
            D.find_fashion_mnist(src, download=False)
        _fetch_advice_in(str(err.value), "train-labels-idx1-ubyte")
        assert "run again" not in str(err.value)
        assert not (src / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte").exists()
        assert not list(tmp_path.rglob("*.part"))


@needs_genuine
def test_a_damaged_copy_of_a_genuine_source_says_to_prepare_it_again(nowhere, tmp_path):
    src = _copy_with(tmp_path / "src")
    D.find_fashion_mnist(src, download=False)  # prepared into src/FashionMNIST/raw
    copy = src / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte"
    copy.write_bytes(_set(8 + 9999, 10)(copy.read_bytes()))  # the copy is damaged later
    with pytest.raises(D.DamagedDataError, match=rf"{copy} is damaged: label 10 of example 9999.*"
                                                 rf"prepared from \S+{copy.name}, which checks "
                                                 rf"out as genuine: delete {copy}"):
        D.find_fashion_mnist(src, download=False)
    copy.unlink()  # what the message says to do
    _, test_iter = D.load_fashion_mnist(10000, root=src, quick=False, download=False)
    assert torch.bincount(test_iter.y).tolist() == [1000] * 10


@needs_genuine
def test_a_damaged_copy_of_a_damaged_source_sends_to_a_genuine_one(nowhere, tmp_path):
    src = _copy_with(tmp_path / "src")
    D.find_fashion_mnist(src, download=False)
    name = "train-labels-idx1-ubyte"
    copy = src / "FashionMNIST" / "raw" / name
    (src / name).unlink()
    (src / name).write_bytes(_set(9, 77)(copy.read_bytes()))  # the source damaged too...
    copy.write_bytes(_set(9, 77)(copy.read_bytes()))         # ...and its copy
    raw_stamp = (src / "FashionMNIST" / "raw" / ".course_sources.json")
    import json
    sources = json.loads(raw_stamp.read_text())
    sources[name] = {"source": str(src / name), "stamp": list(D._stamp(src / name))}
    raw_stamp.write_text(json.dumps(sources))
    with pytest.raises(D.DamagedDataError, match=rf"{copy} is damaged: label 77.*prepared from "
                                                 rf"{src / name}, which is damaged too") as err:
        D.find_fashion_mnist(src, download=False)
    _fetch_advice_in(str(err.value), name)
    assert "run again" not in str(err.value)


def test_images_and_labels_must_agree_on_the_count(nowhere, tmp_path):
    _write_idx(tmp_path / "mine", gz=False)
    (tmp_path / "mine" / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, 3)
                                                                + bytes([1, 2, 3]))
    with pytest.raises(D.DamagedDataError, match="t10k-images-idx3-ubyte holds 4 images but "
                                                 "t10k-labels-idx1-ubyte 3 labels"):
        D.find_fashion_mnist(tmp_path / "mine", download=False)


def test_the_verdict_is_cached_per_file(nowhere, tmp_path, monkeypatch):
    import os

    _write_idx(tmp_path / "mine" / "FashionMNIST" / "raw", gz=False)
    checked = []
    real = C.idx_problem
    monkeypatch.setattr(C, "idx_problem", lambda data, name: checked.append(name)
                        or real(data, name))
    D.find_fashion_mnist(tmp_path / "mine", download=False)
    assert sorted(checked) == sorted(D.FILES)
    D.find_fashion_mnist(tmp_path / "mine", download=False)
    monkeypatch.setattr(C, "_verified", set())  # a new process: the stamp file remembers
    D.find_fashion_mnist(tmp_path / "mine", download=False)
    assert len(checked) == 4
    labels = tmp_path / "mine" / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    st = labels.stat()
    os.utime(labels, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed: checked again
    D.find_fashion_mnist(tmp_path / "mine", download=False)
    assert checked[4:] == ["train-labels-idx1-ubyte"]


def test_published_checksums_are_torchvisions():
    from torchvision.datasets import FashionMNIST

    assert [(f"{n}.gz", md5) for n, (_, _, md5) in C.PUBLISHED.items()] == FashionMNIST.resources
    assert C.MIRROR == FashionMNIST.mirrors[0] and list(C.PUBLISHED) == list(D.FILES)
