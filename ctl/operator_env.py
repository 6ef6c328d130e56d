"""The environment the Kubeflow training operator (v1.9) injects into each pod.

Both `ctl run` (which starts one torchrun agent per simulated pod) and the tests use
this module, so a laptop run and a cluster run see the same variables. torchrun reads
every `PET_*` variable as its own flag, so the command stays `python -m trainer.launch -m trainer ...`
(torchrun, with signal exit codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ctl.spec import JobSpec

RDZV_BACKEND = "c10d"
# Set by the chart (not the operator) on elastic pods: a fresh rendezvous store every round.
# torchrun's shared store keeps the previous round's keys, and restarted workers can then
# wait forever for peers that are gone.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Set by the chart on every pod: how long torchrun waits for its workers to save and exit after it
# forwards SIGTERM, before it kills them. torch's own default is 30 s whatever the pod's grace period;
# the chart gives them the grace period less a margin for torchrun's own exit.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_MARGIN_SECONDS = 5


def shutdown_timeout(spec: JobSpec) -> str:
    """The chart's TORCH_ELASTIC_SHUTDOWN_TIMEOUT for the pods of `spec`."""
    return str(max(0, spec.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS))


@dataclass(frozen=True)
class Replica:
    """One pod of the PyTorchJob."""

    type: Literal["master", "worker"]
    index: int

    def pod_name(self, job: str) -> str:
        return f"{job}-{self.type}-{self.index}"


def replicas(spec: JobSpec) -> list[Replica]:
    """Master + (nodes-1) Workers; or, elastic, `nodes` Workers and no Master."""
    if spec.elastic.enabled:
        return [Replica("worker", i) for i in range(spec.nodes)]
    return [Replica("master", 0)] + [Replica("worker", i) for i in range(spec.nodes - 1)]


def operator_env(
    spec: JobSpec, replica: Replica, address: str | None = None, port: int | None = None
) -> dict[str, str]:
    """The variables the operator appends to the `pytorch` container of `replica`.

    `address`/`port` stand in for the master (or rendezvous) Service and the
    `pytorchjob-port` when the pods are simulated locally.
    """
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
