"""What the committed notebooks show is clean: no machine paths, no unused imports, no per-cell
timestamps, no launcher banner left unexplained (issue 13's output hygiene)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

#: Absolute paths of this machine, a temporary folder or the kernel's cell files in an output.
MACHINE_PATH = re.compile(r"/tmp/|/work/|/root/|/home/|/usr/|site-packages|ipykernel_\d+")


def _outputs(nb: dict):
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            for text in (out.get("text", ""), data.get("text/plain", ""),
                         data.get("text/html", ""), out.get("traceback", "")):
                yield i, "".join(text) if isinstance(text, list) else text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_name_no_machine_or_temporary_paths(path):
    nb = json.loads(path.read_text())
    for i, text in _outputs(nb):
        hit = MACHINE_PATH.search(text)
        if hit:
            around = text[max(0, hit.start() - 60):hit.end() + 40]
            pytest.fail(f"{path.name} cell {i}: {around!r} (print paths relative to the repo)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_per_cell_timestamps_in_metadata(path):
    nb = json.loads(path.read_text())
    stamped = [i for i, c in enumerate(nb["cells"]) if "execution" in c.get("metadata", {})]
    assert not stamped, (f"{path.name}: cells {stamped} carry execution timestamps; execute with "
                         "--ExecutePreprocessor.record_timing=False (make notebooks does)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_launcher_banners_are_explained(path):
    nb = json.loads(path.read_text())
    prose = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    if any("Setting OMP_NUM_THREADS" in text for _, text in _outputs(nb)):
        assert "OMP_NUM_THREADS" in prose, f"{path.name}: torchrun's banner is never explained"


def test_notebooks_import_nothing_they_do_not_use():
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this Python (make setup installs it)")
    out = subprocess.run([str(ruff), "check", "--select", "F401", "--output-format", "concise",
                          "--no-cache", *map(str, NOTEBOOKS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
