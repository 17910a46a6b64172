"""``course_lib.timing.wait_for_quiet``: a quiet machine runs at once; a busy one waits (bounded),
then runs stamped "taken on a busy machine"; a load that falls while waiting ends the wait; the
stamp goes into a comparison's JSON. ``os.getloadavg`` is monkeypatched: no real load needed."""
import json

import pytest

from course_lib import timing


@pytest.fixture
def loads(monkeypatch):
    """Feed the guard a sequence of 1-minute load averages (the last one repeats)."""
    seq = []

    def getloadavg():
        value = seq.pop(0) if len(seq) > 1 else seq[0]
        return (value, value, value)

    monkeypatch.setattr(timing.os, "getloadavg", getloadavg)
    monkeypatch.setattr(timing, "cpu_cores", lambda: 2)
    monkeypatch.setattr(timing.time, "sleep", lambda s: None)  # waiting costs no test time
    return seq


def test_quiet_machine_runs_at_once(loads):
    loads += [0.3]
    stamp = timing.wait_for_quiet(max_wait_s=60)
    assert not stamp.busy and stamp.waited_s < 1 and stamp.threshold == 1.0
    assert stamp.message.startswith("quiet machine (load 0.30 on 2 cores")


def test_busy_machine_waits_then_runs_stamped(loads, monkeypatch, capsys):
    clock = iter(range(0, 10_000, 10))  # each reading of the clock: 10 s later
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(clock))
    loads += [5.0]
    stamp = timing.wait_for_quiet(max_wait_s=30, poll_s=10)
    assert stamp.busy and 30 <= stamp.waited_s <= 50
    assert "taken on a busy machine (load 5.00 on 2 cores" in stamp.message
    assert "waiting up to 30 s" in capsys.readouterr().err  # stdout stays for JSON


def test_wait_ends_when_the_load_falls(loads, monkeypatch):
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(clock))
    loads += [3.0, 2.0, 0.5]
    stamp = timing.wait_for_quiet(max_wait_s=600, poll_s=10, verbose=False)
    assert not stamp.busy and stamp.load == 0.5 and stamp.waited_s < 600


def test_threshold_and_no_wait(loads):
    loads += [1.5]
    assert timing.wait_for_quiet(threshold=2.0).busy is False
    assert timing.wait_for_quiet(threshold=1.0, max_wait_s=0, verbose=False).busy is True
    with pytest.raises(ValueError, match="max_wait_s"):
        timing.wait_for_quiet(max_wait_s=-1)


def test_unknown_load_is_said(monkeypatch):
    def no_load():
        raise OSError("no load average here")
    monkeypatch.setattr(timing.os, "getloadavg", no_load)
    stamp = timing.wait_for_quiet()
    assert stamp.load is None and not stamp.busy and "unknown" in stamp.message


def test_stamp_goes_into_the_comparison(loads):
    loads += [4.0]
    stamp = timing.wait_for_quiet(max_wait_s=0, verbose=False)
    c = timing.compare({"a": lambda: None, "b": lambda: None}, samples=2,
                       min_sample_seconds=0.0, stamp=stamp)
    out = json.loads(json.dumps(c.to_json()))
    assert out["load"]["busy"] is True and out["load"]["load_end"] == 4.0
    assert "taken on a busy machine" in out["load"]["message"]
    assert "taken on a busy machine" in c.verdict("b") and "busy machine" in str(c)


def test_a_silent_wait_prints_nothing_and_the_stamp_says_it_waited(loads, monkeypatch, capsys):
    """make notebooks sets COURSE_WAIT_SILENT=1: a stored lesson keeps no "waiting up to" line,
    and its stamp says how long the measurement waited for the quiet machine."""
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(timing.time, "monotonic", lambda: next(clock))
    monkeypatch.setenv("COURSE_WAIT_SILENT", "1")
    loads += [5.0, 0.4]
    stamp = timing.wait_for_quiet(max_wait_s=60, poll_s=10)
    assert not stamp.busy and capsys.readouterr().err == ""
    assert stamp.message.startswith("quiet machine (load 0.40 on 2 cores, after waiting ")
