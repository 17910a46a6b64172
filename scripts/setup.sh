#!/usr/bin/env bash
# Set up the course: .venv with everything the notebooks and tests use, d2l without its pins,
# Fashion-MNIST and Open MPI from Debian where apt is usable. Idempotent; quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.course-setup
# Which versions: by default the lock (requirements/lock.txt, every package at the version CI ran
# green); LOCK=0 the newest releases within pyproject.toml's ranges; TORCH="torch==X
# torchvision==Y" another torch with everything else locked (CI's lowest-supported-torch job).
LOCK=${LOCK:-1}
TORCH=${TORCH:-}
# The constraints used are kept in .venv/.constraints.txt for scripts/setup_site.sh.
mkdir -p "$VENV"
if [ "$LOCK" = 0 ]; then
    : > "$VENV/.constraints.txt"
elif [ -n "$TORCH" ]; then
    # torch's own dependencies (CUDA libraries, triton) follow the torch asked for
    grep -v -i -E '^(torch|torchvision|triton|nvidia-.*|cuda-.*)==' requirements/lock.txt \
        > "$VENV/.constraints.txt"
else
    cp requirements/lock.txt "$VENV/.constraints.txt"
fi
CONSTRAINTS=(-c "$VENV/.constraints.txt")

# What the stamp records: when any of it changes, the install runs again.
want=$( (cat pyproject.toml scripts/setup.sh requirements/lock.txt; echo "LOCK=$LOCK TORCH=$TORCH") \
        | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import course_lib, torch, d2l" 2>/dev/null; then
    echo "setup: .venv is up to date"
    exit 0
fi

say() { printf '\n== setup: %s\n' "$*"; }

# --- system packages: Fashion-MNIST files and mpirun (best effort) ------------------------------
apt_wanted=()
[ -d /usr/share/datasets/fashion-mnist ] || apt_wanted+=(dataset-fashion-mnist)
command -v mpirun >/dev/null 2>&1 || apt_wanted+=(openmpi-bin)
command -v bible >/dev/null 2>&1 || apt_wanted+=(bible-kjv)  # the text of lesson 14
if [ ${#apt_wanted[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && SUDO="sudo -n"; }
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
        say "installing Debian packages: ${apt_wanted[*]}"
        $SUDO apt-get update -qq || true
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${apt_wanted[@]}" >/dev/null \
            || echo "setup: apt-get could not install ${apt_wanted[*]}; see README 'Where the data comes from'."
    else
        echo "setup: apt-get is not usable here (not root, or not Debian/Ubuntu)."
    fi
fi
if [ ! -d /usr/share/datasets/fashion-mnist ] && [ -z "${FASHION_MNIST_DIR:-}" ] && [ ! -d data/FashionMNIST/raw ]; then
    echo "setup: Fashion-MNIST is not on this machine yet: the first run downloads it with"
    echo "       torchvision (needs the internet), or set FASHION_MNIST_DIR to a folder with the files."
fi
command -v mpirun >/dev/null 2>&1 || echo "setup: mpirun not found; the mpirun parts of notebook 06 will say so and skip."

# --- Python environment ----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
say "installing the course package and its dependencies (first time: a few minutes, ~5 GB)"
if [ "$LOCK" != 0 ]; then echo "setup: the locked versions (requirements/lock.txt)${TORCH:+, with $TORCH}"
else echo "setup: the newest releases within pyproject.toml's ranges (LOCK=0)${TORCH:+, with $TORCH}"; fi
"${PIP[@]}" install --upgrade pip
# shellcheck disable=SC2086  # TORCH is a list of requirements
"${PIP[@]}" install "${CONSTRAINTS[@]}" -e ".[dev]" $TORCH
# d2l 1.0.3 pins numpy 1.23.5 (no wheels for Python >= 3.12): install it without its pins; its
# real import-time needs are in pyproject.toml.
"${PIP[@]}" install --no-deps "d2l==1.0.3"

# --- first-start niceties --------------------------------------------------------------------------
# Build matplotlib's font cache now, so its message never lands in a notebook's stderr.
"$VENV/bin/python" -c "import matplotlib.pyplot" >/dev/null 2>&1 || true
# JupyterLab: no "get notified about Jupyter news?" prompt at first start.
settings="$VENV/share/jupyter/lab/settings"
mkdir -p "$settings"
cat > "$settings/overrides.json" <<'JSON'
{
  "@jupyterlab/apputils-extension:notification": {
    "checkForUpdates": false,
    "fetchNews": "false"
  }
}
JSON
# The data, prepared once (no-op when it is already there; a clear message when it cannot be).
"$VENV/bin/python" -c "from course_lib.data import find_fashion_mnist as f; print('setup: Fashion-MNIST at', f())" \
    || echo "setup: Fashion-MNIST is not available yet (see the message above)."

echo "$want" > "$STAMP"
say "done"
