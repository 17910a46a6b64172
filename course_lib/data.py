"""Fashion-MNIST, found locally first, with a fast in-memory batch iterator.

PyTorch counterpart: ``torchvision.datasets.FashionMNIST`` with a ``DataLoader``; d2l's
``load_data_fashion_mnist``. Both read the "prepared raw folder" this module makes:
``<root>/FashionMNIST/raw/`` holding the four uncompressed IDX files.

Search order: the ``root`` argument, ``$FASHION_MNIST_DIR``, the repository's ``data/``, the
Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/``), then torchvision's
download. A prepared copy records its source (path, size, modification time), so a replaced
source is prepared again. Every file is checked once before use (``_data_checks``: header,
size, labels, md5); a damaged one is refused with its name, origin and where to fetch a genuine one.
"""
from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from . import _data_checks
from ._data_checks import DEBIAN_DIR, DamagedDataError, damaged, idx_problem, read_content
from ._data_checks import file_stamp as _stamp
from .config import QUICK_TEST_SIZE, QUICK_TRAIN_SIZE, quick_mode

__all__ = ["DEBIAN_DIR", "DamagedDataError", "REPO_DATA", "TEXT_LABELS", "TensorBatches",
           "find_fashion_mnist", "get_fashion_mnist_labels", "load_fashion_mnist", "shown_path"]

TEXT_LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot"]

FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
#: The repository's own data folder (ignored by git); the prepared raw folder usually lands here.
REPO_DATA = Path(__file__).resolve().parent.parent / "data"
_CACHE_DATA = Path.home() / ".cache" / "course_lib" / "data"


def get_fashion_mnist_labels(labels: Sequence[int] | torch.Tensor) -> list[str]:
    """Text names of Fashion-MNIST class indices."""
    return [TEXT_LABELS[int(i)] for i in labels]


def _raw_files_in(path: Path) -> dict[str, Path] | None:
    """The four IDX files (plain or .gz) in ``path``, ``path/raw`` or ``path/FashionMNIST/raw``."""
    for folder in (path / "FashionMNIST" / "raw", path / "raw", path):
        found = {name: next((c for c in (folder / name, folder / f"{name}.gz") if c.is_file()),
                            None) for name in FILES}
        if all(found.values()):
            return found
    return None


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


#: In a prepared raw folder: each file's source, its size and modification time (a replaced
#: source is prepared again).
_SOURCES = ".course_sources.json"


def _read_sources(raw: Path) -> dict[str, dict]:
    return _data_checks.read_json(raw / _SOURCES)


def _changed_sources(raw: Path) -> dict[str, Path]:
    """The files of ``raw`` whose recorded source still exists but was replaced since (another
    size or modification time): {name: source}. A source that is gone leaves its copy alone."""
    recorded = ((name, Path(rec.get("source", "")), rec) for name, rec in
                _read_sources(raw).items())
    return {name: src for name, src, rec in recorded
            if name in FILES and src.is_file() and _stamp(src) != rec.get("stamp")}


def _copy_one(src: Path, dst: Path) -> None:
    """Decompress (or copy) ``src`` to ``dst`` if its content checks out (``idx_problem``)."""
    content = read_content(src)  # a broken .gz: DamagedDataError naming src
    problem = idx_problem(content, dst.name)
    if problem:  # nothing is copied from a damaged source
        raise DamagedDataError(damaged(src, problem))
    _data_checks.write_atomic(dst, content)


def _prepare(files: dict[str, Path], source: Path, in_place: bool) -> Path:
    """A torchvision root whose ``FashionMNIST/raw`` holds the four files uncompressed: next to
    the source when ``in_place`` (a folder the user named), else in the repository's ``data/``
    (or the user cache when that is read-only). Each copy's source is recorded (``_SOURCES``)."""
    raw_here = source / "FashionMNIST" / "raw"
    if all(p.parent == raw_here and p.suffix != ".gz" for p in files.values()):
        changed = _changed_sources(raw_here)  # prepared earlier: is a source newer?
        if not changed:
            return source
        files = changed
    for root in ((source,) if in_place else ()) + (REPO_DATA, _CACHE_DATA):
        raw = root / "FashionMNIST" / "raw"
        if not _writable(raw):
            continue
        sources = _read_sources(raw)
        for name, src in files.items():
            dst = raw / name
            if src == dst:
                continue  # the file is itself the prepared one
            rec = {"source": str(src.resolve()), "stamp": _stamp(src)}
            if dst.is_file() and dst.stat().st_size > 0 and sources.get(name) == rec:
                continue
            _copy_one(src, dst)
            sources[name] = rec
        _data_checks.write_atomic(raw / _SOURCES, json.dumps(sources, indent=1))
        return root
    raise PermissionError(
        f"Found Fashion-MNIST in {source} but could not write a prepared copy to {source}, "
        f"{REPO_DATA} or {_CACHE_DATA}. Make one of them writable or pass root= a writable folder."
    )


def _verified(root: Path) -> Path:
    """``root`` once the four files of its ``FashionMNIST/raw`` pass ``_data_checks`` (cached
    per file): a damaged one raises ``DamagedDataError`` naming it and where it came from."""
    raw = root / "FashionMNIST" / "raw"
    origins = {name: Path(rec["source"]) for name, rec in _read_sources(raw).items()
               if rec.get("source")}
    _data_checks.verify_folder(raw, FILES, origins)
    return root


def _download(root: Path) -> None:
    """torchvision's download, the last resort (needs the internet)."""
    import torchvision

    for train in (True, False):
        torchvision.datasets.FashionMNIST(root=str(root), train=train, download=True)


def find_fashion_mnist(root: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """Find Fashion-MNIST locally and return a folder ``R`` such that
    ``torchvision.datasets.FashionMNIST(R, download=False)`` works.

    Args:
        root: a folder to look in first (the files directly, in ``raw/``, or in
            ``FashionMNIST/raw/``; plain or gzipped).
        download: whether torchvision may download the files when nothing local is found.
    """
    # (what it is, where, whether a prepared copy may be written next to it)
    candidates = [("the root argument", Path(root).expanduser(), True)] if root is not None else []
    if os.environ.get("FASHION_MNIST_DIR"):
        candidates.append(("$FASHION_MNIST_DIR", Path(os.environ["FASHION_MNIST_DIR"]), True))
    candidates.append(("the repository's data/ folder", REPO_DATA, True))
    candidates.append(("the Debian package dataset-fashion-mnist", DEBIAN_DIR, False))
    candidates.append(("the user cache", _CACHE_DATA, True))
    for label, path, in_place in candidates:
        files = _raw_files_in(path)
        if files:
            return _verified(_prepare(files, path, in_place))
        if label in ("the root argument", "$FASHION_MNIST_DIR"):  # named explicitly: no fallback
            holds = sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else None
            what = ("does not exist" if holds is None else
                    f"holds {holds}" if holds else "is empty")
            raise FileNotFoundError(
                f"Fashion-MNIST is not in {label} {path}: the folder {what}. Expected the four "
                f"files {list(FILES)} (plain or .gz) there, in raw/ or in FashionMNIST/raw/. "
                "Point it at the folder that holds them, or leave it unset to use the other "
                "places (README: 'Where the data comes from').")

    looked = "\n".join(f"  - {label}: {path}" for label, path, _ in candidates)
    if download:
        target = REPO_DATA if _writable(REPO_DATA) else _CACHE_DATA
        try:
            _download(target)
        except Exception as exc:  # offline: URLError, socket errors, HTTP errors
            reason = (f"torchvision's download into {target} failed too "
                      f"({type(exc).__name__}: {exc}).")
        else:
            return _verified(target)
    else:
        reason = "Download was not allowed (download=False)."
    raise FileNotFoundError(
        "Fashion-MNIST was not found. Looked in:\n" + looked + "\n" + reason + "\n"
        "Any one of these fixes it:\n"
        "  - pass root='/folder/with/the/files' (train-images-idx3-ubyte[.gz] and the other\n"
        "    three);\n"
        "  - set FASHION_MNIST_DIR=/folder/with/the/files;\n"
        f"  - copy the four files into {REPO_DATA};\n"
        "  - install the Debian package: apt-get install dataset-fashion-mnist (make setup does);\n"
        "  - run once with internet access so that torchvision can download them."
    )


def shown_path(path: str | os.PathLike) -> str:
    """``path`` as a lesson prints it: relative to the repository when inside it, ``~/...``
    under the home folder, else as it is (so stored outputs name no machine's folders)."""
    path = Path(path).resolve()
    for base, prefix in ((REPO_DATA.parent, ""), (Path.home(), "~/")):
        try:
            return prefix + str(path.relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def _version(root: str) -> tuple:
    """Sizes and modification times of the prepared files: a new copy is read again."""
    raw = Path(root) / "FashionMNIST" / "raw"
    return tuple(tuple(_stamp(raw / n)) if (raw / n).is_file() else None for n in FILES)


def _unreadable(raw: Path, what: str, error: Exception) -> ValueError:
    """The error for prepared files that passed the checks yet torchvision cannot read."""
    sources = _read_sources(raw)
    name = next((n for n in FILES if what in n), FILES[0])
    origin = Path(sources[name]["source"]) if sources.get(name, {}).get("source") else None
    return ValueError(damaged(raw / name, f"torchvision could not read the {what} files "
                                          f"({type(error).__name__}: {error})", origin))


@lru_cache(maxsize=4)
def _load_split(root: str, train: bool, version: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 (N, 28, 28), labels int64 (N,)) of one split, read once per ``version``."""
    import torchvision

    try:
        ds = torchvision.datasets.FashionMNIST(root=root, train=train, download=False)
    except Exception as e:  # a truncated or corrupted prepared file
        raise _unreadable(Path(root) / "FashionMNIST" / "raw", "train" if train else "t10k",
                          e) from None
    return ds.data, ds.targets


def _check_sizes(batch_size, resize) -> tuple[int, int | None]:
    """batch_size and resize as integers >= 1, checked at the call, not at the first batch."""
    def integer(name, value):
        try:
            if not isinstance(value, bool) and operator.index(value) >= 1:
                return operator.index(value)
        except TypeError:
            pass
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return integer("batch_size", batch_size), None if resize is None else integer("resize", resize)


class TensorBatches:
    """Shuffled minibatches from tensors held in memory, optionally on a GPU.

    The fast path: no per-example Python, no PIL, no worker processes; one index per batch.
    Images stay uint8 (a quarter of the memory) and become float in [0, 1] per batch.

    Args:
        X, y: uint8 images (N, 28, 28) or (N, 1, 28, 28); int64 labels (N,).
        batch_size: examples per batch; the last batch may be smaller.
        shuffle: reshuffle the order at every pass.
        device: where batches are produced (the data is moved there once).
        resize: if given, bilinear resize of each batch to (resize, resize).
        seed: seed of the shuffling generator (None: seeded from torch's global RNG).
        drop_last: leave out a last batch smaller than ``batch_size`` (so that every batch
            can be split over a fixed number of devices).
    """

    def __init__(self, X: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool,
                 device: torch.device | str | None = None, resize: int | None = None,
                 seed: int | None = None, drop_last: bool = False):
        batch_size, resize = _check_sizes(batch_size, resize)
        if len(X) != len(y):
            raise ValueError(f"X has {len(X)} examples but y has {len(y)}; they must match.")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.X = (X if X.dim() == 4 else X.unsqueeze(1)).to(device)  # (N, 1, 28, 28) uint8
        self.y = y.to(device)  # (N,) int64
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.resize, self.device = resize, device
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))

    def __len__(self) -> int:
        n, b = len(self.y), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.y)
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        order = order.to(self.device)
        last = n - self.batch_size + 1 if self.drop_last else n
        for start in range(0, max(0, last), self.batch_size):
            idx = order[start:start + self.batch_size]
            X = self.X[idx].float().div_(255)  # (B, 1, 28, 28) float in [0, 1]
            if self.resize is not None:
                X = F.interpolate(X, size=(self.resize, self.resize), mode="bilinear",
                                  align_corners=False)
            yield X, self.y[idx]


def load_fashion_mnist(batch_size: int, *, resize: int | None = None,
                       root: str | os.PathLike | None = None, fast: bool = True,
                       device: torch.device | str | None = None, quick: bool | None = None,
                       num_workers: int = 0, seed: int | None = None, download: bool = True,
                       drop_last: bool = False):
    """Fashion-MNIST as ``(train_iter, test_iter)`` of ``(X, y)`` batches.

    ``X`` is float in [0, 1] of shape (B, 1, 28, 28) (or (B, 1, resize, resize)); ``y`` int64.

    Args:
        batch_size, resize: examples per batch; optional side length to resize the images to.
        root, download: as ``find_fashion_mnist`` takes them.
        fast: True: ``TensorBatches`` over in-memory tensors (on ``device``). False: the plain
            torchvision ``Dataset`` + ``DataLoader`` with ``ToTensor``, for comparison.
        device: where the fast path keeps the data and produces batches (default CPU).
        quick: use a small slice (first 2048 train / 1024 test examples); default: quick mode.
        num_workers: DataLoader worker processes (only with ``fast=False``).
        seed: seed of the training-set shuffle (fast path only).
        drop_last: leave out a short last training batch (the test set keeps every example).
    """
    import torchvision

    batch_size, resize = _check_sizes(batch_size, resize)
    from torch.utils import data

    data_root = str(find_fashion_mnist(root, download=download))
    quick = quick_mode() if quick is None else quick
    n_train, n_test = (QUICK_TRAIN_SIZE, QUICK_TEST_SIZE) if quick else (None, None)
    if fast:
        version = _version(data_root)
        X_tr, y_tr = _load_split(data_root, True, version)
        X_te, y_te = _load_split(data_root, False, version)
        train_iter = TensorBatches(X_tr[:n_train], y_tr[:n_train], batch_size, shuffle=True,
                                   device=device, resize=resize, seed=seed, drop_last=drop_last)
        test_iter = TensorBatches(X_te[:n_test], y_te[:n_test], batch_size, shuffle=False,
                                  device=device, resize=resize)
        return train_iter, test_iter

    T = torchvision.transforms
    trans = T.Compose(([T.Resize(resize)] if resize else []) + [T.ToTensor()])
    train = torchvision.datasets.FashionMNIST(data_root, train=True, transform=trans)
    test = torchvision.datasets.FashionMNIST(data_root, train=False, transform=trans)
    if quick:
        train = data.Subset(train, range(QUICK_TRAIN_SIZE))
        test = data.Subset(test, range(QUICK_TEST_SIZE))
    return (data.DataLoader(train, batch_size, shuffle=True, num_workers=num_workers,
                            drop_last=drop_last),
            data.DataLoader(test, batch_size, shuffle=False, num_workers=num_workers))
