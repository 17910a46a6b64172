"""Every benchmark times its variants one way (``course_lib.timing.compare``): interleaved in the
same processes, loops sized from several calls, a bootstrap interval on each ratio, and a JSON
that says what made it (command, date, hardware, load before and after). Small, fast runs at 2
AND 3 ranks; the launches are bounded by their own timeouts, and nothing here asserts a speed
(the machine may be loaded), only what the report must hold."""
import json

import pytest

from course_lib.bench import allreduce, collectives, dataloader, ddp

PROVENANCE = {"benchmark", "command", "machine", "hardware", "torch", "date", "quick",
              "load_average_start", "load_average_end", "load", "taken_on_busy_machine",
              "method", "wall_s"}


@pytest.fixture(autouse=True)
def no_quiet_wait(monkeypatch):
    """A test checks the report; it does not wait for a quiet machine (stamped busy if not)."""
    monkeypatch.setenv("COURSE_QUIET_WAIT_S", "0")


def _run(main, argv, capsys, tmp_path):
    out = tmp_path / "report.json"
    assert main([*argv, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert json.loads(out.read_text()) == report          # the file is what was printed
    assert PROVENANCE <= set(report), PROVENANCE - set(report)
    assert {"load", "load_end", "busy", "message"} <= set(report["load"])   # before and after
    return report, captured.err


def _assert_interval_holds_ratio(ratio, low, high):
    assert 0 < low <= ratio <= high, (low, ratio, high)


def _assert_rotated(order, names, samples):
    """Interleaved: each round times every variant once, starting with a different one."""
    assert len(order) == len(names) * samples
    rounds = [order[i * len(names):(i + 1) * len(names)] for i in range(samples)]
    assert all(sorted(r) == sorted(names) for r in rounds)
    assert len({r[0] for r in rounds}) == min(samples, len(names))


def _check_collective_rows(report, ops, sizes, world_sizes, samples):
    rows = report["results"]
    assert {(r["world_size"], r["bytes"], r["op"]) for r in rows} == {
        (w, n, op) for w in world_sizes for n in sizes for op in ops}
    for r in rows:
        assert len(r["seconds"]) == r["samples"] == samples
        assert 0 < r["min_s"] <= r["median_s"] and r["q1_s"] <= r["q3_s"]
        assert r["reps"] >= 1 and r["busbw_GBps"] > 0 and r["min_busbw_GBps"] >= r["busbw_GBps"]
        assert r["baseline"] == "all_reduce"
        _assert_interval_holds_ratio(r["ratio_to_baseline"], r["ratio_low"], r["ratio_high"])
        if r["op"] == "all_reduce":
            assert r["ratio_to_baseline"] == 1.0 and r["verdict"] == "baseline"
        else:
            assert r["op"] in r["verdict"] and "all_reduce" in r["verdict"]


@pytest.mark.slow
def test_collectives_2_and_3_ranks_every_op_interleaved(capsys, tmp_path):
    report, _ = _run(collectives.main, ["--quick", "--world-sizes", "2,3", "--sizes", "4K",
                                        "--samples", "3", "--min-sample-ms", "2",
                                        "--timeout", "300"], capsys, tmp_path)
    assert report["benchmark"] == "collectives" and report["samples"] == 3
    _check_collective_rows(report, list(collectives.OPS), [4096], [2, 3], 3)


@pytest.mark.slow
def test_old_allreduce_name_runs_collectives_with_its_two_ops(capsys, tmp_path):
    """``bench allreduce`` timed one operation behind a barrier; now it is ``collectives``."""
    report, err = _run(allreduce.main, ["--world-sizes", "3", "--sizes", "4K", "--repeat", "2",
                                        "--warmup", "1", "--min-sample-ms", "2",
                                        "--timeout", "300"], capsys, tmp_path)
    assert "now part of bench collectives" in err
    assert report["benchmark"] == "allreduce" and report["ops"] == allreduce.OPS
    _check_collective_rows(report, allreduce.OPS, [4096], [3], 2)
    # the names old code imports still come from the one implementation
    assert allreduce.bus_bandwidth is collectives.bus_bandwidth
    assert allreduce.parse_size("64K") == 65536 and allreduce.DEFAULT_SIZES[-1] == 64 * 2**20


def test_pipelined_ring_goal_reads_the_interval():
    def row(lo, hi):
        return {"op": "ring_pipelined", "baseline": "all_reduce", "bytes": 16 * 2**20,
                "world_size": 2, "ratio_to_baseline": (lo + hi) / 2, "ratio_low": lo,
                "ratio_high": hi}
    verdict = lambda lo, hi: collectives.pipelined_ring_goal([row(lo, hi)])["2"][  # noqa: E731
        str(16 * 2**20)]["goal_met"]
    assert verdict(0.9, 1.05) == "met"              # time at most 1 / 0.9 of all_reduce's
    assert verdict(1.2, 1.4) == "not met"
    assert verdict(1.0, 1.3).startswith("undecided")


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_interleaved_with_intervals(world_size, capsys, tmp_path):
    report, _ = _run(ddp.main, ["--quick", "--models", "lenet", "--batch", "8", "--rounds", "2",
                                "--world-size", str(world_size), "--timeout", "300"],
                     capsys, tmp_path)
    assert report["world_size"] == world_size and report["rounds"] == 2
    entry = report["models"]["lenet"]
    results = entry["results"]
    assert set(results) == set(ddp.IMPLEMENTATIONS)
    for name, r in results.items():
        assert len(r["seconds"]) == r["samples"] == 2 and r["loops"] >= 1
        assert 0 < r["min_s"] <= r["median_s"] and r["iqr_s"] >= 0
        _assert_interval_holds_ratio(r["ratio_to_torch"], r["ratio_low"], r["ratio_high"])
        assert report["ratio_to_torch_interval"]["lenet"][name] == [
            round(r["ratio_low"], 3), round(r["ratio_high"], 3)]
    assert results["torch"]["ratio_to_torch"] == 1.0
    assert report["goal_met"]["lenet"] in ("met", "not met",
                                           "undecided: the interval contains the goal")
    c = entry["comparison"]
    assert c["baseline"] == "torch"
    _assert_rotated(c["order"], ddp.IMPLEMENTATIONS, 2)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_over_a_slow_link_pays_a_latency_per_message(world_size, capsys, tmp_path):
    """LeNet's 8 gradients: naive and overlap send 8 messages a step, bucketed and torch's DDP
    one bucket; naive sends after backward, so its step is at least 8 latencies above local."""
    latency_ms = 5
    report, _ = _run(ddp.main, ["--quick", "--models", "lenet", "--batch", "8", "--rounds", "2",
                                "--world-size", str(world_size), "--link-latency-ms",
                                str(latency_ms), "--timeout", "300"], capsys, tmp_path)
    assert report["link_latency_s"] == latency_ms / 1e3
    entry = report["models"]["lenet"]
    assert set(entry["results"]) == set(ddp.IMPLEMENTATIONS) - {"bucketed+bf16"} | {
        "bucketed_small"}
    assert entry["messages_per_step"] == {"naive": 8, "overlap": 8, "bucketed": 1,
                                          "bucketed_small": 2, "torch": 1}
    seconds = {n: r["seconds"] for n, r in entry["results"].items()}
    for naive, local in zip(seconds["naive"], seconds["local"]):   # round by round
        assert naive - local > 0.8 * 8 * latency_ms / 1e3
    with pytest.raises(ValueError, match=r"link_latency_s must be seconds in \[0, 1\)"):
        ddp.measure_step_times(["lenet"], rounds=2, link_latency_s=-1)


def test_ddp_refuses_one_round(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ddp.main(["--quick", "--rounds", "1", "--out", "-"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rounds must be an integer >= 2 .*got 1"):
        ddp.measure_step_times(["lenet"], rounds=1)
    with pytest.raises(ValueError, match="unknown model"):
        ddp.measure_step_times(["vgg"], rounds=2)


@pytest.mark.slow
def test_dataloader_interleaved_with_interval(capsys, tmp_path):
    report, _ = _run(dataloader.main, ["--quick", "--samples", "3", "--min-sample-ms", "10"],
                     capsys, tmp_path)
    assert report["samples"] == 3 and report["lr"] == 0.3   # lesson 01's baseline learning rate
    assert len(report["fast_s_per_epoch"]) == len(report["dataloader_s_per_epoch"]) == 3
    for name in ("fast", "dataloader"):
        assert 0 < report[f"{name}_min_s_per_epoch"] <= report[f"{name}_median_s_per_epoch"]
    _assert_interval_holds_ratio(report["ratio_fast_over_dataloader"], *report["ratio_interval"])
    assert report["comparison"]["baseline"] == "dataloader"
    _assert_rotated(report["comparison"]["order"], ["fast", "dataloader"], 3)
    assert report["goal_met"] in ("met", "not met", "undecided: the interval contains the goal")
    with pytest.raises(SystemExit):
        dataloader.main(["--quick", "--samples", "1", "--out", "-"])


@pytest.mark.slow
def test_old_measure_keeps_its_row_keys():
    rows = allreduce.measure(2, [4096], repeat=2, timeout=300)
    (row,) = rows
    assert row["bytes"] == 4096 and row["ring_s"] > 0 and row["all_reduce_s"] > 0
    lo, hi = row["speed_ratio_interval"]
    assert 0 < lo <= row["speed_ratio"] <= hi


def test_collectives_one_op_alone_is_timed_at_each_size():
    """Lesson 10 times ``dist.all_reduce`` alone: one row per size, its ratio to itself 1."""
    from course_lib.bench.collectives import measure_collectives

    rows = measure_collectives(2, [4096, 65536], names=["all_reduce"], samples=2,
                               min_sample_s=0.001, timeout=120)
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_reduce", 4096), ("all_reduce", 65536)]
    assert all(len(r["seconds"]) == 2 and r["median_s"] > 0 and r["ratio_to_baseline"] == 1
               for r in rows)
    with pytest.raises(ValueError, match="distinct operations"):
        measure_collectives(2, [4096], names=["all_reduce", "all_reduce"])
    with pytest.raises(ValueError, match="distinct operations"):
        measure_collectives(2, [4096], names=[])
    with pytest.raises(SystemExit) as exit_info:   # the command line: the same rule
        collectives.main(["--quick", "--ops", "all_reduce,all_reduce", "--out", "-"])
    assert exit_info.value.code == 2
