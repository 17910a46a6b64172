"""scripts/execute_notebooks.py (`make notebooks`): what it removes before a lesson runs."""
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import execute_notebooks as E  # noqa: E402


def test_only_the_files_the_lessons_writefile_cells_write_are_named():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%%writefile my_ddp.py\nimport torch"),
        nbformat.v4.new_code_cell("%%writefile -a my_more.py\nx = 1"),
        nbformat.v4.new_code_cell("%%writefile ../elsewhere.py\nx = 1"),   # outside: never
        nbformat.v4.new_code_cell("print('%%writefile not_a_magic.py')"),
        nbformat.v4.new_markdown_cell("%%writefile in_markdown.py"),
    ])
    assert E.written_files(nb) == ["my_ddp.py", "my_more.py"]
    lesson = nbformat.read(Path(__file__).resolve().parent.parent / "notebooks"
                           / "10_timing_plots.ipynb", as_version=4)
    assert E.written_files(lesson) == ["my_timing.py"]


def test_a_stored_run_drops_the_test_settings_a_shell_may_hold():
    shell = {"PATH": "/bin", "COURSE_QUICK": "1", "MPLBACKEND": "agg", "OMP_NUM_THREADS": "1",
             "COURSE_QUIET_WAIT_S": "0", "GLOO_SOCKET_IFNAME": "lo"}
    env = E.kernel_env(shell)
    assert not {"COURSE_QUICK", "MPLBACKEND", "OMP_NUM_THREADS", "COURSE_QUIET_WAIT_S"} & set(env)
    assert env["PATH"] == "/bin" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["COURSE_STORED_RUN"] == "1" and env["TQDM_DISABLE"] == "1"
    assert shell["OMP_NUM_THREADS"] == "1"    # the caller's environment is left as it was
