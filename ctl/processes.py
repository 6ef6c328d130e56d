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


class Hurried(Exception):
    """Raised by a signal handler while `stop` waits out the grace period: kill the processes now."""


def stop(processes: list[subprocess.Popen], grace: float = STOP_GRACE_SECONDS) -> bool:
    """SIGTERM every process's group (torchrun passes it on to its workers, which save and exit), then SIGKILL
    what is left after `grace` seconds, or at once when Hurried: the groups and their workers, which torchrun starts
    in sessions of their own (killing an agent alone would orphan them). Whether it was hurried."""
    workers: set[int] = set()
    hurried = False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        workers |= descendants([process.pid for process in processes])
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        if sig == signal.SIGKILL:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else STOP_GRACE_SECONDS)
        try:
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except Hurried:
            hurried = True
    return hurried


def join(threads: list[threading.Thread]) -> None:
    """Let the output threads print what is left (an agent's children may keep a pipe open: not forever)."""
    for thread in threads:
        if thread.ident is not None:
            thread.join(timeout=5)
