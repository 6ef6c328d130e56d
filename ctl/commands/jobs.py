"""The commands of a job on the cluster: submit, wait, status, list, logs, suspend, resume, delete."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ctl.commands.common import (
    Cluster,
    SetFileOpt,
    SetOpt,
    SpecArg,
    ValuesOpt,
    command,
    fail,
    load_job,
    note,
    object_name,
    one_of,
    timeout_option,
)
from ctl.commands.output import follow_log, interruptible, print_data, print_logs
from ctl.tables import list_table, status_line, status_table

if TYPE_CHECKING:
    from ctl.cluster import Target
    from ctl.spec import JobSpec
    from ctl.status import JobStatus

WATCH_INTERVAL_S = 2.0
# status -w: a job ends with its master (or first node), and its other pods' end reaches the API seconds later;
# the watch waits this long for them, so that its last line is each pod's end (a pod still running then shows so).
POD_END_WAIT_S = 30.0
LOG_DRAIN_S = 10.0  # submit --follow: how long the log may still print after the job's outcome is known

NameArg = Annotated[
    str, typer.Argument(help="The job's name (the spec's `name`).", show_default=False, parser=object_name)
]
OutputOpt = Annotated[
    str, typer.Option("--output", "-o", help="table, yaml or json.", parser=one_of("table", "yaml", "json"))
]


@command(cluster=True)
def submit(
    spec: SpecArg,
    values: ValuesOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    set_values: SetOpt = [],  # noqa: B006
    set_files: SetFileOpt = [],  # noqa: B006
    dry_run: Annotated[
        str,
        typer.Option(
            "--dry-run",
            help="none; client (print the objects); server (the API server validates).",
            parser=one_of("none", "client", "server"),
        ),
    ] = "none",
    replace: Annotated[bool, typer.Option("--replace", help="Delete and recreate a job of the same name.")] = False,
    wait_for: Annotated[bool, typer.Option("--wait", help="Wait until the job succeeds or fails.")] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Print rank 0's log as it runs, until the job ends (implies --wait).")
    ] = False,
    timeout: Annotated[float, timeout_option("--wait/--follow wait")] = 86_400,
    *,
    cluster: Cluster,
) -> None:
    """Create the job on the cluster: every rendered object by server-side apply (field manager `ctl`)."""
    if dry_run != "none" and (wait_for or follow):
        flag, verb = ("'--follow'", "follow") if follow else ("'--wait'", "wait for")
        raise typer.BadParameter(f"a dry run (--dry-run {dry_run}) creates no job to {verb}", param_hint=flag)
    if dry_run == "client" and replace:
        why = "--dry-run client only prints the objects (--dry-run server checks a replacement)"
        raise typer.BadParameter(why, param_hint="'--replace'")
    job = load_job(spec, values, set_values, set_files, cluster=True)
    target = None if dry_run == "client" else cluster.connect()
    if target is not None and "api_kind" not in job.model_fields_set:
        job = served_kind(target, job, spec)
    from ctl.render import render, to_yaml

    manifests = render(job)
    if target is None:
        typer.echo(to_yaml(manifests), nl=False)
        return
    from ctl.jobs import submit as submit_objects

    submit_objects(target, [m.obj for m in manifests], dry_run=dry_run == "server", replace=replace, note=note)
    api = job.kind
    typer.echo(f"{api.kind.lower()}.{api.group}/{job.name}" + (" (server dry run)" if dry_run == "server" else ""))
    if dry_run == "server":
        return
    ns = target.namespace
    # Created suspended (runPolicy.suspend) it has no pods until resumed; under Kueue, until Kueue admits it.
    resume = f"ctl resume {job.name} -n {ns}  |  " if job.run_policy.suspend and not job.queue.kueue else ""
    typer.echo(
        f"next: {resume}ctl logs {job.name} -n {ns} -f  |  ctl status {job.name} -n {ns}"
        f"  |  ctl wait {job.name} -n {ns} --for succeeded  |  ctl delete {job.name} -n {ns}",
        err=True,
    )
    if wait_for or follow:
        raise typer.Exit(outcome(target, job.name, follow, timeout))


def outcome(target: Target, name: str, follow: bool, timeout: float) -> int:
    """submit --wait/--follow: the job's exit code once it has ended; with `follow`, rank 0's log meanwhile."""
    from ctl.logs import LogOptions
    from ctl.status import wait

    printer = None
    if follow:  # the log in the background; the job's outcome (and --timeout) decides when ctl returns
        printer = threading.Thread(target=follow_log, args=(target, name, LogOptions(follow=True)), daemon=True)
        printer.start()
    waited = wait(target, name, "succeeded", timeout, progress=note)
    if printer is not None:
        printer.join(LOG_DRAIN_S)
    if waited.problem:
        note(f"error: {waited.problem}")
    return waited.code


def served_kind(target: Target, job: JobSpec, spec: Path) -> JobSpec:
    """The spec leaves apiKind unset: the default (PyTorchJob), unless the cluster serves only TrainJob; then the
    spec as a TrainJob (validated as one), said on stderr. Not read again: `-` (stdin) was read once."""
    from ctl.cluster import serves
    from ctl.kinds import DEFAULT_KIND, KINDS

    if serves(target, DEFAULT_KIND):
        return job
    served = next((kind for kind in KINDS.values() if kind is not DEFAULT_KIND and serves(target, kind)), None)
    if served is None:
        return job
    note(
        f"apiKind unset: the cluster serves {served.kind} ({served.operator}), not {DEFAULT_KIND.kind}:"
        f" submitting a {served.kind}"
    )
    from ctl.spec import with_keys

    return with_keys(job, {"apiKind": served.kind}, spec)


@command(cluster=True)
def wait_command(
    name: NameArg,
    state: Annotated[str, typer.Option("--for", help="succeeded, failed or running.")] = "succeeded",
    timeout: Annotated[float, timeout_option("to wait")] = 86_400,
    *,
    cluster: Cluster,
) -> None:
    """Wait for a job's state; the exit code says how it ended (0: reached; 100, 101, 102: see below)."""
    if state not in ("succeeded", "failed", "running"):
        raise fail(f"--for {state!r}: expected succeeded, failed or running")
    from ctl.status import wait

    waited = wait(cluster.connect(), name, state, timeout, progress=lambda s: typer.echo(f"{name}: {s}", err=True))
    raise fail(waited.problem, waited.code) if waited.problem else typer.Exit(waited.code)


@command(cluster=True)
def status(
    name: NameArg,
    output: OutputOpt = "table",
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            "-w",
            help="Print each change (table: one line each) until the job has ended, then its pods' end"
            f" (at most {POD_END_WAIT_S:.0f} s more).",
        ),
    ] = False,
    *,
    cluster: Cluster,
) -> None:
    """A job's state and training progress (rank 0's step, loss, last checkpoint), its conditions,
    each pod's phase, restarts and exit code, recent events."""
    from ctl.status import status as job_status

    target = cluster.connect()
    data = job_status(target, name)
    print_data(data, output, lambda: status_table(data))
    if watch:
        watch_status(target, name, data, output)


def watch_status(target: Target, name: str, data: JobStatus, output: str) -> None:
    """status --watch: each change after `data` until the job has ended (a table: one line each), then its pods'
    end, for at most POD_END_WAIT_S. A job that had ended before the watch began is not watched."""
    from ctl.cluster import JobNotFound
    from ctl.status import status as job_status

    if data.state.terminal:
        return
    last = status_line(data) if output == "table" else data
    pods_end_by: float | None = None  # set when the job is seen to end
    with interruptible():
        while pods_end_by is None or (pods_running(data) and time.monotonic() < pods_end_by):
            time.sleep(WATCH_INTERVAL_S)
            try:
                data = job_status(target, name)
            except JobNotFound:
                if pods_end_by is None:
                    raise
                return  # deleted once it had ended (ttlSecondsAfterFinished, ctl delete)
            if data.state.terminal and pods_end_by is None:
                pods_end_by = time.monotonic() + POD_END_WAIT_S
            current = status_line(data) if output == "table" else data
            if current == last:
                continue
            last = current
            if output == "table":
                typer.echo(f"{time.strftime('%H:%M:%S')}  {current}")
                continue
            if output == "yaml":
                typer.echo("---")  # a stream of documents, as `kubectl get -w -o yaml`
            print_data(data, output, table=str)  # json or yaml: no table


def pods_running(data: JobStatus) -> bool:
    return any(pod.phase in ("Pending", "Running") for pod in data.pods)


@command(cluster=True)
def list_command(
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Jobs of every namespace.")] = False,
    output: OutputOpt = "table",
    *,
    cluster: Cluster,
) -> None:
    """The jobs of the namespace, PyTorchJobs and TrainJobs: state, nodes x processes per node, age, rank 0's step
    while running."""
    from ctl.status import list_jobs

    rows = list_jobs(cluster.connect(), all_namespaces)
    print_data(rows, output, lambda: list_table(rows))


@command(cluster=True)
def logs(
    name: NameArg,
    rank: Annotated[
        int | None,
        typer.Option("--rank", help="The pod that runs this global rank (default 0).", show_default=False, min=0),
    ] = None,
    all_nodes: Annotated[
        bool, typer.Option("--all", help="Every pod, each line prefixed [master-0], [worker-0]... ([node-0]...)")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Stream new lines, across restarts, until the job ends.")
    ] = False,
    tail: Annotated[int, typer.Option("--tail", help="Last lines of each pod's log (-1: all).")] = -1,
    previous: Annotated[
        bool, typer.Option("--previous", "-p", help="The log of the container run before the last restart.")
    ] = False,
    timestamps: Annotated[
        bool, typer.Option("--timestamps", help="Prefix each line with its time (RFC 3339).")
    ] = False,
    *,
    cluster: Cluster,
) -> None:
    """Print a job's log: rank 0's pod by default. Waits for pods that have not started yet."""
    from ctl.logs import LogOptions

    if rank is not None and all_nodes:
        raise fail("--rank and --all: choose one")
    if tail < -1:
        raise fail(f"--tail {tail}: expected a number of lines, or -1 for all")
    options = LogOptions(follow, None if tail == -1 else tail, previous, timestamps)
    target = cluster.connect()
    with interruptible():
        print_logs(target, name, all_nodes, rank or 0, options)


@command(cluster=True)
def suspend(name: NameArg, *, cluster: Cluster) -> None:
    """Stop a job's pods until `ctl resume`: they get SIGTERM, so rank 0 saves a checkpoint first, and the job frees
    its nodes (a job of queue.kueue: its Workload is deactivated, and Kueue suspends it)."""
    set_suspended(cluster.connect(), name, True)


@command(cluster=True)
def resume(name: NameArg, *, cluster: Cluster) -> None:
    """Start a suspended job's pods again: they go on from its last checkpoint (a job of queue.kueue: its Workload
    is activated, and Kueue starts the job once its queue has quota)."""
    set_suspended(cluster.connect(), name, False)


def set_suspended(target: Target, name: str, suspend: bool) -> None:
    """suspend/resume: what changed on stdout, as `kubectl patch` says it; what happens next on stderr."""
    from ctl.suspension import set_suspended as change

    done = change(target, name, suspend)
    typer.echo(f"{done.reference} {'suspended' if suspend else 'resumed'}" + ("" if done.changed else " (no change)"))
    by = f"Kueue, its Workload {done.workload} {'inactive' if suspend else 'active'}: " if done.workload else ""
    if suspend:
        note(
            f"{by}its pods get SIGTERM: rank 0 saves a checkpoint, they stop, and"
            f" `ctl resume {name} -n {target.namespace}` goes on from it"
        )
    else:
        queued = " once its queue has quota" if done.workload else ""
        note(f"{by}its pods start again{queued} and go on from its last checkpoint")


@command(cluster=True)
def delete(
    name: NameArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    purge: Annotated[bool, typer.Option("--purge", help="Also delete the run directory's volume claim.")] = False,
    *,
    cluster: Cluster,
) -> None:
    """Delete a job and the objects rendered with it; its volume claim (checkpoints) stays unless --purge (which
    also deletes the claim a deletion without it left)."""
    from ctl.cluster import JobNotFound, find_job
    from ctl.jobs import CLAIMS, labelled
    from ctl.jobs import delete as delete_objects

    target = cluster.connect()
    if not yes:
        if not sys.stdin.isatty():
            raise fail("delete: confirm with --yes (stdin is not a terminal)")
        try:
            what = f"{find_job(target, name)['kind'].lower()} {name}"
        except JobNotFound:
            if not purge or not labelled(target, name, *CLAIMS):
                raise
            what = f"what is left of job {name} (its volume claim)"
        if not typer.confirm(f"delete {what} in namespace {target.namespace}?", err=True):
            raise typer.Exit(1)
    removed = delete_objects(target, name, purge)
    for item in removed:
        typer.echo(f"{item} deleted")
