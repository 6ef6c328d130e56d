"""Process helpers of the control plane: its processes on loopback, nothing left behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """preexec_fn: `signum` to the child when its parent dies, even by SIGKILL (Linux prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def terminate_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group led by `process`, SIGKILL after `grace_s`; then SIGKILL to what is left of
    the group (members may outlive their leader)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
