"""The control-plane tier: the chart's objects against a real kube-apiserver with the real PyTorchJob, TrainJob and
JobSet CRDs, and jobs reconciled by the real Kubeflow training operator (v1.9) or Kubeflow Trainer v2 (v2.3, on
JobSet v0.12 and the Job controller), their pods scheduled by kube-scheduler and run by a real kubelet in containers
of the project's image (tests/e2e/node.py).

With DDPJOB_E2E_KUBECONFIG set, the same tests run against that cluster (kind or any cluster with the operator
v1.9, Trainer v2.3, JobSet and Kueue installed) instead; DDPJOB_E2E_IMAGE names the training image its nodes can pull
(default: the chart's, ddpjob:<appVersion>).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import controlplane
import kubernetes
import node
import pytest
import yaml
from certs import private_ca
from cluster_binaries import BuildError, build_helm, ensure_binaries
from conftest import CTL, MARKER_ENV, REPO, processes_with_marker, run_ctl, start_ctl, tiny_spec, wait_for
from node import NODE_NAME, POD_CIDR
from pod_security import violations
from s3server import s3_server

from ctl import jobs as ctl_jobs
from ctl import kinds as job_kinds
from ctl.cluster import ClusterError, Target, apply
from ctl.jobs import RUNTIME_SEEN_WAIT_S, apply_job
from ctl.kinds import JobKind
from ctl.kinds.pytorchjob import REPLICA_TYPE_LABEL
from ctl.kinds.trainjob import RUNTIME_PLURAL
from ctl.names import COMPILE_CACHE_DIR, COMPILE_CACHES, EXIT_JOB_FAILED, EXIT_NOT_FINISHED, EXIT_NOT_FOUND
from ctl.operator_env import Replica, operator_env, replicas
from ctl.processes import parent_pid
from ctl.render import render
from ctl.spec import JobSpec, load_spec, with_keys
from trainer.location import S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV
from trainer.names import EXIT_BAD_INPUT, EXIT_HUNG, SLOW_RANK_ENV
from trainer.spec import SpecError

pytestmark = pytest.mark.e2e

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
EXTERNAL_KUBECONFIG = os.environ.get("DDPJOB_E2E_KUBECONFIG", "")
CHART_IMAGE = f"ddpjob:{yaml.safe_load((REPO / 'helm' / 'ddpjob' / 'Chart.yaml').read_text())['appVersion']}"
IMAGE = os.environ.get("DDPJOB_E2E_IMAGE", CHART_IMAGE)
JOB_TIMEOUT_S = 400
# A job that trains long enough to be stopped midway, saving every 50 steps.
LONG_TRAINING = {"maxSteps": 600, "logEvery": 20, "checkpoint": {"every": 50}}
POD_EXIT_S = 60  # a pod's processes end within its grace period
POD_GONE_S = 30  # the operator replaces a pod it deleted within seconds; one gone this long is gone for good
# Real text that is in the image as much as on this machine: the standard library's json package.
STDLIB_TEXT = ["{stdlib}/json/*.py"]


@dataclass
class Cluster:
    kubeconfig: Path
    plane: controlplane.ControlPlane | None  # None: an external cluster (its own kubelets run the pods)
    kubectl: str | None  # the tier's own build; on an external cluster, the one on PATH (if any)

    def client(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))


@dataclass(frozen=True)
class Kind:
    """What a user sees differ between the two job APIs: the resource, the pods' names within the job (node 0
    first), the replicas' names, and what `ctl delete` removes with the job."""

    api: JobKind  # the resource (ctl/kinds)
    nodes: tuple[str, str]
    replicas: frozenset[str]
    rendered: tuple[str, ...]  # of `{name}`

    @property
    def resource(self) -> str:
        return f"{self.api.kind.lower()}.{self.api.group}"

    def get(self, cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
        api = kubernetes.client.CustomObjectsApi(cluster.client())
        return api.get_namespaced_custom_object(self.api.group, self.api.version, namespace, self.api.plural, name)


PYTORCHJOB = Kind(
    job_kinds.PYTORCHJOB, ("master-0", "worker-0"), frozenset({"Master", "Worker"}),
    ("configmap/{name}-training",),
)  # fmt: skip
TRAINJOB = Kind(
    job_kinds.TRAINJOB, ("node-0", "node-1"), frozenset({"node"}),
    ("configmap/{name}-training", "trainingruntime/{name}"),
)  # fmt: skip
KINDS = [pytest.param(PYTORCHJOB, id="PyTorchJob"), pytest.param(TRAINJOB, id="TrainJob")]
V1 = job_kinds.PYTORCHJOB  # what the tests of the operator v1 alone use


# Module scope: the control plane stops when this tier is done, not at the end of the whole suite.
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if EXTERNAL_KUBECONFIG:
        yield Cluster(Path(EXTERNAL_KUBECONFIG), None, shutil.which("kubectl"))
        return
    before = node.machine_state()
    try:
        binaries = ensure_binaries()
        plane = controlplane.start(tmp_path_factory.mktemp("control-plane"), binaries)
    except BuildError as error:
        pytest.fail(f"the control plane's binaries could not be built: {error}", pytrace=False)
    try:
        yield Cluster(plane.kubeconfig, plane, str(binaries.kubectl))
    finally:
        plane.stop()
    # The node restored this machine: no process, cgroup, link, route or mount of it is left, and what it changes
    # in its own namespaces (iptables chains, IP forwarding) never reached this machine's.
    assert node.leftovers(before) == []


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    client = cluster.client()
    controlplane.ensure_namespace(client, name)
    yield name
    # The namespace controller empties and removes it meanwhile (the test may have done so already).
    try:
        kubernetes.client.CoreV1Api(client).delete_namespace(name)
    except kubernetes.client.ApiException as error:
        if error.status != 404:
            raise


@pytest.fixture
def shipped_namespace(cluster: Cluster) -> Iterator[str]:
    """k8s/namespace.yaml as shipped: Pod Security admission enforcing "restricted" (the API server's PodSecurity
    plugin is on by default). Its pods are admitted only when every container, the operator's included, meets it."""
    manifest = yaml.safe_load((REPO / "k8s" / "namespace.yaml").read_text())
    assert manifest["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    name = manifest["metadata"]["name"]
    client = cluster.client()
    core = kubernetes.client.CoreV1Api(client)
    existed = name in {n.metadata.name for n in core.list_namespace().items}  # an external cluster's: kept
    controlplane.ensure_namespace(client, name)
    controlplane.server_side_apply(client, manifest)  # after: its apply of the bare namespace would drop the labels
    yield name
    if existed:
        return
    try:
        core.delete_namespace(name)
    except kubernetes.client.ApiException as error:
        if error.status != 404:
            raise


def apply_rendered(cluster: Cluster, spec: JobSpec, namespace: str, dry_run: bool = False) -> list[Any]:
    client = cluster.client()
    return [
        controlplane.server_side_apply(client, in_namespace(m.obj, namespace), dry_run)
        for m in render(spec, namespace=namespace)
    ]


def in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    return obj | {"metadata": obj["metadata"] | {"namespace": namespace}}


def job_spec(
    marker: str,
    train: list[str] = STDLIB_TEXT,
    training: dict[str, Any] | None = None,
    env: list[dict[str, str]] | None = None,
    **values: Any,
) -> JobSpec:
    """The tiny char-gpt job on 2 pods x 1 process; every process carries DDPJOB_TEST_MARKER=marker, to find
    what a job left running (containers' processes are this machine's too), and `env` after it. Its requests fit
    the tier's 2-CPU node, or a small kind node (the defaults are sized for GPU training)."""
    spec = tiny_spec(Path("unused"), data={"train": train, "valFraction": 0.1}, **(training or {}))
    spec |= {
        "nodes": 2,
        "image": image_values(),
        # A quarter CPU: two jobs, a prepare Job and pods still ending fit the tier's node (CPU is not limited).
        "resources": {"cpu": "250m", "memory": "1Gi", "shm": "256Mi", "cache": "1Gi"},
        "env": [{"name": MARKER_ENV, "value": marker}, *(env or [])],
    }
    return JobSpec.model_validate(spec | values)


def assert_no_process_left(cluster: Cluster, marker: str) -> None:
    """Finished or deleted pods leave no process behind (the runtime ends each container's processes)."""
    if cluster.plane is None:
        return
    deadline = time.monotonic() + 60
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {
        pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in processes_with_marker(marker)
    }
    assert left == {}


def image_values() -> dict[str, str]:
    repository, _, tag = IMAGE.rpartition(":")
    return {"repository": repository, "tag": tag}


def wait_for_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """The PyTorchJob once it has a true Succeeded or Failed condition."""
    api = kubernetes.client.CustomObjectsApi(cluster.client())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        job = api.get_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural, name)
        conditions = {c["type"]: c for c in job.get("status", {}).get("conditions", []) if c["status"] == "True"}
        if "Succeeded" in conditions or "Failed" in conditions:
            return job
        time.sleep(1)
    raise AssertionError(
        f"{name} did not finish in {JOB_TIMEOUT_S} s: {job.get('status')}\n{pod_logs(cluster, namespace)}"
    )


def finished_as(job: dict[str, Any]) -> str:
    return next(
        c["type"] for c in job["status"]["conditions"] if c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
    )


def pods_of(cluster: Cluster, namespace: str, job: str) -> dict[str, kubernetes.client.V1Pod]:
    selector = f"training.kubeflow.org/job-name={job}"
    pods = kubernetes.client.CoreV1Api(cluster.client()).list_namespaced_pod(namespace, label_selector=selector)
    return {p.metadata.name: p for p in pods.items}


def ended_pods(cluster: Cluster, namespace: str, job: str) -> dict[str, kubernetes.client.V1Pod]:
    """The job's pods once none runs: the operator calls a PyTorchJob Succeeded as soon as its master is, while a
    worker may still be exiting."""
    deadline = time.monotonic() + POD_EXIT_S
    while True:
        pods = pods_of(cluster, namespace, job)
        if all(p.status.phase in ("Succeeded", "Failed") for p in pods.values()) or time.monotonic() > deadline:
            return pods
        time.sleep(0.5)


def pod_logs(cluster: Cluster, namespace: str) -> str:
    """The output of every pod's containers in the namespace (pods/log), a restarted container's previous run's
    first."""
    core = kubernetes.client.CoreV1Api(cluster.client())
    logs = []
    for pod in core.list_namespaced_pod(namespace).items:
        restarted = {s.name for s in pod.status.container_statuses or [] if s.restart_count}
        for container in [c.name for c in pod.spec.containers]:
            for previous in (True, False) if container in restarted else (False,):
                try:
                    log = core.read_namespaced_pod_log(
                        pod.metadata.name, namespace, container=container, previous=previous
                    )
                except kubernetes.client.ApiException as error:  # not started, or gone meanwhile
                    log = f"({error.status}: {error.reason})"
                logs.append(f"--- {pod.metadata.name} {container}{' (previous)' if previous else ''}\n{log}")
    return "\n".join(logs)


def client_dict(obj: Any) -> dict[str, Any]:
    """A kubernetes client model as the API's JSON (camelCase keys)."""
    return kubernetes.client.ApiClient().sanitize_for_serialization(obj)


def container_env(pod: kubernetes.client.V1Pod) -> dict[str, str]:
    (container,) = [c for c in pod.spec.containers if c.name == V1.container]
    return {e.name: e.value for e in container.env or [] if e.value is not None}


def terminated(pod: kubernetes.client.V1Pod) -> kubernetes.client.V1ContainerStateTerminated:
    (status,) = [s for s in pod.status.container_statuses if s.name == V1.container]
    return status.state.terminated


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_examples_are_accepted_by_the_api_server(cluster: Cluster, namespace: str, example: Path) -> None:
    """Every object the chart renders passes the API server's own validation (server-side dry run), the job
    against the installed CRD's structural schema and, for a TrainJob, Trainer v2's webhooks (the TrainingRuntime
    is created first: the TrainJob's webhook checks the job against it)."""
    spec = load_spec(example)
    kind = PYTORCHJOB if spec.api_kind == "PyTorchJob" else TRAINJOB
    client = cluster.client()
    manifests = [m.obj | {"metadata": m.obj["metadata"] | {"namespace": namespace}} for m in render(spec, namespace)]
    runtimes = [obj for obj in manifests if obj["kind"] == "TrainingRuntime"]
    for runtime in runtimes:
        controlplane.server_side_apply(client, runtime)
    applied = [controlplane.server_side_apply(client, obj, dry_run=True) for obj in manifests if obj not in runtimes]
    kinds = {obj["kind"] for obj in applied}
    assert kind.api.kind in kinds and "ConfigMap" in kinds
    jobs = kubernetes.client.CustomObjectsApi(client)
    listed = jobs.list_namespaced_custom_object(kind.api.group, kind.api.version, namespace, kind.api.plural)
    assert listed["items"] == []


def test_kubectl_server_side_apply_accepts_the_rendered_examples(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """What k8s/README.md tells users to run: `kubectl apply --server-side -f k8s/examples/...` (a server dry run);
    for the TrainJob example for real, as it must be (a dry run creates no runtime for the TrainJob's webhook to
    check it against), suspended: Trainer v2 reconciles it (its Suspended condition) and nothing runs."""
    if cluster.kubectl is None:
        pytest.skip("no kubectl binary on PATH (the same objects are applied through the API in the test above)")

    def kubectl(*args: str) -> subprocess.CompletedProcess:
        command = [cluster.kubectl, "--kubeconfig", str(cluster.kubeconfig), *args, "-n", namespace]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    for example in EXAMPLES:
        kind = PYTORCHJOB if load_spec(example).api_kind == "PyTorchJob" else TRAINJOB
        manifest = REPO / "k8s" / "examples" / example.name
        dry_run = ["--dry-run=server"] if kind is PYTORCHJOB else []
        if kind is TRAINJOB:  # `ctl render` output, suspended
            rendered = run_ctl("render", str(example), "--set", "runPolicy.suspend=true", cwd=REPO)
            assert rendered.returncode == 0, rendered.stderr
            manifest = tmp_path / example.name
            manifest.write_text(rendered.stdout)
        command = ("apply", "--server-side", *dry_run, "-f", str(manifest))
        result = kubectl(*command)
        if kind is TRAINJOB and "not found" in result.stderr:  # as docs/trainer-v2.md says: the webhook lagged
            result = kubectl(*command)
        assert result.returncode == 0, f"{manifest.name}: {result.stderr}"
        assert f"{kind.resource}/" in result.stdout and ("(server dry run)" in result.stdout) == bool(dry_run)
        if kind is TRAINJOB:
            name = load_spec(example).name
            deadline = time.monotonic() + 60
            while "Suspended" not in conditions(kind.get(cluster, namespace, name)):
                assert time.monotonic() < deadline, kind.get(cluster, namespace, name)
                time.sleep(0.5)


def conditions(job: dict[str, Any]) -> set[str]:
    """The job's true conditions."""
    return {c["type"] for c in (job.get("status") or {}).get("conditions") or [] if c["status"] == "True"}


# Values on both sides of Kubernetes' rules for the names and labels the spec checks (ctl.api_rules: OBJECT_NAME,
# LABEL_KEY, ANNOTATION_KEY, PREFIX_TOO_LONG, LABEL_VALUE).
NAMES = ["runs", "shared.runs-1", "0", "true", "Shared_Runs", " runs", "runs-", "-runs", "a..b", "a" * 253, "a" * 254]
LABEL_VALUES = ["ml", "ML_team.1", "0", "", "a b", "-ml", "ml.", "x" * 63, "x" * 64]
# The spec refuses more mount paths than the API server: a relative one (the kubelet mounts `runs` at /runs, and the
# run directory would be runs/<name> under the working directory), / and a pod's own mount with a trailing /.
SIZES = ["1Gi", "1", "1.5Gi", "0", "0Gi", "0.0Mi"]  # a claim's: more than nothing
MOUNT_PATHS = ["/checkpoints", "/tmp/runs", "/tmp", "/dev/shm", "/home/ddpjob"]
KEYS = ["team", "example.com/team", "a.b/c_d", "Example.com/team", "example.com/", "/team", "a/b/c", "x" * 64, "a b"]
KEYS += [f"{'a' * 253}/team", f"{'a' * 254}/team"]  # the longest prefix, and one character more


def node_affinity(requirement: dict[str, Any]) -> dict[str, Any]:
    terms = [{"matchExpressions": [requirement]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def pod_anti_affinity(selector: dict[str, Any]) -> dict[str, Any]:
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": selector}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


SECRET_KEY = {"secretKeyRef": {"name": "s", "key": "k"}}
# Values in Kubernetes form on both sides of the API's rules that the spec checks (ctl.api_rules.RULES).
IN_KUBERNETES_FORM: list[tuple[str, Any]] = [
    ("tolerations", [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]),
    ("tolerations", [{"operator": "Exists"}]),
    ("tolerations", [{"key": "gpu", "value": "a100"}]),
    ("tolerations", [{"key": "gpu", "operator": "Equals"}]),
    ("tolerations", [{"effect": "NoSchedule"}]),
    ("tolerations", [{"key": "gpu", "operator": "Exists", "value": "a100"}]),
    ("tolerations", [{"key": "gpu", "value": "a 100"}]),
    ("tolerations", [{"key": "gpu type"}]),
    ("tolerations", [{"key": "gpu", "effect": "NoRun"}]),
    ("tolerations", [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 5}]),
    ("tolerations", [{"key": "gpu", "effect": "NoExecute", "tolerationSeconds": 5}]),
    ("env", [{"name": "A", "value": "x", "valueFrom": SECRET_KEY}]),
    ("env", [{"name": "A", "valueFrom": {}}]),
    ("env", [{"name": "A", "valueFrom": SECRET_KEY | {"configMapKeyRef": {"name": "c", "key": "k"}}}]),
    ("env", [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}]),
    ("env", [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "a b"}}}]),
    ("env", [{"name": "A", "valueFrom": {"configMapKeyRef": {"key": "k"}}}]),
    ("env", [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
    ("envFrom", [{}]),
    ("envFrom", [{"prefix": "X_", "secretRef": {"name": "s"}}]),
    ("envFrom", [{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}]),
    ("envFrom", [{"secretRef": {"name": "Bad_Name"}}]),
    ("envFrom", [{"configMapRef": {}}]),
    ("affinity", node_affinity({"key": "zone", "operator": "In", "values": ["a"]})),
    ("affinity", node_affinity({"key": "zone", "operator": "In"})),
    ("affinity", node_affinity({"key": "zone", "operator": "Exists", "values": ["a"]})),
    ("affinity", node_affinity({"key": "zone", "operator": "Bogus", "values": ["a"]})),
    ("affinity", node_affinity({"key": "zone", "operator": "Gt", "values": ["1", "2"]})),
    ("affinity", node_affinity({"key": "zone", "operator": "Lt", "values": ["4"]})),
    ("affinity", node_affinity({"key": "zone type", "operator": "Exists"})),
    ("affinity", pod_anti_affinity({"matchLabels": {"app": "x"}})),
    ("affinity", pod_anti_affinity({"matchLabels": {"app": "a b"}})),
    ("affinity", pod_anti_affinity({"matchLabels": {"app x": "a"}})),
    ("affinity", pod_anti_affinity({"matchExpressions": [{"key": "app", "operator": "NotIn"}]})),
    ("affinity", pod_anti_affinity({"matchExpressions": [{"key": "app", "operator": "In", "values": ["a b"]}]})),
    ("affinity", pod_anti_affinity({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]})),
]


def in_pod(pod: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """The pod with a value in Kubernetes form where the chart puts that spec key's."""
    container = pod["spec"]["containers"][0]
    if key == "env":
        container.setdefault("env", []).extend(value)
    elif key == "envFrom":
        container["envFrom"] = value
    else:
        pod["spec"][key] = value
    return pod


def claim(name: str, storage_class: str = "standard", size: str = "1Gi") -> dict[str, Any]:
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name}, "spec": spec}


# The spec's mappings that the pods carry as they are: (key, where in the pod, whether its values are label values).
MAPPINGS = [
    ("podLabels", ("metadata", "labels"), True),
    ("podAnnotations", ("metadata", "annotations"), False),
    ("nodeSelector", ("spec", "nodeSelector"), True),
]
Make = Callable[[dict[str, Any]], dict[str, Any]]  # the chart's pod -> the object carrying the value


def placed_values() -> Iterator[tuple[str, dict[str, Any], Make]]:
    """(the value, the spec's keys setting it, the object the API server checks it in) for every value of NAMES,
    SIZES, MOUNT_PATHS, KEYS and LABEL_VALUES where the spec has it: a claim, ServiceAccount and PriorityClass of each
    name, a claim of each storage class and size (a pod may name any claim, and waits for ever for one no claim can
    be), the pod naming each as its Secret and its scheduler, mounting the run volume at each path, carrying each
    label, annotation and node selector, and taking each value in Kubernetes form (IN_KUBERNETES_FORM)."""
    for name in NAMES:
        yield f"existingClaim {name!r}", {"storage": {"existingClaim": name}}, lambda pod, n=name: claim(n)
        # The objects of these names must exist before a pod may name them (the admission looks them up).
        account = {"serviceAccount": {"name": name}}
        yield f"serviceAccount.name {name!r}", account, lambda pod, n=name: named("v1", "ServiceAccount", n)
        priority = {"priorityClassName": name}
        yield f"priorityClassName {name!r}", priority, lambda pod, n=name: priority_class(n)
        gang = {"runPolicy": {"schedulingPolicy": {"priorityClass": name}}}
        yield f"schedulingPolicy.priorityClass {name!r}", gang, lambda pod, n=name: priority_class(n)
        of_class = {"storage": {"storageClassName": name}}
        yield f"storageClassName {name!r}", of_class, lambda pod, n=name: claim("runs", storage_class=n)
        yield f"secretName {name!r}", {"storage": {"secretName": name}}, lambda pod, n=name: with_secret_key(pod, n)
        # The pods' schedulerName: the API server takes any name (the scheduler of that name never comes).
        coscheduled = {"apiKind": "TrainJob", "queue": {"coscheduling": name}}
        yield f"queue.coscheduling {name!r}", coscheduled, lambda pod, n=name: in_pod(pod, "schedulerName", n)
    for size in SIZES:
        yield f"storage.size {size!r}", {"storage": {"size": size}}, lambda pod, s=size: claim("runs", size=s)
    for path in MOUNT_PATHS:
        yield f"mountPath {path!r}", {"storage": {"mountPath": path}}, lambda pod, p=path: with_run_volume_at(pod, p)
    for key, value in IN_KUBERNETES_FORM:
        yield f"{key} {value}", {key: value}, lambda pod, k=key, v=value: in_pod(pod, k, v)
    for key, (part, field), labels in MAPPINGS:
        for entry in [{k: "x"} for k in KEYS] + ([{"team": v} for v in LABEL_VALUES] if labels else []):
            yield f"{key} {entry}", {key: entry}, lambda pod, e=entry, p=part, f=field: with_entry(pod, p, f, e)


def named(api_version: str, kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name}}


def priority_class(name: str) -> dict[str, Any]:
    return named("scheduling.k8s.io/v1", "PriorityClass", name) | {"value": 1000}


def with_run_volume_at(pod: dict[str, Any], path: str) -> dict[str, Any]:
    (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "checkpoints"]
    mount["mountPath"] = path
    return pod


def with_secret_key(pod: dict[str, Any], secret: str) -> dict[str, Any]:
    """The pod with a variable from a key of `secret`, as the chart gives it storage.secretName's."""
    reference = {"secretKeyRef": {"name": secret, "key": S3_ACCESS_KEY_ENV}}
    pod["spec"]["containers"][0].setdefault("env", []).append({"name": S3_ACCESS_KEY_ENV, "valueFrom": reference})
    return pod


def with_entry(pod: dict[str, Any], part: str, field: str, entry: dict[str, str]) -> dict[str, Any]:
    pod[part].setdefault(field, {}).update(entry)
    return pod


def test_the_spec_refuses_exactly_the_names_and_labels_the_api_server_refuses(cluster: Cluster, namespace: str) -> None:
    """The API server checks a PyTorchJob's pod template only when the operator creates its pods: the spec checks
    what the pods name and label as the API server then would (a server dry run of the chart's pod carrying each
    value, or of a claim of each name), so that `ctl` refuses a job whose pods could never run, and no job that
    could."""
    spec = job_spec("names")
    job = next(m.obj for m in render(spec, namespace) if m.obj["kind"] == PYTORCHJOB.api.kind)
    template = next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]
    # Why the spec checks them: the API server takes a job whose pods it will refuse.
    refused_pods = json.loads(json.dumps(job))
    next(iter(refused_pods["spec"]["pytorchReplicaSpecs"].values()))["template"]["metadata"]["labels"]["team"] = "a b"
    controlplane.server_side_apply(cluster.client(), in_namespace(refused_pods, namespace), dry_run=True)
    core = kubernetes.client.CoreV1Api(cluster.client())
    scheduling = kubernetes.client.SchedulingV1Api(cluster.client())
    create = {
        "Pod": core.create_namespaced_pod,
        "PersistentVolumeClaim": core.create_namespaced_persistent_volume_claim,
        "ServiceAccount": core.create_namespaced_service_account,
        "PriorityClass": lambda _, obj, **dry: scheduling.create_priority_class(obj, **dry),  # of no namespace
    }
    deadline = time.monotonic() + 30  # the pod's ServiceAccount, the namespace's default, is made for it meanwhile
    while not core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items:
        assert time.monotonic() < deadline, "the namespace has no default ServiceAccount"
        time.sleep(0.2)
    disagreements = []
    for what, keys, make in placed_values():
        try:
            with_keys(spec, keys, Path("spec.yaml"))
            spec_takes = True
        except SpecError:
            spec_takes = False
        pod = json.loads(json.dumps(template)) | {"apiVersion": "v1", "kind": "Pod"}
        pod["metadata"] |= {"name": "names"}
        obj = make(pod)
        try:
            create[obj["kind"]](namespace, obj, dry_run="All")
            api_takes = True
        except kubernetes.client.ApiException as refused:
            assert refused.status == 422, refused.body  # invalid, not refused for another reason
            api_takes = False
        if spec_takes != api_takes:
            disagreements.append(f"{what}: spec {spec_takes}, API server {api_takes}")
    assert not disagreements, "\n".join(disagreements)


def test_two_node_job_is_reconciled_and_succeeds(cluster: Cluster, shipped_namespace: str) -> None:
    """In the namespace ddpjob ships (enforcing Pod Security "restricted"), the operator (installed as k8s/operator
    configures it) creates the pods with its env (as ctl.operator_env says) and its init container, the admission
    lets them in, they train through torchrun, the job ends Succeeded, and the run directory on the claim holds a
    committed checkpoint and the report."""
    namespace = shipped_namespace
    core = kubernetes.client.CoreV1Api(cluster.client())
    # The admission is on: a pod without the chart's security context is refused here.
    bare = {"metadata": {"name": "bare"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        core.create_namespaced_pod(namespace, bare, dry_run="All")
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in json.loads(refused.value.body)["message"]
    marker = uuid.uuid4().hex
    spec = job_spec(marker)
    apply_rendered(cluster, spec, namespace)
    job = wait_for_job(cluster, namespace, spec.name)
    assert finished_as(job) == "Succeeded", pod_logs(cluster, namespace)

    pods = ended_pods(cluster, namespace, spec.name)
    assert sorted(pods) == sorted(r.pod_name(spec.name) for r in replicas(spec))
    for replica in replicas(spec):
        pod = pods[replica.pod_name(spec.name)]
        assert pod.metadata.labels[REPLICA_TYPE_LABEL] == replica.type
        assert container_env(pod).items() >= operator_env(spec, replica).items()
        assert pod.status.phase == "Succeeded" and terminated(pod).exit_code == 0
        assert violations(client_dict(pod.spec)) == []
    worker = client_dict(pods[Replica("worker", 0).pod_name(spec.name)].spec)
    (init,) = worker["initContainers"]
    assert init["name"] == "init-pytorch" and init["securityContext"]["runAsNonRoot"]  # k8s/operator's template
    # The operator's built-in template (the same container without a securityContext) would not have been admitted.
    builtin = {k: v for k, v in init.items() if k != "securityContext"}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        core.create_namespaced_pod(
            namespace, {"metadata": {"name": "builtin"}, "spec": worker | {"initContainers": [builtin]}}, dry_run="All"
        )
    assert 'container "init-pytorch" must set' in json.loads(refused.value.body)["message"]
    assert job["status"]["replicaStatuses"]["Master"].get("succeeded") == 1
    assert_no_process_left(cluster, marker)

    if cluster.plane is None:  # the claim is out of reach: the trainer's last words name the run directory
        assert f"run directory: {spec.storage.mount_path}/{spec.name}" in pod_logs(cluster, namespace)
        return
    run_dir = cluster.plane.claim_dir(namespace, f"{spec.name}-checkpoints") / spec.name
    checkpoints = sorted(run_dir.glob("step-*/COMMITTED"))
    assert checkpoints, f"no committed checkpoint in {run_dir}: {sorted(run_dir.iterdir())}"
    assert (run_dir / (run_dir / "latest").read_text().strip() / "COMMITTED").exists()
    assert (run_dir / "report.json").exists()


def test_a_two_node_job_on_object_storage_runs_without_any_volume_claim(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """storage.uri: no claim is rendered or mounted; the pods reach a real S3 server (versitygw on this machine's
    end of the node's link, over HTTPS with a certificate of a private CA, which storage.caBundle gives the pods)
    with keys from a Secret, rank 0 shares the prepared dataset through the bucket, and the job's checkpoints, export
    and report end up there."""
    if cluster.plane is None:
        pytest.skip("the S3 server runs on this machine: the tier's own node reaches it, another cluster may not")
    tls = private_ca(tmp_path / "ca", "e2e S3 CA", node.HOST_ADDRESS)
    with s3_server(tmp_path / "s3", address=node.HOST_ADDRESS, tls=tls) as s3:
        s3.bucket("runs")
        keys = {name: value for name, value in s3.env().items() if name in (S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV)}
        kubernetes.client.CoreV1Api(cluster.client()).create_namespaced_secret(
            namespace, {"metadata": {"name": "s3-keys"}, "stringData": keys}
        )
        marker = uuid.uuid4().hex
        storage = {
            "uri": "s3://runs/e2e",
            "endpoint": s3.endpoint,
            "secretName": "s3-keys",
            "caBundle": tls.ca_file.read_text(),
        }
        spec = job_spec(marker, storage=storage)
        assert "PersistentVolumeClaim" not in [m.kind for m in render(spec)]
        apply_rendered(cluster, spec, namespace)
        job = wait_for_job(cluster, namespace, spec.name)
        assert finished_as(job) == "Succeeded", pod_logs(cluster, namespace)
        for pod in ended_pods(cluster, namespace, spec.name).values():
            assert not [v for v in pod.spec.volumes if v.persistent_volume_claim is not None]
        run = s3.root / "runs" / "e2e" / spec.name
        assert (run / (run / "latest").read_text().strip() / "COMMITTED").exists()
        assert (run / "report.json").exists() and (run / "final" / "model.safetensors").exists()
        assert list((s3.root / "runs" / "e2e" / "_datasets").glob("*/manifest.json"))
    assert_no_process_left(cluster, marker)


@pytest.mark.parametrize(
    ("restart_policy", "run_policy"),
    [("ExitCode", {}), ("OnFailure", {"backoffLimit": 3, "cleanPodPolicy": "All"})],
    ids=["ExitCode", "OnFailure-backoffLimit-3"],
)
def test_a_failing_trainer_fails_the_job(
    cluster: Cluster, namespace: str, restart_policy: str, run_policy: dict[str, Any]
) -> None:
    """A trainer that exits on bad input fails the job, as the restart policy says (Never: at the first exit, in
    test_ctl_wait_exit_codes_for_a_failed_and_a_missing_job[PyTorchJob]). ExitCode: the launcher's exit code 2 (bad
    input) is not retryable (only >= 128 are), so no restart either.
    OnFailure: the containers are restarted in place until their restarts, summed over the job's running pods, reach
    runPolicy.backoffLimit; with cleanPodPolicy All the operator then deletes the pods, and their processes end. (With
    None it may still delete them, or recreate them in a reconcile that has not seen the Failed condition yet: the
    operator's own race.) A restarted container's previous run keeps its log: pods/log with previous=true. Limit 3:
    both pods restart at once (the kubelet's first restart has no back-off), so the master's previous log is there
    for at least the 10 s back-off before the third restart; with limit 1 the worker's first restart alone can fail
    the job and delete the pods before the master's previous log is ever readable."""
    marker = uuid.uuid4().hex
    spec = job_spec(marker, ["/nonexistent/ddpjob-e2e/train.txt"], restartPolicy=restart_policy, runPolicy=run_policy)
    apply_rendered(cluster, spec, namespace)
    if restart_policy == "OnFailure":  # before the operator deletes the pods (cleanPodPolicy All)
        master = Replica("master", 0).pod_name(spec.name)
        assert "error: training.data.train" in wait_for_log(cluster, namespace, master, "error: ", previous=True)
    job = wait_for_job(cluster, namespace, spec.name)
    failed = time.monotonic()
    assert finished_as(job) == "Failed", pod_logs(cluster, namespace)
    pods = pods_of(cluster, namespace, spec.name)
    if restart_policy == "OnFailure":
        assert "backoff limit" in next(c["message"] for c in job["status"]["conditions"] if c["type"] == "Failed")
        # Deleted as their containers restart, Python starting: not held for their grace period (120 s).
        wait_for_deletion(cluster, namespace, spec.name)
        assert time.monotonic() - failed < spec.termination_grace_period_seconds / 2
    else:
        assert "training.data.train" in pod_logs(cluster, namespace)
        # The job fails with its first failed replica; the other pod may still be on its way out.
        for name in pods:
            pods[name] = wait_for_pod(cluster, namespace, name, lambda pod: pod.status.phase in ("Succeeded", "Failed"))
        master = pods[Replica("master", 0).pod_name(spec.name)]
        assert master.status.phase == "Failed" and terminated(master).exit_code == EXIT_BAD_INPUT
        assert sum(s.restart_count for pod in pods.values() for s in pod.status.container_statuses) == 0
    assert_no_process_left(cluster, marker)


@pytest.mark.parametrize("kind", KINDS)
def test_with_compile_each_pod_keeps_its_compile_caches_in_the_run_directory_and_gets_its_threads(
    cluster: Cluster, namespace: str, kind: Kind
) -> None:
    """training.compile: the kubelet resolves the chart's folder of each pod in the run directory on the volume, for
    torch's and Triton's caches, named by what stays the same when the operator recreates the pod (the pod's name;
    a TrainJob pod's completion index), so a recreated pod finds what it compiled before (the next test). Each
    pod's processes get OMP_NUM_THREADS for their share of its CPU request (250m: 1; unset, torch would start one
    thread per core of the node). Read from the pods' processes; the job is deleted then."""
    if cluster.plane is None:
        pytest.skip("reads the pods' processes on this machine: needs the tier's node")
    marker = uuid.uuid4().hex
    spec = job_spec(marker, training={"compile": True}, apiKind=kind.api.kind)
    apply_rendered(cluster, spec, namespace)
    folders = [f"{spec.name}-{node}" for node in kind.nodes] if kind is PYTORCHJOB else ["0", "1"]
    run_dir = f"{spec.storage.mount_path}/{spec.name}"
    expected = {
        str(rank): {
            variable: f"{run_dir}/{COMPILE_CACHE_DIR}/{folder}/{leaf}" for variable, leaf in COMPILE_CACHES.items()
        }
        | {"OMP_NUM_THREADS": "1"}
        for rank, folder in enumerate(folders)
    }
    found: dict[str, dict[str, str]] = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while found != expected and time.monotonic() < deadline:
        for env in first_processes(marker).values():
            if "PET_NODE_RANK" in env:
                found[env["PET_NODE_RANK"]] = {variable: env.get(variable, "") for variable in expected["0"]}
        time.sleep(0.5)
    assert found == expected, pod_logs(cluster, namespace)
    kubernetes.client.CustomObjectsApi(cluster.client()).delete_namespaced_custom_object(
        kind.api.group, kind.api.version, namespace, kind.api.plural, spec.name
    )
    assert_no_process_left(cluster, marker)


def test_pods_recreated_mid_run_load_what_they_compiled_before(cluster: Cluster, namespace: str) -> None:
    """training.compile, the master pod deleted mid-run (an eviction, a preemption, a node draining: its kubelet sends
    SIGTERM to the container): every rank stops at one agreed step, rank 0 saves, and both pods exit 143, the
    master's launcher because of the signal, the worker's because its trainers stopped with the master's. ExitCode
    retries 128 and up, so the operator makes the worker's pod again as well as the master's, and the run resumes
    from the checkpoint and succeeds (plain torchrun exits 1 on both pods, and the job failed). The new pods' first
    step compiles nothing: every graph comes from the caches that the pods before them left in the run directory on
    the volume (a new pod's scratch volume is empty, and it compiled again)."""
    marker = uuid.uuid4().hex
    training = {"compile": True, "maxSteps": 300, "logEvery": 20, "checkpoint": {"every": 50}}
    # Compiling runs gcc beside the trainer: more memory than the other jobs' 1Gi.
    resources = {"cpu": "250m", "memory": "2Gi", "shm": "256Mi", "cache": "1Gi"}
    spec = job_spec(marker, training=training, restartPolicy="ExitCode", resources=resources)
    apply_rendered(cluster, spec, namespace)
    master = Replica("master", 0).pod_name(spec.name)
    first = wait_for_pod(cluster, namespace, master, lambda pod: pod.status.phase == "Running")
    wait_for_log(cluster, namespace, master, "with torch.compile:")  # after the rendezvous: both pods run
    # The stopped pods' logs go with them: followed until their containers end.
    worker = Replica("worker", 0).pod_name(spec.name)
    first_runs = [follow_log(cluster, namespace, pod) for pod in (master, worker)]
    history = watch_pods(cluster, namespace)
    kubernetes.client.CoreV1Api(cluster.client()).delete_namespaced_pod(master, namespace)

    job = wait_for_job(cluster, namespace, spec.name)
    (before, worker_before), after = (followed() for followed in first_runs), pod_logs(cluster, namespace)
    seen = history()
    assert finished_as(job) == "Succeeded", before + after
    assert wait_for_pod(cluster, namespace, master, lambda pod: True).metadata.uid != first.metadata.uid
    stopped = re.search(r"stop requested \(SIGTERM\): saved (step-\d{8}) at step (\d+)/300", before)
    assert stopped, before
    assert f"resuming from {stopped[1]}:" in after, after
    assert "trainer.launch: stopped by SIGTERM; exiting with code 143" in before, before
    assert "trainer.launch: the trainers stopped to be resumed; exiting with code 143" in worker_before, worker_before
    # The worker's pod failed with the retryable code, and the operator made it again (the master's was deleted).
    assert {f"{master} exited with code 143", f"{worker} exited with code 143"} <= seen.exits, seen
    assert len(seen.pods[worker]) == len(seen.pods[master]) == 2, seen
    folder = f"{spec.storage.mount_path}/{spec.name}/{COMPILE_CACHE_DIR}/{master}"
    cache = re.escape(f"{folder}/{COMPILE_CACHES['TORCHINDUCTOR_CACHE_DIR']}")
    compiled = re.compile(rf"with torch\.compile: (\d+) graph\(s\), (\d+) from the cache \({cache}\)")
    found = [compiled.search(log) for log in (before, after)]
    assert all(found), (before, after)
    (graphs, hits), (graphs_again, hits_again) = (match.groups() for match in found if match)
    assert (hits, hits_again) == ("0", graphs) and graphs_again == graphs != "0", (before, after)
    assert_no_process_left(cluster, marker)


def test_a_frozen_rank_fails_both_pods_hung_and_the_job_resumes_under_restart_policy_exit_code(
    cluster: Cluster, namespace: str
) -> None:
    """The worker pod's rank stopped as a whole (SIGSTOP: its watchdog too), as a process stuck in the kernel or
    a frozen node would be. The master's rank finds the job hung and its pod exits EXIT_HUNG; the worker pod's
    launcher finds its rank's heartbeat stale, kills it and exits EXIT_HUNG too. ExitCode retries both, the
    recreated pods resume from the last checkpoint and the job succeeds (without the launcher's part, the worker
    pod never exits and the recreated master waits for it at the rendezvous)."""
    if cluster.plane is None:
        pytest.skip("stops a container's process from this machine: needs the tier's node")
    marker = uuid.uuid4().hex
    training = LONG_TRAINING | {"timeouts": {"hangFloorSeconds": 5}}
    spec = job_spec(marker, training=training, restartPolicy="ExitCode")
    apply_rendered(cluster, spec, namespace)
    master, worker = Replica("master", 0).pod_name(spec.name), Replica("worker", 0).pod_name(spec.name)
    # Meant midway between checkpoints (100 and 150), where the master's rank waits in a gradient all-reduce.
    wait_for_log(cluster, namespace, master, "step 120/600")
    first_runs = [follow_log(cluster, namespace, pod) for pod in (master, worker)]
    history = watch_pods(cluster, namespace)
    marked = processes_with_marker(marker)
    # The trainer of global rank 1, below its launcher (which the operator gives RANK=1 too, the pod's node rank).
    (rank_1,) = [pid for pid in marked if environ(pid).get("RANK") == "1" and parent_pid(pid) in marked]
    os.kill(rank_1, signal.SIGSTOP)

    job = wait_for_job(cluster, namespace, spec.name)
    master_run, worker_run = (followed() for followed in first_runs)
    seen = history()
    logs = "\n".join([master_run, worker_run, pod_logs(cluster, namespace)])
    assert finished_as(job) == "Succeeded", logs
    # The log can lag by 30 steps on a busy machine: stopped just before the checkpoint at 150, the worker's launcher
    # kills its rank while the master's is held to longWorkSeconds in the checkpoint's evaluation, and then the
    # master's failed all-reduce is what names the hang (tests/test_hangs.py has both cases on their own).
    # Or rank 0's watchdog finds rank 1's heartbeat stale first.
    found = r"0 completed no step for|0's collective failed|1 stopped responding \(no new heartbeat"
    assert re.search(rf"\[rank 0\] hang: rank ({found})", master_run), master_run
    assert "[rank 1] hang: rank 1 stopped responding (no heartbeat for" in worker_run, worker_run
    assert "its node's launcher killed it" in worker_run, worker_run
    for run in (master_run, worker_run):
        assert run.splitlines()[-1].startswith("trainer.launch: a rank's watchdog found the job hung"), run
    assert re.search(r"resuming from step-\d{8}:", logs), logs
    assert {m for m in seen.exits if m.endswith(f" {EXIT_HUNG}")} == {
        f"{master} exited with code {EXIT_HUNG}",
        f"{worker} exited with code {EXIT_HUNG}",
    }, seen
    assert len(seen.pods[worker]) == len(seen.pods[master]) == 2, seen
    assert_no_process_left(cluster, marker)


def test_pod_logs_and_proxy_through_the_api_server(cluster: Cluster, namespace: str) -> None:
    """pods/log and pods/proxy as the CLI uses them, through the API server to the pods' kubelet and to the pods'
    own addresses: the trainer's output, with tailLines, timestamps, limitBytes and sinceSeconds; previous for a
    container that never restarted is refused; a follow started while the job runs ends by itself with the
    container; the master's metrics through the pod proxy, while the job runs. Each pod had an address of the
    node's pod network, released once the pod has ended."""
    marker = uuid.uuid4().hex
    spec = job_spec(marker, training={"maxSteps": 300, "logEvery": 50})
    apply_rendered(cluster, spec, namespace)
    core = kubernetes.client.CoreV1Api(cluster.client())
    master = Replica("master", 0).pod_name(spec.name)
    wait_for_log(cluster, namespace, master, "training 300 steps")  # the metrics endpoint opens next
    followed = follow_log(cluster, namespace, master)
    metrics = wait_for_metrics(cluster, namespace, master, spec.metrics.port)
    assert "# TYPE ddpjob_step gauge" in metrics and re.search(r'^ddpjob_step\{rank="0"\} \d', metrics, re.M)

    job = wait_for_job(cluster, namespace, spec.name)
    assert finished_as(job) == "Succeeded", pod_logs(cluster, namespace)
    pods = pods_of(cluster, namespace, spec.name)
    for pod in pods.values():  # bound to a node, whose kubelet serves pods/log
        assert pod.spec.node_name and (cluster.plane is None or pod.spec.node_name == NODE_NAME)

    def read_log(**options: Any) -> str:
        return core.read_namespaced_pod_log(master, namespace, container=V1.container, **options)

    log = read_log()
    lines = log.removesuffix("\n").split("\n")  # not splitlines(): the sampled text may hold \r or \f
    # The trainer's last line: the run directory under the claim's mount path.
    assert "step 300/300 | loss " in log and lines[-1] == f"run directory: {spec.storage.mount_path}/{spec.name}"
    assert followed() == log  # from the first line to the container's end, the stream ending by itself
    assert read_log(tail_lines=2) == "\n".join(lines[-2:]) + "\n"
    assert read_log(limit_bytes=25) == log[:25]
    stamped = read_log(timestamps=True).removesuffix("\n").split("\n")
    assert all(RFC3339_PREFIX.match(line) for line in stamped), stamped[:3]
    assert [RFC3339_PREFIX.sub("", line, count=1) for line in stamped] == lines
    last_line_at = datetime.datetime.fromisoformat(stamped[-1].split(" ")[0]).timestamp()
    time.sleep(max(0.0, last_line_at + 2 - time.time()))  # every line older than a second
    assert (read_log(since_seconds=1), read_log(since_seconds=3600)) == ("", log)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        read_log(previous=True)
    refusal = (refused.value.status, json.loads(refused.value.body)["message"])
    assert refusal == (400, f'previous terminated container "pytorch" in pod "{master}" not found')

    addresses = {pod.status.pod_ip for pod in pods.values()}
    assert len(addresses) == len(pods)
    if cluster.plane is not None and cluster.plane.node is not None:  # released by CNI once the sandbox is gone
        assert all(ipaddress.ip_address(a) in ipaddress.ip_network(POD_CIDR) for a in addresses)
        deadline = time.monotonic() + 60
        while addresses & cluster.plane.node.allocated_addresses() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not addresses & cluster.plane.node.allocated_addresses()
    assert_no_process_left(cluster, marker)


RFC3339_PREFIX = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d) ")


def wait_for_log(cluster: Cluster, namespace: str, pod: str, text: str, **options: Any) -> str:
    """The pod's log (pods/log, with `options`) once it holds `text`. Meanwhile the pod may not exist yet (404),
    its container not have started, or not restarted yet for previous=true (400). A pod that existed and has been
    gone for POD_GONE_S was deleted for good (its job ended), not replaced by the operator: the wait ends then."""
    core = kubernetes.client.CoreV1Api(cluster.client())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    log, error, seen, gone_since = "", None, False, None
    while time.monotonic() < deadline:
        try:
            log = core.read_namespaced_pod_log(pod, namespace, container=V1.container, **options)
            seen, gone_since = True, None
            if text in log:
                return log
        except kubernetes.client.ApiException as refused:
            if refused.status not in (400, 404):
                raise
            error = refused
            seen = seen or refused.status == 400
            if seen and refused.status == 404:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > POD_GONE_S:
                    break
        time.sleep(0.5)
    raise AssertionError(f"{pod}: no {text!r} in its log {options} ({error}):\n{log}\n{pod_logs(cluster, namespace)}")


def follow_log(cluster: Cluster, namespace: str, pod: str) -> Callable[[], str]:
    """Follows the pod's log (pods/log, follow=true) in a thread; the function returned waits for the stream to
    end by itself (a minute at most, once the job is done) and returns what it carried."""
    response = kubernetes.client.CoreV1Api(cluster.client()).read_namespaced_pod_log(
        pod,
        namespace,
        container=V1.container,
        follow=True,
        _preload_content=False,
        _request_timeout=(10, JOB_TIMEOUT_S),
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(response.stream(4096)), daemon=True)
    reader.start()

    def result() -> str:
        reader.join(60)
        assert not reader.is_alive(), f"the follow of {pod} did not end with its container: {b''.join(chunks)!r}"
        return b"".join(chunks).decode()

    return result


@dataclass
class PodHistory:
    exits: set[str]  # "pod exited with code N": each code the trainer's container of a pod by that name ended with
    pods: dict[str, set[str]]  # each pod name's pods (their UIDs): one more for each the operator made again


def watch_pods(cluster: Cluster, namespace: str) -> Callable[[], PodHistory]:
    """Watches the namespace's pods in a thread, from now on; the function returned stops the watch and gives what
    it saw, pods deleted meanwhile included (a watch's DELETED carries the pod's last status). The operator's
    ExitedWithCode events say the same, but its event recorder drops a job's events past 25 (client-go's spam
    filter, per object), and a run with a restart comes close: a test reading them failed when one was dropped."""
    core = kubernetes.client.CoreV1Api(cluster.client())
    seen = PodHistory(exits=set(), pods={})
    stop = threading.Event()

    def record(pod: kubernetes.client.V1Pod) -> None:
        seen.pods.setdefault(pod.metadata.name, set()).add(pod.metadata.uid)
        for status in pod.status.container_statuses or []:
            if status.name == V1.container and status.state.terminated:
                seen.exits.add(f"{pod.metadata.name} exited with code {status.state.terminated.exit_code}")

    listed = core.list_namespaced_pod(namespace)
    for pod in listed.items:
        record(pod)

    failures: list[BaseException] = []

    def watch(version: str) -> None:
        try:
            while not stop.is_set():  # short server-side watches: the stop flag is read between them
                for event in kubernetes.watch.Watch().stream(
                    core.list_namespaced_pod, namespace, resource_version=version, timeout_seconds=2
                ):
                    assert event["type"] != "ERROR", event
                    record(event["object"])
                    version = event["object"].metadata.resource_version
        except BaseException as error:  # given to the test by result()
            failures.append(error)

    watcher = threading.Thread(target=watch, args=(listed.metadata.resource_version,), daemon=True)
    watcher.start()

    def result() -> PodHistory:
        stop.set()
        watcher.join(30)
        assert not watcher.is_alive(), "the pods' watch did not stop"
        if failures:
            raise failures[0]
        return seen

    return result


def wait_for_metrics(cluster: Cluster, namespace: str, pod: str, port: int) -> str:
    """The pod's /metrics through the API server's pod proxy, once it has the training step (ddpjob_step)."""
    core = kubernetes.client.CoreV1Api(cluster.client())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    answer: Any = None
    while time.monotonic() < deadline:
        try:
            answer = core.connect_get_namespaced_pod_proxy_with_path(f"{pod}:{port}", namespace, "metrics")
            if re.search(r"^ddpjob_step\{", answer, re.M):
                return answer
        except kubernetes.client.ApiException as error:  # not listening yet: 503 from the proxy
            answer = error
        if core.read_namespaced_pod(pod, namespace).status.phase in ("Succeeded", "Failed"):
            break
        time.sleep(0.2)
    raise AssertionError(f"no training metrics from {pod}:{port} through pods/proxy while it ran: {answer}")


def wait_for_deletion(cluster: Cluster, namespace: str, job: str) -> None:
    """The job's pods gone: within their grace period (the chart's 120 s), and a kubelet's sync after it."""
    deadline = time.monotonic() + 180
    while pods_of(cluster, namespace, job) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pods_of(cluster, namespace, job) == {}


def test_the_nodes_containerd_holds_only_the_images_it_imported(cluster: Cluster) -> None:
    """containerd's store outlives the node (the ~6 GB training image is imported once per content), so nothing a
    node leaves there may pile up: each earlier version of the training image stayed under the ID the CRI plugin
    names it by, with its ~540 MB of changed layers, 26 of them on this machine before the node removed them."""
    if cluster.plane is None or cluster.plane.node is None:
        pytest.skip("an external cluster's images are its own")
    imported = cluster.plane.node.images
    held = cluster.plane.node.held_images(ensure_binaries().ctr)
    assert {digest for _, digest in held} == set(imported.values()), held
    assert {name for name, _ in held if not name.startswith("sha256:")} == set(imported), held


def test_a_deleted_pod_is_stopped_and_recreated(cluster: Cluster, namespace: str) -> None:
    """Deleting a running pod (as `kubectl delete pod`, or the operator on a restart, does) ends its processes;
    the operator creates the pod again and it runs. Deleted as it starts (its launcher has not started its trainer
    yet), the pod ends at once, not when its grace period (120 s) ends in SIGKILL; so do the
    job's pods when the job is deleted, one of them starting again."""
    marker = uuid.uuid4().hex
    spec = job_spec(marker, training={"maxSteps": 1_000_000})
    apply_rendered(cluster, spec, namespace)
    core = kubernetes.client.CoreV1Api(cluster.client())
    worker = Replica("worker", 0).pod_name(spec.name)
    first = wait_for_pod(cluster, namespace, worker, lambda pod: pod.status.phase == "Running")
    deleted = time.monotonic()
    core.delete_namespaced_pod(worker, namespace)
    again = wait_for_pod(cluster, namespace, worker, lambda p: p.metadata.uid != first.metadata.uid)
    assert time.monotonic() - deleted < spec.termination_grace_period_seconds / 2
    assert (
        wait_for_pod(cluster, namespace, worker, lambda p: p.status.phase == "Running").metadata.uid
        == again.metadata.uid
    )
    if cluster.plane is not None:  # a container's processes are in its pod's cgroups, named by the pod's UID
        old_pod = first.metadata.uid.replace("-", "_").encode()  # as cgroupfs names it
        deadline = time.monotonic() + 60
        while any(old_pod in cgroups(pid).replace(b"-", b"_") for pid in processes_with_marker(marker)):
            assert time.monotonic() < deadline, "the deleted pod's processes are still running"
            time.sleep(0.5)
    delete_job_promptly(cluster, namespace, spec)
    assert_no_process_left(cluster, marker)


def delete_job_promptly(cluster: Cluster, namespace: str, spec: JobSpec) -> None:
    """Deletes the job; the garbage collector removes its pods, which ends their processes, well within their grace
    period (not held until it ends in SIGKILL)."""
    deleted = time.monotonic()
    kubernetes.client.CustomObjectsApi(cluster.client()).delete_namespaced_custom_object(
        V1.group, V1.version, namespace, V1.plural, spec.name
    )
    wait_for_deletion(cluster, namespace, spec.name)
    assert time.monotonic() - deleted < spec.termination_grace_period_seconds / 2


SLOW_START = "slow-start"  # a ConfigMap with a sitecustomize.py, and where the pods mount it


def test_a_job_deleted_while_its_pods_python_starts_ends_at_once(cluster: Cluster, namespace: str) -> None:
    """Stopped before Python has run a line of the pod's command (the interpreter starting, slow on a loaded
    node; or a pod the operator deletes as its container restarts, OnFailure's back-off limit): as its container's
    PID 1 the process had no handler yet, the kernel dropped the kubelet's SIGTERM, and the pod was held until its
    grace period (120 s) ended in SIGKILL. The chart's pods share one process namespace, whose PID 1 is the pod's
    sandbox, so a SIGTERM ends the command at any point. Here every Python in the pods waits in sitecustomize."""
    if cluster.plane is None:
        pytest.skip("reads the pods' processes on this machine: needs the tier's node")
    marker = uuid.uuid4().hex
    spec = job_spec(marker, env=[{"name": "PYTHONPATH", "value": f"/opt/{SLOW_START}"}])
    client = cluster.client()
    sitecustomize = "import sys, time\nprint('starting slowly', file=sys.stderr, flush=True)\ntime.sleep(3600)\n"
    kubernetes.client.CoreV1Api(client).create_namespaced_config_map(
        namespace, {"metadata": {"name": SLOW_START}, "data": {"sitecustomize.py": sitecustomize}}
    )
    objects = [in_namespace(m.obj, namespace) for m in render(spec)]
    job = next(obj for obj in objects if obj["kind"] == V1.kind)
    for pod in V1.replica_pods({V1.kind: job}, spec).values():
        pod["volumes"].append({"name": SLOW_START, "configMap": {"name": SLOW_START}})
        mount = {"name": SLOW_START, "mountPath": f"/opt/{SLOW_START}", "readOnly": True}
        pod["containers"][0]["volumeMounts"].append(mount)
    for obj in objects:
        controlplane.server_side_apply(client, obj)
    for replica in (Replica("master", 0), Replica("worker", 0)):
        wait_for_log(cluster, namespace, replica.pod_name(spec.name), "starting slowly")
    delete_job_promptly(cluster, namespace, spec)
    assert_no_process_left(cluster, marker)


def services_of(cluster: Cluster, namespace: str, job: str) -> list[str]:
    selector = f"training.kubeflow.org/job-name={job}"
    services = kubernetes.client.CoreV1Api(cluster.client()).list_namespaced_service(namespace, label_selector=selector)
    return [service.metadata.name for service in services.items]


def start_running_job(cluster: Cluster, namespace: str, spec: JobSpec) -> None:
    """The job applied, and once both its pods run (and their Services exist)."""
    apply_rendered(cluster, spec, namespace)
    for replica in (Replica("master", 0), Replica("worker", 0)):
        wait_for_pod(cluster, namespace, replica.pod_name(spec.name), lambda pod: pod.status.phase == "Running")
    assert services_of(cluster, namespace, spec.name)


def test_deleted_jobs_and_namespaces_are_garbage_collected(cluster: Cluster, namespace: str) -> None:
    """Owner references are followed (locally: kube-controller-manager's garbage collector and namespace
    controller). A job deleted in the background loses its pods and Services afterwards; one deleted in the
    foreground goes only once they are gone (so a job recreated under its name never meets them); a deleted
    namespace is emptied and removed. Each time the pods' processes end."""
    marker = uuid.uuid4().hex
    # A short grace period: the namespace controller looks again after half the pods' grace period.
    spec = job_spec(marker, training={"maxSteps": 1_000_000}, terminationGracePeriodSeconds=10)
    jobs = kubernetes.client.CustomObjectsApi(cluster.client())
    core = kubernetes.client.CoreV1Api(cluster.client())

    start_running_job(cluster, namespace, spec)
    jobs.delete_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural, spec.name)
    wait_for_deletion(cluster, namespace, spec.name)
    assert services_of(cluster, namespace, spec.name) == []
    assert_no_process_left(cluster, marker)

    start_running_job(cluster, namespace, spec)
    options = {"propagationPolicy": "Foreground"}
    jobs.delete_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural, spec.name, body=options)
    deadline = time.monotonic() + 120
    while jobs.list_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural)["items"]:
        assert time.monotonic() < deadline, "the job deleted in the foreground is still there"
        time.sleep(0.5)
    assert pods_of(cluster, namespace, spec.name) == {}
    assert services_of(cluster, namespace, spec.name) == []
    assert_no_process_left(cluster, marker)

    start_running_job(cluster, namespace, spec)
    core.delete_namespace(namespace)
    deadline = time.monotonic() + 120
    while namespace in {ns.metadata.name for ns in core.list_namespace().items}:
        assert time.monotonic() < deadline, f"namespace {namespace} is still there: {core.read_namespace(namespace)}"
        time.sleep(0.5)
    assert_no_process_left(cluster, marker)


def wait_for_pod(
    cluster: Cluster, namespace: str, name: str, condition: Callable[[kubernetes.client.V1Pod], bool]
) -> kubernetes.client.V1Pod:
    core = kubernetes.client.CoreV1Api(cluster.client())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            pod = core.read_namespaced_pod(name, namespace)
            if condition(pod):
                return pod
        except kubernetes.client.ApiException as error:
            if error.status != 404:
                raise
        time.sleep(0.5)
    raise AssertionError(f"pod {name}: condition not met in {JOB_TIMEOUT_S} s\n{pod_logs(cluster, namespace)}")


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # ended meanwhile
        return {}
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def first_processes(marker: str) -> dict[int, dict[str, str]]:
    """Each container's first process in the run marked `marker`, the one its runtime started and its kubelet
    signals (its parent is not marked), with its environment."""
    marked = processes_with_marker(marker)
    return {pid: environ(pid) for pid in marked if parent_pid(pid) not in marked}


def cgroups(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cgroup").read_bytes()
    except OSError:  # ended meanwhile
        return b""


# ---------------------------------------------------------------------------------------------------------------
# ctl submit | wait | status | list | delete, as a user runs them: exit codes, `-o json` shapes, what stays.

PROGRESS_STEPS = 200
# Rank 1 sleeps this long in each step (the straggler test hook) and rank 0 waits for it, so the steps after the first
# logged loss take 17 s or more however fast the node is: time to read the job while it runs. Unpaced, they once
# took less than the three ctl calls that read it (a thread per process made each step a few milliseconds).
PACED_STEP_S = 0.1


def run_ctl_on(kubeconfig: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`ctl` with the cluster chosen by $KUBECONFIG."""
    return run_ctl(*args, cwd=cwd, env=os.environ | {"KUBECONFIG": str(kubeconfig)})


def ctl_in(kubeconfig: Path, namespace: str, cwd: Path) -> Callable[..., subprocess.CompletedProcess]:
    """`ctl ARGS -n NAMESPACE`, as a user with `kubeconfig` runs it in `cwd`."""

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return run_ctl_on(kubeconfig, *args, "-n", namespace, cwd=cwd)

    return ctl


def start_ctl_on(kubeconfig: Path, *args: str, cwd: Path) -> subprocess.Popen:
    return start_ctl(*args, cwd=cwd, env=os.environ | {"KUBECONFIG": str(kubeconfig)})


@dataclass(frozen=True)
class Follower:
    """`ctl logs NAME -f` in the background, its output gathered as it comes."""

    process: subprocess.Popen
    lines: list[str]
    reader: threading.Thread

    def text(self) -> str:
        return "".join(self.lines)

    def wait(self) -> None:
        """Until it has ended and all it wrote is read."""
        self.process.wait(timeout=60)
        self.reader.join(timeout=10)


def follow_ctl_logs(kubeconfig: Path, name: str, namespace: str, cwd: Path) -> Follower:
    process = start_ctl_on(kubeconfig, "logs", name, "-f", "-n", namespace, cwd=cwd)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    return Follower(process, lines, reader)


def ctl_on_terminal(kubeconfig: Path, *args: str, cwd: Path, **env: str) -> str:
    """`ctl`'s stdout when it is a terminal (a pseudo-terminal here)."""
    reader, writer = pty.openpty()
    process = subprocess.Popen(
        [*CTL, *args], cwd=cwd, stdout=writer, stderr=subprocess.DEVNULL,
        env=os.environ | {"KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO)} | env,
    )  # fmt: skip
    os.close(writer)
    output = b""
    with contextlib.suppress(OSError):  # EIO once ctl has exited and closed its end
        while chunk := os.read(reader, 4096):
            output += chunk
    os.close(reader)
    assert process.wait(timeout=60) == 0
    return output.decode()


def ctl_user_kubeconfig(cluster: Cluster, namespace: str) -> Path:
    """A kubeconfig with the rights k8s/rbac.yaml grants in `namespace` and no others: a member of the group it
    binds (on an external cluster, its admin kubeconfig)."""
    if cluster.plane is None:
        return cluster.kubeconfig
    client = cluster.client()
    for obj in yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text()):
        controlplane.server_side_apply(client, obj | {"metadata": obj["metadata"] | {"namespace": namespace}})
    return cluster.plane.user_kubeconfig


def spec_file(tmp_path: Path, spec: JobSpec) -> Path:
    path = tmp_path / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(spec.to_values()))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_ctl_submit_wait_status_logs_list_delete_round_trip(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """The same user-level round trip for both job APIs: a 2-node job submitted by ctl, followed, read while it
    runs, ending Succeeded with its checkpoint and report on the claim, listed and deleted."""
    marker = uuid.uuid4().hex
    name = f"rt-{marker[:6]}"
    # Long enough (a few seconds of steps) for its progress to be read while it runs.
    training = {"maxSteps": PROGRESS_STEPS, "logEvery": 25, "checkpoint": {"every": 50}}
    paced = [{"name": SLOW_RANK_ENV, "value": f"1:{PACED_STEP_S}"}]
    spec = spec_file(tmp_path, job_spec(marker, name=name, training=training, apiKind=kind.api.kind, env=paced))
    master, worker = kind.nodes

    # As a user with only k8s/rbac.yaml's Role: it is all ctl needs (pods/log, pods/proxy included).
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    if cluster.plane is not None:
        elsewhere = run_ctl_on(kubeconfig, "list", "-n", "default", cwd=tmp_path)
        assert elsewhere.returncode == 1 and "403 Forbidden" in elsewhere.stderr, elsewhere.stderr
    checked = ctl("submit", str(spec), "--dry-run", "server")
    assert (checked.returncode, checked.stdout) == (0, f"{kind.resource}/{name} (server dry run)\n"), checked.stderr
    assert ctl("status", name).returncode == EXIT_NOT_FOUND, "a server dry run created the job"

    submitted = ctl("submit", str(spec))
    assert (submitted.returncode, submitted.stdout) == (0, f"{kind.resource}/{name}\n"), submitted.stderr
    assert f"ctl logs {name} -n {namespace} -f" in submitted.stderr
    # Started before the pods run: it waits for them, then follows both until the job ends.
    follower = start_ctl_on(kubeconfig, "logs", name, "--all", "-f", "-n", namespace, cwd=tmp_path)
    watcher = start_ctl_on(kubeconfig, "status", name, "-w", "-n", namespace, cwd=tmp_path)
    again = ctl("submit", str(spec))
    assert again.returncode == 1 and f"{kind.api.kind.lower()} {name} already exists in namespace {namespace}" in (
        again.stderr
    )
    # Nor as the other kind: both would run at once on one run directory, and the first one's config be replaced.
    other = TRAINJOB if kind is PYTORCHJOB else PYTORCHJOB
    (tmp_path / "other").mkdir()
    crossed = ctl("submit", str(spec_file(tmp_path / "other", job_spec(marker, name=name, apiKind=other.api.kind))))
    assert crossed.returncode == 1 and crossed.stderr.splitlines()[-1] == (
        f"error: {kind.api.kind.lower()} {name} already exists in namespace {namespace}, and this spec is a"
        f" {other.api.kind}: the two would share its config and run directory; delete it first (ctl delete {name})"
    ), crossed.stderr
    assert [row["kind"] for row in json.loads(ctl("list", "-o", "json").stdout) if row["name"] == name] == [
        kind.api.kind
    ]
    assert ctl("wait", name, "--timeout", "500ms").returncode == EXIT_NOT_FINISHED

    progress = progress_while_running(ctl, cluster, namespace, name)
    assert progress["plannedSteps"] == PROGRESS_STEPS and 0 < progress["step"] <= PROGRESS_STEPS
    assert progress["trainLoss"] > 0 and progress["tokensPerSecond"] > 0

    done = ctl("wait", name, "--for", "succeeded", "--timeout", f"{JOB_TIMEOUT_S / 60}m")
    assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    assert set(status) == {
        "name", "namespace", "kind", "state", "progress", "trainerStatus", "prepare", "queue", "conditions",
        "replicas", "pods", "events", "cause",
    }  # fmt: skip
    assert status["queue"] is None  # no queue.kueue
    assert (status["name"], status["namespace"], status["kind"], status["state"], status["progress"]) == (
        name,
        namespace,
        kind.api.kind,
        "Succeeded",
        None,
    )
    assert status["prepare"] is None  # no prepare Job without prepare.enabled
    assert {(p["node"], p["phase"], p["exitCode"]) for p in status["pods"]} == {
        (master, "Succeeded", 0),
        (worker, "Succeeded", 0),
    }
    assert all(p["name"].startswith(f"{name}-") for p in status["pods"])
    assert set(status["replicas"]) == kind.replicas
    table = ctl("status", name).stdout
    assert table.startswith(f"{name} ({namespace}): Succeeded\n")
    if kind is PYTORCHJOB:
        assert status["trainerStatus"] is None
    else:  # rank 0 reported its progress to Trainer v2's status server, the last report at the end
        reported = status["trainerStatus"]
        assert reported["progressPercentage"] == 100 and reported["estimatedRemainingSeconds"] == 0, reported
        metrics = {m["name"]: m["value"] for m in reported["metrics"]}
        assert metrics["step"] == str(PROGRESS_STEPS) and float(metrics["loss"]) > 0, metrics
        assert "\n  trainer status: 100%, about 0 s left, " in table, table
        assert "cannot report progress" not in pod_logs(cluster, namespace)
    if cluster.plane is not None:  # the run directory on the claim: a committed checkpoint and the report
        run_dir = cluster.plane.claim_dir(namespace, f"{name}-checkpoints") / name
        assert (run_dir / (run_dir / "latest").read_text().strip() / "COMMITTED").exists()
        assert json.loads((run_dir / "report.json").read_text())["steps"] == PROGRESS_STEPS

    # The follower and the watcher end by themselves with the job.
    followed, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0, followed
    by_node: dict[str, list[str]] = {master: [], worker: []}
    for line in followed.splitlines():
        label, _, text = line.partition("] ")
        if label.startswith("["):  # the rest is ctl's notes (stderr is merged here)
            by_node[label[1:]].append(text)
    assert f"step {PROGRESS_STEPS}/{PROGRESS_STEPS}" in "\n".join(by_node[master])
    # Each process says where it runs. A TrainJob's worker can start before its master's pod has an address (a CI
    # run met it, the master waiting 14 s for its claim): its launcher waits for the name without a word, where
    # torch's lookups had warned (trainer/rendezvous.py).
    assert any(line.startswith(f"rank 1 of 2 on {name}-") for line in by_node[worker]), by_node
    assert not [line for lines in by_node.values() for line in lines if "cannot be retrieved" in line], by_node
    assert "\x1b[" not in followed  # no colour without a terminal
    watched, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 0 and watched.startswith(f"{name} ({namespace}): ")
    last = watched.rstrip().splitlines()[-1].split("  ", 1)[1]
    assert last == f"Succeeded | {master} Succeeded, {worker} Succeeded", watched

    # On a terminal the --all prefixes are coloured, unless NO_COLOR is set.
    coloured = ctl_on_terminal(kubeconfig, "logs", name, "--all", "--tail", "1", "-n", namespace, cwd=tmp_path)
    assert f"\x1b[36m[{master}]\x1b[0m " in coloured and f"\x1b[35m[{worker}]\x1b[0m " in coloured, coloured
    plain = ctl_on_terminal(
        kubeconfig, "logs", name, "--all", "--tail", "1", "-n", namespace, cwd=tmp_path, NO_COLOR="1"
    )
    assert f"[{master}] " in plain and "\x1b[" not in plain, plain

    rank0 = ctl("logs", name)
    assert rank0.returncode == 0 and rank0.stdout.splitlines() == by_node[master]
    assert ctl("logs", name, "--rank", "1").stdout.splitlines() == by_node[worker]
    assert ctl("logs", name, "--tail", "2").stdout.splitlines() == by_node[master][-2:]
    stamped = ctl("logs", name, "--timestamps", "--tail", "1").stdout
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z " + re.escape(by_node[master][-1]) + "\n", stamped)
    no_rank = ctl("logs", name, "--rank", "2")
    assert no_rank.returncode == 2 and "--rank 2: the job has 2 ranks (0-1)" in no_rank.stderr
    no_previous = ctl("logs", name, "--previous")
    assert (no_previous.returncode, no_previous.stderr) == (
        1,
        f"error: {master} of {name} has no previous log: its container has not restarted\n",
    )

    (row,) = [r for r in json.loads(ctl("list", "-o", "json").stdout) if r["name"] == name]
    assert row | {"ageSeconds": 0} == {
        "name": name,
        "namespace": namespace,
        "kind": kind.api.kind,
        "state": "Succeeded",
        "nodes": 2,
        "procsPerNode": "1",
        "ageSeconds": 0,
        "progress": None,
    }
    table = ctl("list").stdout.splitlines()
    assert table[0].split()[:4] == ["NAMESPACE", "NAME", "KIND", "STATE"]
    assert [namespace, name, kind.api.kind, "Succeeded"] in [line.split()[:4] for line in table[1:]]
    every_namespace = run_ctl_on(cluster.kubeconfig, "list", "-A", "-o", "json", cwd=tmp_path)  # cluster-wide: admin
    assert name in {r["name"] for r in json.loads(every_namespace.stdout)}

    refused = ctl("delete", name)
    assert refused.returncode == 2 and "--yes" in refused.stderr  # no terminal to ask on
    deleted = ctl("delete", name, "-y")
    assert deleted.returncode == 0, deleted.stderr
    removed = [f"{kind.api.kind.lower()}/{name}", *(item.format(name=name) for item in kind.rendered)]
    assert deleted.stdout.splitlines() == [f"{item} deleted" for item in removed]
    assert ctl("status", name).returncode == EXIT_NOT_FOUND
    assert ctl("delete", name, "-y").returncode == EXIT_NOT_FOUND
    # The run directory's claim (the checkpoints) outlives the job unless --purge.
    claims = kubernetes.client.CoreV1Api(cluster.client()).list_namespaced_persistent_volume_claim(namespace).items
    assert f"{name}-checkpoints" in {claim.metadata.name for claim in claims}
    # --purge after a deletion without it deletes the claim left (it said not found), once.
    purged = ctl("delete", name, "-y", "--purge")
    assert (purged.returncode, purged.stdout) == (0, f"persistentvolumeclaim/{name}-checkpoints deleted\n"), purged
    assert ctl("delete", name, "-y", "--purge").returncode == EXIT_NOT_FOUND
    assert_no_process_left(cluster, marker)


def progress_while_running(
    ctl: Callable[..., subprocess.CompletedProcess], cluster: Cluster, namespace: str, name: str
) -> dict[str, Any]:
    """`ctl status -o json`'s progress once rank 0 has a checkpoint and a logged loss, read while the job runs
    (and `ctl list` shows it too). Until the first loss is logged, the wait reads the pods' logs here: each `ctl
    status` is a second of the node's CPU, which would only slow the pods' start."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    wait_for("the first logged loss", lambda: f"step 25/{PROGRESS_STEPS}" in pod_logs(cluster, namespace), deadline)
    while time.monotonic() < deadline:
        status = json.loads(ctl("status", name, "-o", "json").stdout)
        progress = status["progress"]
        assert status["state"] not in ("Succeeded", "Failed"), f"ended before its progress was seen: {status}"
        if progress and progress["checkpoint"] and progress["trainLoss"] is not None:
            assert progress["checkpoint"]["step"] % 50 == 0 and progress["checkpoint"]["step"] <= progress["step"]
            (row,) = [r for r in json.loads(ctl("list", "-o", "json").stdout) if r["name"] == name]
            assert row["state"] != "Running" or row["progress"]["plannedSteps"] == PROGRESS_STEPS, row
            assert "\n  progress: step " in ctl("status", name).stdout
            return progress
        time.sleep(0.5)
    raise AssertionError(f"no progress in {JOB_TIMEOUT_S} s")


@pytest.mark.parametrize("kind", KINDS)
def test_helm_install_by_the_roles_user_runs_the_job_and_uninstall_keeps_the_claim(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """What the docs give beside ctl, as a user with only k8s/rbac.yaml's Role: `helm install` of the chart with a
    spec (Helm 4, its release records in ConfigMaps: its default driver's Secrets are not granted) makes the job,
    which succeeds; `helm uninstall` removes it and keeps the checkpoints claim (and a TrainJob's runtime, a hook)."""
    marker = uuid.uuid4().hex
    name = f"hi-{marker[:6]}"
    spec = spec_file(tmp_path, job_spec(marker, name=name, training={"maxSteps": 5}, apiKind=kind.api.kind))
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    def helm(*args: str, driver: str = "configmap") -> subprocess.CompletedProcess:
        command = [str(build_helm()), *args, "-n", namespace]
        environment = os.environ | {"KUBECONFIG": str(kubeconfig), "HELM_DRIVER": driver}
        return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120)

    install = ("install", name, str(REPO / "helm" / "ddpjob"), "-f", str(spec))
    if cluster.plane is not None:  # an external cluster's admin may read Secrets
        refused = helm(*install, driver="secret")  # Helm's default
        assert refused.returncode == 1 and "secrets is forbidden" in refused.stderr, refused.stderr
        assert ctl("status", name).returncode == EXIT_NOT_FOUND
    installed = helm(*install)
    assert installed.returncode == 0, installed.stderr
    # Helm rewrites its record once the objects are made (PUT): refused, it says so only in its log, exit 0.
    assert json.loads(helm("status", name, "-o", "json").stdout)["info"]["status"] == "deployed", installed.stderr
    done = ctl("wait", name, "--for", "succeeded")
    assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)

    uninstalled = helm("uninstall", name, "--wait")
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert helm("status", name).returncode == 1  # no record left
    assert ctl("status", name).returncode == EXIT_NOT_FOUND
    client = cluster.client()
    kubernetes.client.CoreV1Api(client).read_namespaced_persistent_volume_claim(f"{name}-checkpoints", namespace)
    if kind is TRAINJOB:
        kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
            kind.api.group, kind.api.version, namespace, RUNTIME_PLURAL, name
        )


KUEUE_API = ("kueue.x-k8s.io", "v1beta2")
# Each job's 2 pods ask 250m CPU, 1280Mi memory and 1Gi of scratch (job_spec): room for one job, not two.
ONE_JOB_QUOTA = {"cpu": "750m", "memory": "3Gi", "ephemeral-storage": "3Gi"}


def kueue_object(kind: str, name: str, spec: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    metadata = {"name": name} | ({"namespace": namespace} if namespace else {})
    return {"apiVersion": "/".join(KUEUE_API), "kind": kind, "metadata": metadata, "spec": spec}


@contextlib.contextmanager
def kueue_queue(
    cluster: Cluster, namespace: str, quota: dict[str, str], priorities: dict[str, int] | None = None
) -> Iterator[str]:
    """A LocalQueue in `namespace` (its name yielded) on a ClusterQueue of its own with `quota` in one flavor; with
    `priorities`, WorkloadPriorityClasses of those values (named `<namespace>-<key>`), and a ClusterQueue that
    preempts its lower priorities. The cluster-wide objects are deleted afterwards."""
    client = cluster.client()
    flavor = kueue_object("ResourceFlavor", namespace, {})
    resources = [{"name": resource, "nominalQuota": amount} for resource, amount in quota.items()]
    groups = [{"coveredResources": list(quota), "flavors": [{"name": namespace, "resources": resources}]}]
    preemption = {"preemption": {"withinClusterQueue": "LowerPriority"}} if priorities else {}
    queue = kueue_object("ClusterQueue", namespace, {"namespaceSelector": {}, "resourceGroups": groups} | preemption)
    local = kueue_object("LocalQueue", "team", {"clusterQueue": namespace}, namespace)
    classes = [
        {"apiVersion": "/".join(KUEUE_API), "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}
        for name, value in ((f"{namespace}-{key}", value) for key, value in (priorities or {}).items())
    ]
    try:
        for obj in (*classes, flavor, queue, local):
            controlplane.server_side_apply(client, obj)
        yield local["metadata"]["name"]
    finally:
        api = kubernetes.client.CustomObjectsApi(client)
        cluster_wide = [("clusterqueues", namespace), ("resourceflavors", namespace)]
        for plural, name in cluster_wide + [("workloadpriorityclasses", c["metadata"]["name"]) for c in classes]:
            with contextlib.suppress(kubernetes.client.ApiException):
                api.delete_cluster_custom_object(*KUEUE_API, plural, name)


def job_pods(cluster: Cluster, namespace: str, kind: Kind, job: str) -> list[kubernetes.client.V1Pod]:
    core = kubernetes.client.CoreV1Api(cluster.client())
    return core.list_namespaced_pod(namespace, label_selector=kind.api.pods_selector(job)).items


def workload_status(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    """The status of Kueue's Workload of a job (the one it owns); empty while there is none."""
    api = kubernetes.client.CustomObjectsApi(cluster.client())
    workloads = api.list_namespaced_custom_object(*KUEUE_API, namespace, "workloads")["items"]
    owned = [w for w in workloads if job in {o["name"] for o in w["metadata"].get("ownerReferences", [])}]
    return owned[0].get("status", {}) if owned else {}


@pytest.mark.parametrize("kind", KINDS)
def test_kueue_starts_a_queued_job_only_when_its_queue_has_quota_for_all_its_pods(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """`queue.kueue` hands the job to a real Kueue: its webhook creates the job suspended, and Kueue starts it once
    the ClusterQueue behind the LocalQueue has quota for every pod the job asks for. Two jobs whose pods the node
    would run side by side, in a queue with room for one: the second waits, suspended and without pods, until the
    first has succeeded, then runs and succeeds. Meanwhile `ctl status` and `ctl logs -f` (as the Role's user) say
    why, in Kueue's words from its Workload."""
    marker = uuid.uuid4().hex
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    with kueue_queue(cluster, namespace, ONE_JOB_QUOTA) as local_queue:
        first, second = (f"kq{n}-{marker[:6]}" for n in (1, 2))
        for name in (first, second):
            spec = job_spec(
                marker, name=name, training={"maxSteps": 5}, apiKind=kind.api.kind, queue={"kueue": local_queue}
            )
            submitted = ctl("submit", str(spec_file(tmp_path, spec)))
            assert submitted.returncode == 0, submitted.stderr
            if name == first:  # admitted before the second exists, so the queue's order cannot decide
                wait_for(
                    f"{first} admitted",
                    lambda: workload_status(cluster, namespace, first).get("admission"),
                    time.monotonic() + JOB_TIMEOUT_S,
                )

        def held() -> str | None:
            """Kueue's reason for not admitting the second job, once it has one."""
            conditions = workload_status(cluster, namespace, second).get("conditions", [])
            reserved = [c for c in conditions if c["type"] == "QuotaReserved" and c["status"] == "False"]
            return reserved[0]["message"] if reserved else None

        reason = wait_for(f"Kueue's reason to hold {second}", held, time.monotonic() + JOB_TIMEOUT_S)
        assert "insufficient unused quota" in reason, reason
        follower = start_ctl_on(kubeconfig, "logs", second, "-f", "-n", namespace, cwd=tmp_path)
        status = json.loads(ctl("status", second, "-o", "json").stdout)
        assert (status["state"], status["queue"]["localQueue"], status["queue"]["admitted"]) == (
            "Suspended",
            local_queue,
            False,
        ), status
        assert "insufficient unused quota" in status["queue"]["pending"], status
        assert f"  queue: {local_queue} (Kueue): not admitted: " in ctl("status", second).stdout
        assert job_pods(cluster, namespace, kind, second) == []

        for name in (first, second):
            done = ctl("wait", name, "--for", "succeeded", "--timeout", f"{JOB_TIMEOUT_S / 60}m")
            assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)
        followed, _ = follower.communicate(timeout=60)  # its notes and then the log, which ends with the job
        assert follower.returncode == 0 and "step 5/5" in followed, followed
        assert f"{second} waits in Kueue's LocalQueue {local_queue}: couldn't assign flavors" in followed, followed
        assert json.loads(ctl("status", second, "-o", "json").stdout)["queue"]["admitted"] is True
        # Its terminal condition is its newest.
        ended = max(
            datetime.datetime.fromisoformat(c["lastTransitionTime"])
            for c in kind.get(cluster, namespace, first)["status"]["conditions"]
        )
        started = min(pod.metadata.creation_timestamp for pod in job_pods(cluster, namespace, kind, second))
        assert started >= ended, f"{second}'s pods were made at {started}, before {first} ended at {ended}"
    assert_no_process_left(cluster, marker)


# One kind: a TrainJob that Kueue holds and starts is the test above's, and one suspended, saving and going on from
# its checkpoint is test_ctl_suspend_stops_the_pods_after_a_checkpoint_and_ctl_resume_goes_on_from_it's; Kueue
# preempts either by that same suspend field.
def test_a_job_kueue_preempts_for_a_higher_priority_one_saves_and_goes_on_from_its_checkpoint(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """queue.kueuePriorityClass names a real WorkloadPriorityClass, in a ClusterQueue with room for one job that
    preempts lower priorities. A high-priority job submitted while a low-priority one trains makes Kueue evict the
    low one: Kueue suspends it, its pods get SIGTERM and rank 0 saves. The high one runs and succeeds; then Kueue
    admits the low one again, and its new pods go on from that checkpoint to the last step. Meanwhile `ctl logs -f`
    (as the Role's user) says why the low one waits."""
    kind, marker = PYTORCHJOB, uuid.uuid4().hex
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    low, high = (f"{priority}-{marker[:6]}" for priority in ("low", "high"))
    with kueue_queue(cluster, namespace, ONE_JOB_QUOTA, {"low": 100, "high": 1000}) as local_queue:
        for name, training in ((low, LONG_TRAINING), (high, {"maxSteps": 5})):
            queue = {"kueue": local_queue, "kueuePriorityClass": f"{namespace}-{name.split('-')[0]}"}
            spec = job_spec(marker, name=name, training=training, apiKind=kind.api.kind, queue=queue)
            if name == high:
                deadline = time.monotonic() + JOB_TIMEOUT_S
                wait_for(f"{low} at step 100", lambda: "step 100/600" in pod_logs(cluster, namespace), deadline)
            submitted = ctl("submit", str(spec_file(tmp_path, spec)))
            assert submitted.returncode == 0, submitted.stderr
            if name == low:
                follower = start_ctl_on(kubeconfig, "logs", low, "-f", "-n", namespace, cwd=tmp_path)
        for name in (high, low):
            done = ctl("wait", name, "--for", "succeeded", "--timeout", f"{JOB_TIMEOUT_S}s")
            assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)
        followed, _ = follower.communicate(timeout=60)
        assert_resumed_from_its_checkpoint(followed, kind)
        assert f"{low} waits in Kueue's LocalQueue {local_queue}: " in followed, followed
        evictions = workload_status(cluster, namespace, low)["schedulingStats"]["evictions"]
        assert [(e["reason"], e["count"]) for e in evictions] == [("Preempted", 1)], evictions
    assert_no_process_left(cluster, marker)


def assert_resumed_from_its_checkpoint(followed: str, kind: Kind) -> None:
    """`ctl logs -f` of a job whose pods were stopped after step 100 and made anew: rank 0 saved at the SIGTERM, and
    the new pods went on from that checkpoint to the last of LONG_TRAINING's steps."""
    saved = re.search(r"stop requested \(SIGTERM\): saved (step-\d{8}) at step (\d+)/600", followed)
    assert saved and 100 <= int(saved[2]) < 600, followed
    assert f"resuming from {saved[1]}:" in followed and "step 600/600" in followed, followed
    assert f"{kind.nodes[0]}: new pod" in followed, followed


# Room in a ClusterQueue for every job of the tests at once.
ROOMY_QUOTA = {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "16Gi"}
SUSPENDED = [
    pytest.param(PYTORCHJOB, False, id="PyTorchJob"),
    pytest.param(TRAINJOB, False, id="TrainJob"),
    pytest.param(PYTORCHJOB, True, id="PyTorchJob-Kueue"),
]


@pytest.mark.parametrize(("kind", "queued"), SUSPENDED)
def test_ctl_suspend_stops_the_pods_after_a_checkpoint_and_ctl_resume_goes_on_from_it(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind, queued: bool
) -> None:
    """`ctl suspend` (as the Role's user) sets the job's suspend field, or, for a job of queue.kueue, deactivates
    its Workload, and Kueue suspends the job (which, without Kueue, was created suspended, and `ctl submit` said to
    `ctl resume` it first). Either way the controller deletes the pods: their trainers get SIGTERM,
    stop at one agreed step, and rank 0 saves it. The job waits Suspended, without pods, and `ctl logs -f` says what
    resumes it. `ctl resume` has the pods made again, and they go on from that checkpoint to the last step. Both
    commands leave a job already as asked unchanged, and refuse one that has ended."""
    marker = uuid.uuid4().hex
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    name, deadline = f"sr-{marker[:6]}", time.monotonic() + JOB_TIMEOUT_S
    with contextlib.ExitStack() as stack:
        queue = {"kueue": stack.enter_context(kueue_queue(cluster, namespace, ROOMY_QUOTA))} if queued else {}
        created_suspended = {"suspend": not queued}
        spec = job_spec(
            marker, name=name, training=LONG_TRAINING, apiKind=kind.api.kind, queue=queue, runPolicy=created_suspended
        )
        submitted = ctl("submit", str(spec_file(tmp_path, spec)))
        assert submitted.returncode == 0, submitted.stderr
        follower = follow_ctl_logs(kubeconfig, name, namespace, tmp_path)
        # ctl logs -f polls: each suspension is resumed only once it has noted it (without Kueue, it notes the job
        # created suspended, and again once stopped).
        inactive = f"waits in Kueue's LocalQueue {queue.get('kueue')}: its Workload is inactive"
        held = f"{name} {inactive if queued else 'is suspended: `ctl resume'}"

        def noted(times: int) -> bool:
            return follower.text().count(held) == times

        if not queued:
            assert f"next: ctl resume {name} -n {namespace}  |  " in submitted.stderr, submitted.stderr
            wait_for(
                f"{name} created suspended",
                lambda: kind.api.state(kind.get(cluster, namespace, name)) == "Suspended",
                deadline,
            )
            assert not job_pods(cluster, namespace, kind, name)
            wait_for("ctl logs -f to note the job created suspended", lambda: noted(1), deadline)
            assert ctl("resume", name).stdout == f"{kind.resource}/{name} resumed\n"
        wait_for("step 100", lambda: "step 100/600" in pod_logs(cluster, namespace), deadline)

        suspended = ctl("suspend", name)
        assert (suspended.returncode, suspended.stdout) == (0, f"{kind.resource}/{name} suspended\n"), suspended.stderr
        assert "rank 0 saves a checkpoint" in suspended.stderr
        again = ctl("suspend", name)
        assert (again.returncode, again.stdout) == (0, f"{kind.resource}/{name} suspended (no change)\n"), again.stderr
        wait_for(f"{name}'s pods gone", lambda: not job_pods(cluster, namespace, kind, name), deadline)
        status = json.loads(ctl("status", name, "-o", "json").stdout)
        assert status["state"] == "Suspended", status
        if queued:
            assert kind.get(cluster, namespace, name)["spec"]["runPolicy"]["suspend"] is True  # by Kueue
            assert "its Workload is inactive" in status["queue"]["pending"], status
        wait_for("ctl logs -f to note the suspension", lambda: noted(1 if queued else 2), deadline)

        resumed = ctl("resume", name)
        assert (resumed.returncode, resumed.stdout) == (0, f"{kind.resource}/{name} resumed\n"), resumed.stderr
        done = ctl("wait", name, "--for", "succeeded", "--timeout", f"{JOB_TIMEOUT_S}s")
        assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)
        follower.wait()
        assert_resumed_from_its_checkpoint(follower.text(), kind)
        assert noted(1 if queued else 2), follower.text()
        ended = ctl("resume", name)
        assert ended.returncode == 1, ended.stdout
        assert f"{kind.api.kind.lower()} {name} has ended (Succeeded): there is nothing to resume" in ended.stderr
    assert ctl("suspend", f"{name}-none").returncode == EXIT_NOT_FOUND
    assert_no_process_left(cluster, marker)


# queue.kueueMaxExecutionSeconds of the test below: a job's pods start and train well within it, and it ends
# long before the job's 6000 steps would. 20 s was too short on a slow day (2026-12-05, the e2e tier at about half
# its usual speed): Kueue deactivated the job while its pods were still preparing the data, before any step. So was
# 45 s in a CI run on such a day (2026-12-06), while the test polled `ctl status` meanwhile: a second of CPU each,
# taken from the pods' start on the 2-core node. The test now waits on the Workload itself.
KUEUE_BUDGET_S = 60


# One kind: what differs between the two is Kueue suspending the job and its pods saving, which the preemption test
# above has for both; the deactivation, its reason and ctl's words about it are the Workload's, whichever the kind.
def test_kueue_deactivates_a_job_past_its_execution_time_after_a_checkpoint_and_ctl_says_why(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """queue.kueueMaxExecutionSeconds: `ctl status` counts the time the job uses, and once it has been admitted that
    long, the real Kueue deactivates its Workload and suspends it. The pods get SIGTERM and rank 0 saves. The job
    waits Suspended, without pods, and `ctl status` and `ctl logs -f` (as the Role's user) give Kueue's reason and
    what goes on. Kueue would deactivate the Workload again at once, so `ctl resume` refuses and says so;
    `ctl submit --replace` makes the job anew, with the time again, and it goes on from the checkpoint."""
    kind, marker = PYTORCHJOB, uuid.uuid4().hex
    kubeconfig = ctl_user_kubeconfig(cluster, namespace)
    ctl = ctl_in(kubeconfig, namespace, tmp_path)

    name, deadline = f"mx-{marker[:6]}", time.monotonic() + JOB_TIMEOUT_S
    with kueue_queue(cluster, namespace, ROOMY_QUOTA) as local_queue:
        queue = {"kueue": local_queue, "kueueMaxExecutionSeconds": KUEUE_BUDGET_S}
        training = LONG_TRAINING | {"maxSteps": 6000}
        spec = job_spec(marker, name=name, training=training, apiKind=kind.api.kind, queue=queue)
        submitted = ctl("submit", str(spec_file(tmp_path, spec)))
        assert submitted.returncode == 0, submitted.stderr
        follower = follow_ctl_logs(kubeconfig, name, namespace, tmp_path)

        def status() -> dict[str, Any]:
            return json.loads(ctl("status", name, "-o", "json").stdout)

        def condition(wanted: str) -> bool:
            return wanted in conditions({"status": workload_status(cluster, namespace, name)})

        # While it runs, `ctl status` counts the time it has used up. Each wait is on the Workload first, read here:
        # a `ctl status` is a second of the node's CPU, which the pods need to train within the budget.
        wait_for(f"Kueue to admit {name}", lambda: condition("Admitted"), deadline)
        budget = rf"  queue: {local_queue} \(Kueue\): admitted, \d+s of its {KUEUE_BUDGET_S}s time budget used$"
        wait_for("ctl status to count the time", lambda: re.search(budget, ctl("status", name).stdout, re.M), deadline)
        why = "due to exceeding the maximum execution time"
        inactive = f"Kueue deactivated its Workload {why}, and would again if activated: `ctl submit SPEC --replace"
        wait_for(f"Kueue to deactivate {name}", lambda: condition("DeactivationTarget"), deadline)
        wait_for("ctl status to say why", lambda: inactive in str(status()["queue"]), deadline)
        wait_for(f"{name}'s pods gone", lambda: not job_pods(cluster, namespace, kind, name), deadline)
        stopped = status()
        assert (stopped["state"], stopped["queue"]["timeBudgetSeconds"]) == ("Suspended", KUEUE_BUDGET_S), stopped
        assert stopped["queue"]["timeUsedSeconds"] >= KUEUE_BUDGET_S, stopped
        note = f"{name} waits in Kueue's LocalQueue {local_queue}: {inactive}"
        wait_for("ctl logs -f to note why", lambda: note in follower.text(), deadline)
        saved = re.search(r"stop requested \(SIGTERM\): saved (step-\d{8}) at step (\d+)/6000", follower.text())
        assert saved, follower.text()

        evictions = workload_status(cluster, namespace, name)["schedulingStats"]["evictions"]
        causes = [(e["reason"], e["underlyingCause"]) for e in evictions]
        assert causes == [("Deactivated", "MaximumExecutionTimeExceeded")], evictions

        # Kueue would deactivate it again at once: ctl resume says so, and a new job goes on from the checkpoint.
        refused = ctl("resume", name)
        assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
        assert f"{name}: Kueue deactivated its Workload {why}, and would again if activated: " in refused.stderr
        follower.process.terminate()
        follower.wait()
        again = ctl("submit", str(spec_file(tmp_path, spec)), "--replace")
        assert again.returncode == 0, again.stderr
        wait_for("the new job to go on", lambda: f"resuming from {saved[1]}:" in pod_logs(cluster, namespace), deadline)
        assert ctl("delete", name, "-y").returncode == 0
    assert_no_process_left(cluster, marker)


def test_a_trainjob_denied_before_the_webhook_sees_its_runtime_is_applied_again(
    cluster: Cluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer v2's webhook looks a TrainJob's runtime up in its operator's cache, which can lag the API server
    just after `ctl submit` applied the runtime (a CI run met it: `TrainingRuntime ... not found`, exit 1), and so
    does Kueue's (`runtime '...' not found`). That lag cannot be provoked on demand, so the real denial (of whichever
    webhook answers first: the API server calls both at once), taken while no runtime existed, is replayed once
    after the runtime is applied; a job whose runtime is really missing gets that denial at once."""
    name = f"lag-{uuid.uuid4().hex[:6]}"
    spec = job_spec(name, name=name, apiKind="TrainJob", runPolicy={"suspend": True})
    objects = {m.obj["kind"]: m.obj | {"metadata": m.obj["metadata"] | {"namespace": namespace}} for m in render(spec)}
    target = Target(cluster.client(), namespace)
    started = time.monotonic()
    with pytest.raises(ClusterError, match=f"(\"{name}\"|runtime '{name}') not found") as denied:
        apply_job(target, objects["TrainJob"])
    assert time.monotonic() - started < RUNTIME_SEEN_WAIT_S / 2, "a missing runtime was waited for"

    apply(target, objects["TrainingRuntime"])
    calls = 0

    def lagging(*args: Any, **options: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise denied.value
        return apply(*args, **options)

    monkeypatch.setattr(ctl_jobs, "apply", lagging)
    assert apply_job(target, objects["TrainJob"])["metadata"]["name"] == name
    assert calls >= 2
    assert TRAINJOB.get(cluster, namespace, name)["spec"]["runtimeRef"]["name"] == name


@pytest.mark.parametrize("kind", KINDS)
def test_ctl_wait_exit_codes_for_a_failed_and_a_missing_job(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """A trainer that exits on bad input fails the job, with no retry: restartPolicy Never for a PyTorchJob;
    ExitCode for a TrainJob, whose Job fails at once on exit codes 1-127 (its podFailurePolicy; Never would
    retry the pod up to the Job's backoffLimit). `ctl status` shows the root cause: the trainer's exit code 2."""
    marker = uuid.uuid4().hex
    name = f"fail-{marker[:6]}"
    missing_data = ["/nonexistent/ddpjob-e2e/train.txt"]
    restart_policy = "Never" if kind is PYTORCHJOB else "ExitCode"
    spec = spec_file(
        tmp_path, job_spec(marker, missing_data, name=name, restartPolicy=restart_policy, apiKind=kind.api.kind)
    )
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    # --follow: rank 0's log (the trainer's one-line error) until the job has failed, then its exit code.
    followed = ctl("submit", str(spec), "--follow", "--timeout", str(JOB_TIMEOUT_S))
    assert followed.returncode == EXIT_JOB_FAILED, followed.stderr
    assert "/nonexistent/ddpjob-e2e/train.txt" in followed.stdout, followed.stdout + followed.stderr
    # Its last line is the root cause, as `ctl wait`'s: a failed pod's (the first by node rank).
    cause = re.compile(rf"error: {name} failed: {name}-\S+: training\.data\.train: no file matches '/nonexistent/")
    assert cause.match(followed.stderr.splitlines()[-1]), followed.stderr
    assert ctl("wait", name, "--for", "failed").returncode == 0
    failed = ctl("wait", name, "--for", "succeeded")
    assert failed.returncode == EXIT_JOB_FAILED and cause.match(failed.stderr.splitlines()[-1]), failed.stderr
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    # The job fails with its first failed pod (the other may still be ending).
    assert status["state"] == "Failed" and EXIT_BAD_INPUT in {p["exitCode"] for p in status["pods"]}
    table = ctl("status", name).stdout
    assert table.startswith(f"{name} ({namespace}): Failed\n") and re.search(r" Failed +0 +2  Error\n", table), table
    # One line per pod, condition and event: an operator's event quotes the pod's termination message, lines and all.
    assert all(line.startswith("  ") for line in table.splitlines()[1:]), table
    missing = ctl("wait", "no-such-job")
    assert (missing.returncode, missing.stderr) == (
        EXIT_NOT_FOUND,
        f"error: job no-such-job not found in namespace {namespace} (neither PyTorchJob nor TrainJob)\n",
    )

    # --replace: the job is deleted and created anew (and fails again, on its own).
    first = kind.get(cluster, namespace, name)["metadata"]["uid"]
    replaced = ctl("submit", str(spec), "--replace", "--wait", "--timeout", str(JOB_TIMEOUT_S))
    assert replaced.returncode == EXIT_JOB_FAILED, replaced.stderr
    assert kind.get(cluster, namespace, name)["metadata"]["uid"] != first
    assert_no_process_left(cluster, marker)


# One restart in all, then the pods are deleted (cleanPodPolicy All: with None the operator may recreate them).
ON_FAILURE_ONCE = {"backoffLimit": 1, "cleanPodPolicy": "All"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_root_cause_outlives_the_pods_deleted_under_restart_policy_on_failure(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """restartPolicy OnFailure, the default: the containers restart in place until runPolicy.backoffLimit, then the
    operator stops the pods (exit 143) and deletes them. `ctl wait` gave the job's condition (the backoff limit), and
    the pods' exit 143 before it. A PyTorchJob's cause outlives them in the operator's event quoting the first
    failed container's termination message; a TrainJob's Job leaves no such event, and `wait` tells what it saw a
    pod show while the job ran."""
    marker = uuid.uuid4().hex
    name = f"onf-{marker[:6]}"
    run_policy = ON_FAILURE_ONCE if kind is PYTORCHJOB else {"backoffLimit": 1}  # a TrainJob has no cleanPodPolicy
    values = {"name": name, "runPolicy": run_policy, "apiKind": kind.api.kind}
    spec = spec_file(tmp_path, job_spec(marker, ["/nonexistent/ddpjob-e2e/train.txt"], **values))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    waited = ctl("submit", str(spec), "--wait", "--timeout", str(JOB_TIMEOUT_S))
    assert waited.returncode == EXIT_JOB_FAILED, waited.stderr
    cause = rf"{name}-\S+: training\.data\.train: no file matches '/nonexistent/ddpjob-e2e/train\.txt'"
    assert re.fullmatch(rf"error: {name} failed: {cause}", waited.stderr.splitlines()[-1]), waited.stderr
    if kind is not PYTORCHJOB:
        assert_no_process_left(cluster, marker)
        return
    wait_for_deletion(cluster, namespace, name)
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    assert (status["state"], status["pods"]) == ("Failed", []) and re.fullmatch(cause, status["cause"]), status
    assert re.search(rf"^  cause: {cause}$", ctl("status", name).stdout, re.M)
    assert_no_process_left(cluster, marker)


def test_a_pod_that_cannot_start_says_why(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """An image no node can pull (a registry that refuses connections, at once): its pods wait for ever, and
    `submit --follow` (as `ctl logs`) said only "waiting for master-0 to start", `ctl status` gave no reason, and
    the timeout ended it with the state alone."""
    marker = uuid.uuid4().hex
    name = f"nostart-{marker[:6]}"
    image = {"repository": "localhost:1/ddpjob", "tag": "0.0.0"}
    spec = spec_file(tmp_path, job_spec(marker, name=name, image=image))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    timeout_s = 15  # the pull is refused at once: the pod says so within seconds, even on a slow day
    followed = ctl("submit", str(spec), "--follow", "--timeout", str(timeout_s))
    assert followed.returncode == EXIT_NOT_FINISHED, followed.stderr
    told = rf"^master-0 of {name} is not starting: (ErrImagePull|ImagePullBackOff): \S"
    assert re.search(told, followed.stderr, re.M), followed.stderr
    ended = rf"error: {name} is still \w+ after {timeout_s} s \(--timeout\)\n$"
    assert re.search(ended, followed.stderr), followed.stderr
    table = ctl("status", name).stdout
    assert re.search(rf"  {name}-master-0 +Pending +0 +(ErrImagePull|ImagePullBackOff)\n", table), table
    assert re.search(rf"^  {name}-master-0: \S", table, re.M), table  # the runtime's message, one line
    assert ctl("delete", name, "-y").returncode == 0


def test_an_object_the_cluster_refuses_leaves_nothing_created(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """`ctl submit` sends every object through the server's dry run first: a user whose Role reads and deletes
    PyTorchJobs but may not create them (k8s/rbac.yaml less that right) gets one line, and neither the job's claim
    nor its config exists after. Under --replace the new job is checked as a creation (under a stand-in name) before
    the old one is deleted: the old one stays."""
    if cluster.plane is None:
        pytest.skip("binds a narrower Role to the tier's ctl user: needs the tier's control plane")
    client = cluster.client()
    for obj in yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text()):
        for rule in obj.get("rules", []):
            if rule["resources"] == [V1.plural]:
                rule["verbs"] = ["get", "list", "watch", "delete"]
        controlplane.server_side_apply(client, obj | {"metadata": obj["metadata"] | {"namespace": namespace}})
    marker = uuid.uuid4().hex
    name = f"ro-{marker[:6]}"
    spec = spec_file(tmp_path, job_spec(marker, name=name))
    refused = run_ctl_on(cluster.plane.user_kubeconfig, "submit", str(spec), "-n", namespace, cwd=tmp_path)
    assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
    *notes, line = refused.stderr.splitlines()  # a note: this Role cannot read StorageClasses
    assert all(n.startswith("note: ") for n in notes) and line.startswith("error: PATCH "), refused.stderr
    assert f'403 Forbidden: {V1.plural}.{V1.group} "' in line and f'cannot patch resource "{V1.plural}"' in line
    core = kubernetes.client.CoreV1Api(client)
    assert core.list_namespaced_persistent_volume_claim(namespace).items == []
    assert core.list_namespaced_config_map(namespace, label_selector=f"app.kubernetes.io/instance={name}").items == []
    suspended = ("-n", namespace, "--set", "runPolicy.suspend=true")  # no pods: only the job object matters
    created = run_ctl_on(cluster.kubeconfig, "submit", str(spec), *suspended, cwd=tmp_path)  # by the admin
    assert created.returncode == 0, created.stderr
    jobs = kubernetes.client.CustomObjectsApi(client)
    uid = jobs.get_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural, name)["metadata"]["uid"]
    refused = run_ctl_on(cluster.plane.user_kubeconfig, "submit", str(spec), *suspended, "--replace", cwd=tmp_path)
    assert (refused.returncode, refused.stdout) == (1, ""), refused.stderr
    *notes, line = refused.stderr.splitlines()
    assert all(n.startswith("note: ") for n in notes), refused.stderr
    assert line.startswith(f"error: {V1.kind.lower()} {name}, checked as a new one named ro-"), refused.stderr
    assert f'cannot patch resource "{V1.plural}"' in line and name not in line.split(": PATCH ")[1]
    assert jobs.get_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural, name)["metadata"]["uid"] == uid


def test_ctl_submit_refuses_read_write_many_from_a_block_storage_class(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """A 2-node job's claim asks ReadWriteMany; from a class of EBS volumes (named, or the cluster's default, as on
    EKS) it would never bind: ctl says so in one line, exit 2, and creates nothing. A 1-node job's claim asks
    ReadWriteOnce, which the same class gives: it is accepted."""
    marker = uuid.uuid4().hex
    block = f"ebs-{marker[:8]}"
    classes = kubernetes.client.StorageV1Api(cluster.client())
    default = {"storageclass.kubernetes.io/is-default-class": "true"}
    classes.create_storage_class(
        {"metadata": {"name": block, "annotations": default}, "provisioner": "ebs.csi.aws.com"}
    )
    spec = spec_file(tmp_path, job_spec(marker, name=f"rwx-{marker[:6]}"))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    try:
        for chosen, which in (
            (block, f"storage class {block}"),
            ("", f"storage class {block} (the cluster's default)"),
        ):
            refused = ctl("submit", str(spec), "--set", f"storage.storageClassName={chosen}")
            assert refused.returncode == 2 and refused.stdout == "", refused.stderr
            assert (
                refused.stderr.count("\n") == 1 and f"asks ReadWriteMany, which {which} cannot give" in refused.stderr
            )
            assert "ebs.csi.aws.com" in refused.stderr and "k8s/README.md" in refused.stderr
        core = kubernetes.client.CoreV1Api(cluster.client())
        assert core.list_namespaced_persistent_volume_claim(namespace).items == []
        mine = f"app.kubernetes.io/instance=rwx-{marker[:6]}"
        assert core.list_namespaced_config_map(namespace, label_selector=mine).items == []
        jobs = kubernetes.client.CustomObjectsApi(cluster.client())
        assert jobs.list_namespaced_custom_object(V1.group, V1.version, namespace, V1.plural)["items"] == []
        single = ctl("submit", str(spec), "--set", "nodes=1", "--dry-run=server")
        assert single.returncode == 0, single.stderr
    finally:
        classes.delete_storage_class(block)


def sdk_train() -> None:
    """The Kubeflow SDK's training function: it runs in the SDK job's pods under torchrun (source copied by it)."""
    import os

    print(f"hello from rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)


def test_kubeflow_sdk_and_ctl_manage_each_others_jobs(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """Interop with kubeflow-training's TrainingClient: it reads and deletes a job `ctl submit` created (get,
    conditions, pods, logs), and ctl status/logs/delete work on a job the SDK created from a function."""
    from kubeflow.training import TrainingClient

    marker = uuid.uuid4().hex
    ours, theirs = f"ctl-{marker[:6]}", f"sdk-{marker[:6]}"
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    sdk = TrainingClient(config_file=str(cluster.kubeconfig), namespace=namespace)
    assert ctl("submit", str(spec_file(tmp_path, job_spec(marker, name=ours)))).returncode == 0
    sdk.create_job(
        name=theirs,
        train_func=sdk_train,
        num_workers=2,
        num_procs_per_worker=1,
        base_image=IMAGE,
        env_vars={MARKER_ENV: marker},
    )

    # The SDK on ctl's job.
    sdk.wait_for_job_conditions(ours, timeout=JOB_TIMEOUT_S, polling_interval=1)
    assert sdk.is_job_succeeded(ours) and sdk.get_job(ours).metadata.name == ours
    assert {"Created", "Running", "Succeeded"} <= {c.type for c in sdk.get_job_conditions(ours)}
    assert sorted(sdk.get_job_pod_names(ours, is_master=False)) == [f"{ours}-master-0", f"{ours}-worker-0"]
    logs, _ = sdk.get_job_logs(ours)  # the master's, as the SDK reads it by default
    assert "step 5/5" in logs[f"{ours}-master-0"]

    # ctl on the SDK's job: no chart labels, no metrics port, a command of its own.
    assert ctl("wait", theirs, "--timeout", str(JOB_TIMEOUT_S)).returncode == 0, pod_logs(cluster, namespace)
    status = json.loads(ctl("status", theirs, "-o", "json").stdout)
    assert (status["state"], status["progress"]) == ("Succeeded", None)
    assert {(p["name"], p["exitCode"]) for p in status["pods"]} == {
        (f"{theirs}-master-0", 0),
        (f"{theirs}-worker-0", 0),
    }
    both = ctl("logs", theirs, "--all")
    assert both.returncode == 0, both.stderr
    lines = set(both.stdout.splitlines())
    assert {"[master-0] hello from rank 0 of 2", "[worker-0] hello from rank 1 of 2"} <= lines, both.stdout
    assert "hello from rank 1 of 2" in ctl("logs", theirs, "--rank", "1").stdout.splitlines()
    assert ctl("delete", theirs, "-y").stdout.splitlines() == [f"pytorchjob/{theirs} deleted"]
    assert theirs not in {job.metadata.name for job in sdk.list_jobs()}

    sdk.delete_job(ours)
    assert ctl("wait", ours).returncode == EXIT_NOT_FOUND
    assert_no_process_left(cluster, marker)


def test_kubeflow_trainer_sdk_and_ctl_manage_each_others_trainjobs(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """Interop with the Kubeflow SDK's TrainerClient (Trainer v2): it lists, reads the logs of and waits for a
    TrainJob `ctl submit` created, and ctl status/logs/delete work on a TrainJob the SDK created from a function
    (on the runtime ctl's job brought). On the tier's node, which has no GPU, the pods' GPU request is met by GPUs
    the test advertises on the Node, as an administrator advertises an extended resource (the trainer, finding no
    CUDA device, runs on the CPU)."""
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import CustomTrainer, TrainerClient

    marker = uuid.uuid4().hex
    ours = f"ctl-{marker[:6]}"
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    sdk = TrainerClient(KubernetesBackendConfig(namespace=namespace, config_file=str(cluster.kubeconfig)))
    # kubeflow 0.5 describes a runtime (and so a TrainJob) only when its trainer has a cpu, GPU, TPU or NPU limit
    # (kubernetes/utils.py get_container_devices); the chart sets none for the CPU (a throttled rank would hold
    # up the others), so the job asks for a GPU, which this executor ignores and the trainer does not need.
    resources = {"cpu": "250m", "memory": "1Gi", "shm": "256Mi", "cache": "1Gi", "gpu": 1}
    spec = spec_file(tmp_path, job_spec(marker, name=ours, apiKind="TrainJob", resources=resources))
    advertise_gpus(cluster, 4)  # or the pods would never be scheduled on the tier's node
    assert ctl("submit", str(spec)).returncode == 0

    # The SDK on ctl's job.
    sdk.wait_for_job_status(ours, status={"Complete"}, timeout=JOB_TIMEOUT_S, polling_interval=1)
    assert ours in {job.name for job in sdk.list_jobs()}
    job = sdk.get_job(ours)
    assert (job.status, job.num_nodes, job.runtime.name) == ("Complete", 2, ours)
    assert "step 5/5" in "\n".join(sdk.get_job_logs(ours))  # node 0's, as the SDK reads it by default

    # ctl on the SDK's job: no chart labels, a command of its own, the runtime's processes per node.
    trainer = CustomTrainer(func=sdk_train, num_nodes=2, env={MARKER_ENV: marker})
    theirs = sdk.train(runtime=sdk.get_runtime(ours), trainer=trainer)
    assert ctl("wait", theirs, "--timeout", str(JOB_TIMEOUT_S)).returncode == 0, pod_logs(cluster, namespace)
    status = json.loads(ctl("status", theirs, "-o", "json").stdout)
    assert (status["kind"], status["state"], status["progress"]) == ("TrainJob", "Succeeded", None)
    assert {(p["node"], p["exitCode"]) for p in status["pods"]} == {("node-0", 0), ("node-1", 0)}
    both = ctl("logs", theirs, "--all")
    assert both.returncode == 0, both.stderr
    # The runtime's torch policy leaves the processes per node to torchrun (`auto`), whose ranks share the pod's
    # output: their lines may interleave.
    text = {name: "".join(line.partition("] ")[2] for line in both.stdout.splitlines() if line.startswith(f"[{name}] "))
            for name in ("node-0", "node-1")}  # fmt: skip
    assert "hello from rank 0 of " in text["node-0"] and "hello from rank " in text["node-1"], both.stdout
    assert ctl("delete", theirs, "-y").stdout.splitlines() == [f"trainjob/{theirs} deleted"]
    assert theirs not in {job.name for job in sdk.list_jobs()}

    sdk.delete_job(ours)
    assert ctl("wait", ours).returncode == EXIT_NOT_FOUND
    assert_no_process_left(cluster, marker)
    advertise_gpus(cluster, 0)


def advertise_gpus(cluster: Cluster, count: int) -> None:
    """`count` nvidia.com/gpu in the tier's Node's capacity (its status, as Kubernetes documents advertising an
    extended resource; the kubelet keeps what no device plugin of its own manages); 0 removes them."""
    if cluster.plane is None:
        return
    core = kubernetes.client.CoreV1Api(cluster.client())
    path = "/status/capacity/nvidia.com~1gpu"
    operation = {"op": "add", "path": path, "value": str(count)} if count else {"op": "remove", "path": path}
    core.api_client.call_api(
        f"/api/v1/nodes/{NODE_NAME}/status", "PATCH", body=[operation], auth_settings=["BearerToken"],
        header_params={"Content-Type": "application/json-patch+json"}, _preload_content=False,
    )  # fmt: skip


def test_ctl_submit_refuses_a_cluster_without_the_training_operator(tmp_path: Path) -> None:
    """A cluster without the PyTorchJob CRD (a second, bare control plane): one line saying how to install the
    operator, exit 1, and nothing created. With Trainer v2's CRDs only, a spec without apiKind becomes a
    TrainJob."""
    if EXTERNAL_KUBECONFIG:
        pytest.skip("needs a cluster without the operator: runs on a local control plane only")
    plane = controlplane.start(tmp_path / "bare", with_operator=False)
    try:
        client = plane.api_client()
        controlplane.ensure_namespace(client, "bare")
        spec = spec_file(tmp_path, job_spec(uuid.uuid4().hex, name="bare"))
        env = os.environ | {"KUBECONFIG": str(plane.kubeconfig)}
        for command in (["submit", str(spec)], ["submit", str(spec), "--dry-run", "server"], ["list"]):
            result = run_ctl(*command, "-n", "bare", cwd=tmp_path, env=env)
            assert result.returncode == 1, result.stderr
            assert (
                result.stderr.startswith(
                    "error: the cluster has no PyTorchJob resource (pytorchjobs.kubeflow.org): install the Kubeflow"
                    " training operator v1.9 first, e.g. kubectl apply --server-side -k"
                )
                and result.stderr.count("\n") == 1
            ), result.stderr
        core = kubernetes.client.CoreV1Api(client)
        # (the namespace's kube-root-ca.crt, from the controller-manager, is all there is)
        assert [c.metadata.name for c in core.list_namespaced_config_map("bare").items] == ["kube-root-ca.crt"]
        assert core.list_namespaced_persistent_volume_claim("bare").items == []

        # Once the cluster serves TrainJobs (and still not PyTorchJobs), a spec that leaves apiKind out is
        # submitted as a TrainJob, which ctl says; one that names PyTorchJob is refused as before.
        controlplane.install_crds(plane, controlplane.job_set_and_trainer_crds(ensure_binaries()))
        unset = tmp_path / "unset.yaml"
        unset.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(spec.read_text()).items() if k != "apiKind"}))
        for source, stdin in ((str(unset), None), ("-", unset.read_text())):  # a spec piped in is read once
            chosen = run_ctl("submit", source, "--dry-run", "server", "-n", "bare", cwd=tmp_path, env=env, stdin=stdin)
            assert (chosen.returncode, chosen.stdout) == (0, "trainjob.trainer.kubeflow.org/bare (server dry run)\n")
            assert "apiKind unset: the cluster serves TrainJob (Kubeflow Trainer v2), not PyTorchJob" in chosen.stderr
        named = run_ctl("submit", str(spec), "--dry-run", "server", "-n", "bare", cwd=tmp_path, env=env)
        assert named.returncode == 1 and "the cluster has no PyTorchJob resource" in named.stderr
    finally:
        plane.stop()
