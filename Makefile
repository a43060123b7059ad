# rolloutlake: `make demo` runs the whole pipeline on the embedded broker, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu
export WANDB_MODE ?= offline
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install kafka-jars demo test test-fast lint bench clean

install: $(STAMP)

# torch is pinned to the CPU build first so nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[trainer,test]'
	touch $(STAMP)

# The jars of the embedded Apache Kafka broker (`rolloutlake broker --engine kafka`).
kafka-jars:
	sh deploy/kafka/fetch.sh

demo: install
	$(VENV)/bin/rolloutlake demo

test: install kafka-jars
	sh deploy/install-test-deps.sh
	$(PY) -m ruff check schemas ingest gateway trainer tests bench
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q tests/unit

lint: install
	$(PY) -m ruff check schemas ingest gateway trainer tests bench

bench: install
	$(PY) bench/pipeline.py

clean:
	rm -rf $(VENV) lake artifacts .pytest_cache .hypothesis
