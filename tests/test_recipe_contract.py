"""Contracts of the recipe as a library and of the launch helpers, each checked cheaply.

- ``course_lib.train_ddp`` is a package whose modules import without matplotlib, every name it
  exported as one module still importable from it, ``python -m course_lib.train_ddp`` intact;
- ``evaluate_exact`` / ``evaluate_padded`` score rank 0's model on 3 ranks too (the 2-rank case
  runs inside ``test_train_ddp``'s launch);
- a command of ``run_commands`` that fails (or times out) raises an error that shows the last
  lines it printed;
- ``torchrun(...)``'s caller killed with SIGKILL takes torchrun and its workers with it.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from test_train_ddp import assert_rank0s_model_is_evaluated, batchnorm_evaluation

from course_lib.distributed import launch, run_commands
from course_lib.distributed.processes import kill_processes, tagged_processes
from course_lib.distributed.run import CommandFailed, CommandTimeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Every public name of the recipe when it was one module (course_lib/train_ddp.py).
NAMES_OF_THE_MODULE = [
    "EvalResult", "Job", "StridedShards", "build_model", "build_parser", "check_finite",
    "checkpoint_state", "evaluate_exact", "evaluate_padded", "head_of", "load_checkpoint",
    "load_data", "load_fitting_weights", "lr_factor", "main", "make_loader", "make_optimizer",
    "parse_args", "prepare", "progress", "restore", "rng_states", "run", "save_checkpoint",
    "set_rng_states", "setup", "share_initial_weights", "train_epochs", "train_one_epoch",
    "unwrap", "wrap_model", "log", "seed_everything", "NonFiniteLoss",
]


@pytest.mark.slow
def test_the_recipe_imports_without_matplotlib_and_keeps_its_names():
    code = textwrap.dedent(f"""
        import sys
        import course_lib.train_ddp as recipe
        import course_lib.train_ddp.__main__
        assert "matplotlib" not in sys.modules, "importing the recipe imported matplotlib"
        missing = [n for n in {NAMES_OF_THE_MODULE!r} if not hasattr(recipe, n)]
        assert not missing, missing
        from course_lib.train import NonFiniteLoss
        assert recipe.NonFiniteLoss is NonFiniteLoss
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_the_recipe_is_one_module_per_concern():
    from course_lib import train_ddp
    from course_lib.train_ddp import checkpoints, evaluation, schedule, sharding

    assert train_ddp.StridedShards is sharding.StridedShards
    assert train_ddp.make_loader is sharding.make_loader
    assert train_ddp.save_checkpoint is checkpoints.save_checkpoint
    assert train_ddp.set_rng_states is checkpoints.set_rng_states
    assert train_ddp.evaluate_exact is evaluation.evaluate_exact
    assert train_ddp.lr_factor is schedule.lr_factor
    for name in train_ddp.__all__:
        assert getattr(train_ddp, name).__doc__, f"{name} has no docstring"


def test_evaluation_scores_rank0s_model_on_3_ranks():
    ranks = launch(batchnorm_evaluation, 3, 100, timeout=240)     # 100 = 3 x 34 - 2
    assert_rank0s_model_is_evaluated(ranks)


# ------------------------------------------------------------------------------------------------
# run_commands and torchrun()
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_failed_command_shows_the_end_of_its_output():
    code = "for i in range(100): print(f'line {i}')\nraise SystemExit('the real reason')"
    with pytest.raises(CommandFailed) as err:
        run_commands([[sys.executable, "-c", code]], timeout=120, echo=False)
    message = str(err.value)
    assert isinstance(err.value, subprocess.CalledProcessError)         # as before
    assert "exit status 1" in message and "the real reason" in message
    assert "line 99" in message and "line 10\n" not in message          # the tail only
    assert "earlier line(s) left out" in message
    assert "line 0\n" in err.value.output                                # all of it kept
    with pytest.raises(CommandTimeout) as err:
        run_commands([[sys.executable, "-c", "print('still here', flush=True)\n"
                       "import time; time.sleep(60)"]], timeout=8, echo=False)
    assert isinstance(err.value, subprocess.TimeoutExpired) and "still here" in str(err.value)


def _tagged(tag: str) -> list[int]:
    return tagged_processes("COURSE_TEST_TAG", tag)


@pytest.mark.slow
def test_torchrun_helper_dies_with_its_caller_killed_by_sigkill(tmp_path):
    """torch elastic starts workers in sessions of their own: killing the caller's process
    group misses them. The helper's watchdog must take torchrun and the workers down."""
    tag = uuid.uuid4().hex
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\n"
                      f"open(os.path.join({str(tmp_path)!r}, f'up_{{os.getpid()}}'), 'w')"
                      ".close()\ntime.sleep(300)\n")
    caller = subprocess.Popen(
        [sys.executable, "-c", f"from course_lib.distributed import torchrun\n"
                               f"torchrun({str(worker)!r}, nproc_per_node=2, timeout=600, "
                               f"echo=False)"],
        cwd=ROOT, env={**os.environ, "COURSE_TEST_TAG": tag}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while len([f for f in os.listdir(tmp_path) if f.startswith("up_")]) < 2:
            assert caller.poll() is None, "the caller exited before the workers started"
            assert time.monotonic() < deadline, "the workers did not start in 180 s"
            time.sleep(0.2)
        started = _tagged(tag)
        assert len(started) >= 4            # caller, watchdog, torchrun, 2 workers
        caller.kill()                       # SIGKILL: no finally, no atexit in the caller
        caller.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _tagged(tag)
        assert not left, f"{len(left)} process(es) outlived the killed caller: {left}"
    finally:
        kill_processes(_tagged(tag))
        if caller.poll() is None:
            os.kill(caller.pid, signal.SIGKILL)
            caller.wait(timeout=30)
