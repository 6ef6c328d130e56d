"""The `ctl` command (Typer). Thin: each command parses, delegates, maps errors to exit codes.

Exit codes: 0 ok, 1 error, 2 usage or bad input; for a job's outcome (`wait`, `submit --wait/--follow`)
100 failed, 101 not finished (timeout), 102 not found; `run` stopped after saving: 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from ctl.names import EXIT_NOT_FOUND
from ctl.tables import list_table, status_line, status_table
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR

if TYPE_CHECKING:
    from ctl.cluster import Target
    from ctl.local_pods import LocalJob
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


# The one place where ctl's errors become exit codes (each with its one line), the first match winning. By module
# and class name: `ctl --help` imports none of these modules, and an exception's module is loaded once it is raised.
ERROR_EXITS = (
    ("ctl.cluster", "JobNotFound", EXIT_NOT_FOUND),
    ("ctl.jobs", "StorageMismatch", EXIT_BAD_INPUT),  # the spec asks what the cluster cannot give
    ("ctl.cluster", "ClusterError", EXIT_ERROR),
    ("trainer.spec", "SpecError", EXIT_BAD_INPUT),
    ("ctl.render", "RenderError", EXIT_ERROR),
    ("ctl.pod", "PodSetupError", EXIT_ERROR),  # a pod ctl run cannot start here
)


@contextlib.contextmanager
def mapped_errors() -> Iterator[None]:
    """ctl's errors -> their one line on stderr and their exit code (ERROR_EXITS); anything else is a bug."""
    try:
        yield
    except Exception as exc:
        for module, name, code in ERROR_EXITS:
            error = getattr(sys.modules.get(module), name, None)
            if error is not None and isinstance(exc, error):
                raise fail(str(exc), code) from None
        raise


KubeconfigOpt = Annotated[
    str | None, typer.Option("--kubeconfig", help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster).")
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="Kubeconfig context (default: the current one).")]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", "-n", help="Namespace (default: the context's).", show_default=False)
]
# Every cluster command's targeting options, as kubectl's, in this order after the command's own.
CLUSTER_OPTIONS = [
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=option)
    for name, option in (("kubeconfig", KubeconfigOpt), ("context", ContextOpt), ("namespace", NamespaceOpt))
]


@dataclass(frozen=True)
class Cluster:
    """A cluster command's --kubeconfig, --context and -n: connects when the command first needs the cluster."""

    kubeconfig: str | None
    context: str | None
    namespace: str | None

    def connect(self) -> Target:
        from ctl.cluster import connect

        return connect(self.kubeconfig, self.context, self.namespace)


def command(name: str | None = None, cluster: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a command whose errors become exit codes (mapped_errors); with `cluster`, it takes CLUSTER_OPTIONS,
    given to it as its `cluster: Cluster` parameter."""

    def register(function: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> None:
            if cluster:
                kwargs["cluster"] = Cluster(*(kwargs.pop(option.name) for option in CLUSTER_OPTIONS))
            with mapped_errors():
                function(*args, **kwargs)

        if cluster:  # what Typer reads the options from
            signature = inspect.signature(function, eval_str=True)
            own = [p for p in signature.parameters.values() if p.name != "cluster"]
            run.__signature__ = signature.replace(parameters=own + CLUSTER_OPTIONS)  # type: ignore[attr-defined]
        return app.command(name)(run)

    return register


def load_job(spec: Path, set_values: list[str]) -> JobSpec:
    """The validated spec (a SpecError: exit 2 with its one-line problem)."""
    # Imported here: pydantic's import is most of `ctl --help`'s time otherwise.
    from ctl.spec import load_spec

    return load_spec(spec, set_values)


@command()
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
    """The job's rendered pods, materialised for local processes (a PodSetupError when they cannot be)."""
    from ctl.local_pods import local_job

    with local_job(job, run_dir) as pods:
        yield pods


def require_trainer(command: str) -> None:
    """Exit 2 naming the install when the client lacks the `train` extra that `command` runs."""
    from ctl.local import missing_trainer_requirements

    if missing := missing_trainer_requirements():
        raise fail(f"ctl {command} needs the trainer: pip install 'ddpjob[train]' (missing: {', '.join(missing)})")


def prepare_data(job: JobSpec, directory: Path):  # -> trainer.prepare.Plan
    """The job's dataset in its cache, prepared here unless it is there already (a SpecError on bad data)."""
    try:
        # Imported here: tokenizers, numpy and pyarrow are the trainer's dependencies, not the client's.
        from trainer.prepare import prepare_spec
    except ImportError as exc:
        raise fail(f"ctl prepare needs the trainer's dependencies: {exc}", code=1) from None
    return prepare_spec(job.training, directory, note)


@command()
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


@command()
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
    from ctl.render import render as render_spec
    from ctl.render import to_json, to_yaml
    from ctl.storage import render_note

    manifests = render_spec(job)
    if message := render_note([m.obj for m in manifests]):
        note(message)
    typer.echo(to_json(manifests) if fmt == "json" else to_yaml(manifests), nl=False)


NameArg = Annotated[str, typer.Argument(help="The job's name (the spec's `name`).", show_default=False)]
OutputOpt = Annotated[str, typer.Option("--output", "-o", help="table, yaml or json.")]


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
    """Machine output on stdout in a stable shape (json/yaml: the status's JSON form), or a table for people."""
    from ctl.status import json_form

    if output == "json":
        typer.echo(json.dumps(json_form(data), indent=2))
    elif output == "yaml":
        import yaml

        typer.echo(yaml.safe_dump(json_form(data), sort_keys=False), nl=False)
    elif output == "table":
        typer.echo(table())
    else:
        raise fail(f"--output {output!r}: expected table, yaml or json")


@command(cluster=True)
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
    *,
    cluster: Cluster,
) -> None:
    """Create the job on the cluster: every rendered object by server-side apply (field manager `ctl`)."""
    if dry_run not in ("none", "client", "server"):
        raise fail(f"--dry-run {dry_run!r}: expected none, client or server")
    job = load_job(spec, set_values)
    target = None if dry_run == "client" else cluster.connect()
    if target is not None and "api_kind" not in job.model_fields_set:
        job = served_kind(target, job, spec, set_values)
    from ctl.render import render, to_yaml

    manifests = render(job)
    if target is None:
        typer.echo(to_yaml(manifests), nl=False)
        return
    from ctl.jobs import submit as submit_objects
    from ctl.status import wait

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
        code = wait(target, job.name, "succeeded", timeout, progress=note)
        if follow:
            printer.join(LOG_DRAIN_S)
        raise typer.Exit(code)


def served_kind(target: Target, job: JobSpec, spec: Path, set_values: list[str]) -> JobSpec:
    """The spec leaves apiKind unset: the default (PyTorchJob), unless the cluster serves only TrainJob; then the
    spec as a TrainJob (validated as one), said on stderr."""
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
    return load_job(spec, [*set_values, f"apiKind={served.kind}"])


@command("wait", cluster=True)
def wait_command(
    name: NameArg,
    state: Annotated[str, typer.Option("--for", help="succeeded, failed or running.")] = "succeeded",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 86_400,
    *,
    cluster: Cluster,
) -> None:
    """Wait for a job's state; the exit code says how it ended (0: reached; 100, 101, 102: see below)."""
    if state not in ("succeeded", "failed", "running"):
        raise fail(f"--for {state!r}: expected succeeded, failed or running")
    from ctl.status import wait

    code = wait(cluster.connect(), name, state, timeout, progress=lambda s: typer.echo(f"{name}: {s}", err=True))
    raise typer.Exit(code)


@command(cluster=True)
def status(
    name: NameArg,
    output: OutputOpt = "table",
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Print each change (table: one line each) until the job has ended.")
    ] = False,
    *,
    cluster: Cluster,
) -> None:
    """A job's state and training progress (rank 0's step, loss, last checkpoint), its conditions,
    each pod's phase, restarts and exit code, recent events."""
    from ctl.status import status as job_status

    if output not in ("table", "yaml", "json"):
        raise fail(f"--output {output!r}: expected table, yaml or json")
    target = cluster.connect()
    data = job_status(target, name)
    print_data(data, output, lambda: status_table(data))
    if not watch:
        return
    last = status_line(data) if output == "table" else data
    with interruptible():
        while not data.state.terminal:
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


@command("list", cluster=True)
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


def print_logs(target: Target, name: str, all_nodes: bool, rank: int, options: LogOptions) -> None:
    """The chosen pods' lines on stdout (prefixed by pod with --all, coloured on a terminal); notes on stderr."""
    from ctl.cluster import find_job
    from ctl.kinds import kind_of
    from ctl.logs import interleaved, node_lines
    from ctl.status import procs_per_node

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
    """submit --follow's log thread: rank 0's pod; a failure is reported and ends only the log."""
    with contextlib.suppress(typer.Exit), mapped_errors():
        print_logs(target, name, False, 0, options)


def node_of_rank(rank: int, nodes: int, procs: int | None) -> int:
    if rank == 0:
        return 0
    if procs is None:
        raise fail(f"--rank {rank}: the job leaves processes per node to each node; use --all")
    if not 0 <= rank < nodes * procs:
        raise fail(f"--rank {rank}: the job has {nodes * procs} ranks (0-{nodes * procs - 1})")
    return rank // procs


@command(cluster=True)
def delete(
    name: NameArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    purge: Annotated[bool, typer.Option("--purge", help="Also delete the run directory's volume claim.")] = False,
    *,
    cluster: Cluster,
) -> None:
    """Delete a job and the objects rendered with it; its volume claim (checkpoints) stays unless --purge."""
    from ctl.cluster import find_job
    from ctl.jobs import delete as delete_objects

    target = cluster.connect()
    if not yes:
        if not sys.stdin.isatty():
            raise fail("delete: confirm with --yes (stdin is not a terminal)")
        kind = find_job(target, name)["kind"].lower()
        if not typer.confirm(f"delete {kind} {name} in namespace {target.namespace}?", err=True):
            raise typer.Exit(1)
    removed = delete_objects(target, name, purge)
    for item in removed:
        typer.echo(f"{item} deleted")


# Set by a completion script when it asks `ctl` for the candidates of the word being typed.
COMPLETE_VAR = "_CTL_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


@command()
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
