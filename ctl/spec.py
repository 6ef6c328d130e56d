"""The job spec: one YAML file that is also the Helm chart's values.

`training:` is the trainer's own model (trainer.spec); everything else describes the
PyTorchJob (or Trainer v2 TrainJob, `apiKind`) around it. `--set dotted.key=value` overrides any key before validation.
"""

from __future__ import annotations

import contextlib
import itertools
import posixpath
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ctl.api_rules import (
    ANNOTATION_KEY,
    LABEL_KEY,
    LABEL_VALUE,
    OBJECT_NAME,
    PREFIX_TOO_LONG,
    SUBDOMAIN_MAX,
    prefix_problem,
)
from ctl.kinds import KINDS, JobKind
from ctl.kinds.base import DEFAULT_MASTER_PORT
from ctl.kinds.trainjob import MASTER_PORT as TRAINJOB_MASTER_PORT
from ctl.kubernetes_form import NotText, kubernetes_list, kubernetes_object
from ctl.names import (
    CPU_PER_PROCESS,
    DNS_LABEL_MAX,
    GPUS_BELOW_PROCESSES,
    KUEUE_MAX_EXEC_TIME_LABEL,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    MEMORY_MIB_PER_PROCESS,
    POD_MOUNTS,
    POD_NAME_TOO_LONG,
)
from trainer.location import PEM_CERTIFICATE, S3Location, is_s3
from trainer.names import EXIT_HUNG
from trainer.spec import (
    ENDPOINT_URL,
    WANTED,
    Flag,
    Int,
    KeyProblem,
    Number,
    SpecError,
    SpecModel,
    TrainingSpec,
    describe_validation_error,
    did_you_mean,
    error_path,
    known_keys,
    parse_yaml_mapping,
    pattern,
    read_spec_text,
    read_yaml,
)

LIST_INDEX = re.compile(r"\[\d*\]$")  # helm's --set a.list[0]=value
KEY_DOT = re.compile(r"(?<!\\)\.")  # a dot between keys, not an escaped one (`\.`)
# helm's --set key={a,b}: a list (YAML would read a mapping of nulls); a colon inside makes it YAML's mapping.
HELM_LIST = re.compile(r"\{([^:{}\[\]]*[^:{}\[\]\s][^:{}\[\]]*)\}")
HELM_PAIRS = re.compile(r",\s*([A-Za-z][\w.]*)=")  # helm's --set a=1,b=2: two keys in one flag
# Kubernetes object names derived from the job name must stay valid DNS-1035 labels.
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# The validation context's key that says the spec is for a cluster (load_spec's `cluster`).
CLUSTER = "cluster"
# Variables that carry credentials (W&B's WANDB_API_KEY, MLflow's MLFLOW_TRACKING_TOKEN/_PASSWORD, HF_TOKEN,
# AWS_SECRET_ACCESS_KEY...): by reference only, so that no secret is a value in the spec, the rendered objects
# or Helm's release record.
CREDENTIAL_ENV = re.compile(r"(^|_)(TOKEN|API_KEY|PASSWORD|SECRET|ACCESS_KEY)$")
PROMETHEUS_DURATION = pattern(r"^([0-9]+(ms|s|m|h|d|w|y))+$", "a Prometheus duration, e.g. 30s, 5m or 1h30m")
PROMETHEUS_LABEL = pattern(r"^[a-zA-Z_][a-zA-Z0-9_]*$", "a Prometheus label name: letters, digits, _; no digit first")
# A Kubernetes quantity of bytes as the chart's `ddpjob.mebibytes` helper reads it: a number, an optional suffix.
BYTES_QUANTITY = pattern(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$", "a size in bytes, e.g. 512Mi, 4Gi or 1.5T")
ZERO_BYTES = r"^0+(\.0+)?[A-Za-z]*$"  # a BYTES_QUANTITY of nothing, which a claim may not ask for
CPU_QUANTITY = pattern(r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$", "a number of CPUs, e.g. 4, 0.5 or 500m")
MOUNT_PATH = pattern(r"^/.*[^/]", "an absolute path other than /, e.g. /checkpoints")
# The pods' own mounts, with or without a trailing /: the run volume cannot be mounted there too (refused by
# values.schema.json beside MOUNT_PATH, by ctl in a validator that names the mount).
POD_MOUNT_PATH = f"^({'|'.join(map(re.escape, POD_MOUNTS.values()))})/*$"
IMAGE_REPOSITORY = pattern(r"^\S+$", "an image repository without blanks, e.g. registry.example.com/ml/ddpjob")
# An image reference's tag (and digest) as the kubelet parses it (distribution's reference grammar): another one is
# InvalidImageName on every node, which the API server takes (semver's `1.0+build` among them).
IMAGE_TAG = pattern(
    r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127}(@sha256:[0-9a-f]{64})?)?$",  # ASCII: Python's \w has every letter
    "an image tag: letters, digits, '_', '.' and '-', at most 128, then an optional @sha256:digest, e.g. 0.1.0",
)
# An object's name; empty where the spec says what empty means.
ObjectName = Annotated[str, Field(pattern=OBJECT_NAME, max_length=SUBDOMAIN_MAX)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE)]


def _prefix_within_limit(key: str) -> str:
    if problem := prefix_problem(key):
        raise ValueError(problem)
    return key


def _qualified_key(key_pattern: str) -> dict[str, Any]:
    """The JSON schema of a label's or annotation's key."""
    return {"pattern": key_pattern, "not": {"pattern": PREFIX_TOO_LONG}}


LABEL_KEY_SCHEMA = _qualified_key(LABEL_KEY)
ANNOTATION_KEY_SCHEMA = _qualified_key(ANNOTATION_KEY)
LabelKey = Annotated[
    str,
    Field(pattern=LABEL_KEY),
    AfterValidator(_prefix_within_limit),
    WithJsonSchema({"type": "string", **LABEL_KEY_SCHEMA}),
]
AnnotationKey = Annotated[str, Field(pattern=ANNOTATION_KEY), AfterValidator(_prefix_within_limit)]


def _keyed(keys: dict[str, Any], values: dict[str, Any]) -> Any:
    """A mapping whose keys have a form: values.schema.json checks every key (pydantic's patternProperties would
    let a key that misses the pattern through)."""
    return WithJsonSchema({"type": "object", "propertyNames": keys, "additionalProperties": values})


Labels = Annotated[dict[LabelKey, LabelValue], _keyed(LABEL_KEY_SCHEMA, {"type": "string", "pattern": LABEL_VALUE})]
Annotations = Annotated[dict[AnnotationKey, str], _keyed(ANNOTATION_KEY_SCHEMA, {"type": "string"})]


class ImageSpec(SpecModel):
    """The training image (see the Dockerfile)."""

    repository: str = Field("ddpjob", pattern=IMAGE_REPOSITORY, description="Image repository.")
    tag: str = Field(
        "",
        pattern=IMAGE_TAG,
        description="Image tag (or `tag@sha256:digest`); empty: the chart's appVersion, the version the image is"
        " built as. `latest` is refused: nodes pulling at different times would run different builds.",
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")

    @field_validator("tag")
    @classmethod
    def _pinned(cls, tag: str) -> str:
        if tag.split("@")[0] == "latest":
            raise ValueError("'latest' is not a version: pin one (e.g. the chart's appVersion) or a digest")
        return tag


class ResourcesSpec(SpecModel):
    """Per-pod resources."""

    gpu: Int = Field(
        0,
        ge=0,
        description="nvidia.com/gpu per pod (request and limit): 0, or at least procsPerNode (one per process).",
    )
    cpu: str | None = Field(
        None,
        pattern=CPU_QUANTITY,
        description=f"CPU request per pod, e.g. '8' (when unset: {CPU_PER_PROCESS} per process). No CPU limit: a"
        " throttled rank"
        " holds every other rank back at the next all-reduce.",
    )
    memory: str | None = Field(
        None,
        pattern=BYTES_QUANTITY,
        description="Memory of the trainer processes per pod, e.g. 64Gi (when unset:"
        f" {MEMORY_MIB_PER_PROCESS // 1024}Gi per process). The pod's"
        " memory request and limit are this plus `shm` (/dev/shm is memory the pod is charged for).",
    )
    shm: str = Field("1Gi", pattern=BYTES_QUANTITY, description="Size limit of the /dev/shm memory volume.")
    cache: str = Field(
        "20Gi",
        pattern=BYTES_QUANTITY,
        description="Size limit of the scratch volume (HOME, the Hugging Face, torch.compile and Triton caches,"
        " /tmp) beside the read-only root filesystem; requested as ephemeral-storage.",
    )


class ElasticSpec(SpecModel):
    """Worker-only PyTorchJob with torchrun's c10d rendezvous."""

    enabled: Flag = Field(False, description="Use an elasticPolicy instead of Master + Workers.")
    min_nodes: Int = Field(1, ge=1, description="Fewest pods the job runs with.")
    max_nodes: Int = Field(1, ge=1, description="Most pods the job scales to.")
    max_restarts: Int = Field(3, ge=0, description="Worker-group restarts torchrun allows.")


class StorageSpec(SpecModel):
    """Where run directories (checkpoints, final model, report) live: the shared volume, or with `uri` an S3 bucket
    (docs/object-storage.md)."""

    uri: str = Field(
        "",
        description="s3://bucket/prefix: run directories in an S3 bucket instead of the volume (no claim is"
        " rendered); the run directory is <uri>/<name> unless training.checkpoint.dir names one.",
    )
    endpoint: str = Field(
        "",
        pattern=ENDPOINT_URL,
        description="The S3 server of `uri` and of s3:// data: an S3-compatible endpoint URL (AWS_ENDPOINT_URL);"
        " empty: AWS S3 of `region`.",
    )
    region: str = Field("", description="The S3 buckets' region (AWS_REGION).")
    secret_name: ObjectName = Field(
        "",
        description="For S3: a Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, given to the"
        " pods as those variables; empty: the pods' cloud identity (IRSA, EKS Pod Identity, instance profile).",
    )
    ca_bundle: str = Field(
        "",
        description="For S3: PEM certificates of the private CA that signed the endpoint's TLS certificate, trusted"
        " beside the system's (a file of the job's ConfigMap, named by AWS_CA_BUNDLE).",
    )

    existing_claim: ObjectName = Field("", description="Use this PVC instead of creating one.")
    size: str = Field(
        "10Gi",
        pattern=BYTES_QUANTITY,
        json_schema_extra={"not": {"pattern": ZERO_BYTES}},
        description="Size of the created PVC (more than 0).",
    )
    storage_class_name: ObjectName = Field("", description="StorageClass of the created PVC; empty: cluster default.")
    access_modes: list[Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]] = Field(
        default_factory=list,
        description="Access modes of the created PVC; empty: ReadWriteMany when pods of the job can run on"
        " several nodes (nodes > 1, elastic), else ReadWriteOnce (every cloud's default class gives it).",
    )
    mount_path: str = Field(
        "/checkpoints",
        pattern=MOUNT_PATH,
        json_schema_extra={"not": {"pattern": POD_MOUNT_PATH}},
        description="Where the volume is mounted in every pod.",
    )

    @field_validator("size")
    @classmethod
    def _more_than_nothing(cls, size: str) -> str:
        """The API server refuses a claim of no bytes (values.schema.json's `not` refuses it for helm)."""
        if re.match(ZERO_BYTES, size):
            raise ValueError(f"{size!r} is no bytes: a claim must ask for more")
        return size

    @field_validator("mount_path")
    @classmethod
    def _not_the_pods_own(cls, path: str) -> str:
        """Two volumes at one path: the API server refuses the pods when the operator creates them. And a path with
        `.`, `..` or `//` in it, which the API server takes as it is: the run directory's checks compare plain paths."""
        if match := re.match(POD_MOUNT_PATH, path):
            own = next(name for name, mount in POD_MOUNTS.items() if mount == match.group(1))
            raise ValueError(f"{path!r} is where every pod mounts its {own} volume: choose another, e.g. /checkpoints")
        if (plain := posixpath.normpath(path)) != path:
            raise ValueError(f"{path!r} is {plain!r} once its '.', '..' and '//' are resolved: write that")
        return path

    @field_validator("uri")
    @classmethod
    def _s3_uri(cls, uri: str) -> str:
        if uri:
            S3Location.parse(uri)
        return uri

    @field_validator("ca_bundle")
    @classmethod
    def _pem(cls, bundle: str) -> str:
        if bundle and PEM_CERTIFICATE not in bundle:
            raise ValueError(f"holds no PEM certificate ({PEM_CERTIFICATE})")
        return bundle


class ServiceAccountSpec(SpecModel):
    """The pods' ServiceAccount; the trainer never calls the Kubernetes API."""

    create: Flag = Field(False, description="Create a ServiceAccount for the job (named `name` when `name` is empty).")
    name: ObjectName = Field(
        "", description="ServiceAccount to use; empty: the namespace's `default`, or the created one."
    )
    annotations: Annotations = Field(
        default_factory=dict, description="Annotations of the created ServiceAccount (e.g. cloud IAM bindings)."
    )
    automount_token: Flag = Field(False, description="Mount an API token into the pods (off: least privilege).")


class SchedulingPolicySpec(SpecModel):
    """runPolicy.schedulingPolicy: gang scheduling with Volcano (or scheduler-plugins)."""

    min_available: Int | None = Field(None, ge=1, description="Pods that must be schedulable together; default: all.")
    priority_class: ObjectName = Field("", description="PriorityClass of the PodGroup.")
    schedule_timeout_seconds: Int | None = Field(None, ge=1, description="Give up gang scheduling after this long.")


class RunPolicySpec(SpecModel):
    """The PyTorchJob's runPolicy: retries, lifetime and clean-up."""

    backoff_limit: Int = Field(
        3,
        ge=0,
        description="Container restarts (restartPolicy OnFailure or Always, summed over the job's pods) before the"
        " job is marked Failed and its GPUs are freed: a crash-looping job otherwise holds them forever. Each"
        " restart resumes from the last checkpoint. The operator (v1.9) does not count ExitCode's pod"
        " recreations; 0 fails the job at its first failure.",
    )
    ttl_seconds_after_finished: Int | None = Field(
        None,
        ge=0,
        description="Delete the finished PyTorchJob (and its pods, with their logs) after this many seconds, e.g."
        " 604800 (a week); the run directory's claim stays. When unset they stay until deleted (`ctl delete`).",
    )
    active_deadline_seconds: Int | None = Field(
        None,
        ge=1,
        description="Fail the job after running this long, e.g. as a cost cap; how long training takes is the"
        " spec's to say (maxSteps, epochs).",
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "None", description="Pods deleted when the job finishes; None keeps them for `ctl logs`."
    )
    suspend: Flag = Field(
        False, description="Create the job suspended: no pods until `ctl resume NAME` (as after `ctl suspend NAME`)."
    )
    scheduling_policy: SchedulingPolicySpec = Field(default_factory=SchedulingPolicySpec)


class QueueSpec(SpecModel):
    """Admission through a batch queue: Kueue or Volcano (at most one)."""

    kueue: LabelValue = Field(
        "",
        description=f"Kueue LocalQueue: sets the `{KUEUE_QUEUE_LABEL}` label on the job, which Kueue then starts"
        " (suspended until then) once the LocalQueue's ClusterQueue has quota for all its pods.",
    )
    kueue_priority_class: LabelValue = Field(
        "", description=f"Kueue WorkloadPriorityClass: sets the `{KUEUE_PRIORITY_LABEL}` label on the job."
    )
    kueue_max_execution_seconds: Int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,  # Kueue keeps it as an int32
        description=f"Kueue's time budget: sets the `{KUEUE_MAX_EXEC_TIME_LABEL}` label on the job. Once it has been"
        " admitted this long (its admissions added up), Kueue deactivates its Workload for good: the job is suspended"
        " (rank 0 saves at the SIGTERM) and keeps no pods. Unlike runPolicy.activeDeadlineSeconds, it does not fail:"
        " `ctl submit SPEC --replace` makes it anew, with the time again, and it goes on from its checkpoint.",
    )
    volcano: ObjectName = Field(
        "",
        description="Volcano queue: schedulerName volcano and gang scheduling (PyTorchJob:"
        " runPolicy.schedulingPolicy.queue; TrainJob: the runtime's podGroupPolicy.volcano).",
    )
    coscheduling: str = Field(
        "",
        description="TrainJob only: gang scheduling with the scheduler-plugins coscheduling plugin: the name of the"
        " scheduler running it (the pods' schedulerName, e.g. scheduler-plugins-scheduler); the runtime gets"
        " podGroupPolicy.coscheduling, a PodGroup of all nodes.",
    )

    @model_validator(mode="after")
    def _one_queue(self) -> QueueSpec:
        if self.kueue and self.volcano:
            raise ValueError("set either kueue or volcano, not both")
        if self.volcano and self.coscheduling:
            raise ValueError("set either volcano or coscheduling, not both")
        return self


class PodSecuritySpec(SpecModel):
    """Who the trainer runs as; the chart adds the rest of the "restricted" Pod Security profile."""

    run_as_user: Int = Field(1000, ge=1, description="UID of the trainer (the image's non-root user).")
    run_as_group: Int = Field(1000, ge=0, description="GID of the trainer.")
    fs_group: Int = Field(1000, ge=0, description="Group owning the mounted volumes (changed only on mismatch).")


# Keys given in Kubernetes form, checked against the API's own keys and types (ctl.kubernetes_form).
Affinity = kubernetes_object("V1Affinity")
EnvEntries = kubernetes_list("V1EnvVar")
EnvFromEntries = kubernetes_list("V1EnvFromSource")
SecretReferences = kubernetes_list("V1LocalObjectReference")
LabelSelector = kubernetes_object("V1LabelSelector")
Tolerations = kubernetes_list("V1Toleration")


class NetworkPolicySpec(SpecModel):
    """A NetworkPolicy letting into the job's pods only their peers (rendezvous, NCCL/Gloo) and Prometheus."""

    enabled: Flag = Field(False, description="Create the NetworkPolicy (needs a CNI that enforces them).")
    prometheus_namespace_selector: LabelSelector = Field(
        default_factory=lambda: {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        description="namespaceSelector (Kubernetes form) of the Prometheus allowed to scrape the `metrics` port.",
    )
    prometheus_pod_selector: LabelSelector = Field(
        default_factory=lambda: {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        description="podSelector (Kubernetes form) of that Prometheus.",
    )


class PodMonitorSpec(SpecModel):
    """A prometheus-operator PodMonitor scraping every pod's `metrics` port (needs the operator's CRDs)."""

    enabled: Flag = Field(False, description="Create the PodMonitor.")
    interval: str = Field(
        "15s", pattern=PROMETHEUS_DURATION, description="Scrape interval, a Prometheus duration (e.g. 15s, 1m)."
    )
    labels: Labels = Field(
        default_factory=dict,
        description="Extra labels the Prometheus selects monitors by, e.g. {release: kube-prometheus-stack}.",
    )


class DashboardSpec(SpecModel):
    """The Grafana dashboard (helm/ddpjob/dashboards/) as a ConfigMap for Grafana's dashboard sidecar."""

    enabled: Flag = Field(False, description="Create the dashboard ConfigMap (one per cluster is enough: same uid).")
    label_key: LabelKey = Field("grafana_dashboard", description="Label the sidecar watches for.")
    label_value: LabelValue = Field("1", description="Value of that label.")
    dcgm_pod_label: str = Field(
        "exported_pod",
        pattern=PROMETHEUS_LABEL,
        description="Label naming the pod on NVIDIA DCGM exporter series (pod when the exporter's honorLabels is on).",
    )
    dcgm_namespace_label: str = Field(
        "exported_namespace", pattern=PROMETHEUS_LABEL, description="Label naming the namespace on DCGM series."
    )


class AlertsSpec(SpecModel):
    """A PrometheusRule with this job's alerts (needs the prometheus-operator CRDs)."""

    enabled: Flag = Field(False, description="Create the PrometheusRule.")
    labels: Labels = Field(
        default_factory=dict,
        description="Extra labels the Prometheus selects rules by, e.g. {release: kube-prometheus-stack}.",
    )
    stalled_seconds: Int = Field(
        900,
        ge=60,
        description="TrainingStalled: no optimizer step for this long, once the trainer processes have completed"
        " their first (so compilation and a resume's loading are not taken for a hang).",
    )
    first_step_seconds: Int = Field(
        1800,
        ge=60,
        description="TrainingFirstStepMissing: trainer processes running this long without completing a step"
        " (data preparation, model loading, torch.compile and the rendezvous included).",
    )
    runbook_url: str = Field(
        "",
        description="Where the alerts' runbook_url annotations point: your published copy of this project's"
        " docs/operations.md (each alert adds its own #anchor); empty: the alerts carry no runbook_url.",
    )
    loss_explosion_factor: Number = Field(
        3.0, gt=1.0, description="TrainingLossExploding: loss above this many times its minimum of the last hour."
    )
    checkpoint_max_age_seconds: Int = Field(
        7200, ge=0, description="CheckpointTooOld: no checkpoint committed for this long; 0 disables the alert."
    )
    restart_window_seconds: Int = Field(
        1800,
        ge=60,
        description="TrainingRestarted: a restart within this window (a container restarted in place or a pod"
        " recreated: evicted, preempted, retried by restartPolicy).",
    )
    slow_rank_factor: Number = Field(
        1.5,
        gt=1.0,
        description="SlowRank: a rank's busy time per step (without the wait for the others) above this many"
        " times the median rank's, for 10 minutes.",
    )


class MetricsSpec(SpecModel):
    """Prometheus metrics: every pod serves its ranks' metrics on the container port named `metrics`."""

    port: Int = Field(9402, ge=1, le=65535, description="Container port of the metrics endpoint (/metrics).")
    annotations: Flag = Field(
        False, description="Add prometheus.io/scrape, port and path pod annotations (annotation-based scraping)."
    )
    pod_monitor: PodMonitorSpec = Field(default_factory=PodMonitorSpec)
    dashboard: DashboardSpec = Field(default_factory=DashboardSpec)
    alerts: AlertsSpec = Field(default_factory=AlertsSpec)


class PrepareSpec(SpecModel):
    """A CPU-only Kubernetes Job that prepares the training data on the shared volume while the GPU pods wait."""

    enabled: Flag = Field(
        False,
        description="Render the prepare Job; the training pods then wait for its prepared data instead of"
        " preparing it themselves.",
    )
    cpu: str = Field(
        "4",
        pattern=CPU_QUANTITY,
        description="CPU request and limit of the prepare pod: it tokenizes with a process per CPU of it.",
    )
    memory: str = Field("4Gi", pattern=BYTES_QUANTITY, description="Memory request and limit of the prepare pod.")
    backoff_limit: Int = Field(1, ge=0, description="Retries of the prepare pod before the Job is marked Failed.")
    node_selector: Labels = Field(
        default_factory=dict, description="nodeSelector of the prepare pod (the training pods' is not used: no GPU)."
    )
    tolerations: Tolerations = Field(
        default_factory=list, description="Tolerations of the prepare pod (Kubernetes form)."
    )


class JobSpec(SpecModel):
    """A whole training job."""

    name: str = Field(
        description="Job (and release) name; a DNS-1035 label. Its pods' names (<name>-master-0, <name>-worker-10...)"
        " must fit 63 characters too, which leaves a name about 54.",
        json_schema_extra={"pattern": f"^{DNS_1035.pattern}$", "maxLength": DNS_LABEL_MAX},
    )
    api_kind: Literal["PyTorchJob", "TrainJob"] = Field(
        "PyTorchJob",
        description="The job API: PyTorchJob (Kubeflow training operator v1) or TrainJob (Kubeflow Trainer v2.3,"
        " on JobSet: a TrainingRuntime carrying the pod template and a TrainJob referencing it).",
    )
    image: ImageSpec = Field(default_factory=ImageSpec)
    nodes: Int = Field(1, ge=1, description="Pods: 1 Master + (nodes-1) Workers, or the initial elastic Workers.")
    procs_per_node: Int = Field(1, ge=1, description="torchrun processes per pod (GPUs per pod).")
    master_port: Int = Field(
        DEFAULT_MASTER_PORT,
        ge=1,
        le=65535,
        description="PyTorchJob: the `pytorchjob-port` rendezvous port"
        f" (a TrainJob always uses {TRAINJOB_MASTER_PORT}, Trainer v2's).",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    elastic: ElasticSpec = Field(default_factory=ElasticSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    restart_policy: Literal["OnFailure", "Never", "Always", "ExitCode"] = Field(
        "OnFailure",
        description="What the operator does when a pod's container fails (every replica type). ExitCode recreates"
        f" the pod for exit codes 128 and up (143: stopped by SIGTERM after saving; {EXIT_HUNG}: found hung by the"
        " watchdog) and fails the job for 1-127"
        " (1: error, 2: bad input).",
    )
    run_policy: RunPolicySpec = Field(default_factory=RunPolicySpec)
    queue: QueueSpec = Field(default_factory=QueueSpec)
    termination_grace_period_seconds: Int = Field(
        120,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL: time for the trainer to save a checkpoint"
        " (torchrun gives its workers all but the last 5 s); ctl run's nodes get it too on Ctrl-C or SIGTERM.",
    )
    node_selector: Labels = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: Tolerations = Field(default_factory=list, description="Pod tolerations (Kubernetes form).")
    affinity: Affinity = Field(default_factory=dict, description="Pod affinity (Kubernetes form).")
    priority_class_name: ObjectName = Field("", description="PriorityClass of the pods.")
    image_pull_secrets: SecretReferences = Field(
        default_factory=list, description="Secrets for pulling the image (Kubernetes form), e.g. [{name: regcred}]."
    )
    service_account: ServiceAccountSpec = Field(default_factory=ServiceAccountSpec)
    security: PodSecuritySpec = Field(default_factory=PodSecuritySpec)
    env: EnvEntries = Field(
        default_factory=list,
        description="Extra env of the `pytorch` container (Kubernetes form), e.g. HF_TOKEN from a secretKeyRef."
        " A credential (a name ending in TOKEN, API_KEY, PASSWORD, SECRET or ACCESS_KEY) only by reference.",
    )
    env_from: EnvFromEntries = Field(
        default_factory=list, description="Whole ConfigMaps/Secrets as env (Kubernetes form)."
    )
    pod_annotations: Annotations = Field(default_factory=dict, description="Extra annotations on every pod.")
    pod_labels: Labels = Field(default_factory=dict, description="Extra labels on every pod.")
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    prepare: PrepareSpec = Field(default_factory=PrepareSpec)
    training: TrainingSpec

    @field_validator("name")
    @classmethod
    def _dns_1035(cls, name: str) -> str:
        if not DNS_1035.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)"
            )
        return name

    @field_validator("env", "image_pull_secrets")
    @classmethod
    def _named(cls, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The API lets these entries' `name` be empty; an entry without one names nothing."""
        for i, entry in enumerate(entries):
            if not entry.get("name"):
                raise ValueError(f"entry {i} needs a `name`")
        return entries

    @field_validator("env")
    @classmethod
    def _credentials_by_reference(cls, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for var in env:
            if "value" in var and CREDENTIAL_ENV.search(var["name"]):
                raise ValueError(
                    f"{var['name']}: a credential is not given as a value: use valueFrom.secretKeyRef"
                    " (or envFrom a Secret)"
                )
        return env

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> JobSpec:
        if refused := self.kind.refusal(self):
            raise KeyProblem(*refused)
        if self.elastic.enabled and not self.elastic.min_nodes <= self.nodes <= self.elastic.max_nodes:
            raise KeyProblem(
                "elastic",
                f"nodes ({self.nodes}) must lie within minNodes ({self.elastic.min_nodes}) and maxNodes"
                f" ({self.elastic.max_nodes})",
            )
        gang = self.run_policy.scheduling_policy.min_available or 0
        if gang > (pods := self.elastic.max_nodes if self.elastic.enabled else self.nodes):
            raise KeyProblem(
                "runPolicy.schedulingPolicy.minAvailable",
                f"{gang} pods, and the job has at most {pods}: the gang would never be scheduled",
            )
        if 0 < self.resources.gpu < self.procs_per_node:
            raise stated(GPUS_BELOW_PROCESSES % (self.resources.gpu, self.procs_per_node))
        if self.storage.uri and self.storage.existing_claim:
            raise KeyProblem(
                "storage.existingClaim", "no claim is mounted with storage.uri (runs in the bucket); set one"
            )
        if self.storage.uri and self.prepare.enabled:
            raise KeyProblem(
                "prepare.enabled",
                "the prepare Job hands its dataset to the pods through the shared volume, which storage.uri replaces;"
                " leave it off (each pod then prepares its data into its node's cache)",
            )
        if self.metrics.port == self.rendezvous_port:
            port = self.kind.rendezvous_port_name
            masters = self.master_port == self.rendezvous_port
            if masters and "master_port" in self.model_fields_set and "port" not in self.metrics.model_fields_set:
                # The key given names the clash, so that the line points at the file's line or flag that set it.
                raise KeyProblem("masterPort", f"{self.master_port} is already metrics.port, the metrics port")
            raise KeyProblem("metrics.port", f"{self.metrics.port} is already {port}, the rendezvous port")
        longest = self.longest_pod_name()
        if len(longest) > DNS_LABEL_MAX:
            raise stated(POD_NAME_TOO_LONG % (longest, len(longest), DNS_LABEL_MAX))
        if (info.context or {}).get(CLUSTER) and (problem := self.cluster_problem()):
            raise problem
        return self

    @property
    def kind(self) -> JobKind:
        """The job API the spec renders to (ctl.kinds)."""
        return KINDS[self.api_kind]

    @property
    def rendezvous_port(self) -> int:
        """The port node 0's torchrun listens on: masterPort, or Trainer v2's fixed port."""
        return self.kind.rendezvous_port(self)

    def longest_pod_name(self) -> str:
        """The longest pod hostname the operator derives (the chart's `ddpjob.fullname` checks the same)."""
        return self.kind.longest_replica(self).pod_name(self.name)

    def cluster_problem(self) -> KeyProblem | None:
        """Why the job's run directory (or the dataset cache its prepare Job fills) would not be where every pod finds
        it in a cluster; None when it is. Not a problem for `ctl run`, which trains into any local folder."""
        folder, cache = self.training.checkpoint.dir, self.training.data.cache_dir
        mount = self.storage.mount_path
        lost = "each pod would keep its checkpoints in its own file system, lost with the pod"
        if folder and not is_s3(folder) and self.storage.uri:
            return KeyProblem(
                "training.checkpoint.dir",
                f"{folder} is a path, and with storage.uri the pods mount no volume: {lost}; name an s3:// URI, or"
                " leave it unset for <storage.uri>/<name>",
            )
        # The volume's root is no run directory either: the default dataset cache, beside it, would be off the volume.
        if folder and not is_s3(folder) and not posixpath.normpath(folder).startswith(f"{mount}/"):
            return KeyProblem(
                "training.checkpoint.dir",
                f"{folder} is not a folder under storage.mountPath ({mount}), the volume the pods share: {lost}; name"
                " a folder under it, or an s3:// URI",
            )
        if self.prepare.enabled and cache and not f"{posixpath.normpath(cache)}/".startswith(f"{mount}/"):
            return KeyProblem(
                "training.data.cacheDir",
                f"{cache} is not under storage.mountPath ({mount}): the prepare Job (prepare.enabled) hands its dataset"
                " to the pods through the volume; name a folder under it, or leave it unset",
            )
        return None


TOP_LEVEL_KEYS = frozenset(field.alias or name for name, field in JobSpec.model_fields.items())


def stated(line: str) -> KeyProblem:
    """A problem the chart states too, as `key: problem` (ctl.names), as that key's problem."""
    key, _, problem = line.partition(": ")
    return KeyProblem(key, problem)


def helm_pairs(assignment: str) -> list[str]:
    """helm's `a=1,b=2` as its assignments, split where a comma starts another key of the spec (a value's own
    commas stay); one item when there is no such comma."""
    cuts = [m.start() for m in HELM_PAIRS.finditer(assignment) if m.group(1).split(".")[0] in TOP_LEVEL_KEYS]
    bounds = [0, *cuts, len(assignment)]
    return [assignment[start:end].removeprefix(",").strip() for start, end in itertools.pairwise(bounds)]


def _split_assignment(assignment: str, flag: str, form: str) -> tuple[list[str], str]:
    key, sep, raw = assignment.partition("=")
    # `\.` is a dot within a key, as in helm: nodeSelector.kubernetes\.io/arch=amd64
    path = [part.replace("\\.", ".") for part in KEY_DOT.split(key.strip())]
    if not sep or not all(path):
        raise SpecError(f"{flag} {assignment!r}: expected {form}")
    if indexed := next((part for part in path if LIST_INDEX.search(part)), None):  # helm's `list[0]=value`
        whole = ".".join([*path[: path.index(indexed)], LIST_INDEX.sub("", indexed)])
        raise SpecError(f"{flag} {assignment!r}: no list items by index; set the whole list, {whole}=[a, b]")
    return path, raw


class Override(NamedTuple):
    """One --set or --set-file assignment, read."""

    flag: str
    assignment: str  # as given
    path: list[str]  # `a.b.c` -> ["a", "b", "c"]
    typed: str | None  # the value as typed (--set); None for --set-file, whose value is the file's text
    value: Any  # what the key is set to; None takes it back to its default


def read_set(assignment: str) -> Override:
    """`a.b.c=value`, the value read as YAML (numbers, booleans, lists; helm's `{a,b}` too)."""
    path, raw = _split_assignment(assignment, "--set", "dotted.key=value")
    if len(pairs := helm_pairs(assignment)) > 1:
        flags = " ".join(f"--set {pair}" for pair in pairs)
        raise SpecError(f"--set {assignment!r}: one key per --set (a value is YAML, commas included): {flags}")
    items = HELM_LIST.fullmatch(raw.strip())
    value = [yaml_value(item.strip()) for item in items.group(1).split(",")] if items else yaml_value(raw)
    return Override("--set", assignment, path, raw, value)


def yaml_value(raw: str) -> Any:
    """`raw` read as YAML (a number, a boolean, a list), or the text itself where it is not YAML; nothing is ''."""
    try:
        return read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def read_set_file(assignment: str) -> Override:
    """`a.b=path`, the key set to the file's text, as helm's --set-file: a certificate, a long prompt."""
    path, name = _split_assignment(assignment, "--set-file", "dotted.key=path")
    if not name.strip():  # Path('') is the current directory
        raise SpecError(f"--set-file {assignment!r}: expected dotted.key=path, and the path is empty")
    file = Path(name).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
        return Override("--set-file", assignment, path, None, text)
    except UnicodeDecodeError as exc:
        raise SpecError(f"--set-file {assignment!r}: {file} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"--set-file {assignment!r}: cannot read {file}: {exc.strerror}") from None


def read_overrides(assignments: Sequence[str], files: Sequence[str] = ()) -> list[Override]:
    """Every `--set` assignment, then every `--set-file` one: the order they apply in."""
    return [*map(read_set, assignments), *map(read_set_file, files)]


def apply_overrides(values: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """Return a copy of `values` with `overrides` applied in order."""
    merged: dict[str, Any] = yaml.safe_load(yaml.safe_dump(values))
    for override in overrides:
        node, path = merged, override.path
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise SpecError(f"{override.flag} {override.assignment!r}: {where} is not a mapping")
            node = child
        if override.value is None:  # `key=null`, as in helm: the key's default
            node.pop(path[-1], None)
        else:
            node[path[-1]] = override.value
    return merged


STDIN = "<stdin>"  # the spec's name in messages when it is read from standard input (`-`)


def merge_values(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """`layer` over `base`, as helm merges values files: mappings key by key, anything else replaced, null removing
    the key (its default then holds)."""
    merged = dict(base)
    for key, value in layer.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = value
    return merged


def null_paths(layer: dict[str, Any], within: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """The keys a values file sets to null, mapping within mapping (a list's items are values, not keys)."""
    for key, value in layer.items():
        if value is None:
            yield [*within, str(key)]
        elif isinstance(value, dict):
            yield from null_paths(value, (*within, str(key)))


def refuse_unknown_nulls(paths: Iterable[list[str]], sources: Sources) -> None:
    """A null takes its key back to the default, so validation never sees the key: a mistyped one would do nothing,
    silently. Each must be a key of the spec, or any key within a mapping of free keys (podLabels, affinity)."""
    for path in paths:
        for depth, part in enumerate(path):
            keys = known_keys(JobSpec, path[:depth])
            if not keys:
                break
            if part not in keys:
                where = sources.of(path)
                raise SpecError(f"{where}: {'.'.join(path[: depth + 1])}: unknown key{did_you_mean(part, keys)}")


def spec_name(path: Path) -> str:
    """The spec's name in messages: its path, or <stdin> for `-`."""
    return STDIN if str(path) == "-" else str(path)


class Sources(NamedTuple):
    """Where a spec's keys come from: its files (the spec, then the --values files, each as its name and text), and
    the --set and --set-file flags."""

    files: list[tuple[str, str]]
    overrides: Sequence[Override]

    def of(self, path: Sequence[str]) -> str:
        """Where the key at `path` was given: the last --set or --set-file of it (or of a mapping around it); else
        `file:line` in the last file that writes it, or that writes most of the mappings around it (a key that is
        missing: the line of its mapping); the files' names when none writes any of it."""
        given = [o for o in self.overrides if tuple(path[: len(o.path)]) == tuple(o.path)]
        if given:
            return f"{given[-1].flag} {given[-1].assignment!r}"
        found = [(*written_at(text, path), name) for name, text in self.files]
        depth = max(depth for depth, _, _ in found)
        # A key no file writes, made by a flag that set a key inside it (`--set foo.bar=1`: foo is unknown).
        within = [o for o in self.overrides if tuple(o.path[: len(path)]) == tuple(path)]
        if depth < len(path) and within:
            return f"{within[-1].flag} {within[-1].assignment!r}"
        if not depth:
            return " + ".join(name for name, _ in self.files)
        _, line, name = [place for place in found if place[0] == depth][-1]  # a later file overrides
        return f"{name}:{line}"


def written_at(text: str, path: Sequence[str]) -> tuple[int, int]:
    """How many keys of `path` the YAML `text` writes, from the top, and the line of the last of them (a list's item
    by its index)."""
    node, depth, line = yaml.compose(text, Loader=yaml.SafeLoader), 0, 0
    for part in path:
        if isinstance(node, yaml.MappingNode):
            pair = next((pair for pair in node.value if pair[0].value == part), None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
        depth += 1
    return depth, line


def load_spec(
    path: Path,
    sets: Sequence[str] = (),
    files: Sequence[str] = (),
    layers: Sequence[Path] = (),
    cluster: bool = False,
) -> JobSpec:
    """Read (`-`: standard input, as `kubectl apply -f -`), layer (--values files, in order), override (--set, then
    --set-file) and validate a job spec, in helm's order; every problem is one SpecError line, which names the flag,
    or the file and line, that gave the key. `cluster`: for a cluster (render, submit), whose pods keep only what is
    on their volume or in a bucket."""
    name = spec_name(path)
    texts = [(name, read_stdin() if name == STDIN else read_spec_text(path))]
    texts += [(str(layer), read_spec_text(layer)) for layer in layers]
    values, *layered = [parse_yaml_mapping(text, file) for file, text in texts[:1]] + [
        values_layer(text, file) for file, text in texts[1:]
    ]
    for layer in layered:
        values = merge_values(values, layer)
    sources = Sources(texts, read_overrides(sets, files))
    nulls = [path for layer in layered for path in null_paths(layer)]
    refuse_unknown_nulls(nulls + [o.path for o in sources.overrides if o.value is None], sources)
    values = apply_overrides(values, sources.overrides)
    context = {CLUSTER: cluster}
    try:
        try:
            return JobSpec.model_validate(values, context=context)
        except ValidationError as exc:
            if not keep_text(values, sources.overrides, exc):
                raise
            return JobSpec.model_validate(values, context=context)
    except ValidationError as exc:
        problem = file_text_problem(exc, sources.overrides) or describe_validation_error(exc, JobSpec)
        raise SpecError(f"{sources.of(error_path(exc))}: {problem}") from None


def file_text_problem(error: ValidationError, overrides: Sequence[Override]) -> str | None:
    """A key that takes a number, a boolean or a list, set by --set-file: a file's text stays text, as with helm (its
    YAML reading would have said `'5\n' is quoted`). None for any other problem."""
    first = error.errors()[0]
    path = list(map(str, first["loc"]))
    if first["type"] not in WANTED or first["type"] == "string_type":
        return None
    if not any(o.typed is None and o.path == path for o in overrides):
        return None
    key = ".".join(path)
    return f"{key}: expected {WANTED[first['type']][0]}, and --set-file gives a file's text, as helm's does: use --set"


def values_layer(text: str, name: str) -> dict[str, Any]:
    """A --values file's mapping; nothing (empty, or comments only: every key commented out) is none, as helm's -f."""
    with contextlib.suppress(yaml.YAMLError):
        if yaml.safe_load(text) is None:
            return {}
    return parse_yaml_mapping(text, name)


def with_keys(job: JobSpec, keys: dict[str, Any], spec: Path) -> JobSpec:
    """`job` with top-level `keys` changed, validated again (a SpecError names the spec)."""
    try:
        return JobSpec.model_validate(job.to_values() | keys)
    except ValidationError as exc:
        raise SpecError(f"{spec_name(spec)}: {describe_validation_error(exc, JobSpec)}") from None


def keep_text(values: dict[str, Any], overrides: Sequence[Override], error: ValidationError) -> bool:
    """Where the spec wants text and a `--set` value read as YAML is a number or a boolean (`image.tag=1.10`: 1.1),
    put the value as typed into `values`, as helm's --set-string would; whether there was any."""
    typed = {tuple(o.path): o.typed.strip() for o in overrides if o.typed is not None}
    wanted = [loc for e in error.errors() if (loc := text_key(e)) in typed]
    for loc in wanted:
        node = values
        for part in loc[:-1]:
            node = node[part]
        node[loc[-1]] = typed[loc]
    return bool(wanted)


def text_key(error: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The key of a validation error that is a number or boolean where text belongs; None for other errors."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, NotText):  # within a key in Kubernetes form
        return tuple(map(str, (*error["loc"], *cause.path)))
    return tuple(map(str, error["loc"])) if error["type"] == "string_type" else None


def read_stdin() -> str:
    """The spec piped in, whole."""
    if sys.stdin is None or sys.stdin.isatty():  # closed, or a terminal: a forgotten pipe, not a spec to type
        raise SpecError(f"{STDIN}: no spec piped in: `-` reads it from a pipe or a redirected file")
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{STDIN}: not UTF-8 text (byte {exc.start})") from None
