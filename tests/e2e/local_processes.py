"""Process helpers of the control plane: its processes on loopback, nothing left behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_GRACE_S = 10


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """preexec_fn: `signum` to the child when its parent dies, even by SIGKILL (Linux prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def terminate_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process group led by `process`, SIGKILL after `grace_s`; then SIGKILL to what is left of
    the group (members may outlive their leader)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def start_process(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def wait_until(check: Callable[[], bool], what: str, timeout_s: float, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what}: exited with {process.returncode}; its log {log}:\n{tail(log)}")
        try:
            if check():
                return
        except Exception:  # not up yet: connection refused, 5xx, TLS handshake during startup
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s; its log {log}:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""
