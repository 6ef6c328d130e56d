"""ctl against a cluster: targeting like kubectl, server-side apply, and a job's state in training terms, for both
job APIs: the training operator v1's PyTorchJob and Kubeflow Trainer v2's TrainJob (pods of JobSet's Indexed Jobs).

Only the Kubernetes API is used (the `kubernetes` client, no kubectl). Every failure that is
not the job's own outcome is a `ClusterError` with one line for the user.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ctl import storage
from ctl.kinds import DEFAULT_KIND, KINDS, TRAINJOB, JobKind, kind_of
from ctl.kinds.trainjob import RUNTIME_PLURAL
from ctl.names import COMPONENT_LABEL, INSTANCE_LABEL, METRICS_PORT_NAME, PREPARE_COMPONENT
from trainer.names import METRICS_PREFIX, Metric

FIELD_MANAGER = "ctl"
BATCH_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
SIGKILL_EXIT_CODE = 128 + signal.SIGKILL  # a container killed by SIGKILL, as the OOM killer does
# Longer than the chart's default terminationGracePeriodSeconds (120 s): a foreground deletion outlasts the pods'.
DELETE_WAIT_S = 300
PROGRESS_TIMEOUT_S = 5.0  # a metrics endpoint that does not answer leaves the progress out, not ctl hanging
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# `wait` and `submit --wait/--follow`: the job's outcome as the exit code (0 is the awaited state).
EXIT_JOB_FAILED = 100
EXIT_NOT_FINISHED = 101
EXIT_NOT_FOUND = 102
# The training objects rendered with a TrainJob, deleted with it (selected by the chart's instance label).
TRAINING_RUNTIMES = (f"/apis/{TRAINJOB.api_version}", RUNTIME_PLURAL)


class ClusterError(RuntimeError):
    """Talking to the cluster failed; the message is the one line `ctl` prints."""


class NotFound(ClusterError):
    """The API server answered 404."""


class JobNotFound(NotFound):
    """The job a command names does not exist."""


@dataclass
class Target:
    """An API client and the namespace commands work in."""

    api: ApiClient
    namespace: str

    def call(self, path: str, method: str = "GET", **kwargs: Any) -> Any:
        """One API request; the parsed JSON body. API errors become one-line ClusterErrors."""
        with self.errors(method, path):
            return self.api.call_api(
                path,
                method,
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                **kwargs,
            )

    def open(self, path: str, query: list[tuple[str, str]], timeout: float | None = None) -> urllib3.BaseHTTPResponse:
        """A GET whose body is read as it arrives (a pod's log, a metrics page); the caller closes it.
        `timeout` bounds the connection and each read (None: a log followed for hours)."""
        with self.errors("GET", path):
            return self.api.call_api(
                path,
                "GET",
                query_params=query,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=False,
                _request_timeout=timeout,
            )

    @contextlib.contextmanager
    def errors(self, method: str, path: str) -> Iterator[None]:
        try:
            yield
        except ApiException as exc:
            if exc.status == 404:
                raise NotFound(f"{method} {path}: not found: {api_message(exc)}") from None
            raise ClusterError(f"{method} {path}: {exc.status} {exc.reason}: {api_message(exc)}") from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # connection refused, DNS, TLS
            raise ClusterError(f"cannot reach the API server {self.api.configuration.host}: {exc}") from None


def api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(exc.body or "").strip()


def connect(kubeconfig: str | None, context: str | None, namespace: str | None) -> Target:
    """Like kubectl: --kubeconfig, else $KUBECONFIG (a list of files), else ~/.kube/config, else in-cluster;
    the namespace from -n, else the context's, else `default` (in a pod: the pod's)."""
    config = kubernetes.config
    in_cluster = (
        kubeconfig is None
        and "KUBECONFIG" not in os.environ
        and not Path("~/.kube/config").expanduser().exists()
        and "KUBERNETES_SERVICE_HOST" in os.environ
    )
    try:
        if in_cluster:
            configuration = kubernetes.client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            default_namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
            return Target(ApiClient(configuration), namespace or default_namespace)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if chosen is None:
            raise ClusterError(f"--context {context!r}: no such context in the kubeconfig")
        api = config.new_client_from_config(config_file=kubeconfig, context=chosen["name"])
    except config.ConfigException as exc:
        raise ClusterError(f"kubeconfig: {exc}") from None
    except OSError as exc:
        raise ClusterError(f"kubeconfig: {exc}") from None
    return Target(api, namespace or chosen["context"].get("namespace") or "default")


def resource_path(target: Target, obj: dict[str, Any]) -> str:
    """The object's URL, its resource name found through discovery (as kubectl does)."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    try:
        resources = target.call(base)["resources"]
    except NotFound:
        raise ClusterError(f"the cluster does not serve {api_version} (for {kind})") from None
    (resource,) = [r for r in resources if r["kind"] == kind and "/" not in r["name"]]
    scope = f"/namespaces/{target.namespace}" if resource["namespaced"] else ""
    return f"{base}{scope}/{resource['name']}/{obj['metadata']['name']}"


def apply(target: Target, obj: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
    """Server-side apply (field manager `ctl`), in the target namespace; the object as stored."""
    query = [("fieldManager", FIELD_MANAGER), ("force", "true")] + ([("dryRun", "All")] if dry_run else [])
    return target.call(
        resource_path(target, obj),
        "PATCH",
        query_params=query,
        header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
        body=obj,
    )


def get_job(target: Target, name: str, api: JobKind = DEFAULT_KIND) -> dict[str, Any]:
    try:
        return target.call(api.path(target.namespace, name))
    except NotFound:
        raise JobNotFound(f"{api.kind.lower()} {name} not found in namespace {target.namespace}") from None


def find_job(target: Target, name: str) -> dict[str, Any]:
    """The job of that name, of whichever kind the cluster has it as (PyTorchJob first)."""
    for api in KINDS.values():
        try:
            return target.call(api.path(target.namespace, name))
        except NotFound:  # no such job, or no such resource in this cluster
            continue
    raise JobNotFound(f"job {name} not found in namespace {target.namespace} (neither PyTorchJob nor TrainJob)")


def serves(target: Target, api: JobKind) -> bool:
    """Whether the cluster serves the kind (its CRD installed)."""
    try:
        resources = target.call(f"/apis/{api.api_version}")["resources"]
    except NotFound:
        return False
    return any(r["name"] == api.plural for r in resources)


def require_operator(target: Target, api: JobKind = DEFAULT_KIND) -> None:
    if not serves(target, api):
        raise ClusterError(f"the cluster has no {api.kind} resource ({api.plural}.{api.group}): install {api.install}")


def delete_job(target: Target, name: str, foreground: bool = False, api: JobKind = DEFAULT_KIND) -> None:
    """Delete the job and wait until it is gone. In the background (the default) the cluster's garbage
    collector removes its pods and Services afterwards; in the foreground the job object goes only once the
    collector has removed them, so a job recreated under its name never meets the old pods. A TrainJob is deleted
    in the background even so, and then its pods awaited: Trainer v2.3 recreates the JobSet of a TrainJob that a
    foreground deletion holds, again and again until the collector wins the race."""
    policy = "Foreground" if foreground and api.foreground_deletion else "Background"
    target.call(api.path(target.namespace, name), "DELETE", body={"propagationPolicy": policy})
    deadline = time.monotonic() + DELETE_WAIT_S
    pods = f"/api/v1/namespaces/{target.namespace}/pods"
    while time.monotonic() < deadline:
        try:
            get_job(target, name, api)
        except JobNotFound:
            selector = [("labelSelector", f"{api.job_label}={name}")]
            if policy == "Foreground" or not foreground or not target.call(pods, query_params=selector)["items"]:
                return
        time.sleep(0.5)
    left = " (its pods and Services are still being removed)" if foreground else ""
    raise ClusterError(f"{api.kind.lower()} {name} still exists {DELETE_WAIT_S} s after its deletion{left}")


def submit(
    target: Target,
    objects: list[dict[str, Any]],
    dry_run: bool,
    replace: bool,
    note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Apply the rendered objects in install order (volume claim, config and a TrainJob's runtime before the job),
    once the cluster is known to run them: the operator installed, a claim its storage class can give
    (ctl.storage)."""
    (job,) = [obj for obj in objects if obj["kind"] in KINDS]
    api = kind_of(job)
    require_operator(target, api)
    if (message := check_claim(target, objects)) and note:
        note(message)
    name = job["metadata"]["name"]
    try:
        get_job(target, name, api)
        exists = True
    except JobNotFound:
        exists = False
    if exists and not replace:
        raise ClusterError(
            f"{api.kind.lower()} {name} already exists in namespace {target.namespace}:"
            " --replace deletes and recreates it (the run directory and its checkpoints stay)"
        )
    if exists and not dry_run:
        delete_job(target, name, foreground=True, api=api)
    if not dry_run and any(obj["kind"] == "Job" for obj in objects):  # prepare.enabled
        clear_prepare_job(target, name, replace)
    for obj in objects:
        if obj is not job:
            apply(target, obj, dry_run=dry_run)
    if dry_run and (runtime := api.runtime_name(job)) and not runtime_exists(target, runtime):
        if note:
            note(
                "note: Trainer v2's webhook checks a TrainJob against its TrainingRuntime, which a dry run does not"
                " create: the runtime and the other objects passed the server dry run, the TrainJob was not sent"
            )
        return job
    return apply(target, job, dry_run=dry_run)


def clear_prepare_job(target: Target, name: str, replace: bool) -> None:
    """The prepare Job an earlier submit of this name left: a finished Job never runs again (nor can its pod template
    change), so the new one would never prepare; it goes first, and so does a running one that --replace replaces."""
    for job in prepare_jobs(target, name):
        if not (replace or prepare_state(job) in ("Succeeded", "Failed")):
            continue
        path = f"/apis/batch/v1/namespaces/{target.namespace}/jobs/{job['metadata']['name']}"
        target.call(path, "DELETE", body={"propagationPolicy": "Background"})
        deadline = time.monotonic() + DELETE_WAIT_S
        with contextlib.suppress(NotFound):
            while time.monotonic() < deadline:
                target.call(path)
                time.sleep(0.5)
            raise ClusterError(f"job {job['metadata']['name']} still exists {DELETE_WAIT_S} s after its deletion")


def prepare_jobs(target: Target, name: str) -> list[dict[str, Any]]:
    """The job's prepare Job, by the labels helm/ddpjob/templates/prepare-job.yaml gives it (none, or one)."""
    selector = f"{INSTANCE_LABEL}={name},{COMPONENT_LABEL}={PREPARE_COMPONENT}"
    jobs = f"/apis/batch/v1/namespaces/{target.namespace}/jobs"
    return target.call(jobs, query_params=[("labelSelector", selector)])["items"]


def prepare_state(job: dict[str, Any]) -> str:
    """A batch Job's state in ctl's words: Pending, Running, Succeeded (Complete) or Failed."""
    status = job.get("status") or {}
    true = {c["type"] for c in status.get("conditions") or [] if c.get("status") == "True"}
    state = "Running" if status.get("active") else "Pending"
    return "Succeeded" if "Complete" in true else "Failed" if "Failed" in true else state


def runtime_exists(target: Target, name: str) -> bool:
    base, plural = TRAINING_RUNTIMES
    try:
        target.call(f"{base}/namespaces/{target.namespace}/{plural}/{name}")
    except NotFound:
        return False
    return True


class StorageMismatch(ClusterError):
    """The claim asks an access mode its storage class cannot give: bad input (exit 2), nothing created."""


def check_claim(target: Target, objects: list[dict[str, Any]]) -> str | None:
    """Raise StorageMismatch when the rendered claim asks ReadWriteMany of a class (named, or the cluster's default)
    whose provisioner cannot give it. Returns a note when the check could not be made (StorageClasses are
    cluster-scoped: k8s/rbac.yaml does not let users read them)."""
    claim = storage.rwx_claim(objects)
    if claim is None:
        return None
    name = claim["spec"].get("storageClassName")
    try:
        if name:
            storage_class = target.call(f"/apis/storage.k8s.io/v1/storageclasses/{name}")
        else:
            classes = target.call("/apis/storage.k8s.io/v1/storageclasses")["items"]
            annotation = storage.DEFAULT_CLASS_ANNOTATION
            defaults = [c for c in classes if (c["metadata"].get("annotations") or {}).get(annotation) == "true"]
            if not defaults:
                return None
            # Of several defaults, the API server gives a new claim the newest.
            storage_class = max(defaults, key=lambda c: c["metadata"]["creationTimestamp"])
    except NotFound:
        return None  # a class of statically provisioned volumes need not exist as an object
    except ClusterError as error:
        return f"note: the claim's storage class was not checked: {error}"
    problem = storage.mismatch(claim, storage_class, default=not name)
    if problem:
        raise StorageMismatch(problem)
    return None


def condition(job: dict[str, Any]) -> str:
    """The job's state in one word, the same for both kinds: Created, Running, Restarting, Succeeded, Failed..."""
    return kind_of(job).state(job)


def finished(job: dict[str, Any]) -> bool:
    return condition(job) in ("Succeeded", "Failed")


def wait(target: Target, name: str, state: str, timeout: float, progress: Callable[[str], None] | None = None) -> int:
    """Block until the job reaches `state` (succeeded, failed or running); the exit code for `ctl wait`."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            current = condition(find_job(target, name))
        except JobNotFound:
            return EXIT_NOT_FOUND
        if current != last and progress:
            progress(current)
        last = current
        reached = {"succeeded": current == "Succeeded", "failed": current == "Failed"}
        reached["running"] = current in ("Running", "Succeeded")
        if reached[state]:
            return 0
        if current == "Failed":
            return EXIT_JOB_FAILED
        if current == "Succeeded":  # finished otherwise than awaited (--for failed): it never will be
            return EXIT_NOT_FINISHED
        if time.monotonic() >= deadline:
            return EXIT_NOT_FINISHED
        time.sleep(1)


def job_pods(target: Target, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's pods in node-rank order (master-0, worker-0, worker-1...; node-0, node-1...), oldest first
    among a node's pods (a Job replaces a failed pod by a new one)."""
    kind = kind_of(job)
    selector = f"{kind.job_label}={job['metadata']['name']}"
    pods = target.call(f"/api/v1/namespaces/{target.namespace}/pods", query_params=[("labelSelector", selector)])
    ranks = {label: rank for rank, label in enumerate(kind.node_labels(job))}
    return sorted(
        pods["items"],
        key=lambda p: (ranks.get(kind.pod_label(p), len(ranks)), p["metadata"].get("creationTimestamp", "")),
    )


def procs_per_node(job: dict[str, Any]) -> int | None:
    """Processes per pod when the job fixes the number (`auto`, `gpu`... leave it to each node)."""
    value = kind_of(job).procs_value(job)
    return int(value) if value.isdigit() else None


def progress(target: Target, pod: dict[str, Any]) -> dict[str, Any] | None:
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


def metrics_progress(text: str) -> dict[str, Any] | None:
    """Rank 0's progress from its pod's metrics page (Prometheus text); None before there is any."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    rank0 = {s.name: s.value for s in samples if s.labels.get("rank") == "0"}

    def value(metric: str) -> float | None:
        return rank0.get(METRICS_PREFIX + metric)

    if value(Metric.STEP) is None and value(Metric.PLANNED_STEPS) is None:
        return None
    saved_at = value(Metric.CHECKPOINT_TIME)
    planned = value(Metric.PLANNED_STEPS)
    slowest = value(Metric.SLOWEST_RANK)
    return {
        "step": int(value(Metric.STEP) or 0),
        "plannedSteps": None if planned is None else int(planned),
        "trainLoss": value(Metric.TRAIN_LOSS),
        "evalLoss": value(Metric.EVAL_LOSS),
        "tokensPerSecond": value(Metric.TOKENS_PER_SECOND),
        "checkpoint": None
        if saved_at is None
        else {
            "step": int(value(Metric.CHECKPOINT_STEP) or 0),
            "time": datetime.fromtimestamp(saved_at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        # Rank 0's watchdog compares every rank's busy time per step with the median (trainer.watchdog).
        "slowestRank": None
        if slowest is None
        else {"rank": int(slowest), "stepTimeRatioToMedian": value(Metric.SLOWEST_RANK_RATIO)},
    }


def trainer_status(pod: dict[str, Any], container: str) -> dict[str, Any]:
    """The status of the pod's trainer container ({} before it has one)."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == container), {})


def pod_summary(pod: dict[str, Any], kind: JobKind, container: str) -> dict[str, Any]:
    """A pod of a job of `kind` (or of its prepare Job) in one stable shape; `container` is the one it reports."""
    trainer = trainer_status(pod, container)
    terminated = (trainer.get("state") or {}).get("terminated") or (trainer.get("lastState") or {}).get("terminated")
    return {
        "name": pod["metadata"]["name"],
        "node": kind.pod_label(pod),
        "replicaType": kind.pod_replica_type(pod),
        "phase": pod.get("status", {}).get("phase", "Unknown"),
        "restarts": trainer.get("restartCount", 0),
        "exitCode": terminated.get("exitCode") if terminated else None,
        "reason": (terminated or {}).get("reason") or pod.get("status", {}).get("reason"),
        "message": termination_cause(terminated),
    }


def termination_cause(terminated: dict[str, Any] | None) -> str | None:
    """A failed container's root cause: the last line of its termination message (the chart's containers fall back
    to their log's tail, whose last line trainer.launch and trainer.prepare make the one-line root cause). None for
    a container killed by SIGKILL (the OOM killer's): its last line was not its last word."""
    if not terminated or terminated.get("exitCode") == SIGKILL_EXIT_CODE:
        return None
    lines = (terminated.get("message") or "").strip().splitlines()
    return lines[-1] if lines else None


def status(target: Target, name: str) -> dict[str, Any]:
    """The job in one stable shape, for both kinds: state, training progress (rank 0's metrics while it runs;
    for a TrainJob also what its trainer reported to Trainer v2, `trainerStatus`), conditions, replica counts,
    pods, recent events (of the job, its pods and, for a TrainJob, its JobSet and Jobs)."""
    job = find_job(target, name)
    kind = kind_of(job)
    pods = job_pods(target, job)
    prepare = prepare_job(target, name, kind)
    involved = {name} | {pod["metadata"]["name"] for pod in pods} | ({prepare["name"]} if prepare else set())
    involved |= {(pod["metadata"].get("labels") or {}).get(BATCH_JOB_NAME_LABEL) for pod in pods}
    events = [
        e
        for e in target.call(f"/api/v1/namespaces/{target.namespace}/events")["items"]
        if e["involvedObject"].get("name") in involved
    ]
    return {
        "name": name,
        "namespace": target.namespace,
        "kind": job["kind"],
        "state": condition(job),
        "progress": rank0_progress(target, job, pods),
        "trainerStatus": (job.get("status") or {}).get("trainerStatus"),
        "prepare": prepare,
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
            for c in job.get("status", {}).get("conditions") or []
        ],
        "replicas": kind.replica_counts(job),
        "pods": [pod_summary(pod, kind, kind.container) for pod in pods],
        "events": [
            {"object": f"{e['involvedObject'].get('kind', '').lower()}/{e['involvedObject'].get('name')}"}
            | {k: e.get(k) for k in ("type", "reason", "message", "lastTimestamp")}
            for e in sorted(events, key=lambda e: e.get("lastTimestamp") or "")[-10:]
        ],
    }


def prepare_job(target: Target, name: str, kind: JobKind) -> dict[str, Any] | None:
    """The job's prepare Job (prepare.enabled), which its training pods wait for: Pending, Running, Succeeded or
    Failed, why it failed (its Failed condition) and its newest pod (exit code 137: killed, as by the OOM killer; 2:
    bad data, its message the line naming the file). None without one."""
    jobs = prepare_jobs(target, name)
    if not jobs:
        return None
    job = jobs[0]
    conditions = (job.get("status") or {}).get("conditions") or []
    failed = next((c for c in conditions if c["type"] == "Failed" and c.get("status") == "True"), {})
    selector = f"{BATCH_JOB_NAME_LABEL}={job['metadata']['name']}"
    pods = target.call(f"/api/v1/namespaces/{target.namespace}/pods", query_params=[("labelSelector", selector)])
    newest = max(pods["items"], key=lambda p: p["metadata"].get("creationTimestamp", ""), default=None)
    (container,) = job["spec"]["template"]["spec"]["containers"]  # the chart's one container
    return {
        "name": job["metadata"]["name"],
        "state": prepare_state(job),
        "reason": failed.get("reason"),
        "message": failed.get("message"),
        "pod": None if newest is None else pod_summary(newest, kind, container["name"]),
    }


def rank0_progress(target: Target, job: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Progress from node 0's pod (where rank 0 runs; its newest) while the job runs."""
    kind = kind_of(job)
    labels = kind.node_labels(job)
    rank0 = [p for p in pods if labels and kind.pod_label(p) == labels[0]]
    return progress(target, rank0[-1]) if rank0 and not finished(job) else None


def list_jobs(target: Target, all_namespaces: bool) -> list[dict[str, Any]]:
    """The jobs of both kinds the cluster serves (an error naming the install when it serves neither)."""
    items = []
    for api in KINDS.values():
        scope = "" if all_namespaces else f"namespaces/{target.namespace}/"
        try:
            items += target.call(f"/apis/{api.api_version}/{scope}{api.plural}")["items"]
        except NotFound:  # this kind is not served here
            continue
    if not items and not any(serves(target, api) for api in KINDS.values()):
        require_operator(target)
    rows = []
    for job in sorted(items, key=lambda j: (j["metadata"]["namespace"], j["metadata"]["name"], j["kind"])):
        in_namespace = Target(target.api, job["metadata"]["namespace"])
        running = condition(job) in ("Running", "Restarting")
        pods = job_pods(in_namespace, job) if running else []
        rows.append(job_row(job) | {"progress": rank0_progress(in_namespace, job, pods) if running else None})
    return rows


def job_row(job: dict[str, Any]) -> dict[str, Any]:
    created = datetime.fromisoformat(job["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    return {
        "name": job["metadata"]["name"],
        "namespace": job["metadata"]["namespace"],
        "kind": job["kind"],
        "state": condition(job),
        "nodes": kind_of(job).nodes(job),
        "procsPerNode": kind_of(job).procs_value(job),
        "ageSeconds": int((datetime.now(timezone.utc) - created).total_seconds()),
    }


def delete(target: Target, name: str, purge: bool) -> list[str]:
    """The job, and the objects rendered with it (config, monitoring, a TrainJob's runtime); its claim only with
    `purge`."""
    api = kind_of(find_job(target, name))
    delete_job(target, name, api=api)
    removed = [f"{api.kind.lower()}/{name}"]
    selector = f"{INSTANCE_LABEL}={name}"
    kinds = [("/api/v1", "configmaps"), ("/api/v1", "serviceaccounts")]
    kinds += [("/apis/monitoring.coreos.com/v1", "podmonitors"), ("/apis/monitoring.coreos.com/v1", "prometheusrules")]
    kinds.append(("/apis/networking.k8s.io/v1", "networkpolicies"))
    kinds.append(("/apis/batch/v1", "jobs"))  # prepare.enabled: the prepare Job
    kinds.append(TRAINING_RUNTIMES)
    if purge:
        kinds.append(("/api/v1", "persistentvolumeclaims"))
    for base, plural in kinds:
        collection = f"{base}/namespaces/{target.namespace}/{plural}"
        try:
            items = target.call(collection, query_params=[("labelSelector", selector)])["items"]
        except NotFound:  # e.g. no prometheus-operator CRDs in this cluster
            continue
        for item in items:
            target.call(f"{collection}/{item['metadata']['name']}", "DELETE")
            singular = plural.removesuffix("ies") + "y" if plural.endswith("ies") else plural.removesuffix("s")
            removed.append(f"{singular}/{item['metadata']['name']}")
    return removed
