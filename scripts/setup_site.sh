#!/usr/bin/env bash
# The website's tools, on top of `make setup`: MkDocs (+ mkdocs-jupyter, mkdocstrings, Material)
# and Playwright in .venv, and Debian's Chromium for the browser test where apt is usable.
# Idempotent; quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.course-site
# The same versions make setup chose (the lock by default; see scripts/setup.sh).
CONSTRAINTS=(-c "$VENV/.constraints.txt")
want=$(cat pyproject.toml scripts/setup_site.sh "$VENV/.constraints.txt" | sha256sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install "${CONSTRAINTS[@]}" -e ".[site]"
    echo "$want" > "$STAMP"
fi
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
        echo "setup-site: installing Debian's chromium (for the browser test)"
        $SUDO apt-get update -qq || true
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null \
            || echo "setup-site: apt-get could not install chromium; the browser test will skip."
    else
        echo "setup-site: no usable apt-get; the browser test will skip without a chromium."
    fi
fi
