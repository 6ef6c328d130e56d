"""The `ctl` command (Typer). Thin: each command parses, delegates, maps errors to exit codes.

Exit codes: 0 ok, 1 error, 2 usage or bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

if TYPE_CHECKING:
    from ctl.spec import JobSpec

EXIT_BAD_INPUT = 2

app = typer.Typer(
    name="ctl",
    help="Train GPT-2-style models with PyTorch DDP: locally, or as a Kubeflow PyTorchJob.",
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


@app.callback()
def cli() -> None:
    """Train GPT-2-style models with PyTorch DDP: locally, or as a Kubeflow PyTorchJob."""


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
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory (default: ./runs/<name>).", show_default=False)
    ] = None,
) -> None:
    """Run the job on this machine: one torchrun agent per node, with the operator's env."""
    job = load_job(spec, set_values)
    from ctl.local import run_local  # starts processes; kept out of `ctl --help`'s import time

    directory = (run_dir or Path(job.training.checkpoint.dir or Path("runs") / job.name)).absolute()
    code = run_local(job, directory)
    raise typer.Exit(code)


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

    try:
        manifests = render_spec(job)
    except RenderError as exc:
        raise fail(str(exc), code=1) from None
    typer.echo(to_json(manifests) if fmt == "json" else to_yaml(manifests), nl=False)


def main() -> None:
    app()
