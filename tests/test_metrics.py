"""Metrics end to end: a real Prometheus scrapes a live `ctl run` job, and every dashboard query and alert
rule is evaluated against what it scraped. Also the exposition itself, read with prometheus_client's parser."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import CTL, REPO, ctrl_c_reaches, processes_with_marker, prometheus_server, tiny_spec, wait_for
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ctl.processes import free_port
from ctl.render import render
from ctl.spec import JobSpec
from trainer.checkpoint import SaveStats
from trainer.dist import Dist
from trainer.metrics import TrainingMetrics, flops_per_token
from trainer.models import build_char_gpt
from trainer.spec import TrainingSpec

NODES, PROCS = 2, 2
NAMESPACE = "ddpjob-test"
DASHBOARD = REPO / "helm" / "ddpjob" / "dashboards" / "training.json"
# Grafana's variables as a user viewing this job would have them.
VARIABLES = {
    "$namespace": NAMESPACE,
    "$job": "tiny",
    "${dcgm_pod_label}": "exported_pod",
    "${dcgm_namespace_label}": "exported_namespace",
    "$__rate_interval": "4s",
}
# Series the trainer exports only on CUDA devices (MFU only where the GPU's peak is known).
CUDA_ONLY = ("ddpjob_mfu_ratio", "ddpjob_gpu_memory_")
CHECKPOINT = "ddpjob_checkpoint_"  # exported once a checkpoint has been saved
# From the watchdog thread, once every rank has reported its step time (the slowest rank: rank 0 only).
STRAGGLERS = ("ddpjob_step_time_ratio_to_median", "ddpjob_slowest_rank")
COUNTERS = {"ddpjob_steps", "ddpjob_samples", "ddpjob_tokens"}
PREPARE = "ddpjob_prepare_"  # data preparation's series (trainer/preparation/progress.py)
HISTOGRAMS = {"ddpjob_step_duration_seconds", "ddpjob_data_wait_seconds"}
GAUGES = {
    "ddpjob_info",
    "ddpjob_step",
    "ddpjob_planned_steps",
    "ddpjob_restarts",
    "ddpjob_start_timestamp_seconds",
    "ddpjob_train_loss",
    "ddpjob_learning_rate",
    "ddpjob_grad_norm",
    "ddpjob_tokens_per_second",
    "ddpjob_eval_loss",
    "ddpjob_eval_accuracy_ratio",
}


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def families(text: str) -> dict[str, Any]:
    """Metric families that have samples (the exposition also lists those without any)."""
    return {family.name: family for family in text_string_to_metric_families(text) if family.samples}


def scrape_with(endpoint: str, name: str) -> dict[str, Any] | None:
    """The endpoint's metric families once they include `name`."""
    scraped = families(get(endpoint))
    return scraped if name in scraped else None


def evaluated_rules(prometheus: str) -> list[dict[str, Any]] | None:
    """Every loaded rule, once each has been evaluated."""
    groups = json.loads(get(f"{prometheus}/api/v1/rules"))["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    return rules if rules and all(rule["health"] != "unknown" for rule in rules) else None


def endpoints(ctl_stderr: Path) -> list[tuple[str, str]] | None:
    """(node, URL) of every node once `ctl run` has printed them all."""
    found = re.findall(r"ctl: metrics of node (\d) at (http://\S+)", ctl_stderr.read_text())
    return found if len(found) == NODES else None


@dataclass
class LiveJob:
    endpoints: list[str]  # node i's metrics URL
    run_dir: Path


@pytest.fixture
def live_job(tmp_path: Path, corpus_file: Path, marked_env: tuple[dict[str, str], str]) -> Iterator[LiveJob]:
    """`ctl run` of a tiny job, 2 nodes x 2 processes, long enough to outlast the test; stopped afterwards."""
    env, marker = marked_env
    spec = tiny_spec(
        corpus_file, maxSteps=1_000_000, logEvery=5, evalEvery=40, checkpoint={"every": 100}, sample={"maxNewTokens": 0}
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec | {"nodes": NODES, "procsPerNode": PROCS}))
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        ctl = subprocess.Popen(
            [*CTL, "run", str(spec_file)],
            cwd=tmp_path,
            env=env | {"PYTHONPATH": str(REPO)},
            stdout=stdout,
            stderr=stderr,
            preexec_fn=ctrl_c_reaches,
        )
    try:
        # ctl announces them with the first line of training (a run failing on its input prints only its error):
        # after every rank has started and read its data.
        announced = wait_for("ctl run to print the metrics endpoints", lambda: endpoints(err), time.monotonic() + 120)
        assert [int(node) for node, _ in announced] == list(range(NODES))
        yield LiveJob([url for _, url in announced], tmp_path / "runs" / "tiny")
    finally:
        ctl.send_signal(signal.SIGINT)  # ctl stops every node, as on Ctrl-C
        try:
            ctl.wait(timeout=60)
        finally:
            if ctl.poll() is None:
                ctl.kill()
    assert processes_with_marker(marker) == [], out.read_text()[-2000:] + err.read_text()


@pytest.fixture
def prometheus(tmp_path: Path, live_job: LiveJob) -> Iterator[str]:
    """A real Prometheus on loopback scraping every node each second, as the PodMonitor would (job = the job's
    name, the pod's namespace and name as target labels), with the chart's alert rules for this job loaded."""
    rule = next(m.obj for m in render(JobSpec.model_validate(alerting_spec())) if m.kind == "PrometheusRule")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    pods = ["tiny-master-0"] + [f"tiny-worker-{i}" for i in range(NODES - 1)]
    targets = [
        {"targets": [urllib.parse.urlsplit(url).netloc], "labels": {"namespace": NAMESPACE, "pod": pod}}
        for url, pod in zip(live_job.endpoints, pods, strict=True)
    ]
    config = tmp_path / "prometheus.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [{"job_name": "tiny", "static_configs": targets}],
            }
        )
    )
    with prometheus_server(config, tmp_path) as url:
        wait_for("Prometheus to be ready", lambda: get(f"{url}/-/ready"), time.monotonic() + 30)
        yield url


def alerting_spec() -> dict[str, Any]:
    return {"name": "tiny", "training": {"data": {"train": ["x"]}}, "metrics": {"alerts": {"enabled": True}}}


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query; a query Prometheus refuses fails the test with its error."""
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(get(url))
    except urllib.error.HTTPError as exc:
        pytest.fail(f"{expr}: {json.loads(exc.read())['error']}")
    assert body["status"] == "success", body
    return body["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression with the variables filled in) for every target of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in sorted(VARIABLES.items(), key=lambda item: -len(item[0])):
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {target['expr']}"
            found.append((panel["title"], expr))
    return found


def expects_data(expr: str, run_dir: Path) -> bool:
    if "DCGM_" in expr:
        return False  # no DCGM exporter here: the query must be valid, nothing more
    if any(name in expr for name in CUDA_ONLY):
        return torch.cuda.is_available()
    if CHECKPOINT in expr:
        return any(run_dir.glob("step-*"))
    return True


@pytest.mark.timeout(240)
def test_prometheus_scrapes_every_rank_and_every_dashboard_query_works(live_job: LiveJob, prometheus: str) -> None:
    deadline = time.monotonic() + 90
    # The exposition of each node: one endpoint serving its own ranks, with the right metric types.
    for node, endpoint in enumerate(live_job.endpoints):
        scraped = wait_for(
            f"node {node}'s first evaluation", lambda e=endpoint: scrape_with(e, "ddpjob_eval_loss"), deadline
        )
        ranks = {s.labels["rank"] for s in scraped["ddpjob_steps"].samples}
        assert ranks == {str(node * PROCS + local) for local in range(PROCS)}
        # Rank 0 prepared the data before training: its node's endpoint keeps the preparation's series.
        prepared = {name for name in scraped if name.startswith(PREPARE)}
        assert ("ddpjob_prepare_tokens" in prepared) == (node == 0), prepared
        assert {name for name, f in scraped.items() if f.type == "counter"} - prepared == COUNTERS
        optional = {name for name in scraped if name.startswith((*CUDA_ONLY, CHECKPOINT, *STRAGGLERS, PREPARE))}
        assert {name for name, f in scraped.items() if f.type == "histogram"} - optional == HISTOGRAMS
        assert {name for name, f in scraped.items() if f.type == "gauge"} - GAUGES <= optional
        assert set(scraped) >= GAUGES
        (info, *_) = scraped["ddpjob_info"].samples
        assert info.labels | {"rank": "0"} == {
            "job_name": "tiny",
            "task": "char-gpt",
            "model": "gpt2-1l-2h-32d",
            "world_size": str(NODES * PROCS),
            "rank": "0",
        }

    # Every dashboard query is valid; each one the trainer feeds returns data once a few scrapes are in.
    queries = dashboard_queries()
    pending = {expr for _, expr in queries if expects_data(expr, live_job.run_dir)}
    while pending and time.monotonic() < deadline:
        pending = {expr for expr in pending if not query(prometheus, expr)}
        time.sleep(1)
    assert not pending, f"no data for: {sorted(pending)}"
    for title, expr in queries:
        result = query(prometheus, expr)
        if not expects_data(expr, live_job.run_dir) and "DCGM_" not in expr and CHECKPOINT not in expr:
            assert result == [], f"{title}: {expr} should have no series on this device"

    # Step time per rank: every rank, each from exactly one endpoint, the endpoint of its node.
    per_rank = query(prometheus, 'count by (rank, pod) (ddpjob_step_duration_seconds_count{job="tiny"})')
    assert sorted((int(s["metric"]["rank"]), s["metric"]["pod"]) for s in per_rank) == [
        (rank, "tiny-master-0" if rank < PROCS else f"tiny-worker-{rank // PROCS - 1}") for rank in range(NODES * PROCS)
    ]
    (step_panel,) = [expr for title, expr in queries if title == "Step time by rank (mean)"]
    assert sorted(s["metric"]["rank"] for s in query(prometheus, step_panel)) == [str(r) for r in range(NODES * PROCS)]

    # The chart's alert rules evaluate cleanly against the live series, and none fires on a healthy run.
    rules = wait_for("the alert rules' first evaluation", lambda: evaluated_rules(prometheus), deadline)
    rendered = next(m.obj for m in render(JobSpec.model_validate(alerting_spec())) if m.kind == "PrometheusRule")
    assert sorted(r["name"] for r in rules) == sorted(
        r["alert"] for g in rendered["spec"]["groups"] for r in g["rules"]
    )
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
    assert [r["name"] for r in rules if r["state"] == "firing"] == []


def test_metric_names_types_and_values_in_one_process(corpus_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a launcher (no port, no shared directory) the metrics live in the process: what each call records."""
    for name in ("DDPJOB_METRICS_PORT", "PROMETHEUS_MULTIPROC_DIR", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DDPJOB_JOB_NAME", "unit")
    spec = TrainingSpec.model_validate(tiny_spec(corpus_file)["training"])
    model = build_char_gpt(spec.model, vocab_size=60, special_id=59)
    metrics = TrainingMetrics(spec, Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), model, 500)
    batches = metrics.timed(iter([1, 2]))
    assert list(batches) == [1, 2]
    metrics.step_done(41, 0.02, samples=4, tokens=128)
    metrics.logged(loss=2.5, lr=1e-3, grad_norm=None, tokens_per_second=6400.0)
    metrics.evaluated(loss=2.25, accuracy=0.5)
    before = families(generate_latest(metrics.registry).decode())
    assert not [name for name in before if name.startswith((*CUDA_ONLY, CHECKPOINT, "ddpjob_grad_norm"))]
    saved = SaveStats(step=41, seconds=3.5, size_bytes=123_456, finished_at=time.time())
    metrics.checkpoint_saved(saved)
    metrics.checkpoint_saved(saved)  # reported once however often the loop passes it on
    scraped = families(generate_latest(metrics.registry).decode())

    def value(name: str, sample: str | None = None) -> float:
        (found,) = [s.value for s in scraped[name].samples if s.name == (sample or name)]
        return found

    assert (
        value("ddpjob_step") == 41
        and value("ddpjob_steps", "ddpjob_steps_total") == 1
        and value("ddpjob_tokens", "ddpjob_tokens_total") == 128
    )
    assert value("ddpjob_samples", "ddpjob_samples_total") == 4
    assert value("ddpjob_step_duration_seconds", "ddpjob_step_duration_seconds_sum") == 0.02
    assert value("ddpjob_data_wait_seconds", "ddpjob_data_wait_seconds_count") == 1
    assert value("ddpjob_train_loss") == 2.5 and value("ddpjob_eval_accuracy_ratio") == 0.5
    assert value("ddpjob_restarts") == 0 and time.time() - value("ddpjob_start_timestamp_seconds") < 60
    assert scraped["ddpjob_checkpoint_save_duration_seconds"].type == "histogram"
    assert value("ddpjob_checkpoint_save_duration_seconds", "ddpjob_checkpoint_save_duration_seconds_sum") == 3.5
    assert value("ddpjob_checkpoint_save_duration_seconds", "ddpjob_checkpoint_save_duration_seconds_count") == 1
    assert value("ddpjob_checkpoint_size_bytes") == 123_456 and value("ddpjob_checkpoint_step") == 41
    assert value("ddpjob_planned_steps") == 500
    assert time.time() - value("ddpjob_checkpoint_last_success_timestamp_seconds") < 60
    assert {s.labels["job_name"] for s in scraped["ddpjob_info"].samples} == {"unit"}
    for family in scraped.values():
        assert all(s.labels["rank"] == "0" for s in family.samples), family.name


def test_flops_per_token_is_nanogpts_estimate(corpus_file: Path) -> None:
    spec = TrainingSpec.model_validate(tiny_spec(corpus_file, model={"nLayer": 2, "nHead": 2, "nEmbd": 32})["training"])
    model = build_char_gpt(spec.model, vocab_size=60, special_id=59)
    non_embedding = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    block = spec.model.block_size
    assert flops_per_token(model, block) == 6 * non_embedding + 12 * 2 * 2 * 16 * block


def test_a_port_without_a_shared_directory_is_refused_in_one_line(
    tmp_path: Path, corpus_file: Path, marked_env: tuple[dict[str, str], str]
) -> None:
    """torchrun by hand with DDPJOB_METRICS_PORT but no PROMETHEUS_MULTIPROC_DIR: ranks would hide each other."""
    env, marker = marked_env
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump(tiny_spec(corpus_file)["training"]))
    env = {k: v for k, v in env.items() if k != "PROMETHEUS_MULTIPROC_DIR"} | {"DDPJOB_METRICS_PORT": str(free_port())}
    env["TMPDIR"] = str(tmp_path)  # where plain torchrun leaves its folder of error files
    result = subprocess.run(
        [*("python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer"), "--config", str(config)],
        cwd=tmp_path,
        env=env | {"PYTHONPATH": str(REPO), "PATH": f"{Path(os.sys.executable).parent}:{env['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "error: DDPJOB_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not" in result.stdout + result.stderr
    assert processes_with_marker(marker) == []
