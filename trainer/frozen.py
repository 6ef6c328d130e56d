"""Frozen ranks, found by their own node's launcher.

The watchdog (trainer.watchdog) finds a hang from inside the ranks: every rank whose threads still
run exits EXIT_HUNG, and the operator's restartPolicy ExitCode recreates their pods. A rank whose
whole process is stopped or frozen (SIGSTOP, stuck in the kernel) runs nothing, watchdog included:
its pod would never exit, the recreated pods would wait for it at the rendezvous, and the job would
hang for good. So each rank's watchdog thread also leaves a heartbeat file on its node, and the
launcher (trainer.launch) kills a rank of its own whose heartbeat is older than the rank's hang limit
plus a few polls, after the other ranks' watchdogs have had their turn, and reports it as hung.
Torch-free, like the launcher's other helpers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer import scratch
from trainer.failures import Failure
from trainer.names import EXIT_HUNG, HEARTBEAT_DIR_ENV

# Polls past the rank's hang limit before its launcher acts: the others' watchdogs report first (they find the
# hang at the limit and exit two polls later), with the better report, naming every rank behind. Those held to a
# longer limit meanwhile (longWorkSeconds) exit hung when their collective with the killed rank fails (its heartbeat
# in the store is stale: trainer.watchdog).
MARGIN_POLLS = 4
CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class Beat:
    """What a rank's watchdog last said of itself; the file's modification time says when."""

    pid: int
    rank: int
    step: int  # the last completed step
    limit: float  # seconds without progress that mean a hang, now
    why: str  # why that many
    poll: float  # seconds between beats


def beat_path(directory: Path, pid: int) -> Path:
    return directory / f"{pid}.json"


def write_beat(directory: Path, beat: Beat) -> None:
    """Replaced atomically: the launcher never reads half a beat."""
    staging = directory / f".{beat.pid}.tmp"
    staging.write_text(json.dumps(asdict(beat)), encoding="utf-8")
    os.replace(staging, beat_path(directory, beat.pid))


def parent_pid(pid: int | str) -> int | None:
    """The parent of process `pid`, from /proc; None once it has ended (or where there is no /proc)."""
    try:  # after the command name, which may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class FrozenRanks:
    """The launcher's watch over its ranks' heartbeats, from `start()` until the process ends."""

    def __init__(self) -> None:
        self.directory = scratch.make(scratch.HEARTBEATS)
        self.found: list[Failure] = []  # the ranks it killed, as hangs
        self.grace = 0.0  # seconds to stay up once it has killed one

    def start(self) -> FrozenRanks:
        os.environ[HEARTBEAT_DIR_ENV] = str(self.directory)  # the workers torchrun starts inherit it
        threading.Thread(target=self.watch, name="ddpjob-frozen-ranks", daemon=True).start()
        return self

    def watch(self) -> None:
        while True:
            time.sleep(CHECK_SECONDS)
            self.check()

    def check(self) -> None:
        for path in self.directory.glob("*.json"):
            try:
                beat = Beat(**json.loads(path.read_text(encoding="utf-8")))
                age = time.time() - path.stat().st_mtime
            except (OSError, ValueError, TypeError):
                continue  # removed meanwhile (the rank's watchdog ended)
            if age <= beat.limit + MARGIN_POLLS * beat.poll:
                continue
            # Only a worker of this launcher: one that ended without removing its beat (killed for an elastic
            # restart) may have left its pid to another process.
            if parent_pid(beat.pid) == os.getpid():
                self.kill(beat, age)
            path.unlink(missing_ok=True)

    def kill(self, beat: Beat, age: float) -> None:
        report = (
            # The beat is written once a poll: its step may be a few behind the rank's last.
            f"hang: rank {beat.rank} stopped responding (no heartbeat for {age:.0f} s, the last after step {beat.step};"
            f" limit {beat.limit:.0f} s: {beat.why}): process stopped or frozen; its node's launcher killed it"
        )
        print(f"[rank {beat.rank}] {report}", file=sys.stderr, flush=True)
        self.found.append(Failure(EXIT_HUNG, report, time.time(), beat.rank))
        self.grace = max(self.grace, MARGIN_POLLS * beat.poll)
        with contextlib.suppress(ProcessLookupError):
            os.kill(beat.pid, signal.SIGKILL)

    def linger(self) -> None:
        """After a kill, before the launcher exits: node 0's torchrun agent serves the rendezvous store until this
        process ends (the failed run's frames hold it), and the other ranks learn of the hang there (trainer.watchdog):
        those whose collective with the killed rank failed read its stale heartbeat at once; those waiting where the
        kill does not reach read the report of the rank that watches it, written up to a poll after the kill."""
        time.sleep(self.grace)
