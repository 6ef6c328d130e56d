"""Which failure to tell, in one line: the root cause among the ranks (or nodes) of a run that failed.

When one rank fails, the others fail soon after in their next collective ("Connection closed by
peer"), and may exit first. Neither the order of exits nor torchrun's own pick (the earliest
timestamp, in whole seconds) finds the cause reliably. This order does, for the launcher
(trainer.launch, among a node's ranks) and for `ctl run` (among the nodes) alike:

1. bad input (exit code 2) on any rank: its one line names the key;
2. a rank's own error (an exception, an exit code below 128), earliest first;
3. a hang found by a rank's watchdog (EXIT_HUNG): the ranks torchrun kills after it are its consequences;
4. a process ended by a signal other than the stopping ones (a crash, the OOM killer, a teardown);
5. a stop (SIGTERM or SIGINT after saving, exit 143 or 130): the run is resumable;
6. a lost connection to a peer: the consequence of another process's failure.

Records are torchelastic error files (what `@record` writes per rank and torchrun copies for the
node), with the exit code, rank, exact time and log directory added. Torch-free: `ctl` imports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_HUNG, EXIT_INTERRUPTED, EXIT_PREEMPTED

# How Python's report of an uncaught exception begins.
TRACEBACK = "Traceback (most recent call last)"
# What gloo, NCCL and the rendezvous store say when the other end of a connection has gone.
PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited", "ncclRemoteError")


def first_line(what: str | BaseException, fallback: str = "") -> str:
    """The first line of a message (of an exception: its text) that has anything on it, stripped: what a one-line
    cause quotes of a longer one. Without one: `fallback`, else an exception's type name."""
    line = next((line.strip() for line in str(what).splitlines() if line.strip()), "")
    return line or fallback or (type(what).__name__ if isinstance(what, BaseException) else "")


class Kind(IntEnum):
    """What a failure is, in the order in which it is the root cause."""

    BAD_INPUT = 0
    ERROR = 1
    HUNG = 2
    KILLED = 3
    STOPPED = 4
    PEER_LOST = 5


@dataclass(frozen=True)
class Failure:
    """One process's failure."""

    code: int  # its exit code; 128 + N when signal N ended it
    message: str  # one line
    time: float  # when it failed (seconds since the epoch, to the file system's precision)
    rank: int | None = None  # the global rank, when a trainer process failed
    log: str | None = None  # the directory holding its output and traceback
    # Every rank failed so at the same step (a non-finite loss, summed over the ranks): the job's failure, told
    # without naming a rank or a node.
    everywhere: bool = False
    traceback: bool = False  # its log ends with a Python traceback (an exception `@record` saw), not one line only

    @property
    def kind(self) -> Kind:
        if self.code == EXIT_BAD_INPUT:
            return Kind.BAD_INPUT
        if self.code in (EXIT_INTERRUPTED, EXIT_PREEMPTED):
            return Kind.STOPPED
        if self.code == EXIT_HUNG:
            return Kind.HUNG
        if any(text in self.message for text in PEER_LOST):
            return Kind.PEER_LOST
        return Kind.KILLED if self.code > 128 else Kind.ERROR

    @property
    def exit_code(self) -> int:
        """What the launcher and `ctl run` exit with when this failure is the root cause."""
        return {Kind.BAD_INPUT: EXIT_BAD_INPUT, Kind.HUNG: EXIT_HUNG, Kind.STOPPED: EXIT_PREEMPTED}.get(
            self.kind, EXIT_ERROR
        )


def root_cause(failures: Iterable[Failure]) -> Failure:
    """The failure to report: the first kind in the order above, then the earliest."""
    return min(failures, key=lambda failure: (failure.kind, failure.time))


def write_record(path: Path, failure: Failure) -> None:
    """`failure` as a torchelastic error file (replaced atomically: a reader never sees half of it)."""
    extra = {"py_callstack": failure.message, "timestamp": str(int(failure.time)), "time": repr(failure.time)}
    if failure.rank is not None:
        extra["rank"] = str(failure.rank)
    if failure.log:
        extra["log"] = failure.log
    if failure.everywhere:
        extra["everywhere"] = "true"
    if failure.traceback:
        extra["traceback"] = "true"
    staging = path.with_name(f".{path.name}.tmp")
    record = {"message": failure.message, "errorCode": failure.code, "extraInfo": extra}
    staging.write_text(json.dumps({"message": record}), encoding="utf-8")
    os.replace(staging, path)


def read_record(path: Path, code: int) -> Failure | None:
    """The failure recorded in error file `path` (None when there is none); `code`: the exit code of the
    process that wrote it, for records that carry none (those of `@record` itself)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        written = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):  # torchelastic's older, flat form
        text, extra = message, {}
    elif isinstance(message, dict):
        text, extra = str(message.get("message", "")), message.get("extraInfo") or {}
        code = int(message.get("errorCode") or code)
    else:
        return None
    rank = extra.get("rank")
    return Failure(
        code=code,
        message=first_line(text, f"exited with code {code}"),
        time=float(extra.get("time", written)),  # a rank's own record: when it wrote it
        rank=None if rank is None else int(rank),
        log=extra.get("log"),
        everywhere=extra.get("everywhere") == "true",
        # `@record`'s own record keeps the traceback in py_callstack; a relayed one says it has one.
        traceback=extra.get("traceback") == "true" or str(extra.get("py_callstack", "")).startswith(TRACEBACK),
    )
