"""A running job's training progress: rank 0's metrics page (Prometheus text), read through the API server's pod
proxy, by the metric names trainer/metrics.py defines (trainer/names.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import urllib3

from ctl.cluster import ClusterError, Target
from ctl.names import METRICS_PORT_NAME
from trainer.names import METRICS_PREFIX, Metric

PROGRESS_TIMEOUT_S = 5.0  # a metrics endpoint that does not answer leaves the progress out, not ctl hanging


@dataclass(frozen=True)
class Checkpoint:
    """The newest committed checkpoint: its step and when (UTC, RFC 3339)."""

    step: int
    time: str


@dataclass(frozen=True)
class SlowestRank:
    """Rank 0's watchdog compares every rank's busy time per step with the median (trainer.watchdog)."""

    rank: int
    step_time_ratio_to_median: float | None


@dataclass(frozen=True)
class Progress:
    """Rank 0's progress."""

    step: int
    planned_steps: int | None
    train_loss: float | None
    eval_loss: float | None
    tokens_per_second: float | None
    checkpoint: Checkpoint | None
    slowest_rank: SlowestRank | None


def progress(target: Target, pod: dict[str, Any]) -> Progress | None:
    """Rank 0's training progress from its pod's metrics endpoint, read through the API server's pod proxy;
    None while there is none to read (pod not running, metrics off, no step yet)."""
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == METRICS_PORT_NAME]
    if not ports or pod.get("status", {}).get("phase") != "Running":
        return None
    pod_port = f"{pod['metadata']['name']}:{ports[0]['containerPort']}"
    path = f"/api/v1/namespaces/{target.namespace}/pods/{pod_port}/proxy/metrics"
    try:
        response = target.open(path, [], timeout=PROGRESS_TIMEOUT_S)
        try:
            return metrics_progress(response.read().decode())
        finally:
            response.release_conn()
    except (ClusterError, urllib3.exceptions.HTTPError, ValueError):  # not up yet, restarting, not ours
        return None


def metrics_progress(text: str) -> Progress | None:
    """Rank 0's progress from its pod's metrics page (Prometheus text); None before there is any."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    rank0 = {s.name: s.value for s in samples if s.labels.get("rank") == "0"}

    def value(metric: str) -> float | None:
        return rank0.get(METRICS_PREFIX + metric)

    step, planned = value(Metric.STEP), value(Metric.PLANNED_STEPS)
    if step is None and planned is None:
        return None
    saved_at, slowest = value(Metric.CHECKPOINT_TIME), value(Metric.SLOWEST_RANK)
    return Progress(
        step=int(step or 0),
        planned_steps=None if planned is None else int(planned),
        train_loss=value(Metric.TRAIN_LOSS),
        eval_loss=value(Metric.EVAL_LOSS),
        tokens_per_second=value(Metric.TOKENS_PER_SECOND),
        checkpoint=None
        if saved_at is None
        else Checkpoint(
            int(value(Metric.CHECKPOINT_STEP) or 0),
            datetime.fromtimestamp(saved_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        ),
        slowest_rank=None if slowest is None else SlowestRank(int(slowest), value(Metric.SLOWEST_RANK_RATIO)),
    )
