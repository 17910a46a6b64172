"""Lesson 07's script, run as the lesson runs it (torchrun, 2 and 3 ranks): it prints the steps
that ran, and asking for more steps than one pass has batches wraps around the data."""
import re
import subprocess
import sys

import pytest

from course_lib import distributed as D

SCRIPT = D.example_path("train_ddp_script.py")
LINE = re.compile(r"train_ddp_script: (\d+) rank\(s\), (\d+) steps of 64 examples per rank "
                  r"\(([\d.]+) passes over (\d+) batches\); rank 0's loss ([\d.]+) -> ([\d.]+); "
                  r"weights equal on every rank: True$")


def _run(steps: int, ranks: int) -> tuple[int, int, float, int, float]:
    """(ranks, steps, passes, batches per pass, rank 0's last loss) from the script's line."""
    out = D.torchrun(SCRIPT, str(steps), nproc_per_node=ranks, timeout=240, echo=False)[0]
    lines = [ln for ln in out.splitlines() if ln.startswith("train_ddp_script:")]
    assert len(lines) == 1, out
    m = LINE.match(lines[0])
    assert m, lines[0]
    return int(m[1]), int(m[2]), float(m[3]), int(m[4]), float(m[6])


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.slow
def test_the_steps_printed_are_the_steps_that_ran(ranks):
    """Lesson 07 asked for 50 steps and printed '50 steps' where the data allowed 16. (At 3
    ranks only the wrapping run: each torchrun costs seconds of start-up.)"""
    per_pass = 2048 // (64 * ranks)               # quick slice, a full global batch each
    asked = 2 * per_pass + per_pass // 2          # more than the data has: it wraps around
    more = _run(asked, ranks)
    assert more[:4] == (ranks, asked, pytest.approx(asked / per_pass, abs=0.005), per_pass)
    if ranks == 2:
        one_pass = _run(per_pass, ranks)
        assert one_pass[:4] == (ranks, per_pass, 1.0, per_pass)
        assert more[4] != one_pass[4]  # the extra steps really ran: training went on


def test_steps_below_one_are_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "steps must be an integer >= 1, got 0" in out.stderr
