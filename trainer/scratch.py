"""The launcher's scratch folders: its ranks' heartbeats (trainer.frozen), torchrun's error files and its ranks'
temporary directory.

They live in the temporary directory, which in a pod is the scratch volume: it outlives the container. The launcher
removes its own when it exits; one it was killed before (SIGKILL: the kubelet's or `ctl run`'s after the grace
period, a hung rank that cannot save; the OOM killer) ran no exit handler, so the next launcher on that directory
removes it. Each folder's launcher holds a lock on a file in it, which the kernel releases however the process ends:
a folder whose lock is free is abandoned. Torch-free, like the launcher's other helpers.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

from trainer.owned import OWNER, remove, remove_if_abandoned

HEARTBEATS = "ddpjob-heartbeats-"
TORCHRUN = "ddpjob-torchrun-"
RANKS = "ddpjob-ranks-"
PREFIXES = (HEARTBEATS, TORCHRUN, RANKS)  # what the sweep removes once abandoned
MADE: list[Path] = []  # this process's, removed at its exit


def make(prefix: str) -> Path:
    """A new folder in the temporary directory, this process's until it exits; before the first, the abandoned
    scratch folders (their launcher was killed) are removed."""
    if not MADE:
        with contextlib.suppress(OSError):  # tidying: never a reason for the launcher to fail
            remove_abandoned()
        atexit.register(remove_made)
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    MADE.append(directory)
    claim = directory / f"{OWNER}.tmp"
    owner = os.open(claim, os.O_WRONLY | os.O_CREAT, 0o600)  # not inherited: the workers torchrun starts never hold it
    with contextlib.suppress(OSError):  # a filesystem without locks: the folder is never taken for abandoned
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until this process ends: the descriptor stays open
        os.rename(claim, directory / OWNER)  # found by others only once locked, never between creation and lock
    return directory


def remove_made() -> None:
    """This process's folders; also where its exit handlers are skipped (trainer.launch's stop while starting)."""
    for directory in MADE:
        remove(directory)


def remove_abandoned() -> None:
    """Removes the scratch folders in the temporary directory whose owner file is not locked: their launcher is
    gone. One without an owner file (another program's, or being made) is left."""
    with os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            if entry.name.startswith(PREFIXES):
                remove_if_abandoned(Path(entry.path))
