"""Submitting and deleting a job: the rendered objects applied in install order once the cluster can run them (the
operator installed, a claim its storage class can give), the prepare Job an earlier submit left, and everything
rendered with the job on deletion."""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from typing import Any

from ctl import storage
from ctl.cluster import (
    ClusterError,
    JobNotFound,
    NotFound,
    Target,
    apply,
    exists,
    find_job,
    require_operator,
    resource_path,
)
from ctl.kinds import DEFAULT_KIND, KINDS, TRAINJOB, JobKind, State, kind_of
from ctl.kinds.trainjob import RUNTIME_PLURAL
from ctl.names import COMPONENT_LABEL, INSTANCE_LABEL, PREPARE_COMPONENT

# Longer than the chart's default terminationGracePeriodSeconds (120 s): a foreground deletion outlasts the pods'.
DELETE_WAIT_S = 300
# The training objects rendered with a TrainJob, deleted with it (selected by the chart's instance label).
TRAINING_RUNTIMES = (f"/apis/{TRAINJOB.api_version}", RUNTIME_PLURAL)
# How long a job is applied again while a webhook has not yet seen the runtime applied before it.
RUNTIME_SEEN_WAIT_S = 30
# How the webhooks that look a TrainJob's runtime up in their informer caches deny it while the cache lags: Trainer
# v2's (the API's NotFound of the TrainingRuntime) and, on a cluster with Kueue, Kueue's (its TrainJob integration).
RUNTIME_UNSEEN = ('"{runtime}" not found', "runtime '{runtime}' not found")
# The letters at the end of a recreated object's name that its dry run draws anew (26^5 names to find a free one).
STAND_IN_LETTERS = 5


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
        if not exists(target, api.path(target.namespace, name)):
            selector = [("labelSelector", api.pods_selector(name))]
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
) -> None:
    """Apply the rendered objects in install order (volume claim, config and a TrainJob's runtime before the job),
    once the cluster is known to run them: the operator installed, a claim its storage class can give
    (ctl.storage), and every object through the server's dry run."""
    (job,) = [obj for obj in objects if obj["kind"] in KINDS]
    api = kind_of(job)
    require_operator(target, api)
    name = job["metadata"]["name"]
    if other := next((kind for kind in KINDS.values() if kind is not api and other_job(target, kind, name)), None):
        raise ClusterError(
            f"{other.kind.lower()} {name} already exists in namespace {target.namespace}, and this spec is a"
            f" {api.kind}: the two would share its config and run directory; delete it first (ctl delete {name})"
        )
    existing = exists(target, api.path(target.namespace, name))
    if existing and not replace:
        raise ClusterError(
            f"{api.kind.lower()} {name} already exists in namespace {target.namespace}:"
            " --replace deletes and recreates it (the run directory and its checkpoints stay)"
        )
    if (message := check_claim(target, objects)) and note:
        note(message)
    # Objects deleted before they are applied: their dry run checks a creation (`stand_in`).
    stale = stale_prepare_jobs(target, name, replace) if any(obj["kind"] == "Job" for obj in objects) else []
    old = {("Job", obj["metadata"]["name"]) for obj in stale} | ({(job["kind"], name)} if existing else set())
    recreated = [obj for obj in objects if (obj["kind"], obj["metadata"]["name"]) in old]
    # The server's dry run of every object first, so that one it refuses (its RBAC, a webhook, a field its schema
    # lacks) leaves nothing created or deleted: not the claim and config of a job that never comes, nor, under
    # --replace, the end of the job it was to replace.
    dry_run_all(target, objects, job, recreated, note if dry_run else None)
    if dry_run:
        return
    if existing:
        delete_job(target, name, foreground=True, api=api)
    delete_prepare_jobs(target, stale)
    for obj in objects:
        if obj is not job:
            apply(target, obj)
    apply_job(target, job)


def other_job(target: Target, kind: JobKind, name: str) -> bool:
    """Whether a job of another kind has the name: the cluster serves that kind, and this user may read it (a Role
    for one kind alone cannot tell)."""
    try:
        return exists(target, kind.path(target.namespace, name))
    except ClusterError:  # forbidden
        return False


def dry_run_all(
    target: Target,
    objects: list[dict[str, Any]],
    job: dict[str, Any],
    recreated: list[dict[str, Any]],
    note: Callable[[str], None] | None,
) -> None:
    """The objects through the server's dry run (admission, validation, RBAC), in install order, those `recreated`
    under a name nothing has (`stand_in`). A TrainJob whose runtime does not exist yet is not sent: Trainer v2's
    webhook looks the runtime up, and a dry run creates none (a note says so)."""
    runtime = kind_of(job).runtime_name(job)
    waiting = runtime is not None and not runtime_exists(target, runtime)
    if waiting and note:
        note(
            f"note: not sent to the server's dry run: {job['kind'].lower()}/{job['metadata']['name']}"
            " (Trainer v2's webhook checks a TrainJob against its runtime, which a dry run does not create)"
        )
    for obj in objects:
        if obj is not job:
            dry_run(target, obj, obj in recreated)
    if not waiting:
        dry_run(target, job, job in recreated, apply_job)


def dry_run(target: Target, obj: dict[str, Any], recreated: bool, send: Callable[..., object] = apply) -> None:
    """The object through the server's dry run, as `send` applies it; one that is recreated under a stand-in name,
    which its refusal names beside its own."""
    if not recreated:
        send(target, obj, dry_run=True)
        return
    sent = stand_in(target, obj)
    try:
        send(target, sent, dry_run=True)
    except ClusterError as error:
        as_new = (
            f"{obj['kind'].lower()} {obj['metadata']['name']}, checked as a new one named {sent['metadata']['name']}"
        )
        raise ClusterError(f"{as_new}: {error}") from None


def stand_in(target: Target, obj: dict[str, Any]) -> dict[str, Any]:
    """The object under a name of the same length (names derived from it keep their lengths and limits) that no
    object of its kind has: the dry run of an object that is deleted and then created again. Under its own name the
    dry run would check a change to the old object, refusing what a creation allows (a Job's pod template and a
    TrainJob's trainer are immutable) and missing the right to create."""
    name = obj["metadata"]["name"]
    kept = name[: max(len(name) - STAND_IN_LETTERS, 0)]  # a DNS label's first character is a letter: kept or drawn
    while True:
        drawn = "".join(random.choices(string.ascii_lowercase, k=len(name) - len(kept)))
        candidate = obj | {"metadata": obj["metadata"] | {"name": kept + drawn}}
        if not exists(target, resource_path(target, candidate)):
            return candidate


def apply_job(target: Target, job: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
    """Apply the job, its runtime (if its kind has one) applied already. Trainer v2's webhook (and Kueue's) looks the
    runtime up in its informer cache, which can lag the API server by a moment: while one denies the job for a
    runtime the API server has, the job is applied again, for up to RUNTIME_SEEN_WAIT_S."""
    runtime = kind_of(job).runtime_name(job)
    deadline = time.monotonic() + RUNTIME_SEEN_WAIT_S
    while True:
        try:
            return apply(target, job, dry_run=dry_run)
        except ClusterError as error:
            unseen = runtime is not None and runtime_unseen(str(error), runtime) and runtime_exists(target, runtime)
            if not unseen or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def runtime_unseen(denial: str, runtime: str) -> bool:
    """Whether a webhook denied a TrainJob because it did not find its runtime (RUNTIME_UNSEEN)."""
    return any(form.format(runtime=runtime) in denial for form in RUNTIME_UNSEEN)


def stale_prepare_jobs(target: Target, name: str, replace: bool) -> list[dict[str, Any]]:
    """The prepare Jobs an earlier submit of this name left that go first: a finished Job never runs again (nor can
    its pod template change), so the new one would never prepare; a running one only when --replace replaces it."""
    return [job for job in prepare_jobs(target, name) if replace or prepare_state(job).terminal]


def delete_prepare_jobs(target: Target, jobs: list[dict[str, Any]]) -> None:
    for job in jobs:
        path = f"/apis/batch/v1/namespaces/{target.namespace}/jobs/{job['metadata']['name']}"
        target.call(path, "DELETE", body={"propagationPolicy": "Background"})
        deadline = time.monotonic() + DELETE_WAIT_S
        while exists(target, path):
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job['metadata']['name']} still exists {DELETE_WAIT_S} s after its deletion")
            time.sleep(0.5)


def prepare_jobs(target: Target, name: str) -> list[dict[str, Any]]:
    """The job's prepare Job, by the labels helm/ddpjob/templates/prepare-job.yaml gives it (none, or one)."""
    selector = f"{INSTANCE_LABEL}={name},{COMPONENT_LABEL}={PREPARE_COMPONENT}"
    jobs = f"/apis/batch/v1/namespaces/{target.namespace}/jobs"
    return target.call(jobs, query_params=[("labelSelector", selector)])["items"]


def prepare_state(job: dict[str, Any]) -> State:
    """A batch Job's state in ctl's words: Pending, Running, Succeeded (Complete) or Failed."""
    status = job.get("status") or {}
    true = {c["type"] for c in status.get("conditions") or [] if c.get("status") == "True"}
    state = State.RUNNING if status.get("active") else State.PENDING
    return State.SUCCEEDED if "Complete" in true else State.FAILED if "Failed" in true else state


def runtime_exists(target: Target, name: str) -> bool:
    base, plural = TRAINING_RUNTIMES
    return exists(target, f"{base}/namespaces/{target.namespace}/{plural}/{name}")


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


CLAIMS = ("/api/v1", "persistentvolumeclaims")


def delete(target: Target, name: str, purge: bool) -> list[str]:
    """The job, and the objects rendered with it (config, monitoring, a TrainJob's runtime); its claim only with
    `purge`, which also deletes the claim that a deletion without it left (the job then gone: JobNotFound only when
    no such claim is left either)."""
    try:
        api = kind_of(find_job(target, name))
    except JobNotFound:
        if purge and (removed := delete_labelled(target, name, [CLAIMS])):
            return removed
        raise
    delete_job(target, name, api=api)
    kinds = [("/api/v1", "configmaps"), ("/api/v1", "serviceaccounts")]
    kinds += [("/apis/monitoring.coreos.com/v1", "podmonitors"), ("/apis/monitoring.coreos.com/v1", "prometheusrules")]
    kinds.append(("/apis/networking.k8s.io/v1", "networkpolicies"))
    kinds.append(("/apis/batch/v1", "jobs"))  # prepare.enabled: the prepare Job
    kinds.append(TRAINING_RUNTIMES)
    if purge:
        kinds.append(CLAIMS)
    return [f"{api.kind.lower()}/{name}", *delete_labelled(target, name, kinds)]


def labelled(target: Target, name: str, base: str, plural: str) -> list[dict[str, Any]]:
    """The objects of a kind (API base, plural) that the chart labelled as the job `name`'s, but those being deleted
    already (a claim a pod still mounts)."""
    collection = f"{base}/namespaces/{target.namespace}/{plural}"
    try:
        items = target.call(collection, query_params=[("labelSelector", f"{INSTANCE_LABEL}={name}")])["items"]
    except NotFound:  # e.g. no prometheus-operator CRDs in this cluster
        return []
    return [item for item in items if not item["metadata"].get("deletionTimestamp")]


def delete_labelled(target: Target, name: str, kinds: list[tuple[str, str]]) -> list[str]:
    """Delete the objects of `kinds` (API base, plural) that the chart labelled as the job `name`'s; what was deleted,
    as `kind/name`."""
    removed = []
    for base, plural in kinds:
        collection = f"{base}/namespaces/{target.namespace}/{plural}"
        for item in labelled(target, name, base, plural):
            # Background: a batch Job's default is still to orphan its pods (the prepare Job's would live on).
            target.call(f"{collection}/{item['metadata']['name']}", "DELETE", body={"propagationPolicy": "Background"})
            singular = plural.removesuffix("ies") + "y" if plural.endswith("ies") else plural.removesuffix("s")
            removed.append(f"{singular}/{item['metadata']['name']}")
    return removed
