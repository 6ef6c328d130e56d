"""What every command shares: the one place where errors become exit codes and one-line messages, the cluster
commands' --kubeconfig, --context and -n (defined once), the spec's argument, --set and --set-file, progress notes."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ctl.names import EXIT_NOT_FOUND
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR

if TYPE_CHECKING:
    from ctl.cluster import Target
    from ctl.spec import JobSpec


def given_path(text: str) -> Path:
    """A path as typed: an empty one is refused, where Path('') would be the current directory (`--run-dir ''`
    would train into it); `~` is the home folder, as the shell gives it (which it does not after `--run-dir=`)."""
    if not text.strip():
        raise typer.BadParameter("an empty path")
    return Path(text).expanduser()


def given_file(text: str) -> str:
    """A file's name as typed (--kubeconfig): not empty, for the same reason."""
    return str(given_path(text))


def namespace_name(text: str) -> str:
    """-n: a namespace's name, checked before the cluster is asked (which would answer not found)."""
    from ctl.api_rules import namespace_problem

    if problem := namespace_problem(text):
        raise typer.BadParameter(problem)
    return text


def object_name(text: str) -> str:
    """A job's name: a name an object can have, checked before the cluster is asked (which would answer not found)."""
    from ctl.api_rules import object_name_problem

    if problem := object_name_problem(text, "job"):
        raise typer.BadParameter(problem)
    return text


def one_of(*choices: str) -> Callable[[str], str]:
    """A flag's parser that takes only `choices`: checked as the command line is read, before anything runs."""

    def parse(text: str) -> str:
        if text not in choices:
            raise typer.BadParameter(f"{text!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
        return text

    return parse


SpecArg = Annotated[
    Path,
    typer.Argument(
        help="Job spec (YAML; also the Helm chart's values); - reads it from stdin.",
        show_default=False,
        parser=given_path,
    ),
]
SetOpt = Annotated[
    list[str],
    typer.Option("--set", help="Override a spec key: dotted.key=value (repeatable).", metavar="KEY=VALUE"),
]
SetFileOpt = Annotated[
    list[str],
    typer.Option(
        "--set-file",
        help="Set a spec key to a file's text, after --set: dotted.key=path (repeatable; storage.caBundle=ca.crt).",
        metavar="KEY=PATH",
    ),
]
ValuesOpt = Annotated[
    list[Path],
    typer.Option(
        "--values",
        help="A YAML file of spec keys merged over the spec, before --set (repeatable, in order; helm's -f).",
        metavar="PATH",
        parser=given_path,
    ),
]

# A Go duration, as kubectl's --timeout takes: 90s, 30m, 1h30m, 1.5h, 500ms.
DURATION = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def seconds(value: str | float) -> float:
    """A --timeout: seconds (a number) or a Go duration, as kubectl takes (`30m`, `1h30m`)."""
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        parts = list(DURATION.finditer(text))
        if not parts or "".join(part.group() for part in parts) != text:
            raise typer.BadParameter(f"{text!r}: expected seconds or a duration such as 90s, 30m or 1h30m") from None
        number = sum(float(part.group()[: part.start(1) - part.start()]) * DURATION_UNITS[part[1]] for part in parts)
    if not (math.isfinite(number) and number >= 0):
        raise typer.BadParameter(f"{text!r}: expected a duration of 0 or more")
    return number


def timeout_option(what: str) -> Any:
    """--timeout: how long `what` waits, in seconds or as a duration."""
    return typer.Option(
        "--timeout", help=f"How long {what}: seconds, or 30m, 1h30m.", parser=seconds, metavar="<duration>"
    )


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


# The one place where ctl's errors become exit codes (each with its one line), the first match winning. By module
# and class name: `ctl --help` imports none of these modules, and an exception's module is loaded once it is raised.
ERROR_EXITS = (
    ("ctl.cluster", "JobNotFound", EXIT_NOT_FOUND),
    ("ctl.jobs", "StorageMismatch", EXIT_BAD_INPUT),  # the spec asks what the cluster cannot give
    ("ctl.cluster", "KubeconfigError", EXIT_BAD_INPUT),  # --kubeconfig, $KUBECONFIG, --context
    ("ctl.cluster", "ClusterError", EXIT_ERROR),
    ("trainer.spec", "SpecError", EXIT_BAD_INPUT),
    ("trainer.storage", "StorageUnreachable", EXIT_ERROR),  # ctl run/prepare reading s3:// data: no server answered
    ("ctl.render", "RenderError", EXIT_ERROR),
    ("ctl.pod", "PodSetupError", EXIT_ERROR),  # a pod ctl run cannot start here
    ("ctl.local", "RunDirInUse", EXIT_ERROR),  # another ctl run trains into the run directory
)


@contextlib.contextmanager
def mapped_errors() -> Iterator[None]:
    """ctl's errors -> their one line on stderr and their exit code (ERROR_EXITS); anything else is a bug."""
    try:
        yield
    except ModuleNotFoundError as exc:  # one of ddpjob's own dependencies (what a command may lack is checked first)
        raise fail(
            f"the Python module {exc.name!r} is missing: ddpjob's installation is incomplete (reinstall it: pip install"
            " ddpjob)",
            EXIT_ERROR,
        ) from None
    except Exception as exc:
        for module, name, code in ERROR_EXITS:
            error = getattr(sys.modules.get(module), name, None)
            if error is not None and isinstance(exc, error):
                raise fail(str(exc), code) from None
        raise


KubeconfigOpt = Annotated[
    str | None,
    typer.Option(
        "--kubeconfig", help="Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, in-cluster).", parser=given_file
    ),
]
ContextOpt = Annotated[str | None, typer.Option("--context", help="Kubeconfig context (default: the current one).")]
NamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "--namespace", "-n", help="Namespace (default: the context's).", show_default=False, parser=namespace_name
    ),
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


def command(cluster: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A command whose errors become exit codes (mapped_errors); with `cluster`, it takes CLUSTER_OPTIONS, given to
    it as its `cluster: Cluster` parameter. ctl.cli registers it."""

    def wrap(function: Callable[..., None]) -> Callable[..., None]:
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
        return run

    return wrap


def load_job(
    spec: Path, values: list[Path], set_values: list[str], set_files: list[str], cluster: bool = False
) -> JobSpec:
    """The validated spec (a SpecError: exit 2 with its one-line problem); `cluster`: for render and submit, also
    refused when the job would keep nothing there."""
    # Imported here: pydantic's import is most of `ctl --help`'s time otherwise.
    from ctl.spec import load_spec

    return load_spec(spec, set_values, set_files, values, cluster)


def note(message: str) -> None:
    """Progress for people: stderr, so that stdout stays data."""
    typer.echo(message, err=True)
