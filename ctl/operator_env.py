"""The environment the job's operator injects into each pod: the Kubeflow training operator v1.9
(PyTorchJob) or Kubeflow Trainer v2.3's torch plugin (TrainJob).

Only what the operator adds: everything else a pod gets is in the rendered pod template, which `ctl run` starts
its agents from (ctl/local.py). Both `ctl run` and the tests use this module, so a laptop run and a cluster run
see the same variables. torchrun reads every `PET_*` variable as its own flag, so the command stays
`python -m trainer.launch -m trainer ...` (torchrun, with signal exit codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ctl.spec import TRAINJOB_MASTER_PORT, JobSpec

RDZV_BACKEND = "c10d"


@dataclass(frozen=True)
class Replica:
    """One pod of the job: a PyTorchJob's master or worker, or a TrainJob's node (its completion index)."""

    type: Literal["master", "worker", "node"]
    index: int

    def pod_name(self, job: str) -> str:
        """The pod's name; a TrainJob's Job pods have a random suffix after this, their hostname."""
        if self.type == "node":  # replicated job `node`, its first (only) Job, then the completion index
            return f"{job}-node-0-{self.index}"
        return f"{job}-{self.type}-{self.index}"


def replicas(spec: JobSpec) -> list[Replica]:
    """Master + (nodes-1) Workers; or, elastic, `nodes` Workers and no Master; a TrainJob: `nodes` nodes."""
    if spec.api_kind == "TrainJob":
        return [Replica("node", i) for i in range(spec.nodes)]
    if spec.elastic.enabled:
        return [Replica("worker", i) for i in range(spec.nodes)]
    return [Replica("master", 0)] + [Replica("worker", i) for i in range(spec.nodes - 1)]


def trainer_v2_env(
    spec: JobSpec, replica: Replica, address: str | None = None, port: int | None = None
) -> dict[str, str]:
    """The variables Trainer v2.3's torch plugin upserts into the `node` container of `replica`.

    PET_NODE_RANK comes from the pod's completion index (a fieldRef); the master is node 0's pod by its
    hostname under the JobSet's headless Service, on the plugin's fixed port.
    """
    master = Replica("node", 0).pod_name(spec.name)
    return {
        "PET_NNODES": str(spec.nodes),
        "PET_NPROC_PER_NODE": str(spec.procs_per_node),
        "PET_NODE_RANK": str(replica.index),
        "PET_MASTER_ADDR": address or f"{master}.{spec.name}",
        "PET_MASTER_PORT": str(port or TRAINJOB_MASTER_PORT),
    }


def operator_env(
    spec: JobSpec, replica: Replica, address: str | None = None, port: int | None = None
) -> dict[str, str]:
    """The variables the operator appends to the trainer container (`pytorch`, or a TrainJob's `node`) of `replica`.

    `address`/`port` stand in for the master (or rendezvous) Service and the
    rendezvous port when the pods are simulated locally.
    """
    if spec.api_kind == "TrainJob":
        return trainer_v2_env(spec, replica, address, port)
    port = port or spec.master_port
    env = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": str(spec.procs_per_node)}
    if spec.elastic.enabled:
        host = address or Replica("worker", 0).pod_name(spec.name)
        env |= {
            "PET_RDZV_ENDPOINT": f"{host}:{port}",
            "PET_RDZV_BACKEND": RDZV_BACKEND,
            "PET_NNODES": f"{spec.elastic.min_nodes}:{spec.elastic.max_nodes}",
            "PET_MAX_RESTARTS": str(spec.elastic.max_restarts),
        }
        return env
    host = address or Replica("master", 0).pod_name(spec.name)
    node_rank = replica.index + (1 if replica.type == "worker" else 0)
    env |= {
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": host,
        "PET_MASTER_ADDR": host,
        "WORLD_SIZE": str(spec.nodes * spec.procs_per_node),
        "RANK": str(node_rank),
        "PET_NODE_RANK": str(node_rank),
        "PET_NNODES": str(spec.nodes),
    }
    return env
