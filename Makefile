# Thin wrappers; each target works on a fresh machine with only python3 installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Optional extra package index tried first (e.g. a local mirror with CPU-only torch wheels).
TORCH_INDEX ?=
UV_INSTALL := $(BIN)/uv pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match)
INSTALL := $(UV_INSTALL) --python $(BIN)/python
# The floors tier's environment: every dependency pyproject.toml declares at the oldest version it allows.
FLOORS_VENV ?= .venv-floors

.PHONY: demo test test-prerequisites floors-env e2e e2e-binaries image bench lint install dev chart k8s prometheus

$(BIN)/uv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv

# Byte-compiled ahead: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile what it
# imports (`ctl status`: 1.5 s instead of 0.5 s). One torch test helper is Python 3.12 syntax. The project's own
# packages too: the venvs install them editable, from their sources here (0.1 s more in every ctl and rank).
compile_venv = $(1)/bin/python -m compileall -q -j 0 -x 'py312_intrinsics' $(1)/lib ctl trainer
COMPILE := $(call compile_venv,$(VENV))

# The trainer's install (`ddpjob[train]`): `ctl run` needs it. The client alone is `pip install .`.
install: $(BIN)/uv
	$(INSTALL) -e '.[train]'
	$(COMPILE)

dev: $(BIN)/uv
	$(INSTALL) -e '.[dev,interop]'
	$(COMPILE)

demo: install
	$(BIN)/ctl run examples/quickstart.yaml

# The test tier's Prometheus and promtool (the distribution's package, when missing).
prometheus:
	.ci/install-prometheus

# The e2e tier's etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, training operator, Trainer v2
# manager and JobSet controller, its node's kubelet, kube-proxy, containerd (with its shim and ctr), CoreDNS and
# pause, and the S3 server of the object-storage tests (versitygw), built from their Go modules into
# ~/.cache/ddpjob/bin the first time (about 15 minutes with the downloads, two builds at a time on 2 busy cores;
# docs/testing.md), found there afterwards. The script needs only the standard library, so on a fresh machine the
# builds start at once, not after the venv.
e2e-binaries:
	$(PYTHON) tests/e2e/cluster_binaries.py

# The training image from the Dockerfile, with podman (tools from the distribution's packages when missing, as root
# or with sudo); where the real base cannot be pulled, on a stand-in made once per machine (about 4 minutes), then
# rebuilt only when the Dockerfile or the project's files change (docs/testing.md).
image: dev
	.ci/install-container-tools
	$(BIN)/python tests/image.py

# What the suite needs, made side by side: on a fresh machine the Go builds keep both cores busy for about 15
# minutes, while the venvs, Prometheus and the image's base mostly download and write (docs/testing.md).
test-prerequisites:
	$(MAKE) -j5 dev prometheus e2e-binaries floors-env image

test: test-prerequisites
	$(BIN)/python -m pytest
	$(FLOORS_VENV)/bin/python -m pytest $(FLOOR_TESTS)

# The floors tier: pyproject.toml's dependencies at their lower bounds (uv's lowest-direct resolution; what they pull
# in, and the dev tools, at their newest), under the tests that reach each of them: pydantic, typer and helm (spec,
# CLI, shell completion, and of the chart's tests a render through each path: the API, `ctl render`, Helm's merge of
# every example's values; the rest check what the templates make of the values: Helm's work); torch, transformers,
# tokenizers, safetensors, prometheus-client, tensorboard, numpy and obstore (a 2-process run of each workload with
# its export loaded by transformers, torchrun's report of a killed rank, compile, checkpoint and resume,
# trainer/gpt.py's GPT-2 exchanged with transformers' both ways, metrics, TensorBoard event files, checkpoints in a
# bucket). Each is one run, not a file's every variation: the suite ran those already, and the tier is to find an API
# a floor lacks. urllib3 is reached only by the cluster commands (the e2e tier).
FLOOR_TESTS := tests/test_spec.py tests/test_operator_env.py tests/test_completion.py \
	tests/test_chart.py::test_master_and_workers \
	tests/test_chart.py::test_training_config_is_the_spec_training_section \
	tests/test_chart.py::test_ctl_render_prints_multi_document_yaml_and_json \
	tests/test_chart.py::test_helm_values_merge_gives_the_same_objects_as_ctl \
	tests/test_gpt.py tests/test_causal_lm.py \
	tests/test_local_run.py::test_run_writes_a_loadable_final_model_and_report \
	tests/test_local_run.py::test_a_killed_node_is_said_to_be_killed_by_its_signal \
	tests/test_classification.py::test_report_shape_and_it_beats_chance \
	tests/test_classification.py::test_final_model_loads_with_plain_transformers_and_predicts_labels_by_name \
	tests/test_ddp.py::test_compiled_ddp_equals_single_process \
	tests/test_object_storage.py::test_keeps_the_newest_and_the_best_in_the_bucket_and_prunes_only_after_a_commit \
	tests/test_object_storage.py::test_ctl_run_with_storage_uri_keeps_the_run_in_the_bucket \
	"tests/test_checkpoint.py::test_sigterm_saves_at_one_agreed_step_and_the_restart_finishes_exactly"

# A new environment each time rather than `--upgrade` over the old one: `--upgrade` implies `--refresh`, which
# fetched torch and its CUDA libraries again and unpacked another 6 GB copy into uv's cache on every run.
floors-env: $(BIN)/uv
	$(BIN)/uv venv --quiet --clear --python $(PYTHON) $(FLOORS_VENV)
	$(UV_INSTALL) --python $(FLOORS_VENV)/bin/python --resolution lowest-direct -e '.[train]'
	$(UV_INSTALL) --python $(FLOORS_VENV)/bin/python -e '.[dev]'
	$(call compile_venv,$(FLOORS_VENV))

# Only the control-plane tier (tests/e2e): its node runs the training image.
e2e: dev e2e-binaries image
	$(BIN)/python -m pytest -m e2e tests/e2e

# Ratios against peers measured in the same run: training throughput (vs a bare DDP loop and
# transformers' Trainer), wall time and loss on nanoGPT's baby GPT (vs a nanoGPT-style reference),
# checkpoint stalls (sync vs async), ctl start-up, metrics cost per step, data preparation at
# real size (vs a nanoGPT-style prepare), and a recreated pod's torch.compile (its caches from
# scratch vs on the volume).
bench: $(BIN)/uv
	$(INSTALL) -e '.[bench]'
	$(COMPILE)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/nanogpt.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/cli.py
	$(BIN)/python bench/metrics_overhead.py
	$(BIN)/python bench/data.py
	$(BIN)/python bench/compile_cache.py

lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The chart's values.yaml and values.schema.json, and docs/spec.md, generated from the job spec model.
chart: install
	$(BIN)/python -m ctl.schema

# k8s/examples: every examples/*.yaml rendered by `ctl render` (tests fail when these drift).
k8s: chart
	$(BIN)/python -m ctl.k8s
