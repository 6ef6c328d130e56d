"""The cyclic garbage collector at a process's start: paused while torch (and transformers, for the tasks that
use it) import, then every object they created kept out of its passes.

Importing torch and transformers' GPT-2 creates about 650,000 objects (measured when the trainer imported both at
its start), nearly all of them alive for the whole process (about 10,000 in garbage cycles). Left to itself, the
collector passes over that heap again and again for nothing, while it grows and afterwards: about 1 s of the
trainer's CPU to its first step, 0.2 s of torchrun's agent's (docs/performance.md). An entry module calls
`gc.disable()` before its imports and `resume_collection()` after them; a later heavy import runs in `importing()`.
This module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager

# The interpreter's last collection at exit sees everything again: extension modules that check for leaked objects
# at exit (nanobind's, in triton) then find none. Once, however often `freeze` runs (a no-op if it never did).
atexit.register(gc.unfreeze)


def resume_collection() -> None:
    """Everything alive now stays out of later collections; the collector runs again for what comes next."""
    freeze()
    gc.enable()


def freeze() -> None:
    """Keep every object alive now out of later collections, until the process exits."""
    gc.freeze()


@contextmanager
def importing() -> Iterator[None]:
    """A heavy import after the start (transformers, imported only by the tasks that use it): the collector paused
    while it runs, then one pass over what it created, and what lives frozen, as for the entry modules' imports."""
    if not gc.isenabled():  # inside an entry module's imports, or another `importing`
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        # Its garbage first: a model load's cycles may hold tensors, which frozen would stay for good. One pass over
        # what came since the last freeze (0.17 s after transformers' import and a model load), not the whole heap.
        gc.collect()
        resume_collection()
