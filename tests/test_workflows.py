"""The CI recipes a teacher copies: the GitHub Actions workflows parse, run on the events they
claim, and every `make` target they call (or .ci/run calls) exists in the Makefile."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def make_calls(text: str) -> list[str]:
    return re.findall(r"\bmake\s+([A-Za-z][\w-]*)", text)


def test_there_is_a_cpu_workflow_and_a_manual_gpu_workflow():
    names = {p.name for p in WORKFLOWS}
    assert {"ci.yml", "gpu.yml"} <= names, names


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_parses_and_calls_existing_targets(path):
    flow = yaml.safe_load(path.read_text())
    # YAML reads the key `on` as True.
    events = flow.get("on", flow.get(True))
    assert events, f"{path.name}: no trigger"
    assert flow["jobs"], f"{path.name}: no jobs"
    targets = make_targets()
    calls = []
    for job in flow["jobs"].values():
        assert "runs-on" in job and job["steps"], f"{path.name}: a job without runner or steps"
        for step in job["steps"]:
            calls += make_calls(step.get("run", ""))
    assert calls, f"{path.name} runs no make target"
    missing = [c for c in calls if c not in targets]
    assert not missing, f"{path.name} calls make targets the Makefile lacks: {missing}"


def test_cpu_workflow_runs_on_push_and_pull_request_and_uploads_artifacts():
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    events = flow.get("on", flow.get(True))
    assert "push" in events and "pull_request" in events
    steps = [s for job in flow["jobs"].values() for s in job["steps"]]
    runs = " ".join(s.get("run", "") for s in steps)
    assert "make test" in runs
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("actions/cache") for u in uses), "no cache of the environment"
    uploaded = " ".join(str(s.get("with", {}).get("path", "")) for s in steps
                        if s.get("uses", "").startswith("actions/upload-artifact"))
    assert "build/executed" in uploaded and "build/site" in uploaded


def test_gpu_workflow_is_manual_and_asks_for_a_gpu_runner():
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    events = flow.get("on", flow.get(True))
    assert set(events) == {"workflow_dispatch"}, "a GPU runner should be started by hand"
    runner = next(iter(flow["jobs"].values()))["runs-on"]
    assert "gpu" in runner


def test_ci_script_calls_existing_targets():
    calls = make_calls((ROOT / ".ci" / "run").read_text())
    assert calls[0] == "test"
    assert set(calls) <= make_targets()


def test_the_slow_tier_runs_wherever_the_tests_run():
    """`make test` leaves out the tests marked slow: .ci/run and the CPU workflow run them after
    it, the GPU workflow runs both tiers, and every marker pytest is asked for is declared."""
    import tomllib

    assert "slowtest" in make_calls((ROOT / ".ci" / "run").read_text())
    for name, wanted in (("ci.yml", "slowtest"), ("gpu.yml", "testall")):
        flow = yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())
        runs = [c for job in flow["jobs"].values() for s in job["steps"]
                for c in make_calls(s.get("run", ""))]
        assert wanted in runs, f"{name} runs {runs}, not make {wanted}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^testall: test slowtest$", makefile, re.M)
    declared = {m.split(":")[0] for m in tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["tool"]["pytest"]["ini_options"]["markers"]}
    asked = set(re.findall(r'-m "([^"]+)"', makefile))
    used = {w for expr in asked for w in re.findall(r"\w+", expr)} - {"not", "and", "or"}
    assert used <= declared, f"markers the Makefile asks for but pyproject lacks: {used - declared}"


def test_cpu_workflow_runs_the_lock_the_lowest_torch_and_the_newest():
    """The range pyproject states is the range CI runs: the lock, torch at pyproject's lower
    bound (with its torchvision), and the newest releases (LOCK=0)."""
    import tomllib
    from packaging.requirements import Requirement

    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    job = next(iter(flow["jobs"].values()))
    runs = {m["versions"]: m for m in job["strategy"]["matrix"]["include"]}
    assert {"lock", "lowest-torch", "newest"} <= set(runs)
    assert runs["lock"]["lock"] == "1" and not runs["lock"]["torch"]
    assert runs["newest"]["lock"] == "0" and not runs["newest"]["torch"]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = next(Requirement(d) for d in deps if d.startswith("torch>"))
    lower = next(s.version for s in torch_req.specifier if s.operator == ">=")
    pinned = dict(p.split("==") for p in runs["lowest-torch"]["torch"].split())
    assert pinned["torch"].startswith(lower), (pinned, str(torch_req))
    assert job["env"]["LOCK"] and job["env"]["TORCH"], "the matrix must reach make setup"
