"""The README and the library map name only what exists: lessons, files, make targets, and every
`course_lib` name they mention; every public module is on the library map."""
from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LIBRARY = (ROOT / "docs" / "library.md").read_text()
GENERATED = {"api/index.md"}  # pages that `make site` generates


def _public_names() -> tuple[set[str], set[str]]:
    """(every name in some course_lib module's __all__, every public module path)."""
    import course_lib

    names, modules = set(), {"course_lib"}
    for info in pkgutil.walk_packages(course_lib.__path__, prefix="course_lib."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        modules.add(info.name)
        names.update(getattr(module, "__all__", []))
        names.update(n for n in vars(module) if not n.startswith("_"))
        for obj in list(vars(module).values()):   # methods of its classes (no_sync, ...)
            if isinstance(obj, type) and obj.__module__.startswith("course_lib"):
                names.update(n for n in dir(obj) if not n.startswith("_"))
    return names, modules


_CACHE: list = []


def _names() -> tuple[set[str], set[str]]:
    if not _CACHE:
        _CACHE.append(_public_names())
    return _CACHE[0]


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("doc", ["README.md", "docs/library.md"])
def test_every_course_lib_name_mentioned_exists(doc):
    text = (ROOT / doc).read_text()
    missing = []
    for span in _code_spans(text):
        for token in re.findall(r"[A-Za-z_][\w.]*", span):
            if token.startswith("course_lib."):
                if not _resolves(token.rstrip(".")):
                    missing.append(token)
            elif re.fullmatch(r"(?:parallel|distributed|checks|bench|train_ddp|models)\.[\w.]+",
                              token):
                if not _resolves("course_lib." + token):
                    missing.append(token)
    assert not missing, f"{doc} names what course_lib does not have: {sorted(set(missing))}"


def test_library_map_names_exist_in_their_modules():
    """Each row of the map names only what exists (it once named a NonFiniteLossError)."""
    missing = []
    for row in LIBRARY.splitlines():
        m = re.match(r"\| `(course_lib[\w.]*)` \|[^|]*\|(.*)\|\s*$", row)
        if not m:
            continue
        for span in _code_spans(m.group(2)):
            name = span.split("(")[0].strip()
            if not re.fullmatch(r"[A-Za-z_]\w*", name) or name in {"module", "cuda"}:
                continue
            names, modules = _names()
            if name not in names and f"course_lib.{name}" not in modules:
                missing.append(f"{m.group(1)}: {name}")
    assert not missing, f"the library map names what does not exist: {missing}"


def test_every_public_module_is_on_the_library_map():
    absent = []
    for module in sorted(_names()[1]):
        leaf = module.rsplit(".", 1)[-1]
        if leaf.startswith("_") or module.startswith("course_lib.examples.") or \
                module == "course_lib":
            continue
        short = module.removeprefix("course_lib.")
        if f"`{module}`" not in LIBRARY and f"`{short}`" not in LIBRARY:
            absent.append(module)
    assert not absent, f"docs/library.md lists no {absent}"


def test_links_point_to_files_that_exist():
    for doc, text in (("README.md", README), ("docs/library.md", LIBRARY)):
        base = ROOT if doc == "README.md" else ROOT / "docs"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#")) or target in GENERATED:
                continue
            assert (base / target).exists(), f"{doc} links {target}, which does not exist"


def test_every_lesson_is_in_the_readme_in_order():
    lessons = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    linked = re.findall(r"\(notebooks/([0-9][0-9]_[\w]+\.ipynb)\)", README)
    assert linked == lessons, (linked, lessons)


def test_make_targets_named_exist():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert named and named <= targets, named - targets
