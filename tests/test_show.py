"""``plots.show``: the source of library code, stored in a notebook as one representation."""
import pytest

from course_lib import plots
from course_lib.parallel.comm import gather, scatter


def test_show_in_a_notebook_stores_one_markdown_code_block(monkeypatch):
    shown = []
    monkeypatch.setattr(plots, "_in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    plots.show(scatter, gather)
    (bundle, raw), = shown                                  # one display call ...
    assert raw and list(bundle) == ["text/markdown"]        # ... with one mimetype
    text = bundle["text/markdown"]
    assert text.startswith("```python\ndef scatter(") and text.endswith("\n```")
    assert "\ndef gather(" in text


def test_show_fences_source_that_holds_backticks():
    bundle = plots._markdown_code('x = "```"\n')
    assert bundle["text/markdown"].startswith("````python\n")


def test_show_outside_a_notebook_prints(capsys):
    plots.show(scatter)
    assert capsys.readouterr().out.startswith("def scatter(")
    with pytest.raises(TypeError, match="at least one"):
        plots.show()


def test_a_method_is_headed_by_its_class(capsys):
    from course_lib.parallel import ddp
    plots.show(ddp.Bucket.mark_ready, ddp.assign_buckets)
    out = capsys.readouterr().out
    assert out.startswith("# Bucket.mark_ready\n    def mark_ready(")
    assert "\ndef assign_buckets(" in out and "# assign_buckets" not in out
