"""Ending a process that imported torch without tearing its interpreter down.

A normal exit clears every module and runs the garbage collector over the objects of torch,
transformers and what they import: about a second of CPU per process once the work is done, in
every rank and in the launcher, paid by every job on every start. `quick_exit` does the first
steps of a normal exit, those anyone could notice, in the interpreter's order: threading's own
shutdown (its exit callbacks, which stop executors such as torch.compile's worker pool, then the
join of every non-daemon thread), the exit handlers, a flush of the output. Then it skips the
teardown, as `os._exit` does.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int) -> NoReturn:
    """From the main thread."""
    # What the interpreter calls first at exit; joining the threads alone would wait forever for an executor's.
    threading._shutdown()  # type: ignore[attr-defined]
    # The handlers libraries registered (logging, trackers, prometheus_client, torch): the same as at a normal exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
