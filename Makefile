# The course's commands. `make lab` to learn, `make test` to check the course (CI runs it, then
# `make slowtest`: `make testall` runs both).
VENV    := .venv
PY      := $(VENV)/bin/python
PORT    ?= 8888
# JupyterLab refuses to run as root unless told; containers and CI often are root.
ROOTFLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
# nbval: run every notebook in quick mode, compare only cells marked NBVAL_CHECK_OUTPUT.
NBVAL   := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
           --nbval-cell-timeout=600
# pytest-xdist: many tests wait on processes they launch or on timeouts, so three pytest workers
# keep two cores busy (measured on 2 cores, clean clone: pytest 8:31 with 3, 9:02 with 2); a
# notebook's cells stay together in one worker (--dist loadfile). The notebooks come first: xdist
# hands out files in the order collected, and a long lesson started last would run alone at the
# end while the other workers sit idle. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 3
XDIST   := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# OMP_NUM_THREADS=1: three workers on two cores, so torch's intra-op threads would only contend
# (lessons 01, 04 and 05 under nbval: 86 s with torch's default threads, 50 s with one each).
TESTENV := COURSE_QUICK=1 TQDM_DISABLE=1 MPLBACKEND=agg PYTHONHASHSEED=0 COURSE_QUIET_WAIT_S=0 \
           OMP_NUM_THREADS=1

.PHONY: setup lab test slowtest testall unit nbtest notebooks bench lint grade clean site sitetest executed lock

# The versions: LOCK=1 (default) the lock, requirements/lock.txt, that CI ran green; LOCK=0 the
# newest releases within pyproject.toml's ranges; TORCH="torch==X torchvision==Y" another torch.
LOCK    ?= 1
TORCH   ?=
export LOCK TORCH

setup:
	@bash scripts/setup.sh

# Write the lock anew from .venv (after a green `make test LOCK=0` on newer releases).
lock:
	@{ sed -n '/^#/p' requirements/lock.txt; \
	   $(PY) -m pip freeze --exclude-editable --all | grep -v -i -E '^(pip|setuptools|wheel)==' \
	   | sort -f; } > requirements/lock.txt.new && mv requirements/lock.txt.new requirements/lock.txt
	@echo "lock: requirements/lock.txt written from .venv"

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --port=$(PORT) $(ROOTFLAG)

test: setup
	$(VENV)/bin/ruff check course_lib tests conftest.py
	$(VENV)/bin/lint-imports
	$(TESTENV) $(PY) -m pytest notebooks tests -m "not site and not slow" --durations=25 $(XDIST) $(NBVAL)

# The slow tier (pytest marker `slow`, pyproject.toml): failure paths that wait on timeouts or
# kill processes, torchrun, mpirun and whole scripts in fresh interpreters, grading end to end,
# world sizes beyond 2 and 3. CI runs it after `make test`; so does `make testall`.
slowtest: setup
	$(TESTENV) $(PY) -m pytest tests -m "slow and not site" --durations=10 $(XDIST)

testall: test slowtest

unit: setup
	$(TESTENV) $(PY) -m pytest tests -m "not site"

# Every notebook executed in quick mode into build/executed/ (the committed ones are left alone).
executed: setup
	mkdir -p build/executed
	@for nb in notebooks/[0-9]*.ipynb; do \
	    echo "== $$nb"; \
	    $(TESTENV) $(VENV)/bin/jupyter nbconvert --to notebook --execute --output-dir build/executed \
	        --ExecutePreprocessor.timeout=600 --ExecutePreprocessor.kernel_name=python3 "$$nb" || exit 1; \
	done

# The course as a static website in build/site (lessons with their stored outputs, the README as
# home page, the API reference from the docstrings); open build/site/index.html.
site: setup
	@bash scripts/setup_site.sh
	NO_MKDOCS_2_WARNING=1 $(PY) scripts/build_site.py
	@echo "site: build/site/index.html"

# Builds the site and opens it in headless Chromium (screenshot in build/site-screenshots/).
sitetest: setup
	@bash scripts/setup_site.sh
	NO_MKDOCS_2_WARNING=1 $(PY) -m pytest tests/test_site.py -m site -q

nbtest: setup
	$(TESTENV) $(PY) -m pytest notebooks $(NBVAL)

# Re-execute lessons in place in full mode (refreshes the stored outputs), each after waiting for a
# quiet machine; wall times go to results/notebook-times-MACHINE.json. NB=path runs only that one.
notebooks: setup
	GLOO_SOCKET_IFNAME=lo $(PY) scripts/execute_notebooks.py $(NB)

# Every benchmark, each writing its JSON to results/NAME-MACHINE.json (the stored results), with
# the command, machine, date, load before and after, samples, medians, minimums and intervals.
# Each waits (bounded) for a quiet machine first, so run it with nothing else running: about
# 14 minutes on 2 quiet cores, scaling 9 of them (last: no other benchmark then waits for its
# load average to decay); gpt-baseline (lesson 14's one-process oracle) about 70 s, tp-vs-dp
# about 45 s. `bench allreduce` is the older name of a part of `bench collectives`.
bench: setup
	mkdir -p results
	GLOO_SOCKET_IFNAME=lo $(PY) -m course_lib.bench collectives
	GLOO_SOCKET_IFNAME=lo $(PY) -m course_lib.bench ddp
	$(PY) -m course_lib.bench dataloader
	$(PY) -m course_lib.bench gpt-baseline
	GLOO_SOCKET_IFNAME=lo $(PY) -m course_lib.bench tp-vs-dp
	GLOO_SOCKET_IFNAME=lo $(PY) -m course_lib.bench scaling

# Grade a learner's copy of a lesson: run it in quick mode, print each exercise's verdict;
# non-zero exit when an answered exercise is wrong. make grade NB=path/to/my_copy.ipynb
grade: setup
	@test -n "$(NB)" || { echo "usage: make grade NB=path/to/notebook.ipynb"; exit 2; }
	$(PY) -m course_lib.checks.grade "$(NB)"

lint: setup
	$(VENV)/bin/ruff check course_lib tests conftest.py
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache build
