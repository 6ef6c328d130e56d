"""Folders that a live process owns: it holds a lock on the owner file inside, which the kernel releases however the
process ends, so a folder whose lock is free was left by a process that is gone and may be removed. The launcher's
scratch folders (trainer.scratch) and the dataset cache's staging directories (trainer.preparation.build). Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

OWNER = ".owner"  # the file whose lock its owner holds while it lives


def remove_if_abandoned(directory: Path, old: Callable[[int], bool] | None = None) -> bool:
    """Removes `directory` when its owner is gone: its owner file's lock is free and, where `old` is given, `old` of
    that file's descriptor holds too; on a filesystem without locks only `old` can tell, and without it the folder
    stays. One without an owner file (being made, or another program's) stays. Whether it was removed."""
    try:
        owner = os.open(directory / OWNER, os.O_RDWR)  # NFS grants an exclusive lock on a file open for writing only
    except OSError:
        return False
    try:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held meanwhile: another process's sweep skips it
        except BlockingIOError:  # held by its owner, alive
            return False
        except OSError:  # a filesystem without locks
            if old is None:
                return False
        return (old is None or old(owner)) and remove(directory)
    finally:
        os.close(owner)


def remove(directory: Path) -> bool:
    """Removes `directory`, its owner file last: while anything else in it stays (not this user's to remove), so
    does the owner file, and the next sweep tries again, where without it the folder would be taken for another
    program's and left for ever. Folders in it made read-only (a copy of a read-only tree) are made writable, as
    TemporaryDirectory's cleanup does. Whether it is gone."""
    for attempt in range(2):
        if attempt:
            make_writable(directory)
        with contextlib.suppress(OSError):
            with os.scandir(directory) as entries:
                for entry in list(entries):
                    if entry.name == OWNER:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
            if set(os.listdir(directory)) <= {OWNER}:
                (directory / OWNER).unlink(missing_ok=True)
                directory.rmdir()
                return True
    return not directory.exists()


def make_writable(top: Path) -> None:
    """The folders under `top` that their owner, this user, made read-only or unlistable. Symbolic links are left:
    chmod would change their target."""
    with contextlib.suppress(OSError):
        os.chmod(top, 0o700)
    for folder, subfolders, _ in os.walk(top):  # top-down: each folder is changed before it is listed
        for name in subfolders:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
