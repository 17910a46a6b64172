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


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "conda-forge" in env["channels"]
    deps = env["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-e ." in pip, "the pip section must install this package"
    listed = sorted(r for r in pip if r != "-e .")
    # same packages with the same version ranges
    assert sorted(project["dependencies"]) == listed
    assert {_name(r) for r in listed} == {_name(r) for r in project["dependencies"]}


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
