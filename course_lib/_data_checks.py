"""Is a Fashion-MNIST file genuine? The checks and error texts behind ``course_lib.data``.

Every IDX file is checked once: its header (magic number, 28x28 images, the byte count it
announces), labels in 0..9, at most 60,000 / 10,000 examples (fewer: a deliberate subset), and
for a full-size file the md5 of its uncompressed content. The verdict is cached per file (path,
size, modification time) in memory and in a stamp file beside it. A damaged file is named with
where it came from and where to fetch a genuine one (never "copy it again" from a damaged source).
It also holds the data modules' small file helpers (``file_stamp``, ``read_json``,
``write_atomic``), which ``course_lib.data_text`` shares.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

#: {file: (examples in the full set, md5 of the uncompressed file, md5 of torchvision's .gz)}:
#: the .gz md5s are torchvision's ``FashionMNIST.resources``. Debian's package recompresses the
#: files (other .gz bytes, the same content), so the uncompressed content is what is checked.
PUBLISHED = {
    "train-images-idx3-ubyte": (60000, "f4a8712d7a061bf5bd6d2ca38dc4d50a",
                                "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
    "train-labels-idx1-ubyte": (60000, "9018921c3c673c538a1fc5bad174d6f9",
                                "25c81989df183df01b3e8a0aad5dffbe"),
    "t10k-images-idx3-ubyte": (10000, "8181f5470baa50b63fa0f6fddb340f0a",
                               "bef4ecab320f06d8554ea6380940ec79"),
    "t10k-labels-idx1-ubyte": (10000, "15d484375f8d13e6eb1aabb0c3f46965",
                               "bb300cfdad3c16e7a12a480ee83cd310"),
}
#: torchvision's ``FashionMNIST.mirrors[0]``: ``MIRROR + name + ".gz"`` downloads one file.
MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
#: Where the Debian package ``dataset-fashion-mnist`` installs the four ``*-ubyte.gz`` files.
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
#: In a raw folder: {file: [size, mtime_ns]} of the files that passed ``idx_problem``.
STAMP = ".course_verified.json"

_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) checked in this process


class DamagedDataError(ValueError):
    """A Fashion-MNIST file is truncated, altered or not a Fashion-MNIST file at all."""


def idx_problem(data: bytes, name: str) -> str | None:
    """What is wrong with ``data``, the uncompressed content of the IDX file ``name``; None if
    nothing is."""
    images = "images" in name
    magic, dims, item = (2051, 3, 28 * 28) if images else (2049, 1, 1)
    head = 4 + 4 * dims
    if len(data) < head:
        return f"it is {len(data)} bytes long, shorter than its {head}-byte header (truncated)"
    found, *shape = struct.unpack(f">{1 + dims}I", data[:head])
    if found != magic:
        return (f"its header starts with {found:#010x}, not {magic:#010x}, the IDX magic number "
                f"of {'an image' if images else 'a label'} file")
    n = shape[0]
    if images and shape[1:] != [28, 28]:
        return f"its images are {shape[1]}x{shape[2]} pixels, not 28x28"
    want = head + n * item
    if len(data) != want:
        how = "truncated" if len(data) < want else "extra bytes at the end"
        return (f"its header announces {n} examples ({want} bytes) but it holds {len(data)} "
                f"bytes ({how})")
    full, md5, _ = PUBLISHED[name]
    if n > full:
        return f"it holds {n} examples; the genuine file holds {full}"
    top = max(data[head:], default=0)
    if not images and top > 9:
        return (f"label {top} of example {data.index(top, head) - head} is outside the classes "
                "0..9")
    if n == full:
        got = hashlib.md5(data).hexdigest()
        if got != md5:
            return (f"its md5 is {got}, not {md5}, the md5 of the genuine file: its content was "
                    "altered")
    return None


def read_content(path: Path) -> bytes:
    """The uncompressed content of ``path`` (plain or .gz); a broken .gz raises
    ``DamagedDataError`` naming it."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DamagedDataError(damaged(path, f"it is corrupted or truncated "
                                             f"({type(e).__name__}: {e})")) from None


def fetch_advice(name: str) -> str:
    """Where a genuine copy of ``name`` comes from."""
    return (f"Fetch a genuine {name}.gz instead: install the Debian package "
            f"(`apt-get install --reinstall dataset-fashion-mnist` as root; it puts the four "
            f".gz files in {DEBIAN_DIR}), or download {MIRROR}{name}.gz (torchvision's mirror; "
            f"md5 of the .gz {PUBLISHED[name][2]}).")


def damaged(path: Path, problem: str, origin: Path | None = None) -> str:
    """The message for a damaged file: which file, what is wrong, where it came from, what to
    fetch instead (never "copy it again" from a damaged source)."""
    name = path.name.removesuffix(".gz")
    text, replace = f"Fashion-MNIST file {path} is damaged: {problem}.", path
    if origin is None and path.parent == DEBIAN_DIR:
        text += " It is the Debian package's own file: nothing was copied from it."
    elif origin is None:
        text += (" It is the only copy the course knows of (no source is recorded): do not "
                 "delete it before you have a genuine one.")
    elif not origin.is_file():
        text += f" It was prepared from {origin}, which is gone: this is the only copy."
    else:
        try:
            origin_problem = idx_problem(read_content(origin), name)
        except DamagedDataError as e:
            origin_problem = str(e).split("is damaged: ", 1)[-1].rstrip(".")
        if not origin_problem:
            return (f"{text} It was prepared from {origin}, which checks out as genuine: delete "
                    f"{path} (only that copy; the original stays) and run again to prepare it "
                    "afresh.")
        text += (f" It was prepared from {origin}, which is damaged too ({origin_problem}): "
                 "preparing it again from there would copy the same damage.")
        replace = origin
    return f"{text} {fetch_advice(name)} Put it in place of {replace}."


def file_stamp(path: Path) -> list[int]:
    """``[size, mtime_ns]``: a file replaced since has another."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_atomic(path: Path, content: bytes | str) -> None:
    """Write through a temporary file, then rename: a crash never leaves half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        tmp.write_bytes(content) if isinstance(content, bytes) else tmp.write_text(content)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def verify_folder(raw: Path, names: tuple[str, ...], origins: dict[str, Path]) -> None:
    """Check the uncompressed IDX files ``names`` in ``raw`` (``origins``: where each was
    prepared from); raise ``DamagedDataError`` for the first damaged one. Cached per file."""
    stamps = read_json(raw / STAMP)
    counts, changed = {}, False
    for name in names:
        path = raw / name
        size, mtime = file_stamp(path)
        key = (str(path.resolve()), size, mtime)
        if key in _verified or stamps.get(name) == [size, mtime]:
            _verified.add(key)
        else:
            data = path.read_bytes()
            problem = idx_problem(data, name)
            if problem:
                raise DamagedDataError(damaged(path, problem, origins.get(name)))
            _verified.add(key)
            stamps[name], changed = [size, mtime], True
        with open(path, "rb") as f:
            counts[name] = struct.unpack(">I", f.read(8)[4:])[0]
    for prefix in ("train", "t10k"):
        n_img = counts.get(f"{prefix}-images-idx3-ubyte")
        n_lab = counts.get(f"{prefix}-labels-idx1-ubyte")
        if n_img is not None and n_lab is not None and n_img != n_lab:
            raise DamagedDataError(
                f"Fashion-MNIST files in {raw} do not match: {prefix}-images-idx3-ubyte holds "
                f"{n_img} images but {prefix}-labels-idx1-ubyte {n_lab} labels. "
                f"{fetch_advice(prefix + '-images-idx3-ubyte')} Do the same for the labels.")
    if changed:
        with contextlib.suppress(OSError):  # read-only: the in-memory verdict still holds
            write_atomic(raw / STAMP, json.dumps(stamps, indent=1))
