"""Real text for the GPT of lesson 14, found offline, and a byte-level tokenizer.

The corpus is the King James Version of the Bible (1611; public domain), about 4.3 MB of English,
as the Debian package ``bible-kjv`` ships it (``make setup`` installs it); any plain-text file
serves as well. PyTorch counterpart: none (torchtext is retired); the byte tokenizer is what
nanoGPT's ``shakespeare_char`` does with characters. Search order: the ``root`` argument,
``$COURSE_TEXT``, the repository's ``data/text/``, the Debian package (its text written once into
``data/text/kjv.txt``, or the user cache when ``data/`` is read-only).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from ._data_checks import write_atomic

__all__ = ["HELD_OUT", "TEXT_ENV", "ByteTokenizer", "batch_schedule", "find_text", "load_text",
           "split_tokens", "text_batch"]

TEXT_ENV = "COURSE_TEXT"
REPO_TEXT = Path(__file__).resolve().parent.parent / "data" / "text"
_CACHE_TEXT = Path.home() / ".cache" / "course_lib" / "data" / "text"
_BIBLE_PROGRAM = "bible"          # from the Debian package bible-kjv
_BIBLE_NAME = "kjv.txt"
_WHOLE_BIBLE = "gen1:1-rev22:21"


class ByteTokenizer:
    """Text to token ids and back: one token per UTF-8 byte, ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D ``torch.long`` tensor of byte values."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids) -> str:
        """Token ids back to text (bytes that do not form UTF-8 are shown as U+FFFD)."""
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode expects ids in 0..255, got {bad[:5]}; a model "
                             "with a padded vocabulary can emit ids >= 256: mask them out first.")
        return bytes(ids).decode("utf-8", errors="replace")


def _text_in(path: Path) -> Path | None:
    """The text file ``path`` is, or the one ``data/text``-style folder holds (kjv.txt first)."""
    if path.is_file():
        return path
    if path.is_dir():
        files = sorted(path.glob("*.txt"), key=lambda p: (p.name != _BIBLE_NAME, p.name))
        return files[0] if files else None
    return None


def _from_debian(program: str) -> Path:
    """Write the whole KJV text from the Debian package into data/text (or the user cache)."""
    text = subprocess.run([program, _WHOLE_BIBLE], capture_output=True, check=True,
                          timeout=120).stdout
    for folder in (REPO_TEXT, _CACHE_TEXT):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / _BIBLE_NAME, text)   # a reader never sees half a file
            return folder / _BIBLE_NAME
        except OSError:
            continue
    raise OSError(f"find_text: neither {REPO_TEXT} nor {_CACHE_TEXT} is writable; pass "
                  "root= a text file, or set $COURSE_TEXT to one.")


def find_text(root: str | os.PathLike | None = None) -> Path:
    """The path of the course's UTF-8 text corpus, found locally; ``root``: a text file, or a
    folder holding ``*.txt`` (``kjv.txt`` first), to use first."""
    candidates = [("the root argument", Path(root).expanduser())] if root is not None else []
    if os.environ.get(TEXT_ENV):
        candidates.append((f"${TEXT_ENV}", Path(os.environ[TEXT_ENV]).expanduser()))
    candidates += [("the repository's data/text/ folder", REPO_TEXT),
                   ("the user cache", _CACHE_TEXT)]
    for label, path in candidates:
        found = _text_in(path)
        if found is not None:
            return found
        if label in ("the root argument", f"${TEXT_ENV}"):  # named explicitly: no fallback
            what = "does not exist" if not path.exists() else "holds no *.txt file"
            raise FileNotFoundError(
                f"find_text: {label} {path} {what}. Expected a plain-text file, or a folder "
                "holding one (*.txt). Point it at one, or leave it unset to use the other places.")
    program = shutil.which(_BIBLE_PROGRAM)
    if program is not None:
        return _from_debian(program)
    looked = "\n".join(f"  - {label}: {path}" for label, path in candidates)
    raise FileNotFoundError(
        "find_text: no text corpus found. Looked in:\n" + looked + "\n"
        f"  - the Debian package bible-kjv: the program '{_BIBLE_PROGRAM}' is not on PATH.\n"
        "Any one of these fixes it:\n"
        "  - pass root='/path/to/a/file.txt' (any plain UTF-8 text, a few MB is plenty);\n"
        f"  - set {TEXT_ENV}=/path/to/a/file.txt;\n"
        f"  - copy a .txt file into {REPO_TEXT};\n"
        "  - install the Debian package: apt-get install bible-kjv (make setup does).")


def load_text(root: str | os.PathLike | None = None, *,
              max_bytes: int | None = None) -> torch.Tensor:
    """The corpus (``root`` as ``find_text`` takes it) as byte token ids: a 1-D ``torch.long``
    tensor; ``max_bytes``: keep only the first ``max_bytes`` bytes (a quick run)."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 2):
        raise ValueError(f"load_text: max_bytes must be an integer >= 2 or None, got "
                         f"{max_bytes!r}.")
    path = find_text(root)
    with open(path, "rb") as f:
        data = f.read(max_bytes) if max_bytes is not None else f.read()
    if len(data) < 2:
        raise ValueError(f"load_text: {path} holds {len(data)} bytes; a language model needs "
                         "at least two (an input and its next byte). Point root= at real text.")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, *,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of windows: inputs ``X`` and next-token targets ``Y``, each (B, T).

    ``Y[b, i] = X[b, i + 1]``: the byte that follows. Pass the same ``generator`` state on every
    rank for tensor parallelism (every rank sees the same batch).
    """
    if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
        raise ValueError(f"text_batch expects 1-D tokens longer than seq_len={seq_len}, got "
                         f"shape {tuple(tokens.shape)}; load more text or shorten seq_len.")
    starts = torch.randint(tokens.numel() - seq_len, (batch_size,), generator=generator)
    X = torch.stack([tokens[s:s + seq_len] for s in starts.tolist()])          # (B, T)
    Y = torch.stack([tokens[s + 1:s + 1 + seq_len] for s in starts.tolist()])  # (B, T)
    return X, Y


#: The share of the corpus held out for a validation loss: its last 10 % of tokens.
HELD_OUT = 0.1


def split_tokens(tokens: torch.Tensor,
                 held_out: float = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the first ``1 - held_out`` of ``tokens`` and the rest (the end of the
    text, so no training window overlaps a held-out one)."""
    if not 0 < held_out < 1:
        raise ValueError(f"split_tokens: held_out must be between 0 and 1, got {held_out!r}.")
    cut = int(tokens.numel() * (1 - held_out))
    return tokens[:cut], tokens[cut:]


def batch_schedule(tokens: torch.Tensor, batch_size: int, seq_len: int, *,
                   seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of a run, in order: ``text_batch`` with one generator seeded ``seed`` (drawn
    the same way on every rank, a later lesson trains on exactly the baseline's text)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield text_batch(tokens, batch_size, seq_len, generator=g)
