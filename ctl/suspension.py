"""`ctl suspend` and `ctl resume`: a job's pods stop, and later start again, as its controller does for its suspend
field. The pods get SIGTERM, so rank 0 saves a checkpoint first (within terminationGracePeriodSeconds), and the pods
made on resume go on from it. A job that Kueue queues (queue.kueue) is suspended through its Workload instead:
Kueue owns the job's suspend field and would resume the job at once."""

from __future__ import annotations

from dataclasses import dataclass

from ctl.cluster import ClusterError, Target, find_job, merge_patch
from ctl.kinds import kind_of
from ctl.status import KUEUE_WORKLOADS, deactivated_by_kueue, kueue_deactivation, queued_workload


@dataclass(frozen=True)
class Suspension:
    """What `ctl suspend` or `ctl resume` did to a job."""

    reference: str  # `pytorchjob.kubeflow.org/NAME`, as ctl submit names what it made
    changed: bool  # False when the job was already as asked
    workload: str | None  # the Kueue Workload set (in)active instead of the job, with queue.kueue


def set_suspended(target: Target, name: str, suspend: bool) -> Suspension:
    """Suspend the job, or resume it; an ended job is refused (nothing would restart it)."""
    job = find_job(target, name)
    api = kind_of(job)
    reference = f"{api.kind.lower()}.{api.group}/{name}"
    state = api.state(job)
    if state.terminal:
        verb = "suspend" if suspend else "resume"
        raise ClusterError(f"{api.kind.lower()} {name} has ended ({state}): there is nothing to {verb}")
    queued = queued_workload(target, job)
    if queued is None:
        changed = api.suspended(job) != suspend
        if changed:
            merge_patch(target, api.path(target.namespace, name), api.suspend_patch(suspend))
        return Suspension(reference, changed, None)
    workload = queued.workload
    if workload is None:  # nothing to deactivate yet, and the job's own field is Kueue's
        raise ClusterError(f"{name} is queued by Kueue (LocalQueue {queued.local_queue}): {queued.missing}")
    if not suspend and (why := kueue_deactivation(workload)):
        raise ClusterError(f"{name}: {deactivated_by_kueue(why, target.namespace)}")
    # A Workload is active unless it says otherwise; Kueue evicts an inactive one and suspends its job.
    changed = workload["spec"].get("active", True) == suspend
    if changed:
        path = f"{KUEUE_WORKLOADS.format(namespace=target.namespace)}/{workload['metadata']['name']}"
        merge_patch(target, path, {"spec": {"active": not suspend}})
    return Suspension(reference, changed, workload["metadata"]["name"])
