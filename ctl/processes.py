"""Processes of a local run: free ports, and stopping whole process trees (torchrun starts its workers in sessions
of their own, so a process group alone does not reach them)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from trainer.frozen import parent_pid

LOCAL_ADDRESS = "127.0.0.1"
PORTS_FROM = 20000  # free_port's lowest: above the ports services are usually configured on
STOP_GRACE_SECONDS = 15  # after a node failed: the others have nothing to save
# The ports free_port has given: free until their servers bind them (a run's rendezvous, then its metrics), so never
# given twice by one process.
GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port nothing uses now, below the kernel's range for outgoing connections: one picked from that range can be
    taken, before its server binds it, as the local end of a connection (gloo's, the store's): EADDRINUSE."""
    low = ephemeral_ports_start()
    for port in random.sample(range(PORTS_FROM, low), min(64, max(low - PORTS_FROM, 0))):
        with socket.socket() as sock, contextlib.suppress(OSError):
            if port not in GIVEN_PORTS:
                sock.bind((LOCAL_ADDRESS, port))
                GIVEN_PORTS.add(port)
                return port
    while True:  # no such range here: the kernel's pick, which can be a port it gave before
        with socket.socket() as sock:
            sock.bind((LOCAL_ADDRESS, 0))
            if (port := sock.getsockname()[1]) not in GIVEN_PORTS:
                GIVEN_PORTS.add(port)
                return port


def ephemeral_ports_start() -> int:
    """The first port the kernel gives outgoing connections (Linux's default where /proc does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def descendants(pids: list[int]) -> set[int]:
    """Every process below `pids`, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (parent := parent_pid(entry.name)) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    pending = list(pids)
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def stop(
    processes: list[subprocess.Popen], grace: float = STOP_GRACE_SECONDS, hurry: threading.Event | None = None
) -> str | None:
    """SIGTERM every process's group (torchrun passes it on to its workers, which save and exit), then SIGKILL
    what is left after `grace` seconds, or once `hurry` is set (a second signal's handler sets it): the groups and
    their workers, which torchrun starts in sessions of their own (killing an agent alone would orphan them). Why
    some were killed, "grace" or "hurried"; None when all had ended by themselves."""
    # Each with its start time: the grace period may be long enough for an ended worker's pid to be reused.
    workers = {pid: started_at(pid) for pid in descendants([process.pid for process in processes])}
    signal_groups(processes, signal.SIGTERM)
    killed = None
    deadline = time.monotonic() + grace
    while any(process.poll() is None for process in processes):
        if hurry is not None and hurry.is_set():
            killed = "hurried"
            break
        if time.monotonic() >= deadline:
            killed = "grace"
            break
        time.sleep(0.1)
    workers |= {pid: started_at(pid) for pid in descendants([process.pid for process in processes])}
    signal_groups(processes, signal.SIGKILL)
    for pid, start in workers.items():  # those that outlived their agent too
        if start is not None and started_at(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    return killed


def started_at(pid: int) -> str | None:
    """When process `pid` started (/proc/PID/stat's 22nd field, in clock ticks since boot); None once it has ended."""
    try:  # after the command name, which may hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def signal_groups(processes: list[subprocess.Popen], sig: signal.Signals) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def join(threads: list[threading.Thread]) -> None:
    """Let the output threads print what is left (an agent's children may keep a pipe open: not forever)."""
    for thread in threads:
        if thread.ident is not None:
            thread.join(timeout=5)
