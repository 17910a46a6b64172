"""config: quick mode, and claim, which holds a lesson's text to the run that stored its outputs
without failing a learner's run on other hardware."""
import pytest

from course_lib.config import choose, claim, quick_mode, stored_run


def test_quick_mode_and_choose(monkeypatch):
    monkeypatch.setenv("COURSE_QUICK", "1")
    assert quick_mode() and choose(10, 1) == 1
    monkeypatch.setenv("COURSE_QUICK", "0")
    assert not quick_mode() and choose(10, 1) == 10


def test_a_finding_that_fails_the_stored_run_raises(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_STORED_RUN", "1")
    assert stored_run()
    assert claim(True, "bucketed is shorter") is True
    with pytest.raises(AssertionError, match="the text reads 'bucketed is shorter', and this run"):
        claim(False, "bucketed is shorter")
    assert capsys.readouterr().out == ""


def test_elsewhere_a_finding_that_fails_is_printed_not_raised(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_STORED_RUN", raising=False)
    assert not stored_run()
    assert claim(1 > 2, "one beats two") is False
    out = capsys.readouterr().out
    assert "Your run differs from the stored run the text reads: not 'one beats two'" in out
    assert claim(2 > 1, "two beats one") is True and capsys.readouterr().out == ""


def test_a_finding_must_be_said():
    for bad in ("", None, 3):
        with pytest.raises(TypeError, match="finding must be the text's sentence"):
            claim(True, bad)
