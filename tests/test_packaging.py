"""The conda environment, pyproject and the set-up stay in step."""
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _lock() -> dict[str, str]:
    """requirements/lock.txt as {name: exact version}."""
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", line), f"not an exact pin: {line!r}"
            name, version = line.split("==")
            pins[_name(name)] = version
    return pins


def test_environment_yml_follows_the_lock_and_pyproject():
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "conda-forge" in env["channels"]
    deps = env["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-e ." in pip, "the pip section must install this package"
    listed = [r for r in pip if r != "-e ."]
    lock = _lock()
    # the same packages as pyproject, each at the lock's exact version
    assert sorted(_name(r) for r in listed) == sorted(_name(r) for r in project["dependencies"])
    for r in listed:
        assert r == f"{_name(r)}=={lock[_name(r)]}", (r, lock.get(_name(r)))
    # every package the course asks for (extras and d2l included) is in the lock, at a version
    # pyproject's range admits: the lock is one point of the range the course states
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    for req in map(Requirement, project["dependencies"] + extras + ["d2l==1.0.3"]):
        name = _name(req.name)
        assert name in lock, f"{name} is not in requirements/lock.txt (run make lock)"
        assert req.specifier.contains(lock[name], prereleases=True), (str(req), lock[name])


def test_setup_installs_the_lock_by_default_and_can_opt_out():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "LOCK=${LOCK:-1}" in setup and 'CONSTRAINTS=(-c "$VENV/.constraints.txt")' in setup
    assert 'install "${CONSTRAINTS[@]}" -e ".[dev]"' in setup
    assert "LOCK=0" in (ROOT / "README.md").read_text(), "the README says how to opt out"
    lock = _lock()
    assert lock["torch"] == "2.14.1", "the lock must install where the newest torch is 2.14.1"


def test_required_layout_and_ci_calls_make_test():
    for path in ("notebooks", "course_lib", "tests", "environment.yml", "README.md",
                 "pyproject.toml", "Makefile", ".ci/run", "scripts/setup.sh"):
        assert (ROOT / path).exists(), path
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_setup_installs_d2l_without_its_pins():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '--no-deps "d2l==1.0.3"' in setup
    assert "dataset-fashion-mnist" in setup and "openmpi-bin" in setup


def test_notebooks_have_a_kernelspec_and_start_with_the_hardware():
    import json

    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks
    for nb in notebooks:
        meta = json.loads(nb.read_text())
        assert meta["metadata"]["kernelspec"]["name"] == "python3", nb.name
        first_code = next(c for c in meta["cells"] if c["cell_type"] == "code")
        assert "hardware_summary()" in "".join(first_code["source"]), nb.name


def _notebooks():
    import json

    return [(p.name, json.loads(p.read_text()))
            for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))]


def _modules():
    import importlib
    import pkgutil

    import course_lib

    for info in pkgutil.walk_packages(course_lib.__path__, prefix="course_lib."):
        if not info.name.endswith(".__main__"):  # importing it would run the command
            yield info, importlib.import_module(info.name)


def test_every_public_name_exists_and_is_documented():
    """(tests/test_readme.py checks that docs/library.md lists every public module.)"""
    import inspect

    for info, module in _modules():
        if info.name.rsplit(".", 1)[-1].startswith("_") or info.name.endswith(".__main__"):
            continue
        assert module.__doc__, f"{info.name} has no module docstring"
        if info.name.startswith("course_lib.examples"):
            continue  # scripts and workers, shown by the lessons
        names = getattr(module, "__all__", None)
        assert names is not None, f"{info.name} has no __all__"
        for name in names:
            obj = getattr(module, name)  # AttributeError: __all__ names a missing object
            if inspect.isfunction(obj) or inspect.isclass(obj):
                assert inspect.getdoc(obj), f"{info.name}.{name} has no docstring"


def test_a_package_reexports_its_modules_names_and_defines_none_twice():
    """One implementation of each idea: a name a package exports is its module's very object,
    and no two modules of the library define a public name twice."""
    import inspect

    defined: dict[str, str] = {}
    for info, module in _modules():
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if info.ispkg:
                assert home == info.name or home.startswith(info.name + "."), (info.name, name)
                continue
            if home == info.name:
                key = f"{name}"
                assert key not in defined or defined[key] == info.name or name in {
                    "gather", "ring_allreduce", "main"}, \
                    f"{name} is defined in both {defined[key]} and {info.name}"
                defined.setdefault(key, info.name)


def test_the_layering_contract_holds():
    """import-linter's contract in pyproject.toml: mechanisms never import loops or presentation."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


#: Lessons whose exercises are still gathered at the end, as before build-then-reveal
#: (tests/test_reveal.py marks the same ones); remove a lesson once it is rebuilt.
OLD_STYLE: set[str] = set()


def test_every_lesson_declares_exercises_judged_by_a_checker():
    """Build, then reveal: every lesson from 01 on has exercise cells (``# EXERCISE: name``, read
    by ``course_lib.checks.grade``), each running a ``course_lib.checks`` checker in that cell."""
    import re

    for name, nb in _notebooks():
        if name.startswith("00"):
            continue
        if name[:2] in OLD_STYLE:  # exercises still gathered at the end (not yet rebuilt)
            tail = "".join("".join(c["source"]) for c in nb["cells"][-5:])
            assert "checks.check_" in tail, f"{name}: the exercises use no checker"
            continue
        cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
        declared = [i for i, c in enumerate(cells) if re.search(r"^#\s*EXERCISE:", c, flags=re.M)]
        assert declared, f"{name}: no exercise cell (# EXERCISE: name)"
        for i in declared:  # the checker runs in the cell, or right after a %%writefile cell
            judged = "check_" in cells[i] or (
                cells[i].startswith("%%writefile") and i + 1 < len(cells)
                and "check_" in cells[i + 1])
            assert judged, f"{name}: an exercise cell runs no checker:\n{cells[i][:300]}"


def test_committed_notebooks_carry_the_outputs_of_a_full_run():
    for name, nb in _notebooks():
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        counts = [c["execution_count"] for c in code]
        assert None not in counts, f"{name}: a code cell was never executed"
        assert counts == list(range(1, len(code) + 1)), f"{name}: not one run top to bottom"
        for c in code:
            for out in c["outputs"]:
                assert out["output_type"] != "error", f"{name}: a stored error output"
