"""Assemble the course's website sources in build/site-src, then build it with MkDocs.

The home page is the README, the lessons are the committed notebooks with their stored outputs
(mkdocs-jupyter renders them; nothing is executed), `docs/library.md` is the map of the library and
one API page per public module of `course_lib` is generated from its docstrings (mkdocstrings).
Run by `make site`; the result is build/site/index.html.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "build" / "site-src"


def public_modules() -> list[str]:
    """Every module of course_lib that lists its public names in ``__all__`` (examples aside)."""
    names = []
    for path in sorted((ROOT / "course_lib").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__" or "examples" in parts or any(
                p.startswith("_") and p != "__init__" for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        tree = ast.parse(path.read_text())
        has_all = any(isinstance(node, ast.Assign)
                      and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                      for node in tree.body)
        if has_all:
            names.append(".".join(parts))
    return names


def lesson_title(nb_path: Path) -> str:
    """The first markdown heading of a notebook, without its leading #."""
    nb = json.loads(nb_path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return nb_path.stem


def rewrite_links(text: str) -> str:
    """Links that leave the site (files of the repository that are not pages) become code."""
    def fix(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if target.startswith(("http://", "https://", "#", "notebooks/", "docs/")) \
                or target.endswith((".png", ".svg")):
            return match.group(0).replace("](docs/", "](")
        return f"{label} (`{target}`)"
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", fix, text)


def assemble() -> list:
    if SRC.exists():
        shutil.rmtree(SRC)
    (SRC / "notebooks").mkdir(parents=True)
    (SRC / "api").mkdir()
    (SRC / "index.md").write_text(rewrite_links((ROOT / "README.md").read_text()))
    for path in (ROOT / "docs").iterdir():
        if path.is_dir():
            shutil.copytree(path, SRC / path.name)
        else:
            target = SRC / path.name
            target.write_text(rewrite_links(path.read_text())) if path.suffix == ".md" \
                else shutil.copy(path, target)
    lessons = []
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        shutil.copy(nb, SRC / "notebooks" / nb.name)
        lessons.append({lesson_title(nb).replace("`", ""): f"notebooks/{nb.name}"})
    api = []
    for module in public_modules():
        page = SRC / "api" / f"{module}.md"
        page.write_text(f"# `{module}`\n\n::: {module}\n")
        api.append({module: f"api/{module}.md"})
    index = ["# API reference", "",
             "Generated from the docstrings of `course_lib`; one page per public module.", ""]
    index += [f"- [`{m}`]({m}.md)" for m in public_modules()]
    (SRC / "api" / "index.md").write_text("\n".join(index) + "\n")
    api.insert(0, {"Index": "api/index.md"})
    nav = [{"Home": "index.md"}, {"Lessons": lessons}]
    if (SRC / "library.md").exists():
        nav.append({"The library": "library.md"})
    nav.append({"API reference": api})
    return nav


def main() -> int:
    nav = assemble()
    import yaml

    # mkdocs.yml plus the navigation (lessons in reading order), with absolute paths.
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    settings.update(docs_dir=str(SRC), site_dir=str(ROOT / "build" / "site"), nav=nav)
    for plugin in settings["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    config = ROOT / "build" / "mkdocs.generated.yml"
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(config)],
                           cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
