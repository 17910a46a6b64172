"""Re-execute lessons in place in full mode, one at a time, on a quiet machine (`make notebooks`).

Before each lesson it waits (bounded) for the load average to fall (`course_lib.timing.
wait_for_quiet`); a lesson that had to start on a busy machine is reported as such. Each lesson's
wall time, the load before and after, and the hardware go to
`results/notebook-times-MACHINE.json` (what the README's "what it costs" points to).

    python scripts/execute_notebooks.py                      # every lesson
    python scripts/execute_notebooks.py notebooks/04_*.ipynb # some
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def written_files(nb) -> list[str]:
    """The file names the notebook's ``%%writefile`` cells write (plain names in its folder)."""
    names = []
    for cell in nb.cells:
        first = cell.source.split("\n", 1)[0].split() if cell.cell_type == "code" else []
        if first[:1] == ["%%writefile"] and len(first) >= 2 and "/" not in first[-1]:
            names.append(first[-1])
    return names


def kernel_env(environ) -> dict[str, str]:
    """The stored run's kernel environment: ``environ`` in full mode, no progress bars, the
    kernel's own inline figures (no MPLBACKEND override), and none of the test settings a shell
    may still hold (`make test`'s one thread per process, no wait for a quiet machine): a
    stored run is what a learner's default kernel runs."""
    env = {k: v for k, v in environ.items()
           if k not in ("COURSE_QUICK", "MPLBACKEND", "OMP_NUM_THREADS", "COURSE_QUIET_WAIT_S")}
    env.update(TQDM_DISABLE="1", COURSE_WAIT_SILENT="1",  # the load stamps say any wait
               COURSE_STORED_RUN="1")                    # config.claim asserts each finding
    return env


def execute(path: Path, timeout: int) -> float:
    """Run ``path`` top to bottom in place (full mode); return the wall time in seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # The files the lesson's %%writefile cells write, left by an earlier run: removed, so the
    # stored output reads "Writing", as a learner's first run does (this run rewrites them).
    for name in written_files(nb):
        (path.parent / name).unlink(missing_ok=True)
    env = kernel_env(os.environ)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)           # the kernel inherits this process's environment
    try:
        client.execute()
    except Exception:   # keep what ran, for a look, outside the repository's notebooks
        failed = ROOT / "build" / f"failed-{path.name}"
        failed.parent.mkdir(exist_ok=True)
        nbformat.write(nb, failed)
        print(f"   the partial run: {failed.relative_to(ROOT)}", flush=True)
        raise
    finally:
        os.environ.clear()
        os.environ.update(old)
    seconds = time.monotonic() - start
    nbformat.write(nb, path)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    parser.add_argument("--max-wait", type=float, default=600.0,
                        help="seconds to wait for a quiet machine before each lesson")
    args = parser.parse_args(argv)
    from course_lib.bench.scaling import machine_slug
    from course_lib.devices import hardware_summary
    from course_lib.timing import load_average, wait_for_quiet

    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    out = ROOT / "results" / f"notebook-times-{machine_slug()}.json"
    record = json.loads(out.read_text()) if out.exists() else {
        "what": "wall time of each lesson executed in full mode by scripts/execute_notebooks.py",
        "machine": machine_slug(), "hardware": hardware_summary(), "lessons": {}}
    failed: list[str] = []
    for path in paths:
        stamp = wait_for_quiet(max_wait_s=args.max_wait)
        print(f"== {path.name} ({stamp.message})", flush=True)
        try:
            seconds = execute(path, args.timeout)
        except Exception as exc:  # a failing lesson is reported; the others still run
            failed.append(path.name)
            print(f"   FAILED: {str(exc)[-3000:]}", flush=True)
            continue
        after = load_average()
        record["lessons"][path.name] = {
            "seconds": round(seconds, 1),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "load_before": stamp.to_json(), "load_after_1min": after[0] if after else None,
            "busy": bool(stamp.busy)}
        print(f"   {seconds / 60:.1f} min", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
    if failed:
        print(f"failed (left as they were): {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
