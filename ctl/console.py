"""`ctl run`'s terminal: the trainers' lines as they come, ctl's own notes, and each agent's torchrun output."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import TextIO

from trainer.names import WARNING_PREFIX

# torchrun's prefix of every rank's line it shows (ranks are global, nodes may be several).
LINE_PREFIX = "[rank ${rank}] "
# A rank's warning line as torchrun shows it: "[rank 3] warning: ...".
WARNING_LINE = re.compile(re.escape(LINE_PREFIX).replace(re.escape("${rank}"), r"\d+") + re.escape(WARNING_PREFIX))


class Console:
    """The terminal: trainers' lines on stdout as they come, ctl's on stderr. ctl's start-up notes are held
    until the first trainer line, so that a run that fails before training prints its one line and nothing else."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err
        self.held: list[str] = []
        self.lock = threading.Lock()
        self.gone = False  # the terminal closed: lines are dropped, and the agents' pipes still read

    def release(self) -> None:
        """Print the held notes (once)."""
        with self.lock:
            for note in self.held:
                self.write(self.err, note + "\n")
            self.held = []

    def trainer_line(self, line: str, stream: TextIO | None = None) -> None:
        self.release()
        with self.lock:
            self.write(stream or self.out, line)

    def note(self, message: str) -> None:
        with self.lock:
            self.write(self.err, message + "\n")

    def write(self, stream: TextIO, text: str) -> None:
        """Write and flush, under the lock; once a write fails (a closed terminal: EIO, a closed pipe), no more: the
        pumps go on reading the agents' output, or the trainers would block on a full pipe while they save."""
        if self.gone:
            return
        try:
            stream.write(text)
            stream.flush()
        except OSError:
            self.gone = True


def pump_stdout(process: subprocess.Popen, console: Console) -> None:
    """An agent's stdout: the ranks' lines torchrun shows (prefixed with their rank)."""
    assert process.stdout is not None
    for line in process.stdout:
        console.trainer_line(line)


def pump_stderr(process: subprocess.Popen, node: int, log: Path, console: Console, verbose: bool) -> None:
    """An agent's stderr (torchrun's own messages and reports, and the stderr of the ranks it shows) into the node's
    log; to the terminal the trainers' warning lines, or with --verbose every line."""
    assert process.stderr is not None
    with log.open("w", encoding="utf-8") as file:
        for line in process.stderr:
            file.write(line)
            file.flush()
            if verbose:
                console.trainer_line(f"[node {node}] {line}", console.err)
            elif WARNING_LINE.match(line):
                console.trainer_line(line, console.err)
