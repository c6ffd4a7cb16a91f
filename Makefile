# Two commands do all set-up: `make demo` and `make test`. Both install first if needed.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# The venv is rebuilt only when these files change (content hash, not mtime).
LOCK_HASH := $(shell cat requirements.txt requirements-dev.txt requirements-lock.txt setup.py 2>/dev/null | sha256sum | cut -c1-16)
STAMP  := $(VENV)/.installed-$(LOCK_HASH)
export OMP_NUM_THREADS ?= 1
# Test processes: each test runs one thread (OMP_NUM_THREADS=1), so one worker per core. Each worker
# imports torch (~1.5 GB), so the default stays small rather than `auto`.
PYTEST_WORKERS ?= 2
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: install demo test test-fast lint format bench gpu-check clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt -c requirements-lock.txt
	$(PY) -m pip install --quiet --no-deps -e .
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "installed into $(VENV)"

demo: install
	$(PY) -m demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two test tiers (marks in tests/tiers.py). `make test`: the whole suite, lint first; what CI runs.
# --maxschedchunk 1: pytest-xdist hands out one test at a time, in the order tests/conftest.py sets
# (the longest first), instead of fixed blocks of 70 consecutive tests per worker, which left one worker
# idle while the other ran the long tests of its block one after another (12.2 min instead of ~8).
XDIST := -n $(PYTEST_WORKERS) --maxschedchunk 1
test: lint
	$(VENV)/bin/pytest -q $(XDIST) --durations=15

# `make test-fast`: unit tests only, for the edit-test loop: no Composer fit, no subprocess, no server
# (deselects the marks fit, subprocess, server, heavy and slow). Under 90 s on 2 idle cores. No lint.
# Without --maxschedchunk: for ~470 short tests the one-at-a-time hand-out cost more than it saved
# (85 s against 79 s, 2026-11-26).
FAST_TIER := not (fit or subprocess or server or heavy or slow)
test-fast: install
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) -m "$(FAST_TIER)" --durations=10

# The GPU path measured and checked (bench/gpu_check.py); exits with one line where there is no CUDA.
# In runs because a device call is capped at 10 minutes: `make gpu-check` (run 1: 256 px, the compiled
# step against the eager one and a plain loop), PART=2 (train/save/resume bitwise/export), PART=3 (512 px),
# PART=4-7 (each part).
# `make gpu-check PRESET=sdxl-base` (or sd3-medium) measures that recipe's throughput instead;
# PRESET=flux-schnell times Flux at reduced depth and extrapolates per block (bench/depth_extrapolation.py).
# On a lent GPU machine (no network, no make install): bench/gpu_session.sh (docs/benchmarks.md, GPU figures).
PRESET ?= sd2-base
PART   ?= 1
gpu-check: install
	$(PY) bench/gpu_check.py --preset $(PRESET) $(if $(filter sd2-base,$(PRESET)),--run $(PART))

bench: install
	$(PY) bench/ema.py
	$(PY) bench/convert.py

clean:
	rm -rf runs outputs .pytest_cache
