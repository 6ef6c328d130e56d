"""Ending a process that imported torch without tearing its interpreter down.

A normal exit clears every module and runs the garbage collector over the objects of torch,
transformers and what they import: about a second of CPU per process once the work is done, in
every rank and in the launcher, paid by every job on every start. `quick_exit` does the first
steps of a normal exit, those anyone could notice, in the interpreter's order: threading's own
shutdown (its exit callbacks, which stop executors such as torch.compile's worker pool, then the
join of every non-daemon thread), the exit handlers, a flush of the output. Then it skips the
teardown, as `os._exit` does.

It also gives a process a last word: a line written after all of that, so that nothing a library's
thread logs while the process ends (torch's TCPStore server warns about every peer it cannot name)
comes after it. A pod's last log line is its termination message, the root cause `ctl` shows.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int, last_line: str | None = None) -> NoReturn:
    """From the main thread; `last_line` goes to stderr just before the process ends."""
    # What the interpreter calls first at exit; joining the threads alone would wait forever for an executor's.
    threading._shutdown()  # type: ignore[attr-defined]
    # The handlers libraries registered (logging, trackers, prometheus_client, torch): the same as at a normal exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if last_line is not None:
        # Both streams silenced first (what a thread writes from here on is lost), the line on a copy of stderr.
        stderr = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        line = memoryview(f"{last_line}\n".encode())
        while line:
            line = line[os.write(stderr, line) :]
    os._exit(code)
