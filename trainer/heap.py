"""The cyclic garbage collector at a process's start: paused while torch and transformers import, then every
object they created kept out of its passes.

Importing the trainer (torch, transformers' GPT-2) creates about 650,000 objects, nearly all of them alive for
the whole process (about 10,000 in garbage cycles). Left to itself, the collector passes over that heap again and
again for nothing, while it grows and afterwards: about 1 s of the trainer's CPU to its first step, 0.2 s of
torchrun's agent's (docs/performance.md). An entry module calls `gc.disable()` before its imports and
`resume_collection()` after them; this module imports nothing heavy.
"""

from __future__ import annotations

import atexit
import gc

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
