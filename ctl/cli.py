"""The `ctl` command (Typer). Thin: each command parses, delegates, maps errors to exit codes.

Exit codes: 0 ok, 1 error, 2 usage or bad input; for a job's outcome (`wait`, `submit --wait/--follow`)
100 failed, 101 not finished (timeout), 102 not found; `run` stopped after saving: 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR

if TYPE_CHECKING:
    from ctl.cluster import Target
    from ctl.local import LocalJob
    from ctl.logs import LogOptions
    from ctl.spec import JobSpec

WATCH_INTERVAL_S = 2.0
LOG_DRAIN_S = 10.0  # submit --follow: how long the log may still print after the job's outcome is known
PREFIX_COLOURS = ("36", "35", "33", "32", "34", "31")  # ANSI: cyan, magenta, yellow, green, blue, red

EXIT_CODES = (
    "Exit codes: 0 ok, 1 error, 2 usage or bad input; job outcomes (wait, submit --wait/--follow):"
    " 100 failed, 101 not finished, 102 not found; run stopped after saving: 130 Ctrl-C, 143 SIGTERM."
)

app = typer.Typer(
    name="ctl",
    help="Train GPT-2-style models with PyTorch DDP: locally, or as a Kubeflow PyTorchJob or TrainJob.",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help, as kubectl's; and rich's import would double `ctl --help`'s time
)

SpecArg = Annotated[Path, typer.Argument(help="Job spec (YAML; also the Helm chart's values).", show_default=False)]
SetOpt = Annotated[
    list[str],
    typer.Option("--set", help="Override a spec key: dotted.key=value (repeatable).", metavar="KEY=VALUE"),
]
RunDirOpt = Annotated[
    Path | None, typer.Option("--run-dir", help="Run directory (default: ./runs/<name>).", show_default=False)
]


@app.callback()
def cli() -> None:
    """Train GPT-2-style models with PyTorch DDP: locally, or as a Kubeflow PyTorchJob or TrainJob."""


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_job(spec: Path, set_values: list[str]) -> JobSpec:
    """The validated spec, or exit 2 with its one-line problem."""
    # Imported here: pydantic's import is most of `ctl --help`'s time otherwise.
    from ctl.spec import load_spec
    from trainer.spec import SpecError

    try:
        return load_spec(spec, set_values)
    except SpecError as exc:
        raise fail(str(exc)) from None


@app.command()
def run(
    spec: SpecArg,
    set_values: SetOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    run_dir: RunDirOpt = None,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Also stream every rank's output and torchrun's own (else in logs/)."),
    ] = False,
) -> None:
    """Run the job on this machine: one torchrun agent per node, from the rendered pods, with the operator's env.

    Shows rank 0's progress, then one line: the outcome, or the root cause of a failure with the log files that
    hold the rest (the run directory's logs/). SIGTERM stops the run as Ctrl-C does: every rank saves at one
    agreed step; exit 143 (130 for Ctrl-C), and the same command resumes.
    """
    job = load_job(spec, set_values)
    require_trainer("run")
    from ctl.local import run_local  # kept out of `ctl --help`'s import time

    with local_pods(job, run_dir) as pods:
        if job.prepare.enabled:  # what the chart's prepare Job does, first: the trainers then wait for its data
            prepare_data(job, pods.run_dir)
        code = run_local(job, pods, verbose)
    raise typer.Exit(code)


@contextlib.contextmanager
def local_pods(job: JobSpec, run_dir: Path | None) -> Iterator[LocalJob]:
    """The job's rendered pods, materialised for local processes; exit 1 with the reason when they cannot be."""
    from ctl.local import local_job
    from ctl.pod import PodSetupError
    from ctl.render import RenderError

    try:
        with local_job(job, run_dir) as pods:
            yield pods
    except (RenderError, PodSetupError) as exc:
        raise fail(str(exc), code=EXIT_ERROR) from None


def require_trainer(command: str) -> None:
    """Exit 2 naming the install when the client lacks the `train` extra that `command` runs."""
    from ctl.local import missing_trainer_requirements

    if missing := missing_trainer_requirements():
        raise fail(f"ctl {command} needs the trainer: pip install 'ddpjob[train]' (missing: {', '.join(missing)})")


def prepare_data(job: JobSpec, directory: Path):  # -> trainer.prepare.Plan
    """The job's dataset in its cache, prepared here unless it is there already; exit 2 on bad data."""
    from trainer.spec import SpecError

    try:
        # Imported here: tokenizers, numpy and pyarrow are the trainer's dependencies, not the client's.
        from trainer.prepare import prepare_spec
    except ImportError as exc:
        raise fail(f"ctl prepare needs the trainer's dependencies: {exc}", code=1) from None
    try:
        return prepare_spec(job.training, directory, note)
    except SpecError as exc:
        raise fail(str(exc)) from None


@app.command()
def prepare(
    spec: SpecArg,
    set_values: SetOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    run_dir: RunDirOpt = None,
) -> None:
    """Prepare the job's data on this machine: tokenized once into the dataset cache, which runs then map.

    Prints the prepared dataset's directory. The cache is `training.data.cacheDir`, by default
    `_datasets` next to the run directory; `ctl run` and the trainer find the data there by its fingerprint.
    """
    job = load_job(spec, set_values)
    require_trainer("prepare")
    with local_pods(job, run_dir) as pods:  # the run directory is the one the rendered training config names
        plan = prepare_data(job, pods.run_dir)
    typer.echo(str(plan.entry))


@app.command()
def render(
    spec: SpecArg,
    set_values: SetOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    output: Annotated[
        str, typer.Option("--output", "-o", help="yaml (multi-document, as `helm template`) or json (a List).")
    ] = "yaml",
) -> None:
    """Print the Kubernetes objects the job becomes (the Helm chart, rendered in process); no cluster access.

    The objects carry no namespace: `kubectl apply -n NS` (or `ctl submit -n NS`) chooses it.
    """
    if output not in ("yaml", "json"):
        raise fail(f"--output {output!r}: expected yaml or json")
    fmt: Literal["yaml", "json"] = "json" if output == "json" else "yaml"
    job = load_job(spec, set_values)
    from ctl.render import RenderError, to_json, to_yaml
    from ctl.render import render as render_spec
    from ctl.storage import render_note

    try:
        manifests = render_spec(job)
    except RenderError as exc:
        raise fail(str(exc), code=1) from None
    if message := render_note([m.obj for m in manifests]):
        note(message)
    typer.echo(to_json(manifests) if fmt == "json" else to_yaml(manifests), nl=False)


KubeconfigOpt = Annotated[
    str | None, typer.Option("--kubeconfig", help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster).")
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="Kubeconfig context (default: the current one).")]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", "-n", help="Namespace (default: the context's).", show_default=False)
]
NameArg = Annotated[str, typer.Argument(help="The job's name (the spec's `name`).", show_default=False)]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="table, yaml or json.")]


def cluster_target(kubeconfig: str | None, context: str | None, namespace: str | None):  # -> ctl.cluster.Target
    from ctl.cluster import connect

    with cluster_errors():
        return connect(kubeconfig, context, namespace)


@contextlib.contextmanager
def cluster_errors() -> Iterator[None]:
    """A cluster failure -> its one line and exit 1; a job that does not exist -> exit 102."""
    from ctl.cluster import EXIT_NOT_FOUND, ClusterError, JobNotFound, StorageMismatch

    try:
        yield
    except JobNotFound as exc:
        raise fail(str(exc), code=EXIT_NOT_FOUND) from None
    except StorageMismatch as exc:  # the spec asks what the cluster cannot give: bad input
        raise fail(str(exc)) from None
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None


def note(message: str) -> None:
    """Progress for people: stderr, so that stdout stays data."""
    typer.echo(message, err=True)


def colour_enabled() -> bool:
    """Colour only on a terminal, and not when NO_COLOR is set (https://no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C ends a follow or a watch quietly, with the shell's code for it (130); so does a reader that has
    gone (`ctl logs NAME | head`), with 0."""
    try:
        yield
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        raise typer.Exit(0) from None


def print_data(data: object, output: str, table: Callable[[], str]) -> None:
    """Machine output on stdout in a stable shape (json/yaml), or a table for people."""
    if output == "json":
        typer.echo(json.dumps(data, indent=2))
    elif output == "yaml":
        import yaml

        typer.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
    elif output == "table":
        typer.echo(table())
    else:
        raise fail(f"--output {output!r}: expected table, yaml or json")


@app.command()
def submit(
    spec: SpecArg,
    set_values: SetOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    dry_run: Annotated[
        str, typer.Option("--dry-run", help="none; client (print the objects); server (the API server validates).")
    ] = "none",
    replace: Annotated[bool, typer.Option("--replace", help="Delete and recreate a job of the same name.")] = False,
    wait_for: Annotated[bool, typer.Option("--wait", help="Wait until the job succeeds or fails.")] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Print rank 0's log as it runs, until the job ends (implies --wait).")
    ] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds --wait/--follow wait.")] = 86_400,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Create the job on the cluster: every rendered object by server-side apply (field manager `ctl`)."""
    if dry_run not in ("none", "client", "server"):
        raise fail(f"--dry-run {dry_run!r}: expected none, client or server")
    job = load_job(spec, set_values)
    target = None if dry_run == "client" else cluster_target(kubeconfig, context, namespace)
    if target is not None and "api_kind" not in job.model_fields_set:
        job = served_kind(target, job, spec, set_values)
    from ctl.render import RenderError, render, to_yaml

    try:
        manifests = render(job)
    except RenderError as exc:
        raise fail(str(exc), code=1) from None
    if target is None:
        typer.echo(to_yaml(manifests), nl=False)
        return
    from ctl.cluster import submit as submit_objects
    from ctl.cluster import wait

    with cluster_errors():
        submit_objects(target, [m.obj for m in manifests], dry_run=dry_run == "server", replace=replace, note=note)
    ns = target.namespace
    api = job.kind
    typer.echo(f"{api.kind.lower()}.{api.group}/{job.name}" + (" (server dry run)" if dry_run == "server" else ""))
    if dry_run == "server":
        return
    typer.echo(
        f"next: ctl logs {job.name} -n {ns} -f  |  ctl status {job.name} -n {ns}"
        f"  |  ctl wait {job.name} -n {ns} --for succeeded  |  ctl delete {job.name} -n {ns}",
        err=True,
    )
    if follow:
        from ctl.logs import LogOptions

        # The log in the background; the job's outcome (and --timeout) decides when ctl returns.
        printer = threading.Thread(target=follow_log, args=(target, job.name, LogOptions(follow=True)), daemon=True)
        printer.start()
    if wait_for or follow:
        with cluster_errors():
            code = wait(target, job.name, "succeeded", timeout, progress=note)
        if follow:
            printer.join(LOG_DRAIN_S)
        raise typer.Exit(code)


def served_kind(target: Target, job: JobSpec, spec: Path, set_values: list[str]) -> JobSpec:
    """The spec leaves apiKind unset: the default (PyTorchJob), unless the cluster serves only TrainJob; then the
    spec as a TrainJob (validated as one), said on stderr."""
    from ctl.cluster import serves
    from ctl.kinds import DEFAULT_KIND, KINDS

    with cluster_errors():
        if serves(target, DEFAULT_KIND):
            return job
        served = next((kind for kind in KINDS.values() if kind is not DEFAULT_KIND and serves(target, kind)), None)
    if served is None:
        return job
    note(
        f"apiKind unset: the cluster serves {served.kind} ({served.operator}), not {DEFAULT_KIND.kind}:"
        f" submitting a {served.kind}"
    )
    return load_job(spec, [*set_values, f"apiKind={served.kind}"])


@app.command("wait")
def wait_command(
    name: NameArg,
    state: Annotated[str, typer.Option("--for", help="succeeded, failed or running.")] = "succeeded",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 86_400,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Wait for a job's state; the exit code says how it ended (0: reached; 100, 101, 102: see below)."""
    if state not in ("succeeded", "failed", "running"):
        raise fail(f"--for {state!r}: expected succeeded, failed or running")
    from ctl.cluster import wait

    target = cluster_target(kubeconfig, context, namespace)
    with cluster_errors():
        code = wait(target, name, state, timeout, progress=lambda s: typer.echo(f"{name}: {s}", err=True))
    raise typer.Exit(code)


@app.command()
def status(
    name: NameArg,
    output: OutputOpt = "table",
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Print each change (table: one line each) until the job has ended.")
    ] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """A job's state and training progress (rank 0's step, loss, last checkpoint), its conditions,
    each pod's phase, restarts and exit code, recent events."""
    from ctl.cluster import status as job_status

    if output not in ("table", "yaml", "json"):
        raise fail(f"--output {output!r}: expected table, yaml or json")
    target = cluster_target(kubeconfig, context, namespace)
    with cluster_errors():
        data = job_status(target, name)
    print_data(data, output, lambda: status_table(data))
    if not watch:
        return
    last = status_line(data) if output == "table" else data
    with cluster_errors(), interruptible():
        while data["state"] not in ("Succeeded", "Failed"):
            time.sleep(WATCH_INTERVAL_S)
            data = job_status(target, name)
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


def status_table(data: dict[str, Any]) -> str:
    lines = [f"{data['name']} ({data['namespace']}): {data['state']}"]
    if data["progress"]:
        lines.append(f"  progress: {progress_text(data['progress'])}")
    if data["trainerStatus"]:
        lines.append(f"  trainer status: {trainer_status_text(data['trainerStatus'])}")
    if data["prepare"]:
        lines.append(f"  prepare: {prepare_text(data['prepare'])}")
    lines += [
        f"  {c['type']:<11} {c['status']:<6} {c['reason'] or ''}: {c['message'] or ''}" for c in data["conditions"]
    ]
    lines.append(f"  {'POD':<32} {'PHASE':<10} {'RESTARTS':>8} {'EXIT':>5}  REASON")
    lines += [
        f"  {p['name']:<32} {p['phase']:<10} {p['restarts']:>8} {'' if p['exitCode'] is None else p['exitCode']:>5}"
        f"  {p['reason'] or ''}"
        for p in data["pods"]
    ]
    lines += [f"  {p['name']}: {p['message']}" for p in data["pods"] if p["exitCode"] and p["message"]]
    lines += [f"  event: {e['object']} {e['type']} {e['reason']}: {e['message']}" for e in data["events"]]
    return "\n".join(lines)


def status_line(data: dict[str, Any]) -> str:
    """`ctl status -w`'s line: state, progress and the pods."""
    pods = ", ".join(
        f"{p['node']} {p['phase']}"  # master-0, worker-0; node-0, node-1
        + (f" ({p['restarts']} restarts)" if p["restarts"] else "")
        for p in data["pods"]
    )
    return " | ".join(filter(None, [data["state"], data["progress"] and progress_text(data["progress"]), pods]))


def progress_text(progress: dict[str, Any]) -> str:
    step = f"step {progress['step']}" + (f"/{progress['plannedSteps']}" if progress["plannedSteps"] else "")
    parts = [step]
    parts += [f"loss {progress['trainLoss']:.4f}"] if progress["trainLoss"] is not None else []
    parts += [f"val loss {progress['evalLoss']:.4f}"] if progress["evalLoss"] is not None else []
    parts += [f"{progress['tokensPerSecond']:,.0f} tok/s"] if progress["tokensPerSecond"] is not None else []
    checkpoint = progress["checkpoint"]
    parts += [f"checkpoint step-{checkpoint['step']} at {checkpoint['time']}"] if checkpoint else []
    slowest = progress.get("slowestRank")
    parts += [f"slowest rank {slowest['rank']} ({slowest['stepTimeRatioToMedian']:.2f}x the median)"] if slowest else []
    return ", ".join(parts)


def prepare_text(prepare: dict[str, Any]) -> str:
    """The prepare Job in one line: `job/NAME Failed (exit code 137; BackoffLimitExceeded: ...)`."""
    pod = prepare["pod"] or {}
    why = [f"exit code {pod['exitCode']}"] if pod.get("exitCode") else []
    why += [f"{prepare['reason']}: {prepare['message']}"] if prepare["reason"] else []
    return f"job/{prepare['name']} {prepare['state']}" + (f" ({'; '.join(why)})" if why else "")


def trainer_status_text(status: dict[str, Any]) -> str:
    """A TrainJob's `.status.trainerStatus` (what its trainer reported to Trainer v2) in one line."""
    parts = [f"{status['progressPercentage']}%"] if status.get("progressPercentage") is not None else []
    if status.get("estimatedRemainingSeconds") is not None:
        parts.append(f"about {status['estimatedRemainingSeconds']} s left")
    parts += [f"{m['name']} {m['value']}" for m in status.get("metrics") or []]
    if status.get("lastUpdatedTime"):
        parts.append(f"at {status['lastUpdatedTime']}")
    return ", ".join(parts)


@app.command("list")
def list_command(
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Jobs of every namespace.")] = False,
    output: OutputOpt = "table",
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """The jobs of the namespace, PyTorchJobs and TrainJobs: state, nodes x processes per node, age, rank 0's step
    while running."""
    from ctl.cluster import list_jobs

    target = cluster_target(kubeconfig, context, namespace)
    with cluster_errors():
        rows = list_jobs(target, all_namespaces)

    def table() -> str:
        lines = [f"{'NAMESPACE':<20} {'NAME':<32} {'KIND':<10} {'STATE':<11} {'NODES x PROCS':<14} {'AGE':<8} PROGRESS"]
        lines += [
            f"{r['namespace']:<20} {r['name']:<32} {r['kind']:<10} {r['state']:<11}"
            f" {r['nodes']} x {r['procsPerNode']:<10} {str(r['ageSeconds']) + 's':<8}"
            f" {progress_text(r['progress']) if r['progress'] else ''}"
            for r in rows
        ]
        return "\n".join(lines)

    print_data(rows, output, table)


@app.command()
def logs(
    name: NameArg,
    rank: Annotated[
        int | None, typer.Option("--rank", help="The pod that runs this global rank (default 0).", show_default=False)
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
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Print a job's log: rank 0's pod by default. Waits for pods that have not started yet."""
    from ctl.logs import LogOptions

    if rank is not None and all_nodes:
        raise fail("--rank and --all: choose one")
    if tail < -1:
        raise fail(f"--tail {tail}: expected a number of lines, or -1 for all")
    options = LogOptions(follow, None if tail == -1 else tail, previous, timestamps)
    target = cluster_target(kubeconfig, context, namespace)
    with interruptible():
        print_logs(target, name, all_nodes, rank or 0, options)


def print_logs(target: Target, name: str, all_nodes: bool, rank: int, options: LogOptions) -> None:
    """The chosen pods' lines on stdout (prefixed by pod with --all, coloured on a terminal); notes on stderr."""
    from ctl.cluster import find_job, procs_per_node
    from ctl.kinds import kind_of
    from ctl.logs import interleaved, node_lines

    with cluster_errors():
        job = find_job(target, name)
        labels = kind_of(job).node_labels(job)
        if not all_nodes:
            labels = [labels[node_of_rank(rank, len(labels), procs_per_node(job))]]
        streams = {label: node_lines(target, job, label, options, note) for label in labels}
        colours = dict(zip(labels, itertools.cycle(PREFIX_COLOURS), strict=False)) if colour_enabled() else {}
        for label, line in interleaved(streams):
            if not all_nodes:
                typer.echo(line)
            elif label in colours:
                typer.echo(f"\033[{colours[label]}m[{label}]\033[0m {line}")
            else:
                typer.echo(f"[{label}] {line}")


def follow_log(target: Target, name: str, options: LogOptions) -> None:
    """submit --follow's log thread: rank 0's pod; a failure is reported (by print_logs) and ends only the log."""
    with contextlib.suppress(typer.Exit):
        print_logs(target, name, False, 0, options)


def node_of_rank(rank: int, nodes: int, procs: int | None) -> int:
    if rank == 0:
        return 0
    if procs is None:
        raise fail(f"--rank {rank}: the job leaves processes per node to each node; use --all")
    if not 0 <= rank < nodes * procs:
        raise fail(f"--rank {rank}: the job has {nodes * procs} ranks (0-{nodes * procs - 1})")
    return rank // procs


@app.command()
def delete(
    name: NameArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    purge: Annotated[bool, typer.Option("--purge", help="Also delete the run directory's volume claim.")] = False,
    kubeconfig: KubeconfigOpt = None,
    context: ContextOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Delete a job and the objects rendered with it; its volume claim (checkpoints) stays unless --purge."""
    from ctl.cluster import delete as delete_objects
    from ctl.cluster import find_job

    target = cluster_target(kubeconfig, context, namespace)
    if not yes:
        if not sys.stdin.isatty():
            raise fail("delete: confirm with --yes (stdin is not a terminal)")
        with cluster_errors():
            kind = find_job(target, name)["kind"].lower()
        if not typer.confirm(f"delete {kind} {name} in namespace {target.namespace}?", err=True):
            raise typer.Exit(1)
    with cluster_errors():
        removed = delete_objects(target, name, purge)
    for item in removed:
        typer.echo(f"{item} deleted")


# Set by a completion script when it asks `ctl` for the candidates of the word being typed.
COMPLETE_VAR = "_CTL_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


@app.command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the shell completion script for commands, options and their values, as kubectl and helm do.

    bash: `source <(ctl completion bash)` in ~/.bashrc; zsh: `source <(ctl completion zsh)` in ~/.zshrc,
    after compinit; fish: `ctl completion fish > ~/.config/fish/completions/ctl.fish`.
    """
    if shell not in SHELLS:
        raise fail(f"completion {shell!r}: expected bash, zsh or fish")
    from typer.completion import get_completion_script

    typer.echo(get_completion_script(prog_name="ctl", complete_var=COMPLETE_VAR, shell=shell))


def main() -> None:
    """`ctl`, with Click's usage errors as one line and exit 2, as every other bad input."""
    if COMPLETE_VAR in os.environ:
        # A completion script is asking: Typer's completion for each shell, registered only then
        # (`add_completion=False` keeps Typer's --install-completion options out of every command).
        from typer.completion import completion_init

        completion_init()
    # Click's exceptions module, whichever Click Typer uses (Typer 0.29 on carries its own copy).
    click = sys.modules[typer.BadParameter.__module__]
    try:
        code = app(standalone_mode=False)  # an exit code (typer.Exit), or None when a command returns
    except getattr(click, "NoArgsIsHelpError", ()) as exc:  # no arguments at all (Click 8.2 on): the help
        exc.show()
        code = exc.exit_code
    except click.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx else "ctl"
        typer.echo(f"error: {command}: {exc.format_message().rstrip('.')} (see '{command} --help')", err=True)
        code = EXIT_BAD_INPUT
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        code = exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        code = 1
    sys.exit(code or 0)
