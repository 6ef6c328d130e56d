"""The Kubeflow training operator v1.9's PyTorchJob (kubeflow.org/v1): Master + Workers, or elastic Workers.

The operator appends its env to every container (MASTER_ADDR/PORT, WORLD_SIZE, RANK and torchrun's PET_*
variables; the rendezvous endpoint instead when elastic), names pods `<job>-<master|worker>-<i>` and labels them
with the job's name, the replica type and index.
"""

from __future__ import annotations

from typing import Any

from ctl.kinds.base import JobKind, JobShape, Replica, State, true_conditions

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
RDZV_BACKEND = "c10d"
OPERATOR_INSTALL = (
    "kubectl apply --server-side -k"
    " 'github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.0'"
)


class PyTorchJob(JobKind):
    kind = "PyTorchJob"
    group = "kubeflow.org"
    version = "v1"
    plural = "pytorchjobs"
    operator = "the Kubeflow training operator v1"
    install = f"the Kubeflow training operator v1.9 first, e.g. {OPERATOR_INSTALL}"
    container = "pytorch"
    job_label = JOB_NAME_LABEL
    replica_label = REPLICA_TYPE_LABEL
    rendezvous_port_name = "masterPort"
    replica_types = ("master", "worker")
    index_labels = (REPLICA_TYPE_LABEL, REPLICA_INDEX_LABEL)
    pod_key_field = "metadata.name"  # <job>-master-0, <job>-worker-<i>: a recreated pod keeps its name
    suspend_field = ("spec", "runPolicy", "suspend")

    def replicas(self, spec: JobShape) -> list[Replica]:
        """Master + (nodes-1) Workers; or, elastic, `nodes` Workers and no Master."""
        if spec.elastic.enabled:
            return [Replica("worker", i) for i in range(spec.nodes)]
        return [Replica("master", 0)] + [Replica("worker", i) for i in range(spec.nodes - 1)]

    def longest_replica(self, spec: JobShape) -> Replica:
        workers = spec.elastic.max_nodes if spec.elastic.enabled else spec.nodes - 1
        return Replica("worker", workers - 1) if workers else Replica("master", 0)

    def rendezvous_port(self, spec: JobShape) -> int:
        return spec.master_port

    def operator_env(
        self, spec: JobShape, replica: Replica, address: str | None = None, port: int | None = None
    ) -> dict[str, str]:
        port = port or spec.master_port
        env = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": str(spec.procs_per_node)}
        if spec.elastic.enabled:
            host = address or Replica("worker", 0).pod_name(spec.name)
            return env | {
                "PET_RDZV_ENDPOINT": f"{host}:{port}",
                "PET_RDZV_BACKEND": RDZV_BACKEND,
                "PET_NNODES": f"{spec.elastic.min_nodes}:{spec.elastic.max_nodes}",
                "PET_MAX_RESTARTS": str(spec.elastic.max_restarts),
            }
        host = address or Replica("master", 0).pod_name(spec.name)
        node_rank = replica.index + (1 if replica.type == "worker" else 0)
        return env | {
            "MASTER_PORT": str(port),
            "PET_MASTER_PORT": str(port),
            "MASTER_ADDR": host,
            "PET_MASTER_ADDR": host,
            "WORLD_SIZE": str(spec.nodes * spec.procs_per_node),
            "RANK": str(node_rank),
            "PET_NODE_RANK": str(node_rank),
            "PET_NNODES": str(spec.nodes),
        }

    def refusal(self, spec: JobShape) -> tuple[str, str] | None:
        if spec.queue.coscheduling:
            return "queue.coscheduling", "TrainJob only (the training operator v1 chooses its gang scheduler itself)"
        return None

    def replica_pods(self, objects: dict[str, dict[str, Any]], spec: JobShape) -> dict[Replica, dict[str, Any]]:
        replica_specs = objects[self.kind]["spec"]["pytorchReplicaSpecs"]
        return {r: replica_specs[r.type.capitalize()]["template"]["spec"] for r in self.replicas(spec)}

    def runtime_name(self, job: dict[str, Any]) -> str | None:
        return None

    def state(self, job: dict[str, Any]) -> State:
        """The newest true condition (the operator's condition types are the states' words)."""
        true = true_conditions(job)
        return State(true[-1]) if true else State.PENDING

    def replica_counts(self, job: dict[str, Any]) -> dict[str, Any]:
        return (job.get("status") or {}).get("replicaStatuses") or {}

    def node_labels(self, job: dict[str, Any]) -> list[str]:
        """The master is node 0, the workers follow (an elastic job without a master starts at worker-0)."""
        specs = job["spec"].get("pytorchReplicaSpecs") or {}
        return [
            Replica(kind, index).label
            for kind in self.replica_types
            if kind.capitalize() in specs
            for index in range(int(specs[kind.capitalize()].get("replicas", 1)))
        ]

    def nodes(self, job: dict[str, Any]) -> int:
        return sum(int(s.get("replicas", 1)) for s in (job["spec"].get("pytorchReplicaSpecs") or {}).values())

    def procs_value(self, job: dict[str, Any]) -> str:
        return str(job["spec"].get("nprocPerNode", "1"))

    def pod_label(self, pod: dict[str, Any]) -> str:
        labels = pod["metadata"].get("labels") or {}
        return f"{labels.get(REPLICA_TYPE_LABEL, '')}-{labels.get(REPLICA_INDEX_LABEL, '0')}"


PYTORCHJOB = PyTorchJob()
