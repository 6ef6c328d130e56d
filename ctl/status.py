"""A job's state in training terms, for both kinds (ctl/kinds): `ctl status`, `list` and `wait`.

One typed status (a State, dataclasses for the job, its pods, its prepare Job and rank 0's progress) with one
JSON form, `json_form`, that `-o json` and `-o yaml` print: camelCase keys, states as their words.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from ctl.cluster import ClusterError, JobNotFound, NotFound, Target, find_job, require_operator, serves
from ctl.jobs import prepare_jobs, prepare_state
from ctl.kinds import KINDS, JobKind, State, kind_of
from ctl.names import EXIT_JOB_FAILED, EXIT_NOT_FINISHED, EXIT_NOT_FOUND, KUEUE_QUEUE_LABEL
from ctl.progress import Progress, progress
from ctl.tables import one_line

BATCH_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
SIGKILL_EXIT_CODE = 128 + signal.SIGKILL  # a container killed by SIGKILL, as the OOM killer does
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # a container stopped: after a failure, the failure's consequence
# The training operator's event quoting a failed container's termination message (its RecordAbnormalPods): what is
# left of a root cause once the operator has deleted the pod (restartPolicy OnFailure, at the backoff limit).
QUOTED_TERMINATION = re.compile(r"Error pod (\S+) container \S+ exitCode: (-?\d+) terminated message: (.*)", re.S)
EVENTS_SHOWN = 10
# Kueue's Workloads (one per job it holds), and their label naming the job's uid.
KUEUE_WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# `wait --for`: the states that count as reached.
AWAITED = {
    "succeeded": {State.SUCCEEDED},
    "failed": {State.FAILED},
    "running": {State.RUNNING, State.SUCCEEDED},
}


@dataclass(frozen=True)
class PodStatus:
    """One pod: its node (`master-0`, `node-1`), phase, restarts, and how its trainer container last ended."""

    name: str
    node: str
    replica_type: str
    phase: str
    restarts: int
    exit_code: int | None
    reason: str | None  # how its container last ended; else why it has not started (ErrImagePull, Unschedulable)
    message: str | None  # the root cause of a failure (termination_cause); else the not starting's message


@dataclass(frozen=True)
class PrepareStatus:
    """The job's prepare Job (prepare.enabled), which its training pods wait for."""

    name: str
    state: State
    reason: str | None  # of its Failed condition
    message: str | None
    pod: PodStatus | None  # its newest pod


@dataclass(frozen=True)
class QueueStatus:
    """A job of `queue.kueue`: its LocalQueue, and whether Kueue has admitted its Workload (the job runs) or why
    not (it waits suspended, without pods)."""

    local_queue: str
    workload: str | None  # None until Kueue has made it (or where Kueue's API cannot be read)
    admitted: bool
    pending: str | None  # why it is not admitted, in Kueue's words where it has some
    # queue.kueueMaxExecutionSeconds, and how much of it the job's admissions have used up (Kueue's count)
    time_budget_seconds: int | None = None
    time_used_seconds: int | None = None


@dataclass(frozen=True)
class JobStatus:
    name: str
    namespace: str
    kind: str
    state: State
    progress: Progress | None  # rank 0's, while the job runs
    trainer_status: dict[str, Any] | None  # a TrainJob's status.trainerStatus, as Trainer v2 has it
    prepare: PrepareStatus | None
    queue: QueueStatus | None  # with queue.kueue
    conditions: list[dict[str, Any]]
    replicas: dict[str, Any]
    pods: list[PodStatus]
    events: list[dict[str, Any]]
    cause: str | None  # why the job failed, in one line (failure_cause); None unless it has


@dataclass(frozen=True)
class Waited:
    """How `wait` ended: the exit code, and the line that says why when the awaited state was not reached."""

    code: int
    problem: str | None = None


@dataclass(frozen=True)
class JobRow:
    """One job of `ctl list`."""

    name: str
    namespace: str
    kind: str
    state: State
    nodes: int
    procs_per_node: str  # a number, or `auto`, `gpu`... (each node decides)
    age_seconds: int
    progress: Progress | None


def json_form(value: Any) -> Any:
    """The JSON form of a status (or of a list of them): camelCase keys, states as their words."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {camel_case(f.name): json_form(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [json_form(item) for item in value]
    if isinstance(value, dict):
        return {key: json_form(item) for key, item in value.items()}
    return value


def camel_case(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word.capitalize() for word in rest)


def finished(job: dict[str, Any]) -> bool:
    return kind_of(job).state(job).terminal


def wait(
    target: Target, name: str, state: str, timeout: float, progress: Callable[[str], None] | None = None
) -> Waited:
    """Block until the job reaches `state` (succeeded, failed or running); the exit code for `ctl wait`, with why
    when it is not 0."""
    deadline = time.monotonic() + timeout
    last: State | None = None
    seen: str | None = None  # the newest failure a pod showed meanwhile: its pods may be gone once the job failed
    while True:
        try:
            job = find_job(target, name)
        except JobNotFound as missing:
            gone = f"{name} was deleted while it was {last.value}" if last else str(missing)
            return Waited(EXIT_NOT_FOUND, gone)
        current = kind_of(job).state(job)
        if current != last and progress:
            progress(current.value)
        last = current
        if current in AWAITED[state]:
            return Waited(0)
        if current == State.FAILED:
            return Waited(EXIT_JOB_FAILED, f"{name} failed: {status(target, name, seen).cause}")
        if current.terminal:  # finished otherwise than awaited (--for failed): it never will be
            return Waited(EXIT_NOT_FINISHED, f"{name} {current.value.lower()}: it will never be {state}")
        if time.monotonic() >= deadline:
            return Waited(EXIT_NOT_FINISHED, f"{name} is still {current.value} after {timeout:g} s (--timeout)")
        # A container that failed and restarts in place (restartPolicy OnFailure): a TrainJob's Job deletes its pods
        # at its backoff limit, and nothing else keeps the cause.
        kind = kind_of(job)
        seen = pods_cause([pod_status(pod, kind, kind.container) for pod in job_pods(target, job)]) or seen
        time.sleep(1)


def job_pods(target: Target, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's pods in node-rank order (master-0, worker-0, worker-1...; node-0, node-1...), oldest first
    among a node's pods (a Job replaces a failed pod by a new one)."""
    kind = kind_of(job)
    selector = kind.pods_selector(job["metadata"]["name"])
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


def trainer_status(pod: dict[str, Any], container: str) -> dict[str, Any]:
    """The status of the pod's trainer container ({} before it has one)."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == container), {})


def pod_status(pod: dict[str, Any], kind: JobKind, container: str) -> PodStatus:
    """A pod of a job of `kind` (or of its prepare Job); `container` is the one it reports."""
    trainer = trainer_status(pod, container)
    now = (trainer.get("state") or {}).get("terminated")
    before = (trainer.get("lastState") or {}).get("terminated")
    terminated = now or before
    if now and before and now.get("exitCode") == SIGTERM_EXIT_CODE and before.get("exitCode") != 0:
        terminated = before  # a failure, then the stop of a job that failed (restartPolicy OnFailure): the cause
    waiting = {} if terminated else not_starting(pod)
    return PodStatus(
        name=pod["metadata"]["name"],
        node=kind.pod_label(pod),
        replica_type=kind.pod_replica_type(pod),
        phase=pod.get("status", {}).get("phase", "Unknown"),
        restarts=trainer.get("restartCount", 0),
        exit_code=terminated.get("exitCode") if terminated else None,
        reason=(terminated or waiting).get("reason") or pod.get("status", {}).get("reason"),
        message=termination_cause(terminated) if terminated else waiting.get("message"),
    )


# A container's waiting reasons on its way to start, which say nothing is wrong.
STARTING = {"ContainerCreating", "PodInitializing"}


def not_starting(pod: dict[str, Any]) -> dict[str, str]:
    """Why the pod has not started, as `reason` and `message`: a container's waiting state other than being created
    (ErrImagePull, ImagePullBackOff, CreateContainerConfigError: a Secret or key it names is missing), or the
    scheduler's refusal (Unschedulable); empty while it is on its way."""
    status = pod.get("status") or {}
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") and waiting["reason"] not in STARTING:
            return {"reason": waiting["reason"], "message": waiting.get("message") or ""}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return {"reason": condition.get("reason") or "", "message": condition.get("message") or ""}
    return {}


def termination_cause(terminated: dict[str, Any] | None) -> str | None:
    """A failed container's root cause: the last line of its termination message (the chart's containers fall back
    to their log's tail, whose last line trainer.launch and trainer.prepare make the one-line root cause). None for
    a container killed by SIGKILL (the OOM killer's): its last line was not its last word."""
    if not terminated or terminated.get("exitCode") == SIGKILL_EXIT_CODE:
        return None
    lines = (terminated.get("message") or "").strip().splitlines()
    return lines[-1] if lines else None


def pods_cause(pods: list[PodStatus], stops: bool = False) -> str | None:
    """The root cause of the first of `pods` that failed (its termination message's last line), as `pod: line`; a
    pod stopped by SIGTERM counts only with `stops`."""
    failed = (p for p in pods if p.exit_code and p.message and (stops or p.exit_code != SIGTERM_EXIT_CODE))
    return next((f"{pod.name}: {pod.message.removeprefix('error: ')}" for pod in failed), None)


def failure_cause(
    pods: list[PodStatus], prepare: PrepareStatus | None, conditions: list[dict[str, Any]], quoted: str | None
) -> str:
    """Why a failed job failed, in one line: the root cause of its first failed pod by node rank, else of its
    prepare Job's, else `quoted` (of a pod that is gone: the operator's events, or what `wait` saw), else the first
    pod's stop by SIGTERM, else its Failed condition. A stop comes after the failure: master-0 stopped (143) must not
    hide worker-0's exit 2."""
    pods = [*pods, *([prepare.pod] if prepare and prepare.pod else [])]
    if cause := pods_cause(pods) or quoted or pods_cause(pods, stops=True):
        return cause
    condition = next((c for c in conditions if c["type"] == "Failed" and c["status"] == "True"), None)
    if condition:  # its message may hold lines (another controller's, a log's tail): one line here
        return f"{condition['reason']}: {one_line(condition['message'])}"
    return "no pod says why (ctl status and ctl logs show what there is)"


def quoted_cause(events: list[dict[str, Any]]) -> str | None:
    """The root cause the operator's events quote (QUOTED_TERMINATION), as `pod: line`: the first failure's, one
    other than a stop by SIGTERM where there is one (the stop follows the failure)."""
    causes = []
    for event in sorted(events, key=lambda e: e.get("lastTimestamp") or ""):
        if quoted := QUOTED_TERMINATION.match(event.get("message") or ""):
            pod, code, message = quoted.groups()
            if line := termination_cause({"exitCode": int(code), "message": message}):
                causes.append((int(code) == SIGTERM_EXIT_CODE, f"{pod}: {line.removeprefix('error: ')}"))
    return min(causes, key=lambda cause: cause[0])[1] if causes else None


def status(target: Target, name: str, seen: str | None = None) -> JobStatus:
    """The job in one stable shape, for both kinds: state, training progress (rank 0's metrics while it runs;
    for a TrainJob also what its trainer reported to Trainer v2, `trainerStatus`), conditions, replica counts,
    pods, recent events (of the job, its pods and, for a TrainJob, its JobSet and Jobs), and why it failed (`seen`:
    a pod's failure that `wait` saw, where nothing else is left to tell)."""
    job = find_job(target, name)
    kind = kind_of(job)
    pods = job_pods(target, job)
    prepare = prepare_status(target, name, kind)
    involved = {name} | {pod["metadata"]["name"] for pod in pods} | ({prepare.name} if prepare else set())
    involved |= {(pod["metadata"].get("labels") or {}).get(BATCH_JOB_NAME_LABEL) for pod in pods}
    events = [
        e
        for e in target.call(f"/api/v1/namespaces/{target.namespace}/events")["items"]
        if e["involvedObject"].get("name") in involved
    ]
    state = kind.state(job)
    conditions = [
        {k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
        for c in job.get("status", {}).get("conditions") or []
    ]
    pod_statuses = [pod_status(pod, kind, kind.container) for pod in pods]
    job_events = [e for e in events if e["involvedObject"].get("name") == name]
    return JobStatus(
        name=name,
        namespace=target.namespace,
        kind=job["kind"],
        state=state,
        progress=rank0_progress(target, job, pods),
        trainer_status=(job.get("status") or {}).get("trainerStatus"),
        prepare=prepare,
        queue=queue_status(target, job),
        conditions=conditions,
        replicas=kind.replica_counts(job),
        pods=pod_statuses,
        events=[
            {"object": f"{e['involvedObject'].get('kind', '').lower()}/{e['involvedObject'].get('name')}"}
            | {k: e.get(k) for k in ("type", "reason", "message", "lastTimestamp")}
            for e in sorted(events, key=lambda e: e.get("lastTimestamp") or "")[-EVENTS_SHOWN:]
        ],
        cause=(
            failure_cause(pod_statuses, prepare, conditions, quoted_cause(job_events) or seen)
            if state == State.FAILED
            else None
        ),
    )


def prepare_status(target: Target, name: str, kind: JobKind) -> PrepareStatus | None:
    """The job's prepare Job: Pending, Running, Succeeded or Failed, why it failed (its Failed condition) and its
    newest pod (exit code 137: killed, as by the OOM killer; 2: bad data, its message the line naming the file).
    None without one."""
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
    return PrepareStatus(
        name=job["metadata"]["name"],
        state=prepare_state(job),
        reason=failed.get("reason"),
        message=failed.get("message"),
        pod=None if newest is None else pod_status(newest, kind, container["name"]),
    )


@dataclass(frozen=True)
class Queued:
    """A job of queue.kueue: its LocalQueue, and its Workload as read (None, and why, where there is none to read)."""

    local_queue: str
    workload: dict[str, Any] | None
    missing: str | None = None


def queued_workload(target: Target, job: dict[str, Any]) -> Queued | None:
    """The job's Kueue Workload, found by the job's uid: None for a job without a LocalQueue."""
    local_queue = (job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    if not local_queue:
        return None
    selector = f"{KUEUE_JOB_UID_LABEL}={job['metadata']['uid']}"
    try:
        path = KUEUE_WORKLOADS.format(namespace=target.namespace)
        workloads = target.call(path, query_params=[("labelSelector", selector)])["items"]
    except NotFound:  # the label alone holds nothing back
        return Queued(local_queue, None, "the cluster serves no Kueue Workloads: is Kueue installed?")
    except ClusterError as error:  # e.g. a Role without Kueue's read rights (k8s/rbac.yaml has them)
        return Queued(local_queue, None, f"its Kueue Workload cannot be read: {error}")
    if not workloads:
        return Queued(local_queue, None, "Kueue has not made its Workload yet")
    return Queued(local_queue, workloads[0])


def queue_status(target: Target, job: dict[str, Any]) -> QueueStatus | None:
    """Kueue's hold on the job, from its Workload: None for a job without a LocalQueue."""
    queued = queued_workload(target, job)
    if queued is None:
        return None
    workload = queued.workload
    if workload is None:
        return QueueStatus(queued.local_queue, None, False, queued.missing)
    status = workload.get("status") or {}
    conditions = workload_conditions(workload)
    pending = why_pending(target, job, workload, conditions)
    admitted = pending is None
    budget = workload["spec"].get("maximumExecutionTimeSeconds")
    used = status.get("accumulatedPastExecutionTimeSeconds") or 0
    if budget and admitted:  # the current admission too, which Kueue adds to the past ones when it ends
        since = datetime.now(timezone.utc) - timestamp(conditions["Admitted"]["lastTransitionTime"])
        used += max(0, int(since.total_seconds()))
    return QueueStatus(
        queued.local_queue, workload["metadata"]["name"], admitted, pending, budget, used if budget else None
    )


def workload_conditions(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (workload.get("status") or {}).get("conditions") or []}


def why_pending(
    target: Target, job: dict[str, Any], workload: dict[str, Any], conditions: dict[str, dict[str, Any]]
) -> str | None:
    """Why Kueue does not admit the job's Workload; None when it does."""
    if workload["spec"].get("active") is False:  # Kueue's words for it are its eviction's, not what to do
        if why := kueue_deactivation(workload):
            return deactivated_by_kueue(why, target.namespace)
        name = job["metadata"]["name"]
        return f"its Workload is inactive (`ctl resume {name} -n {target.namespace}` activates it)"
    if conditions.get("Admitted", {}).get("status") == "True":
        return None
    # Quota first: a Workload waits for it, then for its admission checks (if the ClusterQueue has any).
    held = [c for c in (conditions.get("QuotaReserved"), conditions.get("Admitted")) if c and c["status"] == "False"]
    return held[0]["message"] if held else "waiting for Kueue to consider it"


def timestamp(text: str) -> datetime:
    """An API server's time (RFC 3339, `Z` for UTC), which Python before 3.11 does not read as it is."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def kueue_deactivation(workload: dict[str, Any]) -> str | None:
    """Why Kueue itself deactivated the Workload (queue.kueueMaxExecutionSeconds spent, its requeuing limit, a
    rejected admission check), in its words: its DeactivationTarget condition's, which its eviction message quotes.
    None when the Workload is active or was deactivated by hand (`ctl suspend`). Kueue (v0.17) keeps that condition
    after the eviction, and deactivates the Workload again as soon as it is activated."""
    target = workload_conditions(workload).get("DeactivationTarget", {})
    if workload["spec"].get("active") is not False or target.get("status") != "True":
        return None
    return f"due to {target.get('message') or target.get('reason')}"


def deactivated_by_kueue(why: str, namespace: str) -> str:
    return (
        f"Kueue deactivated its Workload {why}, and would again if activated: `ctl submit SPEC --replace -n"
        f" {namespace}` makes the job anew, which goes on from its checkpoint"
    )


def rank0_progress(target: Target, job: dict[str, Any], pods: list[dict[str, Any]]) -> Progress | None:
    """Progress from node 0's pod (where rank 0 runs; its newest) while the job runs."""
    kind = kind_of(job)
    labels = kind.node_labels(job)
    rank0 = [p for p in pods if labels and kind.pod_label(p) == labels[0]]
    return progress(target, rank0[-1]) if rank0 and not finished(job) else None


def list_jobs(target: Target, all_namespaces: bool) -> list[JobRow]:
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
        kind, state = kind_of(job), kind_of(job).state(job)
        running = state in (State.RUNNING, State.RESTARTING)
        created = timestamp(job["metadata"]["creationTimestamp"])
        rows.append(
            JobRow(
                name=job["metadata"]["name"],
                namespace=job["metadata"]["namespace"],
                kind=job["kind"],
                state=state,
                nodes=kind.nodes(job),
                procs_per_node=kind.procs_value(job),
                age_seconds=int((datetime.now(timezone.utc) - created).total_seconds()),
                progress=rank0_progress(in_namespace, job, job_pods(in_namespace, job)) if running else None,
            )
        )
    return rows
