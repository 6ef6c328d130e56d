"""The `ctl` command (Typer): its commands (ctl/commands/: each parses, delegates, maps errors to exit codes),
shell completion, and Click's usage errors as one line.

Exit codes: 0 ok, 1 error, 2 usage or bad input; for a job's outcome (`wait`, `submit --wait/--follow`)
100 failed, 101 not finished (timeout); 102 no such job (any command that names one); `run` stopped after
saving: 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from ctl.commands import jobs, local
from ctl.commands.common import command, fail
from trainer.names import EXIT_BAD_INPUT

EXIT_CODES = (
    "Exit codes: 0 ok, 1 error, 2 usage or bad input; job outcomes (wait, submit --wait/--follow):"
    " 100 failed, 101 not finished; 102 no such job (any command naming one); run stopped after saving:"
    " 130 Ctrl-C, 143 SIGTERM."
)

app = typer.Typer(
    name="ctl",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help, as kubectl's; and rich's import would double `ctl --help`'s time
    context_settings={"help_option_names": ["-h", "--help"]},  # kubectl's and helm's -h too
)


def version_text() -> str:
    """ddpjob's installed version and the chart `ctl` renders with (a source checkout's, $DDPJOB_CHART's or the
    install's): what a bug report needs, as `kubectl version` and `helm version` print theirs."""
    from importlib.metadata import PackageNotFoundError, version

    import yaml

    from ctl.render import RenderError, chart_path

    try:
        installed = version("ddpjob")
    except PackageNotFoundError:
        installed = "(not installed)"
    try:
        path = chart_path()
        chart = yaml.safe_load((path / "Chart.yaml").read_text(encoding="utf-8"))
        rendered = f"chart {chart['name']}-{chart['version']} (appVersion {chart['appVersion']}) at {path}"
    except RenderError as exc:
        rendered = f"chart: {exc}"
    return f"ddpjob {installed}\n{rendered}"


def show_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def cli(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print ddpjob's version and its chart's, then exit.", callback=show_version),
    ] = False,
) -> None:
    """Train GPT-2-style models with PyTorch DDP: locally, or as a Kubeflow PyTorchJob or TrainJob."""


# Set by a completion script when it asks `ctl` for the candidates of the word being typed.
COMPLETE_VAR = "_CTL_COMPLETE"
SHELLS = ("bash", "zsh", "fish")


@command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh or fish.", show_default=False)],
) -> None:
    """Print the shell completion script for commands and options, as kubectl and helm do.

    bash: `source <(ctl completion bash)` in ~/.bashrc; zsh: `source <(ctl completion zsh)` in ~/.zshrc,
    after compinit; fish: `ctl completion fish > ~/.config/fish/completions/ctl.fish`.
    """
    if shell not in SHELLS:
        raise fail(f"completion {shell!r}: expected bash, zsh or fish")
    from typer.completion import get_completion_script

    typer.echo(get_completion_script(prog_name="ctl", complete_var=COMPLETE_VAR, shell=shell))


# Every command by its name, in the order `ctl --help` lists them.
COMMANDS: dict[str, Callable[..., None]] = {
    "run": local.run,
    "prepare": local.prepare,
    "render": local.render,
    "submit": jobs.submit,
    "wait": jobs.wait_command,
    "status": jobs.status,
    "list": jobs.list_command,
    "logs": jobs.logs,
    "suspend": jobs.suspend,
    "resume": jobs.resume,
    "delete": jobs.delete,
    "completion": completion,
}
for name, function in COMMANDS.items():
    app.command(name)(function)


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
        # An option that lacks its value fails before its command has a context: the command is the first word.
        named = sys.argv[1:2] if sys.argv[1:2] and sys.argv[1] in COMMANDS else []
        command = exc.ctx.command_path if exc.ctx else " ".join(["ctl", *named])
        typer.echo(f"error: {command}: {exc.format_message().rstrip('.')} (see '{command} --help')", err=True)
        code = EXIT_BAD_INPUT
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        code = exc.exit_code
    except typer.Abort:
        typer.echo("aborted", err=True)
        code = 1
    sys.exit(code or 0)
