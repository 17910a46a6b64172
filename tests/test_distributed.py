"""course_lib.distributed: hand-written collectives against torch's, launchers, failure guarantees.

Workers handed to ``launch`` are module-level functions here: worker processes import them by
name (this file's directory is on ``sys.path``, which multiprocessing passes on).
"""
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist

from course_lib import distributed as D
from course_lib.bench.allreduce import bus_bandwidth, parse_size
from course_lib.bench.allreduce import main as bench_main
from course_lib.config import quick_mode
from course_lib.devices import cpu_cores
from course_lib.examples import hello_records
from course_lib.examples import workers as W
from course_lib.plots import draw_collectives

HELLO = D.example_path("hello_dist.py")


# ------------------------------------------------------------------------------------------------
# helpers: is a process alive, which processes descend from this one
# ------------------------------------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ...]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as dead)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """Live processes below ``root`` in the process tree."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[0] not in ("Z", "X"):
            parent[int(entry)] = int(st[1])
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def leftover_processes() -> set[int]:
    """Our descendants, except the servers multiprocessing keeps for the next launch."""
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    left = descendants(os.getpid()) - {server, tracker}
    return {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            for pid in left if alive(pid)}


def read_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("*.pid"))]


# ------------------------------------------------------------------------------------------------
# workers (run inside launch)
# ------------------------------------------------------------------------------------------------

def ring_vs_all_reduce(sizes: list[int]) -> list[str]:
    """Ring allreduce == dist.all_reduce for each size, several dtypes and layouts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    bad = []
    for n in sizes:
        for x in (torch.randn(n, generator=g, dtype=torch.float64),  # (n,)
                  torch.randint(-100, 100, (n,), generator=g),  # int64: exact
                  torch.randn(n, 3, generator=g).t()):  # (3, n), not contiguous
            ref = x.clone()
            dist.all_reduce(ref)
            for segments in ("textbook", None, 1, 3):  # pipelined: default, 1 or 3 pieces
                mine = x.clone()
                out = (D.ring_allreduce(mine) if segments == "textbook" else
                       D.ring_allreduce_pipelined(mine, segments=segments))
                if out is not mine or not torch.allclose(mine, ref, rtol=1e-6, atol=1e-6):
                    bad.append(f"rank {rank}/{world}: n={n} {x.dtype} {tuple(x.shape)} "
                               f"segments={segments}")
    if world == 4:  # a sub-group of three ranks: the ring uses group ranks, sends to global ones
        group = dist.new_group([1, 2, 3])
        if rank in (1, 2, 3):
            for ring in (D.ring_allreduce, D.ring_allreduce_pipelined):
                mine = torch.arange(5, dtype=torch.int64) * rank
                ring(mine, group=group)
                if mine.tolist() != [0, 6, 12, 18, 24]:
                    bad.append(f"rank {rank}: {ring.__name__} sub-group result {mine.tolist()}")
    return bad


def tiny() -> int:
    return dist.get_rank()


def write_pid(folder: str) -> None:
    """Record this worker's pid, then wait until every rank has (so all of them are checked)."""
    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()


def raise_on_rank_1(folder: str) -> None:
    write_pid(folder)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    dist.barrier()  # rank 0 waits here for a partner that never comes


def exit_on_rank_1(folder: str) -> None:
    write_pid(folder)
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def hang_with_a_child(folder: str) -> None:
    """Rank 0 starts a grandchild and sleeps; rank 1 waits in a collective."""
    write_pid(folder)
    if dist.get_rank() == 0:
        child = subprocess.Popen(["sleep", "300"])
        Path(folder, "grandchild.pid").write_text(str(child.pid))
    dist.barrier()  # the grandchild's pid is on disk
    if dist.get_rank() == 0:
        time.sleep(300)
    dist.barrier()


def describe_existing_group() -> tuple:
    info = D.init_distributed_mode(verbose=False)
    return info.rank, info.world_size, info.local_rank, info.launcher, D.is_main_process()


def init_from_slurm_variables(port: int) -> dict:
    """Leave launch's group, then join a new one from hand-set Slurm variables, as under srun."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
                      SLURM_STEP_NODELIST="127.0.0.[1-4]", SLURM_JOB_NODELIST="other[1-9]",
                      MASTER_PORT=str(port))
    info = D.init_distributed_mode(verbose=False)
    x = torch.tensor([rank + 1], device=info.device)
    dist.all_reduce(x)
    return {"launcher": info.launcher, "rank": info.rank, "world_size": info.world_size,
            "local_rank": info.local_rank, "master": os.environ["MASTER_ADDR"], "sum": x.item()}


# ------------------------------------------------------------------------------------------------
# the hand-written collectives: torch is the oracle
# ------------------------------------------------------------------------------------------------

def ring_and_hand_collectives(sizes: list[int], hand_sizes: list[int]) -> tuple:
    """Both comparisons below in one launch (a launch costs more than either)."""
    return ring_vs_all_reduce(sizes), W.compare_by_hand(hand_sizes)


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_allreduce_and_hand_collectives_equal_torch(world_size):
    sizes = [1, world_size - 1, world_size + 1, 7, 1001, 0]  # odd, fewer than ranks, empty
    results = D.launch(ring_and_hand_collectives, world_size, sizes, [9, 10], backend="gloo",
                       timeout=120)
    assert [failures for failures, _ in results] == [[]] * world_size
    names = ("ring_allreduce", "ring_allreduce_pipelined", "tree_broadcast", "ring_all_gather")
    for _, result in results:
        assert result == {f"{name}, {n} elements": True for n in (9, 10) for name in names}


def test_a_sub_group_leaves_the_middle_rank_out_at_three_ranks():
    r0, r1, r2 = D.launch(W.collectives, 3, timeout=60)
    key = "all_reduce in group [0, 2]"
    assert r0[key] == r2[key] == [4, 4] and r1[key] == "(not in the group)"
    assert r0["async all_reduce"] == r1["async all_reduce"] == r2["async all_reduce"] == [6, 6]


def test_every_collective_on_small_tensors():
    r0, r1 = D.launch(W.collectives, 2, timeout=60)
    assert r0["broadcast"] == r1["broadcast"] == [1, 1]
    assert r0["all_reduce"] == r1["all_reduce"] == [3, 3]
    assert r0["reduce"] == [3, 3]
    assert r0["all_gather"] == r1["all_gather"] == [[1, 1], [2, 2]]
    assert r0["gather"] == [[1, 1], [2, 2]]
    assert (r0["scatter"], r1["scatter"]) == ([10, 10], [20, 20])
    assert (r0["reduce_scatter"], r1["reduce_scatter"]) == ([1], [3])
    assert (r0["all_to_all"], r1["all_to_all"]) == ([0, 10], [1, 11])
    assert r0["mean_loss"] == r1["mean_loss"] == 1.5
    assert r0["async all_reduce"] == r1["async all_reduce"] == [3, 3]
    assert r0["all_reduce in group [0, 1]"] == r1["all_reduce in group [0, 1]"] == [3, 3]
    assert r0["inputs"]["reduce_scatter"] == [0, 1] and r1["inputs"]["scatter"] == "-"
    fig = draw_collectives([r0, r1])        # the picture of lesson 06, from what the ranks held
    assert sorted(ax.get_title() for ax in fig.axes if ax.get_title()) == sorted(
        ["broadcast", "reduce", "all_reduce", "gather", "all_gather", "scatter",
         "reduce_scatter", "all_to_all"])
    plt.close(fig)
    assert D.launch(W.point_to_point, 2, timeout=60) == [[10, 20, 30], [1, 2, 3]]


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("init_method", ["file", "tcp", "env"])
def test_launch_returns_by_rank(init_method):
    infos = D.launch(W.whoami, 2, init_method=init_method, timeout=60)
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert {i["backend"] for i in infos} == {D.choose_backend(2).backend}
    assert all(i["threads"] == max(1, cpu_cores() // 2) for i in infos)
    assert infos[0]["pid"] != infos[1]["pid"] != os.getpid()


def _local_function():
    return 1


def test_launch_rejects_functions_workers_cannot_import(monkeypatch):
    with pytest.raises(ValueError, match="lambda"):
        D.launch(lambda: 1, 1)
    def nested():
        return 1
    with pytest.raises(ValueError, match="inside another function"):
        D.launch(nested, 1)
    # as in a notebook: __main__ has no file, so workers cannot import its functions
    monkeypatch.setattr(sys.modules["__main__"], "__file__", None, raising=False)
    monkeypatch.setattr(_local_function, "__module__", "__main__")
    with pytest.raises(ValueError, match="notebook cell"):
        D.launch(_local_function, 1)


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_so_before_any_worker_starts(tmp_path):
    """Workers import the script that started them: unguarded, each would launch again. launch
    says so and starts nothing; the same script under the guard runs."""
    body = ("from course_lib.examples.workers import whoami\n"
            "from course_lib.distributed import launch\n"
            "{indent}print(len(launch(whoami, 2, timeout=60)))\n")
    bare, guarded = tmp_path / "bare.py", tmp_path / "guarded.py"
    bare.write_text(body.format(indent=""))
    guarded.write_text(body.replace("{indent}", 'if __name__ == "__main__":\n    '))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(bare)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "bare.py runs its code when it is imported" in out.stderr, out.stderr
    assert 'if __name__ == "__main__":' in out.stderr
    assert "bootstrapping" not in out.stderr and "exited with code" not in out.stderr
    ok = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, env=env,
                        timeout=120, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == "2", ok.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_launch_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size >= 1"):
        D.launch(tiny, bad)


def test_a_raising_rank_fails_launch_fast_with_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(D.WorkerError) as err:
        D.launch(raise_on_rank_1, 2, str(tmp_path), timeout=60)
    assert time.monotonic() - start < 30
    assert err.value.rank == 1
    message = str(err.value)
    assert "ValueError: rank 1 cannot go on" in message
    assert "Traceback" in message and "raise_on_rank_1" in message
    pids = read_pids(tmp_path)
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert not leftover_processes()


def test_a_dying_rank_fails_launch(tmp_path):
    with pytest.raises(D.WorkerError, match="rank 1 exited with code 3"):
        D.launch(exit_on_rank_1, 2, str(tmp_path), timeout=60)
    assert not any(alive(p) for p in read_pids(tmp_path))
    assert not leftover_processes()


@pytest.mark.slow
def test_a_hanging_rank_times_out_and_nothing_survives(tmp_path):
    start = time.monotonic()
    # 15 s: under a load of 20 on 2 cores starting two workers alone takes about 8 s
    with pytest.raises(D.LaunchTimeout, match="timed out after 15 s"):
        D.launch(hang_with_a_child, 2, str(tmp_path), timeout=15)
    took = time.monotonic() - start
    assert 15 <= took < 45
    pids = read_pids(tmp_path)  # both ranks and rank 0's grandchild
    assert len(pids) == 3 and not any(alive(p) for p in pids)
    assert not leftover_processes()


@pytest.mark.slow
def test_many_launches_neither_collide_nor_leak():
    # 100 launches in a full run, 4 in quick mode (make slowtest): a leak of one file descriptor
    # or one temporary folder per launch shows either way (the check allows 2 fds of slack)
    launches = 4 if quick_mode() else 100
    tmp = Path(tempfile.gettempdir())
    mine = f"course_launch_{os.getpid()}_*"  # this process's launches only
    before_dirs = set(tmp.glob(mine))
    D.launch(tiny, 1)  # the forkserver starts once; fds counted after it exists
    before_fds = len(os.listdir("/proc/self/fd"))
    for i in range(launches):
        world_size = 1 + i % 2
        assert D.launch(tiny, world_size, timeout=60) == list(range(world_size))
    assert len(os.listdir("/proc/self/fd")) <= before_fds + 2
    assert set(tmp.glob(mine)) == before_dirs
    assert not leftover_processes()


# ------------------------------------------------------------------------------------------------
# init_distributed_mode under each launcher
# ------------------------------------------------------------------------------------------------

def test_hello_records_reads_lines_that_mpirun_glued_together():
    text = ('$ mpirun ...\nhello_dist {"rank": 1, "sum": [3.0]}'
            'hello_dist {"rank": 0, "sum": [3.0]}\nrank 0: done\n')
    assert [r["rank"] for r in hello_records(text)] == [0, 1]
    assert hello_records(['hello_dist {"rank": 0, ', '"sum": []}\n']) == [{"rank": 0, "sum": []}]


@pytest.mark.parametrize("nodelist, host", [
    ("node[01-04]", "node01"), ("node07", "node07"), ("a1,a2", "a1"),
    ("gpu-[3,5-7],cpu1", "gpu-3"), ("rack[1-2]-n[08-09]", "rack1-n08"),
    ("127.0.0.[1-4]", "127.0.0.1"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert D.first_host(nodelist) == host


def test_no_launcher_falls_back_to_one_process(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    info = D.init_distributed_mode()
    assert (info.rank, info.world_size, info.launcher, info.distributed) == (0, 1, "none", False)
    assert "single process" in capsys.readouterr().out
    assert not dist.is_initialized() and D.is_main_process()
    assert D.reduce_value(2.5) == 2.5
    D.cleanup()  # a no-op without a group


def test_init_inside_launch_describes_the_existing_group():
    assert D.launch(describe_existing_group, 2) == [(0, 2, 0, "launch", True),
                                                    (1, 2, 1, "launch", False)]


def test_init_from_hand_set_slurm_variables():
    infos = D.launch(init_from_slurm_variables, 2, D.find_free_port(), timeout=60)
    for rank, info in enumerate(infos):
        assert info == {"launcher": "slurm", "rank": rank, "world_size": 2, "local_rank": rank,
                        "master": "127.0.0.1", "sum": 3}  # first host of SLURM_STEP_NODELIST


# Two-node torchrun on the loopback (static and c10d rendezvous) and mpirun are asserted by
# notebook 06 (section 6, "Launching scripts"): ranks, local ranks, world size, launcher,
# master address and the ring all-reduce's sum, under nbval in `make test`; not launched twice.


# ------------------------------------------------------------------------------------------------
# run_commands: what torchrun() and mpirun() stand on
# ------------------------------------------------------------------------------------------------

def test_run_commands_fails_loudly_on_a_non_zero_exit():
    failing = [sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"]
    waiting = ["sleep", "60"]  # would wait for the failed one forever
    start = time.monotonic()
    with pytest.raises(subprocess.CalledProcessError) as err:
        D.run_commands([failing, waiting], timeout=60, echo=False)
    assert err.value.returncode == 3 and "about to fail" in err.value.output
    assert time.monotonic() - start < 20
    assert not leftover_processes()


def test_run_commands_kills_the_whole_process_group_on_timeout(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    with pytest.raises(subprocess.TimeoutExpired):
        D.run_commands([["bash", "-c", script]], timeout=2, echo=False)
    assert not alive(int(pidfile.read_text()))
    assert D.run_commands([["echo", "hi"]], echo=False) == ["hi\n"]


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------

def test_benchmark_prints_json(capsys, tmp_path):
    assert parse_size("4K") == 4096 and parse_size("64MB") == 64 * 2**20
    assert bus_bandwidth(100, 1.0, 2) == 100.0  # 2 (p - 1) / p = 1 for two ranks
    out = tmp_path / "allreduce.json"
    assert bench_main(["--world-sizes", "2", "--sizes", "4K,64K", "--repeat", "2",
                       "--min-sample-ms", "2", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report     # the file is what was printed
    for field in ("command", "machine", "hardware", "torch", "date", "load_average_start",
                  "load_average_end"):                # every results file says what made it
        assert field in report, field
    # the older name runs the one way to time collectives, on its two operations
    assert [(r["bytes"], r["op"]) for r in report["results"]] == [
        (n, op) for n in (4096, 65536) for op in ("ring_pipelined", "all_reduce")]
    assert all(r["median_s"] > 0 and r["reps"] >= 1 for r in report["results"])


# --- the backend is chosen once for the job (layout issue, bug 1) -------------------------------

def _init_with_fake_gpus(monkeypatch, gpus: int, env: dict[str, str]):
    """init_distributed_mode with ``gpus`` fake GPUs and the launcher's variables ``env``;
    returns (backend, device) it would have joined with (no group is really formed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    joined = {}
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: joined.update(backend=backend))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_PER_TASK",
                "OMPI_COMM_WORLD_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(key, "0")  # registered, so the test restores it afterwards
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        info = D.init_distributed_mode(verbose=False)
    finally:
        torch.set_num_threads(threads)
    assert joined["backend"] == info.backend
    return info.backend, info.device


def test_one_gpu_two_torchrun_processes_both_take_gloo(monkeypatch):
    """torchrun --nproc_per_node=2 on a machine with one GPU: the old per-rank rule gave rank 0
    NCCL and rank 1 gloo, and the group could never form."""
    chosen = [_init_with_fake_gpus(monkeypatch, 1, {"RANK": str(r), "WORLD_SIZE": "2",
                                                     "LOCAL_RANK": str(r),
                                                     "LOCAL_WORLD_SIZE": "2",
                                                     "MASTER_ADDR": "127.0.0.1",
                                                     "MASTER_PORT": "29500"})
              for r in (0, 1)]
    assert chosen == [("gloo", torch.device("cpu"))] * 2


def test_a_gpu_each_takes_nccl_on_its_local_rank(monkeypatch):
    chosen = [_init_with_fake_gpus(monkeypatch, 2, {"RANK": str(r), "WORLD_SIZE": "2",
                                                     "LOCAL_RANK": str(r),
                                                     "LOCAL_WORLD_SIZE": "2",
                                                     "MASTER_ADDR": "127.0.0.1",
                                                     "MASTER_PORT": "29500"})
              for r in (0, 1)]
    assert chosen == [("nccl", torch.device("cuda", 0)), ("nccl", torch.device("cuda", 1))]


def test_slurm_with_one_gpu_per_task_gives_local_rank_1_its_gpu(monkeypatch):
    """srun --ntasks-per-node=2 --gpus-per-task=1: each task sees only its own GPU (as cuda:0)."""
    chosen = [_init_with_fake_gpus(monkeypatch, 1, {
        "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_PER_TASK": "1",
        "CUDA_VISIBLE_DEVICES": str(r), "SLURM_STEP_NODELIST": "node[01]"}) for r in (0, 1)]
    assert chosen == [("nccl", torch.device("cuda", 0))] * 2


def test_choose_backend_says_why_and_refuses_nccl_without_a_gpu_each():
    assert D.choose_backend(2, gpus=0).backend == "gloo"
    assert "no GPU" in D.choose_backend(2, gpus=0).reason
    assert "not one each" in D.choose_backend(2, gpus=1).reason
    with pytest.raises(ValueError, match="needs a GPU per process: 2 process"):
        D.choose_backend(2, gpus=1, backend="nccl")


@pytest.mark.parametrize("gpus, expected", [(0, "none"), (1, "none"), (2, "own")])
def test_simulated_nodes_never_share_a_gpu(monkeypatch, gpus, expected):
    """Two "nodes" on one machine each give local rank 0 GPU 0 unless told otherwise; NCCL then
    refuses ("Duplicate GPU detected", seen on a one-GPU machine). Each node gets GPUs of its own
    where there are enough, else none (gloo on the CPU)."""
    seen = {}

    def fake_run_commands(commands, timeout, env=None, labels=None, echo=True):
        seen["commands"], seen["env"] = commands, env
        return ["" for _ in commands]

    monkeypatch.setattr(D.run, "run_commands", fake_run_commands)
    monkeypatch.setattr(D.run, "num_gpus", lambda: gpus)
    D.torchrun(HELLO, nproc_per_node=1, nnodes=2, echo=False)
    if expected == "none":
        assert seen["env"] == {"CUDA_VISIBLE_DEVICES": ""}
    else:
        assert [c[:2] for c in seen["commands"]] == [["env", "CUDA_VISIBLE_DEVICES=0"],
                                                     ["env", "CUDA_VISIBLE_DEVICES=1"]]


def raise_on_rank_1_after_closing(folder: str) -> None:
    """Rank 1 closes its connections first and raises a second later: rank 0's barrier fails
    with gloo's "Connection closed by peer" long before rank 1's own error arrives."""
    write_pid(folder)
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        time.sleep(1.0)
        raise ValueError("rank 1 cannot go on")
    dist.barrier()


def test_the_rank_that_caused_a_failure_is_named_not_the_peer_it_cut_off(tmp_path):
    """launch named whichever rank's error came first: in CI, rank 0's 'Connection closed by
    peer' instead of rank 1's own error (test_a_raising_rank_fails_launch_fast_with_its_traceback
    failed so once under load)."""
    with pytest.raises(D.WorkerError) as err:
        D.launch(raise_on_rank_1_after_closing, 2, str(tmp_path), timeout=60)
    assert err.value.rank == 1 and "rank 1 cannot go on" in str(err.value)
    assert not leftover_processes()
