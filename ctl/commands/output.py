"""What the job commands print: data on stdout in a stable shape or as a table, a job's log lines (prefixed and
coloured by pod with --all), and a quiet end on Ctrl-C or a closed pipe."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import typer

from ctl.commands.common import fail, mapped_errors, note

if TYPE_CHECKING:
    from ctl.cluster import Target
    from ctl.logs import LogOptions

PREFIX_COLOURS = ("36", "35", "33", "32", "34", "31")  # ANSI: cyan, magenta, yellow, green, blue, red


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
    else:  # table (the flag's parser took nothing else)
        typer.echo(table())


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
        ranks = nodes * procs
        raise fail(f"--rank {rank}: the job has {'1 rank (0)' if ranks == 1 else f'{ranks} ranks (0-{ranks - 1})'}")
    return rank // procs
