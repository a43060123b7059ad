# rolloutlake: `make demo` runs the whole RL loop (a tiny policy learns on the vLLM CPU engine),
# `make demo-simulate` the simulated pipeline, `make test` the tests, `make test-gpu` the
# engine tests on SGLang (a CUDA GPU machine only).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
ENGINE_VENV ?= .venv-engine
# Where the engine tests look for SGLang (`rolloutlake engine --sglang-venv`'s default).
SGLANG_VENV := .venv-sglang
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export WANDB_MODE ?= offline
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip's wheel cache would keep a second, compressed copy of torch and its CUDA libraries
# (~3 GB) that no later step reads: the engine's venv links the project venv's torch.
export PIP_NO_CACHE_DIR ?= 1

.PHONY: install bytecode kafka-jars engine demo demo-simulate test test-gpu test-fast lint bench clean

install: $(STAMP)

# torch is pinned first (PyPI's 2.13.0: a CUDA build that runs on the CPU) so nothing later
# pulls another version. DeepSpeed compiles its CPU shared-memory all-reduce op the first
# time a trainer starts in a venv (27 s on a quiet machine, 225 s under the test suite's
# load: past a trainer test's start timeout); it is compiled here instead, once per venv.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[trainer,test]'
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" > /dev/null
	touch $(STAMP)

# An editable install leaves the packages' bytecode to the first import, which writes none
# where PYTHONDONTWRITEBYTECODE is set: every start of every process would compile them
# again (0.05-0.1 s each). compileall only redoes what changed since its last run.
bytecode: install
	$(PY) -m compileall -q schemas ingest gateway trainer > /dev/null

# The jars of the embedded Apache Kafka broker (`rolloutlake broker --engine kafka`).
kafka-jars:
	sh deploy/kafka/fetch.sh

# The vLLM CPU engine lives in its own venv (its pins clash with the gateway's), with hard
# links to the project venv's torch rather than a second copy.
engine: install
	PYTHON=$(PYTHON) TORCH_FROM=$(VENV) sh deploy/engine/install.sh $(ENGINE_VENV)

demo: install bytecode engine
	$(VENV)/bin/rolloutlake demo

demo-simulate: install bytecode
	$(VENV)/bin/rolloutlake demo --simulate

# Three pytest workers: most tests wait on brokers, engines and group joins rather than the
# CPU; by file, so a module's engine and lake fixtures stay in one worker. The slowest
# tests are listed at the end: the suite must stay well inside CI's 30 minutes.
test: install bytecode kafka-jars engine
	sh deploy/install-test-deps.sh
	$(PY) -m ruff check schemas ingest gateway trainer tests bench
	$(PY) -m mypy
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=25

# The whole loop and the worker's engine tests on a real SGLang server. The install script
# comes first: without a CUDA GPU it stops at once with one line, before anything installs.
# Every engine, worker and trainer log stays under artifacts/test-gpu/ (pytest's basetemp).
test-gpu:
	@sh deploy/engine/install-sglang.sh $(SGLANG_VENV)
	$(MAKE) install bytecode
	ROLLOUTLAKE_TEST_ENGINE=sglang ROLLOUTLAKE_TEST_BROKERS=tansu \
		$(PY) -m pytest -q --basetemp=artifacts/test-gpu \
		tests/integration/test_loop.py tests/integration/test_engine_worker.py

test-fast: install bytecode
	$(PY) -m pytest -q tests/unit

lint: install
	$(PY) -m ruff check schemas ingest gateway trainer tests bench
	$(PY) -m mypy

bench: install bytecode
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) lake artifacts .pytest_cache .hypothesis
