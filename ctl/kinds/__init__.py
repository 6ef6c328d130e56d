"""The job kinds: one module each behind the JobKind interface (ctl/kinds/base.py). Nothing here imports the rest
of ctl."""

from __future__ import annotations

from typing import Any

from ctl.kinds.base import JobKind, Replica, State
from ctl.kinds.pytorchjob import PYTORCHJOB
from ctl.kinds.trainjob import TRAINJOB

# In the order a job's name is looked up in (PyTorchJob, the default kind, first).
KINDS: dict[str, JobKind] = {k.kind: k for k in (PYTORCHJOB, TRAINJOB)}
DEFAULT_KIND = PYTORCHJOB

__all__ = ["DEFAULT_KIND", "KINDS", "PYTORCHJOB", "TRAINJOB", "JobKind", "Replica", "State", "kind_of"]


def kind_of(job: dict[str, Any]) -> JobKind:
    """The kind of a job object."""
    return KINDS[job["kind"]]
