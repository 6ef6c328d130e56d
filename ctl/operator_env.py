"""The environment the job's operator injects into each pod: the Kubeflow training operator v1.9
(PyTorchJob) or Kubeflow Trainer v2.3's torch plugin (TrainJob); each kind's module says which (ctl/kinds).

Only what the operator adds: everything else a pod gets is in the rendered pod template, which `ctl run` starts
its agents from (ctl/local.py). Both `ctl run` and the tests use this module, so a laptop run and a cluster run
see the same variables. torchrun reads every `PET_*` variable as its own flag, so the command stays
`python -m trainer.launch -m trainer ...` (torchrun, with signal exit codes).
"""

from __future__ import annotations

from ctl.kinds import Replica
from ctl.spec import JobSpec

__all__ = ["Replica", "operator_env", "replicas"]


def replicas(spec: JobSpec) -> list[Replica]:
    """The job's pods: Master + (nodes-1) Workers; or, elastic, `nodes` Workers and no Master; a TrainJob: `nodes`
    nodes."""
    return spec.kind.replicas(spec)


def operator_env(
    spec: JobSpec, replica: Replica, address: str | None = None, port: int | None = None
) -> dict[str, str]:
    """The variables the operator appends to the trainer container (`pytorch`, or a TrainJob's `node`) of `replica`.

    `address`/`port` stand in for the master (or rendezvous) Service and the
    rendezvous port when the pods are simulated locally.
    """
    return spec.kind.operator_env(spec, replica, address, port)
