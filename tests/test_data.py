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
