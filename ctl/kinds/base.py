"""What a job kind is to ctl: the interface each job API's module implements (ctl/kinds/pytorchjob.py,
ctl/kinds/trainjob.py), as kubeflow's SDK has one backend per API.

A leaf: nothing here imports the rest of ctl, so the spec model, the operator's env, the local runner and the
cluster commands can all ask a kind without importing one another. A kind reads a spec through `JobShape` (the
fields of ctl.spec.JobSpec it needs) and a job through its API object as a dict.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class ElasticShape(Protocol):
    enabled: bool
    min_nodes: int
    max_nodes: int
    max_restarts: int


# The spec's masterPort unless it sets one: a PyTorchJob's rendezvous port (a TrainJob's is Trainer v2's own).
DEFAULT_MASTER_PORT = 23456


class JobShape(Protocol):
    """The job spec as a kind reads it (ctl.spec.JobSpec)."""

    name: str
    nodes: int
    procs_per_node: int
    master_port: int
    restart_policy: str
    elastic: ElasticShape
    queue: Any
    run_policy: Any


class State(str, Enum):
    """A job's state in one word, the same for both kinds (and for a prepare Job)."""

    PENDING = "Pending"
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    def __str__(self) -> str:  # the word, on every Python version
        return self.value

    @property
    def terminal(self) -> bool:
        """Whether the job has ended (for good: nothing restarts it)."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED})


@dataclass(frozen=True)
class Replica:
    """One pod of the job: a PyTorchJob's master or worker, or a TrainJob's node (its completion index)."""

    type: str
    index: int
    # What the pod's name has between the job's name and the index when it is not the type (a TrainJob's pods:
    # their replicated job and its one Job's index).
    infix: str = ""

    @property
    def label(self) -> str:
        """The pod's name within its job, as `ctl logs --all` prefixes it: `master-0`, `worker-1`, `node-0`."""
        return f"{self.type}-{self.index}"

    def pod_name(self, job: str) -> str:
        """The pod's name (a TrainJob's Job pods have a random suffix after this, their hostname)."""
        return f"{job}-{self.infix or self.type}-{self.index}"


class JobKind(ABC):
    """One job API: where it is served, what its pods are called and get, and how to read a job of it."""

    kind: str
    group: str
    version: str
    plural: str
    operator: str  # what serves the kind, in the user's words
    install: str  # what a cluster needs installed to serve it
    container: str  # the trainer's container, by the name the controller requires
    job_label: str  # the label naming the job on each of its pods
    replica_label: str  # the label its controller gives each pod, naming its replica type (or replicated job)
    rendezvous_port_name: str  # the spec's name for the rendezvous port, in error messages
    replica_types: tuple[str, ...]  # in node-rank order
    index_labels: tuple[str, ...]  # the pod labels telling the job's pods apart
    # A downward-API field naming each pod of the job that stays the same when the pod is recreated.
    pod_key_field: str
    # Whether a foreground deletion (the pods first, then the job) ends; see ctl.cluster.delete_job.
    foreground_deletion: bool = True
    # Where the job says it is suspended (its controller then deletes its pods, and makes them again once false).
    suspend_field: tuple[str, ...]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def path(self, namespace: str, name: str = "") -> str:
        """The API path of the namespace's jobs of this kind, or of one of them."""
        return f"/apis/{self.api_version}/namespaces/{namespace}/{self.plural}" + (f"/{name}" if name else "")

    def suspended(self, job: dict[str, Any]) -> bool:
        """Whether the job asks to be suspended (its suspend_field)."""
        value: Any = job
        for key in self.suspend_field:
            value = (value or {}).get(key)
        return bool(value)

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """The merge patch that suspends the job, or resumes it."""
        patch: dict[str, Any] = {self.suspend_field[-1]: suspend}
        for key in reversed(self.suspend_field[:-1]):
            patch = {key: patch}
        return patch

    def pods_selector(self, name: str) -> str:
        """The label selector of the job's pods: labelled with their replica by its controller, so not the prepare
        Job's pod, which carries the job label too (helm/ddpjob/templates/prepare-job.yaml)."""
        return f"{self.job_label}={name},{self.replica_label}"

    def pod_name_part(self, replica_type: str) -> str:
        """What the names of a replica type's pods have between the job's name and the index."""
        return replica_type

    @abstractmethod
    def replicas(self, spec: JobShape) -> list[Replica]:
        """The job's pods in node-rank order."""

    @abstractmethod
    def longest_replica(self, spec: JobShape) -> Replica:
        """The pod with the longest name the job can have (elastic jobs scale up to maxNodes)."""

    @abstractmethod
    def rendezvous_port(self, spec: JobShape) -> int:
        """The port node 0's torchrun listens on."""

    @abstractmethod
    def operator_env(
        self, spec: JobShape, replica: Replica, address: str | None = None, port: int | None = None
    ) -> dict[str, str]:
        """The variables the controller injects into the trainer container of `replica`; `address`/`port` stand in
        for the master (or rendezvous) Service and port when the pods run locally."""

    @abstractmethod
    def refusal(self, spec: JobShape) -> tuple[str, str] | None:
        """The key of a setting this kind cannot express, and why; None when it can express them all."""

    @abstractmethod
    def replica_pods(self, objects: dict[str, dict[str, Any]], spec: JobShape) -> dict[Replica, dict[str, Any]]:
        """Each replica's pod spec as the controller creates it from the rendered objects (by kind)."""

    @abstractmethod
    def runtime_name(self, job: dict[str, Any]) -> str | None:
        """The namespaced runtime object the job references, which must exist before the job is admitted."""

    @abstractmethod
    def state(self, job: dict[str, Any]) -> State:
        """The job's state."""

    @abstractmethod
    def replica_counts(self, job: dict[str, Any]) -> dict[str, Any]:
        """Pods by state for each replica type (or replicated job)."""

    @abstractmethod
    def node_labels(self, job: dict[str, Any]) -> list[str]:
        """The job's pods by node rank, as Replica.label names them."""

    @abstractmethod
    def nodes(self, job: dict[str, Any]) -> int:
        """The job's pods."""

    @abstractmethod
    def procs_value(self, job: dict[str, Any]) -> str:
        """Processes per pod as the job says it: a number, or `auto`, `gpu`... (each node decides)."""

    @abstractmethod
    def pod_label(self, pod: dict[str, Any]) -> str:
        """A pod's Replica.label, from the labels its controller gave it."""

    def pod_replica_type(self, pod: dict[str, Any]) -> str:
        """A pod's replica type (or replicated job), from its labels."""
        return (pod["metadata"].get("labels") or {}).get(self.replica_label, "")


def true_conditions(job: dict[str, Any]) -> list[str]:
    """The types of the job's true conditions, oldest first."""
    return [c["type"] for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
