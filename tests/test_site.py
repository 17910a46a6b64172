"""The course as a website (`make site`): built from the repository, opened in a real browser.

Builds build/site with scripts/build_site.py, serves it on loopback and opens the home page, a
lesson with figures and an API page in headless Chromium (Playwright driving Debian's
/usr/bin/chromium). Marked `site`: `make sitetest` runs it (`.ci/run` does), `make test` does not.
Skips, saying why, where MkDocs, Playwright or a Chromium cannot be had.
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
pytestmark = pytest.mark.site

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LESSON_WITH_FIGURES = "notebooks/10_timing_plots.html"


@pytest.fixture(scope="module")
def site_url():
    pytest.importorskip("mkdocs", reason="the site tools are not installed: run `make site`")
    done = subprocess.run([sys.executable, "scripts/build_site.py"], cwd=ROOT, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, \
        f"the site did not build:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_every_lesson_and_public_module_has_a_page(site_url):
    lessons = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    built = {p.stem for p in (SITE / "notebooks").glob("*.html")}
    assert set(lessons) <= built, f"lessons without a page: {set(lessons) - built}"
    home = (SITE / "index.html").read_text()
    for name in lessons:  # the home page (the README) links every lesson, in reading order
        assert f'href="notebooks/{name}.html"' in home, f"the home page does not link {name}"
    for module in ("course_lib.parallel.ddp", "course_lib.distributed.collectives",
                   "course_lib.checks"):
        assert (SITE / "api" / f"{module}.html").exists(), f"no API page for {module}"


def test_internal_links_resolve(site_url):
    import re

    broken = []
    for page in SITE.rglob("*.html"):
        if page.name == "404.html":
            continue  # served for any path, so its links are absolute by design
        for target in re.findall(r'href="([^"#?]+)[^"]*"', page.read_text(errors="replace")):
            if target.startswith(("http:", "https:", "mailto:", "data:", "javascript:")):
                continue
            resolved = (SITE / target.lstrip("/") if target.startswith("/")
                        else page.parent / target).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(SITE)} -> {target}")
    assert not broken, f"{len(broken)} broken links, first: {broken[:5]}"


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; "
                    "`make sitetest` installs it where apt is usable)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed: run `make site`")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    response = page.goto(url, wait_until="load", timeout=60_000)
    assert response is not None and response.status == 200, f"{url}: {response and response.status}"
    return page, errors


def test_home_page_in_a_browser(site_url, browser):
    page, errors = _open(browser, f"{site_url}/index.html")
    assert "from scratch" in page.title()
    links = page.locator("a[href^='notebooks/']")
    assert links.count() >= 13, f"the home page shows {links.count()} lesson links"
    assert not errors, errors
    page.close()


def test_a_lesson_renders_its_figures(site_url, browser):
    page, errors = _open(browser, f"{site_url}/{LESSON_WITH_FIGURES}")
    sizes = page.eval_on_selector_all(
        "img", "imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight, "
               "i.src.slice(0, 40)])")
    assert len(sizes) >= 2, f"the lesson shows {len(sizes)} images"
    broken = [s for s in sizes if not s[0] or s[1] == 0 or s[2] == 0]
    assert not broken, f"images that did not render: {broken}"
    # The lesson's code and stored outputs are there, not just its prose.
    assert page.locator("pre").count() > 10
    out = ROOT / "build" / "site-screenshots"
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / "lesson.png"), full_page=False)
    assert (out / "lesson.png").stat().st_size > 10_000
    assert not errors, errors
    page.close()


def test_the_api_page_shows_docstrings(site_url, browser):
    page, errors = _open(browser, f"{site_url}/api/course_lib.parallel.ddp.html")
    text = page.inner_text("body")
    assert "DistributedDataParallel" in text
    assert "no_sync" in text  # a method's documentation, generated from its docstring
    assert not errors, errors
    page.close()
