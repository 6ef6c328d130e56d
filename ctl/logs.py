"""`ctl logs`: a job's pod logs through the API server (pods/log), by node, waiting for pods to start.

A pod's log is read as the kubelet serves it, one container run at a time. Following goes on across the
pod's restarts (and its re-creation by the operator, or by a TrainJob's Job under a new name) until the job has
ended, as a user watching a
training run expects; `--all` reads every node's pod at once, one thread each, lines interleaved as
they arrive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3

from ctl.cluster import ClusterError, Target, get_job
from ctl.kinds import JobKind, State, kind_of
from ctl.status import finished, job_pods, not_starting, queue_status, trainer_status

POLL_S = 1.0
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class LogOptions:
    follow: bool = False
    tail: int | None = None  # lines of each container run; None: all
    previous: bool = False  # the run before the current one (after a restart)
    timestamps: bool = False


def node_lines(
    target: Target, job: dict[str, Any], label: str, options: LogOptions, note: Callable[[str], None]
) -> Iterator[str]:
    """The log lines of the job's pod `label` (`master-0`, `worker-1`, `node-0`; its newest pod): waits for it to
    start; with `follow`, goes on through its restarts until the job has ended."""
    api = kind_of(job)
    job_name = job["metadata"]["name"]
    streamed: tuple[str, int] | None = None  # the container run read last: (pod uid, restart count)
    waited, told, held = False, {}, None
    while True:
        job = get_job(target, job_name, api)
        pod = next((p for p in reversed(job_pods(target, job)) if api.pod_label(p) == label), None)
        run = container_run(pod, api) if pod else None
        if run is not None and options.previous and run[1] == 0:  # else the kubelet's 400, in its words
            raise ClusterError(f"{label} of {job_name} has no previous log: its container has not restarted")
        if run is not None and run != streamed:
            if streamed is not None:  # the same pod's container again, or a pod made anew (resumed, evicted)
                again = f"container restarted (restart {run[1]})" if run[0] == streamed[0] else "new pod"
                note(f"{label}: {again}")
            streamed, told, held = run, {}, None  # a wait after this run is said again, even for the same reason
            yield from read_log(target, pod["metadata"]["name"], api, options)
            if not options.follow or options.previous:
                return
            continue
        if finished(job):
            if streamed is None:
                raise ClusterError(f"{job_name}: the job has ended and its pod {label} is gone, with its log")
            return
        if not waited:
            note(f"waiting for {label} of {job_name} to start")
            waited = True
        if pod is not None and (why := not_starting(pod)) and why != told:  # a pod may wait for ever: say why
            note(f"{label} of {job_name} is not starting: {why['reason']}: {why['message']}")
            told = why
        why_held = held_by(target, job) if api.state(job) == State.SUSPENDED else None
        if why_held and why_held != held:  # so may a suspended job
            note(why_held)
            held = why_held
        time.sleep(POLL_S)


def held_by(target: Target, job: dict[str, Any]) -> str | None:
    """Why a suspended job has no pods: Kueue's reason (queue.kueue), or its suspend field and what resumes it."""
    name = job["metadata"]["name"]
    queued = queue_status(target, job)
    if queued is None:
        return f"{name} is suspended: `ctl resume {name} -n {target.namespace}` starts it"
    return queued.pending and f"{name} waits in Kueue's LocalQueue {queued.local_queue}: {queued.pending}"


def container_run(pod: dict[str, Any], api: JobKind) -> tuple[str, int] | None:
    """(uid, restart count) of the pod's container run that has a log (running, ended, or backing off after
    ending); None before the container has first started."""
    trainer = trainer_status(pod, api.container)
    if not trainer:
        return None
    state, last = trainer.get("state") or {}, trainer.get("lastState") or {}
    if "running" in state or "terminated" in state or "terminated" in last:
        return pod["metadata"]["uid"], int(trainer.get("restartCount", 0))
    return None


def read_log(target: Target, pod: str, api: JobKind, options: LogOptions) -> Iterator[str]:
    """One container run's log, line by line as it arrives (to the run's end when following)."""
    query = [("container", api.container)]
    query += [("follow", "true")] if options.follow and not options.previous else []
    query += [("previous", "true")] if options.previous else []
    query += [("timestamps", "true")] if options.timestamps else []
    query += [("tailLines", str(options.tail))] if options.tail is not None else []
    response = target.open(f"/api/v1/namespaces/{target.namespace}/pods/{pod}/log", query)
    pending = b""
    try:
        for chunk in response.stream(CHUNK_BYTES):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                yield line.decode(errors="replace")
    except (OSError, urllib3.exceptions.HTTPError) as exc:
        raise ClusterError(f"reading the log of pod {pod}: {exc}") from None
    finally:
        response.release_conn()
    if pending:
        yield pending.decode(errors="replace")


def interleaved(streams: dict[str, Iterator[str]]) -> Iterator[tuple[str, str]]:
    """(label, line) from every stream as lines arrive, until all have ended; a stream's error is raised."""
    arrived: queue.Queue[tuple[str, str | None, BaseException | None]] = queue.Queue()

    def pump(label: str, lines: Iterator[str]) -> None:
        try:
            for line in lines:
                arrived.put((label, line, None))
            arrived.put((label, None, None))
        except BaseException as exc:  # handed to the reader, which raises it
            arrived.put((label, None, exc))

    for label, lines in streams.items():
        threading.Thread(target=pump, args=(label, lines), name=f"logs-{label}", daemon=True).start()
    running = len(streams)
    while running:
        label, line, error = arrived.get()
        if error is not None:
            raise error
        if line is None:
            running -= 1
        else:
            yield label, line
