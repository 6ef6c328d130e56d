"""Ending a process that imported torch without tearing its interpreter down.

A normal exit clears every module and runs the garbage collector over the objects of torch,
transformers and what they import: about a second of CPU per process once the work is done, in
every rank and in the launcher, paid by every job on every start. `quick_exit` does what a normal
exit does that anyone could notice (non-daemon threads finish, exit handlers run, output is
flushed) and skips the teardown, as `os._exit` does.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int) -> NoReturn:
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    # The handlers libraries registered (logging, trackers, prometheus_client, torch): the same as at a normal exit.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
