"""Kubeflow Trainer v2.3's TrainJob (trainer.kubeflow.org/v1alpha1) on JobSet: a TrainingRuntime carrying the pod
template and a TrainJob referencing it.

The torch plugin injects PET_* variables into the container `node`; the pods are the Indexed Job pods of the
JobSet's replicated job `node` (its one Job, index 0), `<job>-node-0-<completion index>` plus a random suffix,
labelled with the JobSet's and the Job's names and the completion index.
"""

from __future__ import annotations

from typing import Any

from ctl.kinds.base import DEFAULT_MASTER_PORT, JobKind, JobShape, Replica, State, true_conditions

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # the JobSet is named after the TrainJob
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The torch plugin's fixed rendezvous port (PET_MASTER_PORT) of every TrainJob.
MASTER_PORT = 29500
RUNTIME_PLURAL = "trainingruntimes"  # the namespaced runtime the chart renders with the TrainJob
NODE = "node"  # the replicated job running the trainer, and the trainer's container
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
# The TrainJob's conditions that end or hold it, in the order they win, and the state each is.
STATE_CONDITIONS = (("Failed", State.FAILED), ("Complete", State.SUCCEEDED), ("Suspended", State.SUSPENDED))
JOB_COUNTS = ("active", "ready", "succeeded", "failed", "suspended")


class TrainJob(JobKind):
    kind = "TrainJob"
    group = "trainer.kubeflow.org"
    version = "v1alpha1"
    plural = "trainjobs"
    operator = "Kubeflow Trainer v2"
    install = "Kubeflow Trainer v2.3 and JobSet first (docs/trainer-v2.md)"
    container = NODE
    job_label = JOBSET_NAME_LABEL
    replica_label = REPLICATED_JOB_LABEL
    rendezvous_port_name = "Trainer v2's port"
    replica_types = (NODE,)
    index_labels = (COMPLETION_INDEX_LABEL,)
    pod_key_field = f"metadata.labels['{COMPLETION_INDEX_LABEL}']"  # a recreated pod gets a new name
    # Trainer v2.3 recreates the JobSet of a TrainJob that a foreground deletion holds, again and again.
    foreground_deletion = False
    suspend_field = ("spec", "suspend")  # JobSet suspends the Jobs, whose controller deletes their pods

    def pod_name_part(self, replica_type: str) -> str:
        """The replicated job, then its one Job's index."""
        return f"{replica_type}-0"

    def replicas(self, spec: JobShape) -> list[Replica]:
        return [Replica(NODE, i, self.pod_name_part(NODE)) for i in range(spec.nodes)]

    def longest_replica(self, spec: JobShape) -> Replica:
        return self.replicas(spec)[-1]

    def rendezvous_port(self, spec: JobShape) -> int:
        return MASTER_PORT

    def operator_env(
        self, spec: JobShape, replica: Replica, address: str | None = None, port: int | None = None
    ) -> dict[str, str]:
        """PET_NODE_RANK comes from the pod's completion index (a fieldRef); the master is node 0's pod by its
        hostname under the JobSet's headless Service, on the plugin's fixed port."""
        master = self.replicas(spec)[0].pod_name(spec.name)
        return {
            "PET_NNODES": str(spec.nodes),
            "PET_NPROC_PER_NODE": str(spec.procs_per_node),
            "PET_NODE_RANK": str(replica.index),
            "PET_MASTER_ADDR": address or f"{master}.{spec.name}",
            "PET_MASTER_PORT": str(port or MASTER_PORT),
        }

    def refusal(self, spec: JobShape) -> tuple[str, str] | None:
        """What Trainer v2.3 cannot express, one key at a time."""
        if spec.elastic.enabled:
            return "elastic.enabled", (
                "Kubeflow Trainer v2.3 has no elastic training (apiKind TrainJob); use apiKind PyTorchJob for elastic"
                " jobs"
            )
        if spec.restart_policy == "Always":
            return "restartPolicy", "Always is not allowed for the Job pods of a TrainJob"
        policy = spec.run_policy
        pytorchjob_only = {
            "masterPort": spec.master_port != DEFAULT_MASTER_PORT,  # a TrainJob's is MASTER_PORT, fixed
            "runPolicy.ttlSecondsAfterFinished": policy.ttl_seconds_after_finished is not None,
            "runPolicy.cleanPodPolicy": policy.clean_pod_policy != "None",
            "runPolicy.schedulingPolicy.minAvailable": policy.scheduling_policy.min_available is not None,
            "runPolicy.schedulingPolicy.priorityClass": bool(policy.scheduling_policy.priority_class),
        }
        key = next((key for key, is_set in pytorchjob_only.items() if is_set), None)
        return (key, "PyTorchJob only; a TrainJob has no such setting (apiKind TrainJob)") if key else None

    def replica_pods(self, objects: dict[str, dict[str, Any]], spec: JobShape) -> dict[Replica, dict[str, Any]]:
        pod = trainer_pod(objects["TrainingRuntime"], objects[self.kind])
        return {replica: pod for replica in self.replicas(spec)}

    def runtime_name(self, job: dict[str, Any]) -> str | None:
        return job["spec"]["runtimeRef"]["name"]

    def state(self, job: dict[str, Any]) -> State:
        """Complete (as Succeeded), Failed or Suspended, else Running while a Job of its JobSet has pods active,
        else Created."""
        true = true_conditions(job)
        for condition, state in STATE_CONDITIONS:
            if condition in true:
                return state
        active = any(j.get("active") or j.get("ready") for j in (job.get("status") or {}).get("jobsStatus") or [])
        return State.RUNNING if active else State.CREATED

    def replica_counts(self, job: dict[str, Any]) -> dict[str, Any]:
        """The JobSet's jobsStatus, by replicated job."""
        jobs = (job.get("status") or {}).get("jobsStatus") or []
        return {j["name"]: {k: j.get(k, 0) for k in JOB_COUNTS} for j in jobs}

    def node_labels(self, job: dict[str, Any]) -> list[str]:
        return [Replica(NODE, index).label for index in range(self.nodes(job))]

    def nodes(self, job: dict[str, Any]) -> int:
        """numNodes (1, the torch plugin's default, when its runtime decides)."""
        return int((job["spec"].get("trainer") or {}).get("numNodes", 1))

    def procs_value(self, job: dict[str, Any]) -> str:
        return str((job["spec"].get("trainer") or {}).get("numProcPerNode", "auto"))

    def pod_label(self, pod: dict[str, Any]) -> str:
        labels = pod["metadata"].get("labels") or {}
        return f"{labels.get(REPLICATED_JOB_LABEL, '')}-{labels.get(COMPLETION_INDEX_LABEL, '0')}"


def trainer_pod(runtime: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The trainer's pod spec of a TrainingRuntime, with the TrainJob's trainer image, command, args and env applied
    to the container `node` as Trainer v2 applies them (the torch plugin's env is operator_env's)."""
    (trainer,) = [
        rj["template"]["spec"]["template"]["spec"]
        for rj in runtime["spec"]["template"]["spec"]["replicatedJobs"]
        if rj["template"]["metadata"]["labels"].get(ANCESTOR_LABEL) == "trainer"
    ]
    overrides = job["spec"].get("trainer", {})
    for container in trainer["containers"]:
        if container["name"] == NODE:
            container |= {key: overrides[key] for key in ("image", "command", "args") if key in overrides}
            env = overrides.get("env", [])
            replaced = {var["name"] for var in env}
            container["env"] = [var for var in container.get("env", []) if var["name"] not in replaced] + env
    return trainer


TRAINJOB = TrainJob()
