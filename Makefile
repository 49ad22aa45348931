# areal_hpc: every set-up step lives here, so a fresh clone needs only `make test` or `make demo`.
PYTHON ?= python3.11
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TINY ?= .cache/tiny
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help venv tiny test test-slow test-gpu test-faults lint format docs demo bench clean slurm-up slurm-down

help:
	@echo "make test   - create the environment and run the test suite but its slow tests"
	@echo "make test-slow - the slow tests that make test leaves out (fault injections, longer recoveries)"
	@echo "make test-gpu - the tests that need a CUDA GPU (tests/test_gpu.py)"
	@echo "make test-faults - every fault-injection test on the local Slurm cluster (minutes each)"
	@echo "make demo   - create the environment, build the tiny model and run the embedded default"
	@echo "make lint   - ruff check and format check"
	@echo "make docs   - regenerate docs/config.md from the config schema"
	@echo "make bench  - run the benchmarks (tools/bench_*.py)"
	@echo "make tiny   - build the tiny model, tokenizer and toy data into $(TINY)"
	@echo "make slurm-up / slurm-down - start / stop a real Slurm cluster on loopback (root; see README)"

# The CPU build of torch is pinned first so that the package's `torch>=2.6` installs nothing more;
# GPU clusters install their own CUDA torch before `pip install -e .`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(STAMP)

# The builder skips in a fraction of a second when $(TINY) holds a current build (its MANIFEST.json).
tiny: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python tools/build_tiny_model.py --out $(TINY) --seed 1

# SGLang's source, for the contract test (tests/test_sglang_contract.py): read as text, never imported (its CUDA
# dependencies cannot be installed here). The version is the `sglang` extra's.
SGLANG_SRC ?= .cache/sglang-src
$(SGLANG_SRC)/.installed: $(STAMP)
	$(BIN)/pip install --quiet --no-deps --target $(SGLANG_SRC) "$$(grep -o 'sglang==[0-9a-z.]*' pyproject.toml)"
	touch $@

# Lint first: a style slip fails CI as a test would. Tests marked slow (most fault injections) are left out;
# the 25 slowest tests are listed at the end (the suite must stay well under 30 minutes).
test: lint tiny $(SGLANG_SRC)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow and not gpu" --durations=25

# What `make test` leaves out: the slow tests, fault injections and longer recoveries (tens of minutes).
test-slow: tiny $(SGLANG_SRC)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "slow and not gpu" --durations=25

# On a GPU machine (the device tool: `source tools/gpu_env.sh; python -m pytest -m gpu`): the CUDA paths.
test-gpu: tiny
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m gpu --durations=10

# Faults injected into a toy run on the local Slurm cluster (tests/test_faults.py), the slow ones included.
# AREAL_FAULT_REPORT=FILE collects a JSON line per fault: `python3 tools/fault_table.py FILE` tabulates them.
test-faults: tiny
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m faults

lint: $(STAMP)
	$(BIN)/ruff check areal_hpc tools tests
	$(BIN)/ruff format --check areal_hpc tools tests

format: $(STAMP)
	$(BIN)/ruff check --fix areal_hpc tools tests
	$(BIN)/ruff format areal_hpc tools tests

docs: $(STAMP)
	$(BIN)/areal-hpc config docs

# Supervised warm-up, then GRPO on toy arithmetic, all roles as local processes; fails unless it learned.
demo: $(STAMP) tiny
	HF_HUB_OFFLINE=1 $(BIN)/python tools/demo.py

bench: $(STAMP) tiny
	@rc=0; for b in tools/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || rc=1; done; exit $$rc

# A real Slurm cluster on loopback (tools/slurm_local/cluster.py, standard library only, so no venv needed);
# as root it installs the Debian packages when they are missing. AREAL_SLURM_ROOT / AREAL_SLURM_PORT_BASE move it.
slurm-up:
	python3 tools/slurm_local/cluster.py up

slurm-down:
	python3 tools/slurm_local/cluster.py down

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis
