"""The commands that need no cluster: `run` and `prepare` on this machine, `render` the objects."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ctl.commands.common import (
    SetFileOpt,
    SetOpt,
    SpecArg,
    ValuesOpt,
    command,
    fail,
    given_path,
    load_job,
    note,
    one_of,
)

if TYPE_CHECKING:
    from ctl.local_pods import LocalJob
    from ctl.spec import JobSpec


def run_directory(text: str) -> Path:
    """--run-dir: a directory, or a path to make one at; not a file, nor a path through one, nor an S3 URI (as a
    path, `s3://b/x` is the local folder `s3:/b/x`, which a run would have been written into)."""
    if text[:3].lower() == "s3:":
        raise typer.BadParameter(
            "a local directory, not an S3 URI: a run directory in a bucket is training.checkpoint.dir"
            f" (--set training.checkpoint.dir={text})"
        )
    path = given_path(text)
    if file := next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None):
        raise typer.BadParameter(f"{file} is a file, not a directory")
    return path


RunDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="Run directory (default: ./runs/<name>).",
        show_default=False,
        parser=run_directory,
        metavar="DIR",
    ),
]


@command()
def run(
    spec: SpecArg,
    values: ValuesOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    set_values: SetOpt = [],  # noqa: B006
    set_files: SetFileOpt = [],  # noqa: B006
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
    job = load_job(spec, values, set_values, set_files)
    require_trainer("run")
    from ctl.local import run_local  # kept out of `ctl --help`'s import time

    with local_pods(job, run_dir) as pods:
        if job.prepare.enabled:  # what the chart's prepare Job does, first: the trainers then wait for its data
            prepare_data(job, pods)
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


def prepare_data(job: JobSpec, pods: LocalJob):  # -> trainer.prepare.Plan
    """The job's dataset in its cache, prepared here unless it is there already (a SpecError on bad data), with the
    pods' S3 variables (s3:// data from storage.endpoint's server). A run directory in a bucket is checked first, as
    the ranks check it: a missing bucket or refused keys would otherwise show only after the preparation."""
    try:
        # Imported here: tokenizers, numpy and pyarrow are the trainer's dependencies, not the client's.
        from trainer.prepare import prepare_spec
    except ImportError as exc:
        raise fail(f"ctl prepare needs the trainer's dependencies: {exc}", code=1) from None
    from ctl.local import pod_variables
    from trainer.location import S3Location, is_s3
    from trainer.storage import S3Store

    with pod_variables(pods.nodes[0]):
        if is_s3(pods.location):
            S3Store(S3Location.parse(pods.location), pods.run_dir).check(writable=True)
        return prepare_spec(job.training, pods.run_dir, note)


@command()
def prepare(
    spec: SpecArg,
    values: ValuesOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    set_values: SetOpt = [],  # noqa: B006
    set_files: SetFileOpt = [],  # noqa: B006
    run_dir: RunDirOpt = None,
) -> None:
    """Prepare the job's data on this machine: tokenized once into the dataset cache, which runs then map.

    Prints the prepared dataset's directory. The cache is `training.data.cacheDir`, by default
    `_datasets` next to the run directory; `ctl run` and the trainer find the data there by its fingerprint.
    """
    job = load_job(spec, values, set_values, set_files)
    require_trainer("prepare")
    with stoppable(), local_pods(job, run_dir) as pods:  # the run directory the rendered training config names
        plan = prepare_data(job, pods)
    typer.echo(str(plan.entry))


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """SIGTERM and SIGHUP (where not ignored) stop a preparation as Ctrl-C does: its staging folder and worker pool
    are cleaned up, and one line says so. By default the signal ended ctl at once, leaving both behind."""
    import signal

    from ctl.local import STOP_SIGNALS
    from trainer.names import EXIT_INTERRUPTED, EXIT_PREEMPTED
    from trainer.prepare import Stopped, stop

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, stop)
    try:
        yield
    except (Stopped, KeyboardInterrupt) as exc:
        by = signal.Signals(exc.args[0]).name if isinstance(exc, Stopped) else "SIGINT"
        how = "interrupted" if by == "SIGINT" else "terminated"
        note(f"ctl: {how} ({by}): the preparation stopped, nothing kept; the same command prepares again")
        raise typer.Exit(EXIT_INTERRUPTED if by == "SIGINT" else EXIT_PREEMPTED) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@command()
def render(
    spec: SpecArg,
    values: ValuesOpt = [],  # noqa: B006 (Typer reads the default; it is never mutated)
    set_values: SetOpt = [],  # noqa: B006
    set_files: SetFileOpt = [],  # noqa: B006
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="yaml (multi-document, as `helm template`) or json (a List).",
            parser=one_of("yaml", "json"),
        ),
    ] = "yaml",
) -> None:
    """Print the Kubernetes objects the job becomes (the Helm chart, rendered in process); no cluster access.

    The objects carry no namespace: `kubectl apply -n NS` (or `ctl submit -n NS`) chooses it.
    """
    job = load_job(spec, values, set_values, set_files, cluster=True)
    from ctl.render import render as render_spec
    from ctl.render import to_json, to_yaml
    from ctl.storage import render_note

    manifests = render_spec(job)
    if message := render_note([m.obj for m in manifests]):
        note(message)
    typer.echo(to_json(manifests) if output == "json" else to_yaml(manifests), nl=False)
