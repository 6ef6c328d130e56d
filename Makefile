# Thin wrappers; each target works on a fresh machine with only python3 installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Optional extra package index tried first (e.g. a local mirror with CPU-only torch wheels).
TORCH_INDEX ?=
INSTALL := $(BIN)/uv pip install --quiet --python $(BIN)/python $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match)

.PHONY: demo test e2e e2e-binaries bench lint install dev chart k8s prometheus

$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv

# Byte-compiled ahead: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile what it
# imports (`ctl status`: 1.5 s instead of 0.5 s). One torch test helper is Python 3.12 syntax.
COMPILE := $(BIN)/python -m compileall -q -j 0 -x 'py312_intrinsics' $(VENV)/lib

install: $(BIN)/uv
	$(INSTALL) -e .
	$(COMPILE)

dev: $(BIN)/uv
	$(INSTALL) -e '.[dev]'
	$(COMPILE)

demo: install
	$(BIN)/ctl run examples/quickstart.yaml

# The test tier's Prometheus and promtool (the distribution's package, when missing).
prometheus:
	.ci/install-prometheus

# The e2e tier's etcd, kube-apiserver and training operator, built from their Go modules into
# ~/.cache/ddpjob/bin the first time (minutes: ~5 of compiling on 2 cores, plus downloads), found there afterwards.
e2e-binaries: dev
	$(BIN)/python tests/e2e/cluster_binaries.py

test: dev prometheus e2e-binaries
	$(BIN)/python -m pytest

# Only the control-plane tier (tests/e2e).
e2e: dev e2e-binaries
	$(BIN)/python -m pytest -m e2e tests/e2e

# Ratios against peers measured in the same run: training throughput (vs a bare DDP loop and
# transformers' Trainer), checkpoint stalls (sync vs async), ctl start-up, metrics cost per step.
bench: $(BIN)/uv
	$(INSTALL) -e '.[bench]'
	$(COMPILE)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/cli.py
	$(BIN)/python bench/metrics_overhead.py

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The chart's values.yaml and values.schema.json, generated from the job spec model.
chart: install
	$(BIN)/python -m ctl.schema

# k8s/examples: every examples/*.yaml rendered by `ctl render` (tests fail when these drift).
k8s: chart
	$(BIN)/python -m ctl.k8s
