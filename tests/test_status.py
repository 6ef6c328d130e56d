"""How `ctl status` and `ctl wait` find a failed job's cause in what the API server returns: the pods as the kubelet
reports them and the training operator's events, in the shapes the e2e tier records from the real ones
(tests/e2e/test_control_plane.py runs them against the operator)."""

from __future__ import annotations

from typing import Any

from ctl.kinds import State
from ctl.kinds.pytorchjob import PYTORCHJOB, REPLICA_INDEX_LABEL, REPLICA_TYPE_LABEL
from ctl.status import (
    JobStatus,
    PrepareStatus,
    QueueStatus,
    failure_cause,
    kueue_deactivation,
    pod_status,
    quoted_cause,
)
from ctl.tables import age, status_line, status_table

NO_FILE = "error: training.data.train: no file matches '/data/x.txt'"
STOPPED = "trainer.launch: stopped by SIGTERM before the trainers started; exiting with code 143"
FAILED = [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed", "message": "backoff limit reached"}]


def terminated(code: int, *lines: str) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error", "message": "\n".join(lines) + "\n"}}


def pod(replica: str, now: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = {REPLICA_TYPE_LABEL: replica, REPLICA_INDEX_LABEL: "0"}
    status = {"name": PYTORCHJOB.container, "state": now, "lastState": before or {}, "restartCount": 1}
    return {"metadata": {"name": f"j-{replica}-0", "labels": labels}, "status": {"containerStatuses": [status]}}


def test_a_pod_stopped_after_its_failure_shows_the_failure() -> None:
    """restartPolicy OnFailure at the backoff limit: the container failed (2), restarted, and the operator stopped
    it (143). The stop is the failure's consequence."""
    shown = pod_status(
        pod("master", terminated(143, STOPPED), terminated(2, "rank 0 of 2", NO_FILE)), PYTORCHJOB, PYTORCHJOB.container
    )
    assert (shown.exit_code, shown.message) == (2, NO_FILE)
    stopped_only = pod_status(
        pod("master", terminated(143, STOPPED), {"running": {}}), PYTORCHJOB, PYTORCHJOB.container
    )
    assert (stopped_only.exit_code, stopped_only.message) == (143, STOPPED)


def test_the_cause_is_a_failure_before_a_stop_whichever_pod_comes_first() -> None:
    master = pod_status(pod("master", terminated(143, STOPPED)), PYTORCHJOB, PYTORCHJOB.container)
    worker = pod_status(pod("worker", terminated(2, NO_FILE)), PYTORCHJOB, PYTORCHJOB.container)
    assert failure_cause([master, worker], None, FAILED, None) == f"j-worker-0: {NO_FILE.removeprefix('error: ')}"
    # A pod that is gone: what the events quote (or `wait` saw) before a stop, the stop before the condition.
    assert failure_cause([master], None, FAILED, "j-worker-0: quoted") == "j-worker-0: quoted"
    assert failure_cause([master], None, FAILED, None) == f"j-master-0: {STOPPED}"
    assert failure_cause([], None, FAILED, None) == "PyTorchJobFailed: backoff limit reached"
    # A condition's message of several lines made `ctl wait`'s line, and `status`'s cause, several.
    lines = [FAILED[0] | {"message": "1 Master replica(s) failed.\nsecond line\n"}]
    assert failure_cause([], None, lines, None) == "PyTorchJobFailed: 1 Master replica(s) failed. ... second line"
    # And the table's line of that condition, and of a prepare Job's, were several.
    prepare = PrepareStatus("j-prepare", State.FAILED, "BackoffLimitExceeded", "first\nlast", None)
    table = status_table(job_status(State.FAILED, prepare=prepare, conditions=lines))
    assert "  Failed      True   PyTorchJobFailed: 1 Master replica(s) failed. ... second line" in table.splitlines()
    assert "  prepare: job/j-prepare Failed (BackoffLimitExceeded: first ... last)" in table.splitlines()


def job_status(state: State, **fields: Any) -> JobStatus:
    """A PyTorchJob's status with nothing but `fields`."""
    empty = {"progress": None, "trainer_status": None, "prepare": None, "queue": None, "conditions": []}
    empty |= {"replicas": {}, "pods": [], "events": [], "cause": None}
    return JobStatus(name="j", namespace="ns", kind="PyTorchJob", state=state, **empty | fields)


def test_a_job_held_by_kueue_says_why_and_one_it_admitted_says_so() -> None:
    """queue.kueue: the LocalQueue, and Kueue's reason from the Workload (tests/e2e has a real Kueue say it)."""
    why = "couldn't assign flavors to pod set master: insufficient unused quota for cpu in flavor f"
    held = job_status(State.SUSPENDED, queue=QueueStatus("team", "pytorchjob-j-1a2b3", False, why))
    assert f"  queue: team (Kueue): not admitted: {why}" in status_table(held).splitlines()
    assert status_line(held) == f"Suspended | team (Kueue): not admitted: {why}"
    admitted = job_status(State.RUNNING, queue=QueueStatus("team", "pytorchjob-j-1a2b3", True, None))
    assert "  queue: team (Kueue): admitted" in status_table(admitted).splitlines()
    assert status_line(admitted) == "Running"
    timed = job_status(State.RUNNING, queue=QueueStatus("team", "pytorchjob-j-1a2b3", True, None, 36000, 1500))
    assert "  queue: team (Kueue): admitted, 25m of its 10h time budget used" in status_table(timed).splitlines()
    assert status_line(timed) == "Running | team (Kueue): admitted, 25m of its 10h time budget used"
    assert not any(line.startswith("  queue:") for line in status_table(job_status(State.RUNNING)).splitlines())


def workload(active: bool, *conditions: tuple[str, str, str]) -> dict[str, Any]:
    """A Workload with these (type, reason, message) conditions, all True."""
    listed = [{"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions]
    return {"spec": {"active": active}, "status": {"conditions": listed}}


def test_only_a_workload_kueue_deactivated_itself_has_its_reason() -> None:
    """Kueue's conditions on a Workload past its max-exec-time-seconds (as the e2e tier's real Kueue v0.17 leaves
    them, DeactivationTarget kept after the eviction) against one deactivated by `ctl suspend`."""
    target = ("DeactivationTarget", "MaximumExecutionTimeExceeded", "exceeding the maximum execution time")
    evicted = "The workload is deactivated due to exceeding the maximum execution time"
    by_kueue = workload(False, target, ("Evicted", "DeactivatedDueToMaximumExecutionTimeExceeded", evicted))
    assert kueue_deactivation(by_kueue) == "due to exceeding the maximum execution time"
    by_hand = workload(False, ("Evicted", "Deactivated", "The workload is deactivated"))
    assert kueue_deactivation(by_hand) is None
    assert kueue_deactivation(workload(True, target)) is None  # Kueue is about to deactivate it
    assert kueue_deactivation({"spec": {}}) is None  # active unless it says otherwise


def event(pod_name: str, code: int, message: str, at: str) -> dict[str, Any]:
    text = f"Error pod {pod_name} container pytorch exitCode: {code} terminated message: {message}"
    return {"reason": "Error", "type": "Warning", "message": text, "lastTimestamp": at}


def test_the_operators_events_quote_the_termination_message_whose_last_line_is_the_cause() -> None:
    """training-operator's RecordAbnormalPods: the whole message, lines and all; the first failure other than a
    stop, whatever order the events came in."""
    events = [
        event("j-master-0", 143, f"rank 0 of 2\n{STOPPED}\n", "2026-12-03T03:34:40Z"),
        event("j-worker-0", 2, f"rank 1 of 2\n{NO_FILE}\n", "2026-12-03T03:34:35Z"),
        event("j-master-0", 2, "rank 0 of 2\nerror: a later failure\n", "2026-12-03T03:34:39Z"),
        {"reason": "ExitedWithCode", "message": "Pod: ns.j-worker-0 exited with code 2", "lastTimestamp": ""},
    ]
    assert quoted_cause(events) == f"j-worker-0: {NO_FILE.removeprefix('error: ')}"
    assert quoted_cause(events[:1]) == f"j-master-0: {STOPPED}"
    assert quoted_cause(events[3:]) is None


def test_ages_read_as_kubectl_gives_them() -> None:
    """`ctl list` gave seconds: 29069957s, wider than its column; then 2y for 2y70d, and -5s for a job created ahead
    of this machine's clock (as k8s.io/apimachinery's HumanDuration gives them)."""
    seconds = [45, 330, 600, 2520, 12000, 28800, 72000, 446400, 29069957, 94608000, 800 * 86400, 3290 * 86400, -1, -5]
    assert [age(s) for s in seconds] == [
        *("45s", "5m30s", "10m", "42m", "3h20m", "8h", "20h", "5d4h", "336d", "3y", "2y70d", "9y", "0s", "<invalid>")
    ]
