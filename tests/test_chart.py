"""The Helm chart as a cluster sees it: rendered by Helm's own engine, validated against the Kubernetes
OpenAPI schemas and the real PyTorchJob CRD of the training operator v1.9, and checked for what a user
would notice (layout, volumes, security, names, bad values)."""

from __future__ import annotations

import ast
import json
import math
import os
import pty
import re
import shutil
import subprocess
import time
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from conftest import CTL, REPO, CtlHere, prometheus_server, prometheus_tool, run_ctl
from e2e.cluster_binaries import build_helm
from pod_security import violations

from ctl.kinds import KINDS, PYTORCHJOB
from ctl.names import COMPILE_CACHE_DIR, COMPILE_CACHES, POD_KEY_ENV
from ctl.operator_env import replicas
from ctl.render import (
    Manifest,
    RenderError,
    chart_path,
    chart_values,
    notes,
    render,
    render_chart,
    split_manifests,
)
from ctl.schema import generated_files
from ctl.spec import BYTES_QUANTITY, JobSpec, load_spec
from trainer.names import EXIT_BAD_INPUT, PREPARED_BY_JOB_ENV
from trainer.spec import load_training_spec

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
TRAINING_OPERATOR = "github.com/kubeflow/training-operator@v1.9.0"
CRD_IN_MODULE = f"manifests/base/crds/{PYTORCHJOB.group}_{PYTORCHJOB.plural}.yaml"
KUBERNETES_VERSION = "1.30.0"  # `helm template --kube-version` for a go-installed helm binary
# Chart.yaml's kubeVersion (>=1.27) up to the newest schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.utils.latest_version()]
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
TRAIN = {"data": {"train": ["/data/train.txt"]}}
# storage.caBundle as a user writes it (the chart passes it through; trainer tests use a real CA's).
PRIVATE_CA = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.76.0"
MONITORING_API = "monitoring.coreos.com/v1"


def spec_of(**values: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "job", "training": TRAIN} | values)


DASHBOARDS = "Dashboards"  # the key of the dashboards' ConfigMap in objects()


def objects(spec: JobSpec) -> dict[str, dict[str, Any]]:
    """kind -> object (the chart renders at most one object of each kind, and the dashboards' ConfigMap)."""
    rendered = render(spec)
    by_kind = {DASHBOARDS if m.source.endswith("/dashboards.yaml") else m.kind: m.obj for m in rendered}
    assert len(by_kind) == len(rendered), [m.kind for m in rendered]
    return by_kind


def pod_templates(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Replica type (PyTorchJob) or replicated job (TrainingRuntime) -> its pod template."""
    if job["kind"] == "TrainingRuntime":
        return {
            rj["name"]: rj["template"]["spec"]["template"] for rj in job["spec"]["template"]["spec"]["replicatedJobs"]
        }
    return {kind: spec["template"] for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()}


def pod_owner(by_kind: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The object carrying the pod templates: the PyTorchJob, or a TrainJob's TrainingRuntime."""
    return by_kind["PyTorchJob"] if "PyTorchJob" in by_kind else by_kind["TrainingRuntime"]


def trainer_container(template: dict[str, Any]) -> dict[str, Any]:
    """The container the operator injects its env into: `pytorch` (v1) or `node` (Trainer v2)."""
    (container,) = [c for c in template["spec"]["containers"] if c["name"] in {k.container for k in KINDS.values()}]
    return container


# Specs covering every branch of the templates.
VARIANTS: dict[str, dict[str, Any]] = {
    "single-node": {},
    "multi-node-gpu": {
        "nodes": 4,
        "procsPerNode": 8,
        "resources": {"gpu": 8, "cpu": "32", "memory": "200Gi", "shm": "32Gi"},
        "storage": {"storageClassName": "fast-rwx", "size": "1Ti"},
    },
    "elastic": {"nodes": 2, "elastic": {"enabled": True, "minNodes": 1, "maxNodes": 4, "maxRestarts": 5}},
    "kueue": {"nodes": 2, "queue": {"kueue": "team-a"}, "runPolicy": {"suspend": True}},
    "volcano": {
        "nodes": 3,
        "queue": {"volcano": "research"},
        "runPolicy": {"schedulingPolicy": {"minAvailable": 3, "priorityClass": "high", "scheduleTimeoutSeconds": 600}},
    },
    "monitoring": {
        "nodes": 2,
        "metrics": {
            "port": 9500,
            "annotations": True,
            "podMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "kube-prometheus-stack"}},
            "dashboard": {"enabled": True, "dcgmPodLabel": "pod", "dcgmNamespaceLabel": "namespace"},
            "alerts": {
                "enabled": True,
                "labels": {"release": "kube-prometheus-stack"},
                "checkpointMaxAgeSeconds": 3600,
                "runbookUrl": "https://runbooks.example/ddpjob/operations.md",
            },
        },
    },
    "prepare-job": {
        "nodes": 2,
        "resources": {"gpu": 8},
        "nodeSelector": {"pool": "gpu"},
        "queue": {"volcano": "research"},
        "prepare": {"enabled": True, "cpu": "16", "memory": "8Gi", "nodeSelector": {"pool": "cpu"}},
    },
    "elastic-monitoring": {
        "nodes": 2,
        "elastic": {"enabled": True, "maxNodes": 3},
        "metrics": {"podMonitor": {"enabled": True}, "alerts": {"enabled": True, "checkpointMaxAgeSeconds": 0}},
    },
    "everything": {
        "nodes": 2,
        "image": {"repository": "registry.example.com/ml/ddpjob", "tag": "0.1.0", "pullPolicy": "Always"},
        "restartPolicy": "ExitCode",
        "runPolicy": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 86400,
            "activeDeadlineSeconds": 1_000_000,
            "cleanPodPolicy": "Running",
        },
        "storage": {"existingClaim": "shared-runs", "mountPath": "/runs"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
                }
            }
        },
        "priorityClassName": "training",
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"create": True, "annotations": {"iam.example.com/role": "trainer"}},
        "env": [
            {"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}},
        ],
        "envFrom": [{"configMapRef": {"name": "nccl-tuning"}}],
        "podAnnotations": {"example.com/team": "ml"},
        "podLabels": {"team": "ml"},
        "networkPolicy": {
            "enabled": True,
            "prometheusNamespaceSelector": {"matchLabels": {"team": "observability"}},
            "prometheusPodSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["prom"]}]},
        },
        "training": {**TRAIN, "checkpoint": {"dir": "/runs/custom"}},
    },
    # Kubeflow Trainer v2 (apiKind TrainJob): the same knobs, where a TrainJob has them (test_trainjob.py).
    "trainjob-gang": {
        "apiKind": "TrainJob",
        "nodes": 3,
        "queue": {
            "kueue": "team-a",
            "kueuePriorityClass": "high",
            "kueueMaxExecutionSeconds": 86400,
            "coscheduling": "scheduler-plugins-scheduler",
        },
        "runPolicy": {"suspend": True, "schedulingPolicy": {"scheduleTimeoutSeconds": 600}},
    },
    "trainjob-volcano": {"apiKind": "TrainJob", "nodes": 2, "queue": {"volcano": "research"}},
    "object-storage": {
        "nodes": 2,
        "storage": {
            "uri": "s3://runs/team-a",
            "endpoint": "https://s3.example.com",
            "secretName": "s3-keys",
            "caBundle": PRIVATE_CA,
        },
    },
    "trainjob-object-storage": {
        "apiKind": "TrainJob",
        "nodes": 2,
        "storage": {"uri": "s3://runs", "region": "eu-west-1"},
    },
}
VARIANTS["trainjob-everything"] = VARIANTS["everything"] | {
    "apiKind": "TrainJob",
    "runPolicy": {"backoffLimit": 0, "activeDeadlineSeconds": 1_000_000},
    "metrics": {"podMonitor": {"enabled": True}},
}


def variant_specs() -> list[tuple[str, JobSpec]]:
    return [(p.stem, load_spec(p)) for p in EXAMPLES] + [(k, spec_of(**v)) for k, v in VARIANTS.items()]


ALL_SPECS = variant_specs()
ALL_IDS = [name for name, _ in ALL_SPECS]
PYTORCHJOB_SPECS = [(name, spec) for name, spec in ALL_SPECS if spec.api_kind == "PyTorchJob"]


# ---------------------------------------------------------------------------------------------------------------
# The real PyTorchJob CRD, from the training operator's published Go module (downloaded at test time).


def _strict(schema: Any) -> Any:
    """Reject unknown fields where the CRD lists its fields: the API server would silently prune them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def go_module_dir(module: str) -> Path:
    """A published Go module's files (downloaded at test time into the Go module cache)."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        pytest.fail(f"the Go toolchain is needed to download {module} (go mod download)")
    result = subprocess.run(
        [go, "mod", "download", "-json", module],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=os.environ | {"GOFLAGS": "-mod=mod", "GO111MODULE": "on"},
    )
    assert result.returncode == 0, f"go mod download failed: {result.stdout}{result.stderr}"
    return Path(json.loads(result.stdout)["Dir"])


def crd_schema(module: str, path_in_module: str, kind: str, version: str = "v1") -> dict[str, Any]:
    """The strict schema of `kind` at `version` from a CRD file of a published Go module (downloaded at test time)."""
    crd = yaml.safe_load((go_module_dir(module) / path_in_module).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(served["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="session")
def pytorchjob_schema() -> dict[str, Any]:
    return crd_schema(TRAINING_OPERATOR, CRD_IN_MODULE, "PyTorchJob")


@pytest.fixture(scope="session")
def monitoring_schemas() -> dict[str, dict[str, Any]]:
    """kind -> schema, from the prometheus-operator's own CRDs (what kube-prometheus-stack installs)."""
    crds = "example/prometheus-operator-crd/monitoring.coreos.com_{}.yaml"
    return {
        kind: crd_schema(PROMETHEUS_OPERATOR, crds.format(plural), kind)
        for kind, plural in (("PodMonitor", "podmonitors"), ("PrometheusRule", "prometheusrules"))
    }


def test_strict_crd_schema_catches_unknown_fields(pytorchjob_schema: dict[str, Any]) -> None:
    job = objects(spec_of())["PyTorchJob"]
    jsonschema.validate(job, pytorchjob_schema)
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        jsonschema.validate(job, pytorchjob_schema)


@pytest.mark.parametrize(("name", "spec"), PYTORCHJOB_SPECS, ids=[name for name, _ in PYTORCHJOB_SPECS])
def test_pytorchjob_validates_against_the_real_crd(name: str, spec: JobSpec, pytorchjob_schema: dict[str, Any]) -> None:
    job = objects(spec)["PyTorchJob"]
    assert (job["apiVersion"], job["kind"]) == (PYTORCHJOB.api_version, PYTORCHJOB.kind)
    jsonschema.validate(job, pytorchjob_schema, cls=jsonschema.Draft7Validator)


def test_prepare_job_is_the_training_pod_without_gpus_running_the_preparation() -> None:
    by_kind = objects(spec_of(**VARIANTS["prepare-job"]))
    job = by_kind["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    training = pod_templates(by_kind["PyTorchJob"])["Master"]["spec"]
    assert container["command"] == ["python", "-m", "trainer.prepare", "--config", "/etc/ddpjob/training.yaml"]
    assert container["resources"] == {
        "requests": {"cpu": "16", "memory": "8Gi"},
        "limits": {"cpu": "16", "memory": "8Gi"},
    }
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    # Labelled with the job's name as the training pods are (their operator's label): its series go with theirs.
    assert job["spec"]["template"]["metadata"]["labels"][PYTORCHJOB.job_label] == "job"
    assert pod["nodeSelector"] == {"pool": "cpu"} and "schedulerName" not in pod and pod["restartPolicy"] == "Never"
    # Bad data is not retried: the Job fails on the preparation's bad-input exit code.
    (rule,) = job["spec"]["podFailurePolicy"]["rules"]
    assert rule == {
        "action": "FailJob",
        "onExitCodes": {"containerName": container["name"], "operator": "In", "values": [EXIT_BAD_INPUT]},
        "onPodConditions": [],
    }
    # The same volumes, mounts, image and security as training: it writes the dataset cache on the same claim.
    assert pod["volumes"] == training["volumes"] and pod["securityContext"] == training["securityContext"]
    assert container["volumeMounts"] == trainer_container({"spec": training})["volumeMounts"]
    assert container["image"] == trainer_container({"spec": training})["image"]
    assert violations(pod) == []
    # The training pods wait for the Job's manifest rather than preparing the data themselves.
    for template in pod_templates(by_kind["PyTorchJob"]).values():  # named, for their message if it never ends
        assert {"name": PREPARED_BY_JOB_ENV, "value": job["metadata"]["name"]} in trainer_container(template)["env"]
    assert not {e["name"] for e in container["env"]} & {PREPARED_BY_JOB_ENV, "PROMETHEUS_MULTIPROC_DIR"}
    assert "Job" not in objects(spec_of())
    assert PREPARED_BY_JOB_ENV not in {
        e["name"] for e in trainer_container(pod_templates(objects(spec_of())["PyTorchJob"])["Master"])["env"]
    }


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS, ids=ALL_IDS)
def test_core_objects_and_pods_validate_strictly(name: str, spec: JobSpec) -> None:
    """Every core object, and each replica's pod as the operator will create it, against Kubernetes' schemas."""
    for manifest in render(spec):
        if manifest.kind == "TrainJob":
            continue  # no pod template: validated against its CRD (test_trainjob.py)
        if manifest.kind in ("PyTorchJob", "TrainingRuntime"):
            for template in pod_templates(manifest.obj).values():
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]}}
                for version in KUBERNETES_VERSIONS:
                    kubernetes_validate.validate(pod | {"spec": template["spec"]}, version, strict=True)
        elif manifest.obj["apiVersion"] != MONITORING_API:  # custom resources: validated against their CRDs below
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(manifest.obj, version, strict=True)


def with_text_replaced(value: Any, old: str, new: str) -> Any:
    if isinstance(value, dict):
        return {with_text_replaced(k, old, new): with_text_replaced(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [with_text_replaced(v, old, new) for v in value]
    return value.replace(old, new) if isinstance(value, str) else value


@pytest.mark.parametrize("name", ["true", "no", "null"])
@pytest.mark.parametrize("variant", ["everything", "trainjob-everything"])
def test_a_job_name_that_yaml_reads_as_a_boolean_or_null_stays_text(variant: str, name: str) -> None:
    """`true`, `no`, `null` (and `y`, `on` for Go's YAML) are DNS labels: every name, label and reference the chart
    writes must be quoted, or the manifest says `name: true` (a boolean) and kubectl and the API server refuse it."""
    values = VARIANTS[variant]
    as_written = [m.obj for m in render(spec_of(**values, name=name))]
    other_name = [with_text_replaced(m.obj, "zqx", name) for m in render(spec_of(**values, name="zqx"))]
    assert as_written == other_name


# ---------------------------------------------------------------------------------------------------------------
# What the objects say.


def test_master_and_workers() -> None:
    spec = spec_of(nodes=3, procsPerNode=4, masterPort=29500)
    job = objects(spec)["PyTorchJob"]["spec"]
    assert job["nprocPerNode"] == "4" and "elasticPolicy" not in job
    reps = job["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in reps.items()} == {"Master": 1, "Worker": 2}
    assert sum(r["replicas"] for r in reps.values()) == len(replicas(spec))  # what `ctl run` simulates
    for rep in reps.values():
        assert rep["restartPolicy"] == "OnFailure"
        container = trainer_container(rep["template"])
        launch = ["python", "-m", "trainer.launch", "-m", "trainer"]
        assert container["command"] == [*launch, "--config", "/etc/ddpjob/training.yaml"]
        assert container["ports"] == [
            {"name": "pytorchjob-port", "containerPort": 29500, "protocol": "TCP"},
            {"name": "metrics", "containerPort": 9402, "protocol": "TCP"},
        ]


def test_one_node_has_no_workers() -> None:
    reps = objects(spec_of(nodes=1))["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    assert list(reps) == ["Master"]


def test_elastic_is_worker_only_with_c10d_rendezvous() -> None:
    spec = spec_of(**VARIANTS["elastic"])
    job = objects(spec)["PyTorchJob"]["spec"]
    assert list(job["pytorchReplicaSpecs"]) == ["Worker"]
    assert job["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2 == len(replicas(spec))
    assert job["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4, "maxRestarts": 5}
    env = {e["name"]: e["value"] for e in trainer_container(job["pytorchReplicaSpecs"]["Worker"]["template"])["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a fresh rendezvous store every round


@pytest.mark.parametrize(("grace", "timeout"), [(120, "115"), (600, "595"), (3, "0")])
def test_torchrun_waits_for_the_workers_most_of_the_grace_period(grace: int, timeout: str) -> None:
    spec = spec_of(nodes=2, terminationGracePeriodSeconds=grace)
    for template in pod_templates(objects(spec)["PyTorchJob"]).values():
        assert template["spec"]["terminationGracePeriodSeconds"] == grace
        env = {e["name"]: e["value"] for e in trainer_container(template)["env"]}
        assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == timeout


def test_training_config_is_the_spec_training_section(tmp_path: Path) -> None:
    spec = spec_of(**VARIANTS["multi-node-gpu"])
    by_kind = objects(spec)
    config = by_kind["ConfigMap"]
    template = pod_templates(by_kind["PyTorchJob"])["Master"]
    (volume,) = [v for v in template["spec"]["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    mount = next(m for m in trainer_container(template)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == "/etc/ddpjob" and mount["readOnly"]
    # What the trainer reads in the pod, through its own loader.
    assert set(config["data"]) == {"training.yaml"}
    path = tmp_path / "training.yaml"
    path.write_text(config["data"]["training.yaml"])
    training = load_training_spec(path)
    assert training.checkpoint.dir == "/checkpoints/job"  # <storage.mountPath>/<name>
    assert training == spec.training.model_copy(update={"checkpoint": training.checkpoint})


def test_explicit_run_directory_and_existing_claim() -> None:
    by_kind = objects(spec_of(**VARIANTS["everything"]))
    assert "PersistentVolumeClaim" not in by_kind
    assert yaml.safe_load(by_kind["ConfigMap"]["data"]["training.yaml"])["checkpoint"]["dir"] == "/runs/custom"
    template = pod_templates(by_kind["PyTorchJob"])["Master"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v
    ]
    assert claims == ["shared-runs"]
    assert {"name": "checkpoints", "mountPath": "/runs"} in trainer_container(template)["volumeMounts"]


def test_names_that_yaml_reads_as_booleans_stay_text() -> None:
    """A claim named `true`, a dashboard label key `on`: valid Kubernetes names that YAML, unquoted, reads as
    booleans, which the job's CRD and the API server would refuse."""
    dashboard = {"enabled": True, "labelKey": "on", "labelValue": "true"}
    by_kind = objects(spec_of(storage={"existingClaim": "true"}, metrics={"dashboard": dashboard}))
    template = pod_templates(by_kind["PyTorchJob"])["Master"]
    claims = [v["persistentVolumeClaim"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "true"}]
    assert by_kind[DASHBOARDS]["metadata"]["labels"]["on"] == "true"


@pytest.mark.parametrize("variant", ["object-storage", "trainjob-object-storage"])
def test_a_run_on_object_storage_has_no_claim_and_gives_the_pods_the_aws_variables(variant: str) -> None:
    by_kind = objects(spec_of(**VARIANTS[variant]))
    assert "PersistentVolumeClaim" not in by_kind
    uri = VARIANTS[variant]["storage"]["uri"]
    assert yaml.safe_load(by_kind["ConfigMap"]["data"]["training.yaml"])["checkpoint"]["dir"] == f"{uri}/job"
    for template in pod_templates(pod_owner(by_kind)).values():
        assert not [v for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
        env = {var["name"]: var for var in trainer_container(template)["env"]}
        aws = {name: var.get("value") or var["valueFrom"]["secretKeyRef"] for name, var in env.items() if "AWS" in name}
        if variant == "object-storage":
            assert aws == {
                "AWS_ENDPOINT_URL": "https://s3.example.com",
                "AWS_CA_BUNDLE": aws["AWS_CA_BUNDLE"],
                "AWS_ACCESS_KEY_ID": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"},
                "AWS_SECRET_ACCESS_KEY": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"},
            }
            # The private CA's certificates: a file of the job's ConfigMap, where the pods mount it.
            folder, _, file = aws["AWS_CA_BUNDLE"].rpartition("/")
            mounts = {m["name"]: m["mountPath"] for m in trainer_container(template)["volumeMounts"]}
            config = next(v for v in template["spec"]["volumes"] if v.get("configMap"))
            assert config["configMap"]["name"] == by_kind["ConfigMap"]["metadata"]["name"]
            assert mounts[config["name"]] == folder
            assert by_kind["ConfigMap"]["data"][file] == PRIVATE_CA
        else:  # no Secret: the pods' cloud identity; the system's CAs only
            assert aws == {"AWS_REGION": "eu-west-1"}
            assert list(by_kind["ConfigMap"]["data"]) == ["training.yaml"]
        assert env["TORCH_FR_DUMP_TEMP_FILE"]["value"].startswith(env["HOME"]["value"])


def test_s3_data_for_a_run_on_the_volume_gets_the_s3_variables_too() -> None:
    """The S3 server's keys serve s3:// data as well as storage.uri: without a uri the claim stays, and the trainer
    pods and the prepare Job get the same variables and CA file."""
    storage = {"endpoint": "https://s3.example.com", "secretName": "s3-keys", "caBundle": PRIVATE_CA}
    by_kind = objects(spec_of(storage=storage, prepare={"enabled": True}))
    assert "PersistentVolumeClaim" in by_kind and by_kind["ConfigMap"]["data"]["s3-ca.crt"] == PRIVATE_CA
    trainer = trainer_container(pod_templates(by_kind["PyTorchJob"])["Master"])
    (prepare,) = by_kind["Job"]["spec"]["template"]["spec"]["containers"]
    for container in (trainer, prepare):
        names = [var["name"] for var in container["env"] if "AWS" in var["name"]]
        assert names == ["AWS_ENDPOINT_URL", "AWS_CA_BUNDLE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"storage": {"uri": "s3://Bad_Bucket/x"}}, "spec.yaml:3: storage.uri: 's3://Bad_Bucket/x' is not an S3 URI"),
        ({"storage": {"uri": "gs://b/x"}}, "spec.yaml:3: storage.uri: 'gs://b/x' is not an S3 URI"),
        (
            {"storage": {"uri": "s3://runs", "existingClaim": "x"}},
            "spec.yaml:3: storage.existingClaim: no claim is mounted",
        ),
        ({"storage": {"uri": "s3://runs"}, "prepare": {"enabled": True}}, "spec.yaml:3: prepare.enabled: the prepare"),
        (
            {"storage": {"uri": "s3://runs", "caBundle": "ca.crt"}},
            "spec.yaml:3: storage.caBundle: holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ),
        (
            {"training": TRAIN | {"checkpoint": {"dir": "s3://x/y"}}},
            "spec.yaml:4: training.checkpoint.dir: 's3://x/y' is not an S3 URI",
        ),
        # Data URIs too (every rank refused them, after the job was created), any case of the scheme (a local path
        # named `S3:/runs/x` was made), and '.' or '..' folders (the S3 client failed on them with a traceback).
        (
            {"training": TRAIN | {"data": {"train": ["s3://Bad_Bucket/x/*.txt"]}}},
            "training.data.train.0: 's3://Bad_Bucket/x/*.txt' is not an S3 URI",
        ),
        ({"training": TRAIN | {"checkpoint": {"dir": "S3://runs/x"}}}, "training.checkpoint.dir: 'S3://runs/x' is not"),
        (
            {"training": TRAIN | {"data": {"train": ["s3://runs/x/../y.txt"]}}},
            "training.data.train.0: 's3://runs/x/../y.txt': an S3 key has no '.' or '..' folders",
        ),
    ],
)
def test_bad_object_storage_settings_are_one_line_naming_the_key(
    tmp_path: Path, values: dict, message: str, ctl_here
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "job", "training": TRAIN} | values))
    result = ctl_here("render", str(spec), cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT and not result.stdout
    (line,) = result.stderr.splitlines()
    assert message in line, line


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"storage": {"uri": "s3://runs"}, "training": TRAIN | {"checkpoint": {"dir": "/checkpoints/job"}}},
            "training.checkpoint.dir: /checkpoints/job is a path, and with storage.uri the pods mount no volume",
        ),
        (
            {"training": TRAIN | {"checkpoint": {"dir": "/checkpoints-old/job"}}},
            "training.checkpoint.dir: /checkpoints-old/job is not a folder under storage.mountPath (/checkpoints), the",
        ),
        ({"training": TRAIN | {"checkpoint": {"dir": "runs/job"}}}, "training.checkpoint.dir: runs/job is not a"),
        (
            {"storage": {"mountPath": "/runs"}, "training": TRAIN | {"checkpoint": {"dir": "/runs/../tmp/job"}}},
            "training.checkpoint.dir: /runs/../tmp/job is not a folder under storage.mountPath (/runs)",
        ),
        ({"training": TRAIN | {"checkpoint": {"dir": "/checkpoints/"}}}, "training.checkpoint.dir: /checkpoints/ is"),
        (
            {"prepare": {"enabled": True}, "training": TRAIN | {"data": TRAIN["data"] | {"cacheDir": "/cache"}}},
            "training.data.cacheDir: /cache is not under storage.mountPath (/checkpoints): the prepare Job",
        ),
    ],
)
@pytest.mark.parametrize("command", [["render"], ["submit", "--dry-run", "client"]])
def test_a_run_directory_on_no_shared_volume_is_refused_for_a_cluster(
    tmp_path: Path, values: dict, message: str, command: list[str], ctl_here
) -> None:
    """The pods saved their checkpoints into their own file systems (a path off the volume, or any path with
    storage.uri, which mounts none) and lost them with each pod; a prepare Job filled a cache the trainers never saw.
    The line names the file's line, or the flag, that gave the key, as every other. `ctl run` trains into any local
    folder."""
    spec = tmp_path / "spec.yaml"
    text = yaml.safe_dump({"name": "job", "training": TRAIN} | values)
    spec.write_text(text)
    key = message.split(":")[0].rpartition(".")[2] + ":"
    number = next(n for n, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith(key))
    result = ctl_here(*command, "spec.yaml", cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT and not result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: spec.yaml:{number}: {message}"), line
    load_spec(spec)  # for `ctl run`, no problem: it trains into any local folder


def test_a_run_directory_set_by_a_flag_off_the_volume_names_the_flag(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "job", "training": TRAIN}))
    result = run_ctl("render", str(spec), "--set", "training.checkpoint.dir=/x/job", cwd=tmp_path)
    assert result.returncode == EXIT_BAD_INPUT and not result.stdout
    assert result.stderr.startswith("error: --set 'training.checkpoint.dir=/x/job': training.checkpoint.dir: /x/job")


def test_created_claim_is_kept_on_uninstall() -> None:
    by_kind = objects(spec_of(**VARIANTS["multi-node-gpu"]))
    pvc = by_kind["PersistentVolumeClaim"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "fast-rwx",
        "resources": {"requests": {"storage": "1Ti"}},
    }
    template = pod_templates(by_kind["PyTorchJob"])["Worker"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_shm_gpu_and_default_resources() -> None:
    """Requests by default, scaled from the spec: CPU per process, the trainer's memory plus /dev/shm (memory the
    pod is charged for), the scratch volume as ephemeral storage; memory and GPUs limited, CPU not."""
    template = pod_templates(objects(spec_of(**VARIANTS["multi-node-gpu"]))["PyTorchJob"])["Worker"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    container = trainer_container(template)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["resources"] == {
        "requests": {"cpu": "32", "memory": f"{232 * 1024}Mi", "ephemeral-storage": "20Gi", "nvidia.com/gpu": 8},
        "limits": {"memory": f"{232 * 1024}Mi", "nvidia.com/gpu": 8},
    }
    defaults = trainer_container(pod_templates(objects(spec_of(procsPerNode=3))["PyTorchJob"])["Master"])
    assert defaults["resources"] == {
        "requests": {"cpu": "6", "memory": f"{3 * 4096 + 1024}Mi", "ephemeral-storage": "20Gi"},
        "limits": {"memory": f"{3 * 4096 + 1024}Mi"},
    }
    decimal = spec_of(resources={"memory": "1.5G", "shm": "512Mi", "cache": "5Gi", "cpu": "500m"})
    resources = trainer_container(pod_templates(objects(decimal)["PyTorchJob"])["Master"])["resources"]
    assert resources["requests"] == {"cpu": "500m", "memory": "1943Mi", "ephemeral-storage": "5Gi"}  # 1431 + 512


@pytest.mark.parametrize(
    ("procs", "cpu", "threads"),
    [
        (1, None, "2"),
        (3, None, "2"),
        (4, "16", "4"),
        (3, "7.5", "2"),
        (2, "1500m", "1"),
        (1, "0.5", "1"),
        (8, "2", "1"),
    ],
)
@pytest.mark.parametrize("api_kind", sorted(KINDS))
def test_each_process_gets_a_thread_for_each_cpu_of_its_share_of_the_request(
    api_kind: str, procs: int, cpu: str | None, threads: str
) -> None:
    """OMP_NUM_THREADS of the trainer container: the pod's CPU request shared by its processes, rounded down, at
    least 1 (torch would start a thread per core of the node). The prepare pod keeps the library's default."""
    resources = {"cpu": cpu} if cpu else {}
    by_kind = objects(spec_of(apiKind=api_kind, procsPerNode=procs, resources=resources, prepare={"enabled": True}))
    for template in pod_templates(pod_owner(by_kind)).values():
        env = [e for e in trainer_container(template)["env"] if e["name"] == "OMP_NUM_THREADS"]
        assert env == [{"name": "OMP_NUM_THREADS", "value": threads}]
    (prepare,) = by_kind["Job"]["spec"]["template"]["spec"]["containers"]
    assert "OMP_NUM_THREADS" not in {e["name"] for e in prepare["env"]}


def test_threads_set_in_the_spec_s_env_are_the_only_ones() -> None:
    """`env` with OMP_NUM_THREADS: the chart sets none of its own, and the prepare pod gets the spec's too."""
    by_kind = objects(spec_of(env=[{"name": "OMP_NUM_THREADS", "value": "6"}], prepare={"enabled": True}))
    (prepare,) = by_kind["Job"]["spec"]["template"]["spec"]["containers"]
    for container in [*map(trainer_container, pod_templates(by_kind["PyTorchJob"]).values()), prepare]:
        assert [e for e in container["env"] if e["name"] == "OMP_NUM_THREADS"] == [
            {"name": "OMP_NUM_THREADS", "value": "6"}
        ]


SIZE_SUFFIXES = BYTES_QUANTITY.rsplit("(", 1)[1].split(")")[0].split("|")  # its last group: Ki|Mi|...


@pytest.mark.parametrize("suffix", ["", *SIZE_SUFFIXES])
def test_the_chart_reads_every_size_the_spec_takes(suffix: str) -> None:
    """The chart's `ddpjob.mebibytes` knows each suffix that the spec's pattern for sizes lets through."""
    factor = 1024 ** ("KMGTP".index(suffix[0]) + 1) if suffix.endswith("i") else 1000 ** ("kMGTP".index(suffix) + 1)
    sized = spec_of(resources={"memory": f"1.5{suffix}", "shm": "0"}) if suffix else spec_of(resources={"shm": "0"})
    resources = trainer_container(pod_templates(objects(sized)["PyTorchJob"])["Master"])["resources"]
    expected = math.ceil(1.5 * factor / 2**20) if suffix else 4096  # no memory: 4Gi for its one process
    assert resources["requests"]["memory"] == f"{expected}Mi"


def test_caches_live_in_a_bounded_scratch_volume_under_a_read_only_root() -> None:
    """HOME, the Hugging Face, torch.compile and Triton caches and /tmp are on one size-limited emptyDir, in the
    directories the image's own ENV names (so `docker run` and a pod agree); the root filesystem is read-only."""
    template = pod_templates(objects(spec_of(resources={"cache": "50Gi"}))["PyTorchJob"])["Master"]
    container = trainer_container(template)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}} in template["spec"]["volumes"]
    scratch = {m["mountPath"]: m["subPath"] for m in container["volumeMounts"] if m["name"] == "scratch"}
    assert scratch == {"/home/ddpjob": "home", "/tmp": "tmp"}
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    image_env = dockerfile_env()
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[name] == image_env[name] and env[name].startswith("/home/ddpjob"), name
    assert env["TMPDIR"] == "/tmp"
    # Every other path the trainer writes is a mount of its own (nothing lands on the read-only root).
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/checkpoints", "/dev/shm", "/run/ddpjob-metrics", "/home/ddpjob", "/tmp"}


@pytest.mark.parametrize("api_kind", sorted(KINDS))
def test_with_compile_its_caches_are_in_the_run_directory_a_folder_per_pod(api_kind: str) -> None:
    """training.compile with the run directory on the volume: torch.compile's caches go there, in a folder named by
    a field that stays the same when the operator recreates the pod, so that a recreated pod does not compile again
    (tests/e2e: a pod stopped by SIGTERM resumes). The prepare Job compiles nothing and keeps the image's."""
    compiled = TRAIN | {"compile": True}
    by_kind = objects(spec_of(apiKind=api_kind, nodes=2, training=compiled, prepare={"enabled": True}))
    for template in pod_templates(pod_owner(by_kind)).values():
        env = trainer_container(template)["env"]
        names = [e["name"] for e in env]
        key = env[names.index(POD_KEY_ENV)]
        assert key["valueFrom"] == {"fieldRef": {"fieldPath": KINDS[api_kind].pod_key_field}}
        for variable, folder in COMPILE_CACHES.items():
            assert names.index(variable) > names.index(POD_KEY_ENV)  # the kubelet expands $(VAR) of earlier ones only
            expected = f"/checkpoints/job/{COMPILE_CACHE_DIR}/$({POD_KEY_ENV})/{folder}"
            assert env[names.index(variable)]["value"] == expected
    (prepare,) = by_kind["Job"]["spec"]["template"]["spec"]["containers"]
    assert not {e["name"] for e in prepare["env"]} & {POD_KEY_ENV, *COMPILE_CACHES}, prepare["env"]
    # In a bucket, the run directory is not a path: the caches stay in the scratch volume.
    in_bucket = objects(spec_of(apiKind=api_kind, training=compiled, storage={"uri": "s3://bucket/runs"}))
    for template in pod_templates(pod_owner(in_bucket)).values():
        env = {e["name"]: e.get("value") for e in trainer_container(template)["env"]}
        assert POD_KEY_ENV not in env and env["TORCHINDUCTOR_CACHE_DIR"] == "/home/ddpjob/.cache/torchinductor"


def dockerfile_env() -> dict[str, str]:
    """The image's ENV (KEY=VALUE pairs of every ENV instruction)."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = [w for line in text.splitlines() if line.startswith("ENV ") for w in line.split()[1:]]
    return dict(pair.split("=", 1) for pair in pairs)


def test_image_tag_defaults_to_the_chart_app_version() -> None:
    app_version = yaml.safe_load((chart_path() / "Chart.yaml").read_text())["appVersion"]
    container = trainer_container(pod_templates(objects(spec_of())["PyTorchJob"])["Master"])
    assert container["image"] == f"ddpjob:{app_version}"
    digest = "0.1.0@sha256:" + "a" * 64
    pinned = trainer_container(pod_templates(objects(spec_of(image={"tag": digest}))["PyTorchJob"])["Master"])
    assert pinned["image"] == f"ddpjob:{digest}"


def operator_init_containers(job: str) -> list[dict[str, Any]]:
    """The init containers the training operator v1.9 adds to a Worker pod of a job with a Master, as installed by
    k8s/operator: its template file filled in as pkg/controller.v1/pytorch/initcontainer.go does (the image and
    max tries at the operator's defaults, the master's pod name)."""
    text = (REPO / "k8s" / "operator" / "initContainer.yaml").read_text()
    fields = {"InitContainerImage": "alpine:3.10", "MasterAddr": f"{job}-master-0", "MaxTries": "100"}
    for field, value in fields.items():
        text = text.replace("{{." + field + "}}", value)
    assert "{{" not in text, "the template uses a field the operator does not fill"
    return yaml.safe_load(text)


def operator_pods(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each replica's pod spec as the operator creates it: Workers of a job with a Master get its init container."""
    pods = {}
    for kind, template in pod_templates(job).items():
        pod = json.loads(json.dumps(template["spec"]))
        if kind == "Worker" and "Master" in job["spec"]["pytorchReplicaSpecs"]:
            pod["initContainers"] = pod.get("initContainers", []) + operator_init_containers(job["metadata"]["name"])
        pods[kind] = pod
    return pods


def pod_specs(value: Any, where: str) -> dict[str, dict[str, Any]]:
    """Every pod spec inside a rendered object (a mapping with `containers`), by where it is."""
    if isinstance(value, dict):
        if isinstance(value.get("containers"), list):
            return {where: value}
        return {k: v for key, child in value.items() for k, v in pod_specs(child, f"{where}.{key}").items()}
    if isinstance(value, list):
        return {k: v for i, child in enumerate(value) for k, v in pod_specs(child, f"{where}[{i}]").items()}
    return {}


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS, ids=ALL_IDS)
def test_pods_satisfy_the_restricted_pod_security_profile_with_resources(name: str, spec: JobSpec) -> None:
    """Every container of every pod any rendered object makes, the one the operator adds included, meets
    "restricted" and says what it needs."""
    pods = {}
    for manifest in render(spec):
        if manifest.kind == "PyTorchJob":
            pods |= {f"PyTorchJob {kind}": pod for kind, pod in operator_pods(manifest.obj).items()}
        else:
            pods |= pod_specs(manifest.obj, f"{manifest.kind} {manifest.name}")
    for where, pod in pods.items():
        assert violations(pod) == [], where
        assert pod["automountServiceAccountToken"] is False, where
        for container in pod["containers"] + pod.get("initContainers", []):
            # Requests (never BestEffort, first evicted) and a memory limit: nothing grows unbounded.
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), (where, container["name"])
            assert "memory" in resources.get("limits", {}), (where, container["name"])
    for template in pod_templates(pod_owner(objects(spec))).values():
        assert template["spec"]["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    if spec.api_kind == "TrainJob":
        return
    job = objects(spec)["PyTorchJob"]
    if spec.nodes > 1 and not spec.elastic.enabled:
        assert [c["name"] for c in operator_pods(job)["Worker"]["initContainers"]] == ["init-pytorch"]


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS, ids=ALL_IDS)
def test_every_pod_shares_its_process_namespace(name: str, spec: JobSpec) -> None:
    """Its PID 1 is then the sandbox's, not the command: as PID 1 the command would drop a SIGTERM that comes
    before Python has a handler (tests/e2e: a job deleted while its pods' Python starts)."""
    pods = {where: pod for m in render(spec) for where, pod in pod_specs(m.obj, f"{m.kind} {m.name}").items()}
    assert pods
    assert {where: pod.get("shareProcessNamespace") for where, pod in pods.items()} == dict.fromkeys(pods, True)


def test_the_operator_s_built_in_init_container_would_be_refused() -> None:
    """The check above can fail: upstream's built-in template (no securityContext) breaks the profile."""
    builtin = {"name": "init-pytorch", "image": "alpine:3.10", "command": ["sh", "-c", "nslookup job-master-0"]}
    pod = operator_pods(objects(spec_of(nodes=2))["PyTorchJob"])["Worker"] | {"initContainers": [builtin]}
    assert violations(pod) == [
        "init-pytorch: allowPrivilegeEscalation must be false",
        "init-pytorch: capabilities must drop ALL",
    ]  # runAsNonRoot and seccomp come from the pod's securityContext


def test_operator_overlay_mounts_the_init_container_template(tmp_path: Path) -> None:
    """k8s/operator builds (kustomize, on the operator's own v1.9.0 manifests) into a Deployment whose operator
    reads the template from the ConfigMap it mounts: the flag's path is in the mounted directory and the ConfigMap
    (name hashed by kustomize) holds initContainer.yaml as shipped."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl binary on PATH for `kubectl kustomize`")
    overlay = tmp_path / "operator"
    shutil.copytree(REPO / "k8s" / "operator", overlay)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    (remote,) = kustomization["resources"]
    assert remote == "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.0"
    # The same base, from the operator's published Go module instead of GitHub (no network at test time).
    base = tmp_path / "upstream"
    shutil.copytree(go_module_dir(TRAINING_OPERATOR) / "manifests", base / "manifests")
    kustomization["resources"] = ["../upstream/manifests/overlays/standalone"]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    built = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout) if o}
    deployment = built["Deployment", "training-operator"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--pytorch-init-container-template-file=")]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, path in mounts.items() if flag.split("=", 1)[1] == f"{path}/initContainer.yaml"]
    config_map = built["ConfigMap", volumes[name]["configMap"]["name"]]
    assert config_map["metadata"]["namespace"] == deployment["metadata"]["namespace"] == "kubeflow"
    assert config_map["data"]["initContainer.yaml"] == (REPO / "k8s" / "operator" / "initContainer.yaml").read_text()


def test_network_policy_admits_the_job_s_pods_and_prometheus_only() -> None:
    assert "NetworkPolicy" not in objects(spec_of(nodes=2))
    by_kind = objects(spec_of(nodes=2, networkPolicy={"enabled": True}))
    policy = by_kind["NetworkPolicy"]["spec"]
    pod_labels = pod_templates(by_kind["PyTorchJob"])["Worker"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]  # egress (DNS, registries) is left alone
    peers, prometheus = policy["ingress"]
    assert peers == {"from": [{"podSelector": policy["podSelector"]}]}  # every port: NCCL picks its own
    assert prometheus["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert prometheus["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]


@pytest.mark.parametrize(
    ("values", "modes"),
    [
        ({}, ["ReadWriteOnce"]),
        ({"nodes": 2}, ["ReadWriteMany"]),
        ({"elastic": {"enabled": True, "maxNodes": 2}}, ["ReadWriteMany"]),
        ({"nodes": 2, "storage": {"accessModes": ["ReadWriteOnce"]}}, ["ReadWriteOnce"]),
    ],
    ids=["one-node", "two-nodes", "elastic", "explicit"],
)
def test_claim_access_mode_follows_the_node_count(values: dict[str, Any], modes: list[str]) -> None:
    """One pod works with ReadWriteOnce, which every cloud's default storage class gives; more need ReadWriteMany."""
    assert objects(spec_of(**values))["PersistentVolumeClaim"]["spec"]["accessModes"] == modes


def test_scheduling_env_and_identity_knobs() -> None:
    values = VARIANTS["everything"]
    by_kind = objects(spec_of(**values))
    job = by_kind["PyTorchJob"]
    assert job["spec"]["runPolicy"] == {
        "cleanPodPolicy": "Running",
        "suspend": False,
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": 86400,
        "activeDeadlineSeconds": 1_000_000,
    }
    for rep in job["spec"]["pytorchReplicaSpecs"].values():
        assert rep["restartPolicy"] == "ExitCode"
        pod = rep["template"]["spec"]
        for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
            assert pod[key] == values[key], key
        assert pod["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"] == "job"
        container = trainer_container(rep["template"])
        assert container["image"] == "registry.example.com/ml/ddpjob:0.1.0"
        assert container["imagePullPolicy"] == "Always"
        assert container["env"][-2:] == values["env"] and container["envFrom"] == values["envFrom"]
        assert rep["template"]["metadata"]["labels"]["team"] == "ml"
        assert rep["template"]["metadata"]["annotations"]["example.com/team"] == "ml"
    assert by_kind["ServiceAccount"]["metadata"]["annotations"] == {"iam.example.com/role": "trainer"}


def test_a_crash_looping_job_fails_after_three_retries_by_default() -> None:
    """backoffLimit 3: a job whose pods keep failing ends Failed and frees its GPUs; lifetime limits stay unset."""
    run_policy = objects(spec_of(nodes=2))["PyTorchJob"]["spec"]["runPolicy"]
    assert run_policy == {"cleanPodPolicy": "None", "suspend": False, "backoffLimit": 3}


@pytest.mark.parametrize("api", KINDS.values(), ids=list(KINDS))
def test_ctl_suspend_and_resume_patch_the_field_the_chart_renders_from_run_policy_suspend(api: Any) -> None:
    """`ctl suspend`/`resume` merge-patch each kind's suspend field: the one the spec's runPolicy.suspend sets."""
    for suspend in (False, True):
        job = objects(spec_of(nodes=2, apiKind=api.kind, runPolicy={"suspend": suspend}))[api.kind]
        assert api.suspended(job) is suspend
        assert api.suspended(api.suspend_patch(suspend)) is suspend  # the patch names the same field


def test_kueue_and_volcano_queues() -> None:
    kueue = objects(spec_of(**VARIANTS["kueue"]))["PyTorchJob"]
    assert kueue["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert kueue["spec"]["runPolicy"]["suspend"] is True and "schedulingPolicy" not in kueue["spec"]["runPolicy"]
    volcano = objects(spec_of(**VARIANTS["volcano"]))["PyTorchJob"]
    assert "kueue.x-k8s.io/queue-name" not in volcano["metadata"]["labels"]
    assert volcano["spec"]["runPolicy"]["schedulingPolicy"] == {
        "queue": "research",
        "minAvailable": 3,
        "priorityClass": "high",
        "scheduleTimeoutSeconds": 600,
    }
    for template in pod_templates(volcano).values():
        assert template["spec"]["schedulerName"] == "volcano"


def test_standard_labels() -> None:
    for manifest in render(spec_of(serviceAccount={"create": True})):
        labels = manifest.obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "ddpjob"
        assert labels["app.kubernetes.io/instance"] == "job"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "ddpjob-0.1.0"


# ---------------------------------------------------------------------------------------------------------------
# Names.


def all_names(manifests: list[Manifest], spec: JobSpec) -> None:
    """Every object name, the pods and Services the operator derives, and every label are valid."""
    job = next(m.obj for m in manifests if m.kind == "PyTorchJob")
    for manifest in manifests:
        name = manifest.name
        assert len(name) <= 253 and DNS_1123_SUBDOMAIN.fullmatch(name), name
        for value in manifest.obj["metadata"].get("labels", {}).values():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
    for kind, rep in job["spec"]["pytorchReplicaSpecs"].items():
        count = spec.elastic.max_nodes if spec.elastic.enabled else rep["replicas"]
        for index in range(count):
            pod = f"{job['metadata']['name']}-{kind.lower()}-{index}"  # also the headless Service's name
            assert len(pod) <= 63 and DNS_1035.fullmatch(pod), pod
        for value in rep["template"]["metadata"]["labels"].values():
            assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value


def test_longest_accepted_name_renders_valid_names_everywhere() -> None:
    spec = spec_of(name="n" * 54, nodes=1)  # "<name>-master-0": 63 characters
    all_names(render(spec), spec)
    spec = spec_of(name="e" * 54, nodes=2, elastic={"enabled": True, "maxNodes": 10})  # "-worker-9"
    all_names(render(spec), spec)


def test_sixty_character_name_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({"name": "a" * 60, "training": TRAIN}))
    result = run_ctl("render", str(path), cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "name: too long: pod name" in result.stderr and "69 characters (at most 63)" in result.stderr


def test_helm_refuses_a_long_name_that_bypasses_ctl() -> None:
    """`helm install -f` with a values file ctl never validated: the chart's own check."""
    values = {"name": "a" * 56, "nodes": 2, "training": TRAIN}
    with pytest.raises(RenderError, match=r"name: too long: pod name \\?\"a{56}-worker-0"):
        render_chart(values, "r")


def test_helm_refuses_fewer_gpus_than_processes_that_bypass_ctl() -> None:
    values = {"name": "g", "procsPerNode": 4, "resources": {"gpu": 2}, "training": TRAIN}
    with pytest.raises(RenderError, match=r"resources.gpu: 2 GPU\(s\) per pod for procsPerNode 4"):
        render_chart(values, "r")
    render_chart(values | {"resources": {"gpu": 4}}, "r")


# ---------------------------------------------------------------------------------------------------------------
# Bad values: one line from ctl; Helm's own message for values files that skip ctl.

BAD = [
    ("restartPolicy=Sometimes", "restartPolicy: Input should be 'OnFailure', 'Never', 'Always' or 'ExitCode'"),
    ("runPolicy.cleanPodPolicy=Some", "runPolicy.cleanPodPolicy: Input should be 'None', 'Running' or 'All'"),
    ("runPolicy.backoffLimit=-1", "runPolicy.backoffLimit: Input should be greater than or equal to 0"),
    ("queue={kueue: a, volcano: b}", "queue: set either kueue or volcano, not both"),
    ("env=[{name: OMP_NUM_THREADS, value: 4}]", "env.0.value: expected text, but YAML read 4 as a number: quote it"),
    ("env=[{value: x}]", "env: entry 0 needs a `name`"),
    # Keys in Kubernetes form, at any depth, as the API has them: the API server would refuse them only at submit,
    # naming the object's path, not the spec's key.
    ("env=[{name: A, valu: x}]", "env.0.valu: unknown key (did you mean value?)"),
    (
        "env=[{name: A, valueFrom: {secretKeyRef: {name: s, kye: k}}}]",
        "env.0.valueFrom.secretKeyRef.kye: unknown key (did you mean key?)",
    ),
    ("envFrom=[{secretref: {name: s}}]", "envFrom.0.secretref: unknown key (did you mean secretRef?)"),
    ("tolerations=[{key: gpu, efect: NoSchedule}]", "tolerations.0.efect: unknown key (did you mean effect?)"),
    ("tolerations=[{key: gpu, tolerationSeconds: soon}]", "tolerations.0.tolerationSeconds: expected an integer"),
    ("prepare.tolerations=[{key: gpu, value: true}]", "prepare.tolerations.0.value: expected text, but YAML read true"),
    (
        "affinity={nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms:"
        " [{matchExpresions: [{key: zone, operator: In, values: [a]}]}]}}}",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0.matchExpresions:"
        " unknown key (did you mean matchExpressions?)",
    ),
    ("affinity={podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: [{weight: high}]}}", ".0.weight:"),
    ("affinity={nodeaffinity: {}}", "affinity.nodeaffinity: unknown key (did you mean nodeAffinity?)"),
    # The API's rules for such objects (ctl.api_rules), which it applies only to the pods: the e2e tier checks each.
    ("tolerations=[{key: gpu, operator: Equals}]", "tolerations.0.operator: 'Equals' is not Equal or Exists"),
    ("tolerations=[{key: gpu, effect: NoSchedule, tolerationSeconds: 5}]", "tolerationSeconds: only with effect"),
    ("env=[{name: A, value: x, valueFrom: {fieldRef: {fieldPath: a}}}]", "env.0.valueFrom: not with a value"),
    ("envFrom=[{}]", "envFrom.0: one of configMapRef and secretRef is required"),
    ("envFrom=[{secretRef: {name: Team_A}}]", "envFrom.0.secretRef.name: 'Team_A' is not a Kubernetes object name"),
    (
        "affinity={nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms:"
        " [{matchExpressions: [{key: zone, operator: In}]}]}}}",
        "nodeSelectorTerms.0.matchExpressions.0.values: required with operator In",
    ),
    (
        "networkPolicy.prometheusNamespaceSelector={matchLabel: {team: ml}}",
        "networkPolicy.prometheusNamespaceSelector.matchLabel: unknown key (did you mean matchLabels?)",
    ),
    ("serviceAccount.craete=true", "serviceAccount.craete: unknown key (did you mean create?)"),
    ("imagePullSecrets=[regcred]", "imagePullSecrets.0: expected a mapping of keys, not the text 'regcred'"),
    ("imagePullSecrets=[{nmae: regcred}]", "imagePullSecrets.0.nmae: unknown key (did you mean name?)"),
    ("imagePullSecrets=[{name: null}]", "imagePullSecrets: entry 0 needs a `name`"),
    ("resources.gpu=-1", "resources.gpu: Input should be greater than or equal to 0"),
    ("resources.gpu=1", "resources.gpu: 1 GPU(s) per pod for procsPerNode 2: each process needs a GPU of its own"),
    ("resources.memory=lots", "resources.memory: 'lots' is not a size in bytes, e.g. 512Mi, 4Gi or 1.5T"),
    ("storage.size=10GB", "storage.size: '10GB' is not a size in bytes"),
    ("storage.size=0Gi", "storage.size: '0Gi' is no bytes: a claim must ask for more"),
    ("prepare.cpu=all", "prepare.cpu: 'all' is not a number of CPUs, e.g. 4, 0.5 or 500m"),
    ("image.tag=latest", "image.tag: 'latest' is not a version: pin one (e.g. the chart's appVersion) or a digest"),
    ("image.tag=1.0+build.5", "image.tag: '1.0+build.5' is not an image tag: letters, digits, '_', '.' and '-'"),
    ("image.tag=.1", "image.tag: '.1' is not an image tag"),
    ("image.tag=v1-été", "image.tag: 'v1-été' is not an image tag"),
    (f"image.tag=1.0@sha256:{'a' * 63}", "image.tag: '1.0@sha256:aaaa"),
    ("storage.accessModes=[ReadWriteSometimes]", "storage.accessModes.0: Input should be 'ReadWriteOnce'"),
    ("metrics.port=23456", "metrics.port: 23456 is already masterPort, the rendezvous port"),
    # The key given, and so its flag: the line blamed the spec file and metrics.port, which nobody had set.
    ("masterPort=9402", "error: --set 'masterPort=9402': masterPort: 9402 is already metrics.port, the metrics port"),
    (
        "runPolicy.schedulingPolicy.minAvailable=9",
        "runPolicy.schedulingPolicy.minAvailable: 9 pods, and the job has at most 1: the gang would never be scheduled",
    ),
    ("training.data.labels=[a, b, a]", "training.data.labels: 'a' is listed twice"),
    ("metrics.podMonitor.interval=soon", "metrics.podMonitor.interval: 'soon' is not a Prometheus duration"),
    ("metrics.alerts.slowRankFactor=1", "metrics.alerts.slowRankFactor: Input should be greater than 1"),
    # What the pods name and label: the API server would check it only when the operator creates them.
    ("storage.existingClaim=Shared_Runs", "storage.existingClaim: 'Shared_Runs' is not a Kubernetes object name"),
    ("podLabels.team=ML team", "podLabels.team: 'ML team' is not a Kubernetes label value"),
    ('nodeSelector={"pool": gpu, "gpu type": a100}', "nodeSelector: key 'gpu type' is not a Kubernetes label key"),
    ('podAnnotations={"example.com/": x}', "podAnnotations: key 'example.com/' is not a Kubernetes annotation key"),
    (f'podAnnotations={{"{"a" * 254}/team": x}}', "/team': its DNS prefix has 254 characters, at most 253"),
    (f"metrics.dashboard.labelKey={'a' * 254}/x", "labelKey: its DNS prefix has 254 characters, at most 253"),
    ("queue.kueue=team a", "queue.kueue: 'team a' is not a Kubernetes label value"),
    ("image.repository=registry.example.com/ml ddpjob", "image.repository: 'registry.example.com/ml ddpjob' is not"),
    ("storage.mountPath=runs", "storage.mountPath: 'runs' is not an absolute path other than /"),
    ("storage.mountPath=/tmp/", "storage.mountPath: '/tmp/' is where every pod mounts its tmp volume"),
    (
        "storage.mountPath=/data/../ckpt",
        "storage.mountPath: '/data/../ckpt' is '/ckpt' once its '.', '..' and '//' are",
    ),
    ("storage.endpoint=s3.example.com", "storage.endpoint: 's3.example.com' is not an http:// or https:// URL"),
    ("storage.endpoint=http://127.0.0.1:99999", "storage.endpoint: 'http://127.0.0.1:99999' is not an http://"),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[b[0].split("=")[0] for b in BAD])
def test_bad_values_are_refused_in_one_line(override: str, message: str, tmp_path: Path, ctl_here: CtlHere) -> None:
    result = ctl_here("render", str(EXAMPLES[0]), "--set", override, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"nodes": 0}, "at '/nodes': minimum: got 0, want 1"),
        ({"restartPolicy": "Sometimes"}, "at '/restartPolicy'"),
        ({"nodez": 2}, "additional properties 'nodez' not allowed"),
        ({"env": [{"name": "A", "valu": "x"}]}, "at '/env/0': additional properties 'valu' not allowed"),
        ({"imagePullSecrets": [{"nmae": "x"}]}, "at '/imagePullSecrets/0': additional properties 'nmae' not allowed"),
        ({"affinity": {"nodeaffinity": {}}}, "at '/affinity': additional properties 'nodeaffinity' not allowed"),
        ({"name": "News_Job"}, "at '/name'"),
        ({"training": {**TRAIN, "batchSize": 0}}, "at '/training/batchSize'"),
        ({"training": {**TRAIN, "data": {"train": ""}}}, "at '/training/data/train'"),
        ({"training": {**TRAIN, "data": {"train": ["a.txt", ""]}}}, "at '/training/data/train'"),
        ({"storage": {"size": "10GB"}}, "at '/storage/size'"),
        ({"storage": {"size": "0"}}, "at '/storage/size'"),
        ({"storage": {"existingClaim": "Shared_Runs"}}, "at '/storage/existingClaim'"),
        ({"podLabels": {"team ml": "x"}}, "invalid propertyName 'team ml'"),  # Helm names no key here
        ({"podLabels": {"team": "ML team"}}, "at '/podLabels/team'"),
        ({"podLabels": {f"{'a' * 254}/team": "x"}}, "invalid propertyName"),
        ({"metrics": {"dashboard": {"labelKey": f"{'a' * 254}/x"}}}, "at '/metrics/dashboard/labelKey'"),
        ({"storage": {"mountPath": "/dev/shm"}}, "at '/storage/mountPath'"),
        ({"storage": {"mountPath": "/tmp/"}}, "at '/storage/mountPath'"),
        ({"storage": {"endpoint": "http://s3.example.com:65536"}}, "at '/storage/endpoint'"),
        ({"terminationGracePeriodSeconds": 2**31}, "at '/terminationGracePeriodSeconds': maximum"),
        ({"training": {**TRAIN, "seed": -(2**31) - 1}}, "at '/training/seed': minimum"),
        ({"nodes": "2"}, "at '/nodes': got string, want integer"),  # as ctl refuses them (test_spec.py)
        ({"training": {**TRAIN, "compile": "true"}}, "at '/training/compile': got string, want boolean"),
    ],
)
def test_helm_schema_refuses_bad_values(values: dict[str, Any], message: str) -> None:
    """`helm install -f bad.yaml` fails on values.schema.json with Helm's message naming the key."""
    with pytest.raises(RenderError, match=re.escape(message)):
        render_chart({"name": "job", "training": TRAIN} | values, "r")


# ---------------------------------------------------------------------------------------------------------------
# One source of truth: the chart's files come from the spec model; ctl and helm agree.


def test_generated_chart_files_match_the_spec_model() -> None:
    for path, text in generated_files().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run `python -m ctl.schema`"


def test_values_yaml_is_the_spec_defaults() -> None:
    """values.yaml holds exactly the defaults of a minimal spec (null = unset, as in Helm)."""
    minimal = JobSpec.model_validate({"name": "job", "training": TRAIN})
    values = _drop_nulls(yaml.safe_load((chart_path() / "values.yaml").read_text()))
    values["name"] = "job"
    values["training"].setdefault("data", {})["train"] = TRAIN["data"]["train"]
    assert values == chart_values(minimal)


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return value


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_helm_values_merge_gives_the_same_objects_as_ctl(example: Path) -> None:
    """`helm install NAME helm/ddpjob -f examples/x.yaml` (Helm merges the file onto values.yaml) == `ctl render`."""
    raw = yaml.safe_load(example.read_text())
    spec = load_spec(example)
    via_helm = split_manifests(render_chart(raw, spec.name))
    assert [m.obj for m in via_helm] == [m.obj for m in render(spec)]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_helm_lint_is_clean(example: Path) -> None:
    """`helm lint --strict -f example` (Helm's linter in process): nothing above info."""
    report = helm_python.lint(chart_path(), values=yaml.safe_load(example.read_text()), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_helm_binary_template_and_lint_match() -> None:
    """The `helm` CLI (built from its module, as the e2e tier's binaries are) gives the same objects with
    `helm template` as `ctl render`, and `helm lint --strict` passes (Helm validates values.schema.json with its own
    JSON Schema library)."""
    helm = str(build_helm())
    for example in EXAMPLES:
        spec = load_spec(example)
        # A helm built from its module defaults to Kubernetes v1.20 (releases set it at link time): say which.
        args = [str(chart_path()), "-f", str(example), "--kube-version", KUBERNETES_VERSION]
        result = subprocess.run([helm, "template", spec.name, *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        # The same objects; helm prints hooks (a TrainJob's runtime) last, where `ctl render` prints it first.
        by_name = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
        rendered = sorted((m.obj for m in render(spec)), key=by_name)
        assert sorted((d for d in yaml.safe_load_all(result.stdout) if d), key=by_name) == rendered
        lint = subprocess.run([helm, "lint", "--strict", *args], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    bad = subprocess.run(
        [helm, "template", "x", str(chart_path()), "-f", str(EXAMPLES[0]), "--set", "nodes=0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "nodes" in bad.stderr


# ---------------------------------------------------------------------------------------------------------------
# ctl render.


def test_ctl_render_prints_multi_document_yaml_and_json(tmp_path: Path) -> None:
    example = REPO / "examples" / "quickstart.yaml"
    result = run_ctl("render", str(example), "--set", "nodes=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert [d["kind"] for d in docs] == ["ConfigMap", "PersistentVolumeClaim", "PyTorchJob"]
    assert result.stdout.startswith("---\n# Source: ddpjob/templates/")
    assert docs[2]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    as_json = run_ctl("render", str(example), "--set", "nodes=2", "-o", "json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"apiVersion": "v1", "kind": "List", "items": docs}
    bad = run_ctl("render", str(example), "-o", "xml", cwd=tmp_path)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "ctl render: Invalid value for '--output' / '-o': 'xml': expected yaml or json" in bad.stderr


def test_ctl_render_set_file_gives_a_key_a_file_s_text_after_set(tmp_path: Path) -> None:
    """As helm's --set-file: the text as it is (a PEM, its newlines kept), never read as YAML, applied after --set."""
    example = REPO / "examples" / "quickstart.yaml"
    (tmp_path / "ca.crt").write_text(PRIVATE_CA)
    (tmp_path / "name").write_text("true")  # YAML would make it a boolean, no name
    set_file = ("--set-file", "storage.caBundle=ca.crt", "--set", "storage.uri=s3://runs/team")
    result = run_ctl("render", str(example), *set_file, "--set", "storage.caBundle=overridden", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (config,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "ConfigMap"]
    assert config["data"]["s3-ca.crt"] == PRIVATE_CA
    not_yaml = run_ctl("render", str(example), "--set-file", "name=name", cwd=tmp_path)
    assert not_yaml.returncode == 0, not_yaml.stderr
    (job,) = [d for d in yaml.safe_load_all(not_yaml.stdout) if d and d["kind"] == "PyTorchJob"]
    assert job["metadata"]["name"] == "true"


def test_ctl_render_reads_a_spec_from_stdin_as_kubectl_apply_f_dash(tmp_path: Path) -> None:
    """`-` is the spec piped in (one generated by a script or a CI template), named `<stdin>` in its problems; a
    terminal as stdin (a forgotten pipe) is one line, not a wait for typing."""
    example = REPO / "examples" / "quickstart.yaml"
    from_file = run_ctl("render", str(example), "--set", "nodes=2", cwd=tmp_path)
    piped = run_ctl("render", "-", "--set", "nodes=2", cwd=tmp_path, stdin=example.read_text())
    assert piped.returncode == 0 and piped.stdout == from_file.stdout and "kind: PyTorchJob" in piped.stdout
    bad = run_ctl("render", "-", cwd=tmp_path, stdin=example.read_text().replace("name: quickstart", "name: Quick"))
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.startswith("error: <stdin>:5: name: 'Quick' is not a DNS-1035 label"), bad.stderr
    primary, secondary = pty.openpty()
    try:
        terminal = subprocess.run(
            [*CTL, "render", "-"],
            cwd=tmp_path,
            env=os.environ | {"PYTHONPATH": str(REPO)},
            stdin=secondary,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(primary)
        os.close(secondary)
    assert (terminal.returncode, terminal.stdout) == (2, ""), terminal.stderr
    assert terminal.stderr == "error: <stdin>: no spec piped in: `-` reads it from a pipe or a redirected file\n"


def test_ctl_render_notes_a_read_write_many_claim_on_the_default_class(tmp_path: Path) -> None:
    """No cluster to ask: a note on stderr (the objects still on stdout) when a multi-node job's claim relies on the
    default class, which on EKS, GKE and AKS cannot give ReadWriteMany; none when a class is named or one node
    needs ReadWriteOnce only."""
    example = REPO / "examples" / "quickstart.yaml"
    noted = run_ctl("render", str(example), "--set", "nodes=2", "--set", "storage.storageClassName=", cwd=tmp_path)
    assert noted.returncode == 0 and "kind: PyTorchJob" in noted.stdout
    (line,) = noted.stderr.splitlines()
    assert line.startswith("note: claim quickstart-checkpoints asks ReadWriteMany of the cluster's default storage")
    assert "k8s/README.md" in line
    for override in ("storage.storageClassName=efs-sc", "nodes=1"):
        quiet = run_ctl("render", str(example), "--set", "nodes=2", "--set", override, cwd=tmp_path)
        assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_ctl_render_does_not_import_torch() -> None:
    code = "import sys, ctl.cli, ctl.render, ctl.schema; sys.exit('torch' in sys.modules)"
    result = subprocess.run([os.sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "ctl imported torch"


def test_ctl_help_imports_neither_pydantic_nor_rich() -> None:
    """`ctl --help` stays quick: the spec model and rich's help formatting are loaded only when needed."""
    code = "import sys, ctl.cli; ctl.cli.app(['--help'], standalone_mode=False); print(sorted(sys.modules))"
    result = subprocess.run([os.sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0 and "Commands:" in result.stdout, result.stderr
    modules = set(ast.literal_eval(result.stdout.splitlines()[-1]))
    assert not modules & {"pydantic", "rich", "torch"}


def test_ctl_takes_h_for_help_as_kubectl_does() -> None:
    """`ctl -h` and `ctl render -h` were usage errors (`No such option: -h`, exit 2)."""
    for args in (["-h"], ["render", "-h"], ["status", "-h"]):
        result = run_ctl(*args, cwd=REPO)
        assert result.returncode == 0 and result.stdout.startswith("Usage: "), result.stderr


# ---------------------------------------------------------------------------------------------------------------
# k8s/: prerequisites and rendered examples.


@cache
def k8s_example_text(example: Path) -> str:
    from ctl.k8s import rendered_example

    return rendered_example(example)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_k8s_examples_are_current(example: Path) -> None:
    path = REPO / "k8s" / "examples" / example.name
    assert path.exists(), f"{path} is missing: run `make k8s`"
    assert path.read_text() == k8s_example_text(example), f"{path} is stale: run `make k8s`"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs == [m.obj for m in render(load_spec(example))]


def test_k8s_generator_help_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from ctl.k8s import RENDERED, main

    before = {path: path.stat().st_mtime_ns for path in RENDERED.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "usage: python -m ctl.k8s" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in RENDERED.iterdir()} == before


def test_k8s_examples_have_a_source() -> None:
    stale = {p.name for p in (REPO / "k8s" / "examples").glob("*.yaml")} - {p.name for p in EXAMPLES}
    assert not stale, f"k8s/examples without an examples/ spec: {stale} (run `make k8s`)"


PREREQUISITES = ["namespace.yaml", "rbac.yaml", "storage.yaml"]


@pytest.mark.parametrize("name", PREREQUISITES)
def test_k8s_prerequisites_validate_strictly(name: str) -> None:
    docs = [d for d in yaml.safe_load_all((REPO / "k8s" / name).read_text()) if d]
    assert docs
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_rbac_is_least_privilege_and_covers_every_object_the_chart_renders() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text()) if d}
    assert set(docs) == {"Role", "RoleBinding"}  # namespaced: no cluster-wide rights
    rules = docs["Role"]["rules"]
    writable = {
        (group, resource)
        for r in rules
        if {"create", "patch", "delete"} <= set(r["verbs"])
        for group in r["apiGroups"]
        for resource in r["resources"]
    }
    everything = spec_of(
        serviceAccount={"create": True},
        networkPolicy={"enabled": True},
        prepare={"enabled": True},
        metrics={"podMonitor": {"enabled": True}, "alerts": {"enabled": True}, "dashboard": {"enabled": True}},
    )
    plural = {"NetworkPolicy": "networkpolicies"}
    trainjob = everything.model_copy(update={"api_kind": "TrainJob"})
    rendered = {
        (m.obj["apiVersion"].rpartition("/")[0], plural.get(m.kind, m.kind.lower() + "s"))
        for m in render(everything) + render(trainjob)
    }
    assert rendered <= writable, rendered - writable
    readable = {(group, resource) for r in rules for group in r["apiGroups"] for resource in r["resources"]}
    # ctl status/logs: pods, their logs, rank 0's metrics (pods/proxy), events and Kueue's Workloads (which ctl
    # suspend/resume also patch: their spec.active).
    read_only = {("", "pods"), ("", "pods/log"), ("", "pods/proxy"), ("", "events"), ("kueue.x-k8s.io", "workloads")}
    assert readable - writable == read_only
    assert writable == rendered
    # Written by apply (PATCH); only Helm's release records (HELM_DRIVER=configmap) are rewritten with PUT.
    updated = {
        (group, resource)
        for r in rules
        if "update" in r["verbs"]
        for group in r["apiGroups"]
        for resource in r["resources"]
    }
    assert updated == {("", "configmaps")}
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        resources = {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
        if not resources <= writable:  # read-only beyond what ctl creates, but for Kueue's Workloads
            patched = {"patch"} if resources == {("kueue.x-k8s.io", "workloads")} else set()
            assert set(rule["verbs"]) <= {"get", "list", "watch"} | patched, rule
    assert docs["RoleBinding"]["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": docs["Role"]["metadata"]["name"],
    }
    assert "kubectl apply --server-side" in (REPO / "k8s" / "README.md").read_text()


def test_notes_tell_how_to_follow_the_job() -> None:
    text = notes(spec_of(nodes=2), namespace="ml")
    assert "kubectl get pytorchjob job -n ml -w" in text
    assert "kubectl logs -n ml -f job-master-0 -c pytorch" in text
    assert "/checkpoints/job" in text and "job-checkpoints" in text
    assert "container port `metrics` (9402, /metrics)." in text
    assert "scraped through PodMonitor job." in notes(spec_of(metrics={"podMonitor": {"enabled": True}}))
    elastic = notes(spec_of(**VARIANTS["elastic"]), namespace="ml")
    assert "job-worker-0 -c pytorch" in elastic and "elastic, 1-4 pods" in elastic
    suspended = notes(spec_of(runPolicy={"suspend": True}), namespace="ml")
    assert "no pods start until spec.runPolicy.suspend is false: ctl resume job -n ml" in suspended
    assert "created suspended" not in notes(spec_of(**VARIANTS["kueue"]))  # Kueue starts it


def test_helm_accepts_what_ctl_accepts_for_a_single_path(tmp_path: Path) -> None:
    """`train: data.txt` (one path, not a list) passes values.schema.json and reaches the trainer as a list."""
    values = {"name": "job", "training": {"data": {"train": "/data/train.txt", "val": "/data/val.txt"}}}
    manifests = split_manifests(render_chart(values, "job"))
    config = next(m.obj for m in manifests if m.kind == "ConfigMap")
    path = tmp_path / "training.yaml"
    path.write_text(config["data"]["training.yaml"])
    data = load_training_spec(path).data
    assert (data.train, data.val) == (["/data/train.txt"], ["/data/val.txt"])


def test_helm_accepts_numeric_labels_as_ctl_does(tmp_path: Path) -> None:
    """`labels: [1, 0]` (rows labelled with numbers) passes values.schema.json; the trainer reads them as text."""
    values = {"name": "job", "training": {"task": "classification", "data": {**TRAIN["data"], "labels": [1, 0]}}}
    config = next(m.obj for m in split_manifests(render_chart(values, "job")) if m.kind == "ConfigMap")
    path = tmp_path / "training.yaml"
    path.write_text(config["data"]["training.yaml"])
    assert load_training_spec(path).data.labels == ["1", "0"]


# ---------------------------------------------------------------------------------------------------------------
# Monitoring: metrics port and env, PodMonitor, PrometheusRule, dashboard.

MONITORING = spec_of(**VARIANTS["monitoring"])


@pytest.mark.parametrize(("name", "spec"), ALL_SPECS, ids=ALL_IDS)
def test_monitoring_objects_validate_against_the_real_crds(
    name: str, spec: JobSpec, monitoring_schemas: dict[str, dict[str, Any]]
) -> None:
    for manifest in render(spec):
        if manifest.obj["apiVersion"] == MONITORING_API:
            # Not jsonschema.validate: its schema check rejects the CRD's Go-only regex `^(?i)(abort|warn)?$`.
            jsonschema.Draft7Validator(monitoring_schemas[manifest.kind]).validate(manifest.obj)


def test_strict_monitoring_schemas_catch_unknown_fields(monitoring_schemas: dict[str, dict[str, Any]]) -> None:
    monitor = objects(MONITORING)["PodMonitor"]
    monitor["spec"]["podMetricEndpoints"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError, match="podMetricEndpoints"):
        jsonschema.Draft7Validator(monitoring_schemas["PodMonitor"]).validate(monitor)


def test_every_pod_serves_metrics_on_the_port_named_metrics() -> None:
    by_kind = objects(MONITORING)
    assert not {"PodMonitor", "PrometheusRule", DASHBOARDS} - set(by_kind)
    for template in pod_templates(by_kind["PyTorchJob"]).values():
        container = trainer_container(template)
        assert {"name": "metrics", "containerPort": 9500, "protocol": "TCP"} in container["ports"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["DDPJOB_METRICS_PORT"] == "9500" and env["DDPJOB_JOB_NAME"] == "job"
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["PROMETHEUS_MULTIPROC_DIR"]]
        assert {"name": mount["name"], "emptyDir": {"sizeLimit": "64Mi"}} in template["spec"]["volumes"]
        annotations = template["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "9500")
    plain = pod_templates(objects(spec_of())["PyTorchJob"])["Master"]
    assert not [key for key in plain["metadata"]["annotations"] if key.startswith("prometheus.io/")]
    assert not {"PodMonitor", "PrometheusRule", DASHBOARDS} & set(objects(spec_of()))


@pytest.mark.parametrize("variant", ["monitoring", "elastic-monitoring"])
def test_pod_monitor_selects_exactly_the_job_pods(variant: str) -> None:
    by_kind = objects(spec_of(**VARIANTS[variant]))
    monitor = by_kind["PodMonitor"]["spec"]
    assert monitor["jobLabel"] == PYTORCHJOB.job_label
    assert monitor["podTargetLabels"] == list(PYTORCHJOB.index_labels)
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"]
    for template in pod_templates(by_kind["PyTorchJob"]).values():
        assert monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    other_job = objects(spec_of(name="other"))["PyTorchJob"]
    for template in pod_templates(other_job).values():
        assert not monitor["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()


@pytest.mark.parametrize("api_kind", ["PyTorchJob", "TrainJob"])
def test_prepare_job_series_get_the_job_label_of_the_training_pods(api_kind: str, tmp_path: Path) -> None:
    """The PodMonitor's rules, run by a real Prometheus on the pod labels Kubernetes' service discovery gives
    (what prometheus-operator generates for a PodMonitor: `job` = namespace/name, then the jobLabel's value,
    then the endpoint's relabelings): the prepare Job's pod, labelled with the job's name as the training pods
    are, gets the same `job` as they do, so the alert rules and the dashboard (`job="<name>"`) see its series."""
    values = VARIANTS["prepare-job"] | {"metrics": {"podMonitor": {"enabled": True}}, "apiKind": api_kind}
    by_kind = objects(spec_of(**values))
    monitor = by_kind["PodMonitor"]

    def meta(label: str) -> str:
        return "__meta_kubernetes_pod_label_" + re.sub("[^a-zA-Z0-9_]", "_", label)

    def pod(port: int, labels: dict[str, str]) -> dict[str, Any]:
        return {"targets": [f"127.0.0.1:{port}"], "labels": {meta(k): v for k, v in labels.items()}}

    job_label = monitor["spec"]["jobLabel"]
    training_kind = "PyTorchJob" if api_kind == "PyTorchJob" else "TrainingRuntime"
    training_template = next(iter(pod_templates(by_kind[training_kind]).values()))
    training = training_template["metadata"]["labels"] | {job_label: "job"}  # added by the operator (JobSet)
    prepare_job = by_kind["Job"]
    prepare = prepare_job["spec"]["template"]["metadata"]["labels"] | {
        "batch.kubernetes.io/job-name": prepare_job["metadata"]["name"]  # added by the Job controller
    }
    for labels in (training, prepare):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    relabel_configs = [
        {"target_label": "job", "replacement": f"default/{monitor['metadata']['name']}"},
        {"source_labels": [meta(job_label)], "regex": "(.+)", "target_label": "job", "replacement": "${1}"},
        *({snake.get(k, k): v for k, v in rule.items()} for rule in endpoint.get("relabelings", [])),
    ]
    config = tmp_path / "prometheus.yaml"
    scrape = {"job_name": "podmonitor", "scrape_interval": "1h", "relabel_configs": relabel_configs}
    config.write_text(
        yaml.safe_dump({"scrape_configs": [scrape | {"static_configs": [pod(1, training), pod(2, prepare)]}]})
    )
    targets: list[dict[str, Any]] = []
    with prometheus_server(config, tmp_path) as url:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=5) as response:
                    targets = json.load(response)["data"]["activeTargets"]
                if len(targets) == 2:
                    break
            except OSError:
                pass
            time.sleep(0.1)
    assert sorted(t["labels"]["job"] for t in targets) == ["job", "job"], targets


def test_monitors_and_rules_carry_the_stack_selector_labels() -> None:
    by_kind = objects(MONITORING)
    assert by_kind["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert by_kind["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"
    assert by_kind["PrometheusRule"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("variant", ["monitoring", "elastic-monitoring"])
def test_alert_rules_pass_promtool(variant: str, tmp_path: Path) -> None:
    """The PrometheusRule's groups are a valid Prometheus rule file: every expression parses, every template too."""
    rule = objects(spec_of(**VARIANTS[variant]))["PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = subprocess.run([prometheus_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert ("CheckpointTooOld" in alerts) == (variant == "monitoring")  # checkpointMaxAgeSeconds 0 disables it
    operations = (REPO / "docs" / "operations.md").read_text().lower()
    runbook = VARIANTS[variant]["metrics"]["alerts"].get("runbookUrl")  # no default: no address is guessed
    for name, alert in alerts.items():
        assert set(alert["annotations"]) == {"summary", "description"} | ({"runbook_url"} if runbook else set())
        assert alert["labels"]["severity"] in ("critical", "warning")
        assert 'job="job"' in alert["expr"]  # scoped to this job's series
        if runbook:
            assert alert["annotations"]["runbook_url"] == f"{runbook}#{name.lower()}"
        assert f"### {name.lower()}" in operations, f"docs/operations.md has no section for {name}"
    if variant == "monitoring":
        assert "> 3600" in alerts["CheckpointTooOld"]["expr"]
    else:
        assert "job-worker-0" in alerts["TrainingStalled"]["annotations"]["description"]


def test_dashboard_configmap_is_the_dashboard_file_with_the_chart_defaults() -> None:
    config_map = objects(MONITORING)[DASHBOARDS]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted((chart_path() / "dashboards").glob("*.json"))
    assert sorted(config_map["data"]) == [f.name for f in files] and files
    shipped = json.loads((chart_path() / "dashboards" / "training.json").read_text())
    dashboard = json.loads(config_map["data"]["training.json"])
    defaults = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "textbox"}
    assert defaults == {"dcgm_pod_label": "pod", "dcgm_namespace_label": "namespace"}
    for variable in shipped["templating"]["list"]:
        if variable["type"] == "textbox":
            variable["query"] = defaults[variable["name"]]
            variable["current"] = {"text": variable["query"], "value": variable["query"]}
    assert dashboard == shipped
    custom = objects(spec_of(metrics={"dashboard": {"enabled": True, "labelKey": "dashboards", "labelValue": "ml"}}))
    assert custom[DASHBOARDS]["metadata"]["labels"]["dashboards"] == "ml"


def test_helm_lint_is_clean_with_every_monitoring_object() -> None:
    report = helm_python.lint(chart_path(), values=chart_values(MONITORING), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_dashboard_is_importable_as_is() -> None:
    """Stable uid, a datasource variable every panel uses, namespace and job variables, no __inputs."""
    dashboard = json.loads((chart_path() / "dashboards" / "training.json").read_text())
    assert dashboard["uid"] == "ddpjob-training" and "__inputs" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job", "dcgm_pod_label"} <= set(variables)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert panel.get("description", "").strip(), f"panel {panel['title']!r} has no description (Grafana's (i))"
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        assert metric in exprs
    # Preparation shows as such, not as a stall before the first step (test_metrics checks the data behind them).
    assert "ddpjob_prepare_read_bytes_total" in exprs and "ddpjob_prepare_eta_seconds" in exprs
