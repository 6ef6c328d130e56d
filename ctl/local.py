"""`ctl run`: a job's pods as local torchrun agents, each with the env its pod would get.

The training config is written to a temporary file standing in for the mounted
ConfigMap; agents run `python -m trainer.launch -m trainer --config FILE` (torchrun with
signal exit codes) exactly as a pod does.
When any agent fails, the others are stopped: no process outlives the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from ctl.operator_env import ELASTIC_ENV, SHUTDOWN_TIMEOUT_ENV, Replica, operator_env, replicas, shutdown_timeout
from ctl.spec import JobSpec
from trainer.spec import EXIT_HUNG, JOB_NAME_ENV, METRICS_DIR_ENV, METRICS_HOST_ENV, METRICS_PORT_ENV

LOCAL_ADDRESS = "127.0.0.1"
STOP_GRACE_SECONDS = 15
EXIT_BAD_INPUT = 2
# Set by the operator, torchrun or an outer launcher; a simulated pod must not inherit them.
LAUNCHER_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


@dataclass
class Agent:
    """One simulated pod: a torchrun agent process and where it records its failure."""

    node: int
    replica: Replica
    process: subprocess.Popen
    error_file: Path

    def failure(self) -> tuple[int, str]:
        """(exit code of the root cause, its message) from torchrun's error file."""
        code = self.process.returncode
        try:
            message = json.loads(self.error_file.read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            return code, f"exited with code {code}"
        if isinstance(message, dict):
            return int(message.get("errorCode", code)), str(message.get("message", "")).splitlines()[0]
        return code, str(message).splitlines()[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL_ADDRESS, 0))
        return sock.getsockname()[1]


def agent_env(
    spec: JobSpec, replica: Replica, port: int, error_file: Path, metrics_port: int, metrics_dir: Path
) -> dict[str, str]:
    """This process's env, less launcher variables, plus what the operator and the chart give the pod."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in LAUNCHER_VARIABLES}
    env |= operator_env(spec, replica, address=LOCAL_ADDRESS, port=port)
    if spec.elastic.enabled:
        env |= ELASTIC_ENV
    # The grace period a pod would have; one exported here (like a spec's `env` in a pod) wins.
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, shutdown_timeout(spec))
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    # The pod's metrics endpoint, on loopback: one port and one shared metrics directory per simulated pod.
    env |= {
        JOB_NAME_ENV: spec.name,
        METRICS_PORT_ENV: str(metrics_port),
        METRICS_HOST_ENV: LOCAL_ADDRESS,
        METRICS_DIR_ENV: str(metrics_dir),
    }
    # Share the machine's cores among all local processes instead of oversubscribing.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (spec.nodes * spec.procs_per_node))))
    return env


def pump(agent: Agent, out: TextIO, lock: threading.Lock) -> None:
    """Copy an agent's output line by line, prefixed with its node."""
    assert agent.process.stdout is not None
    for line in agent.process.stdout:
        with lock:
            out.write(f"[node {agent.node}] {line}")
            out.flush()


def parent_pid(pid: int | str) -> int | None:
    """The parent of process `pid`, from /proc; None once it has ended (or where there is no /proc)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


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


def stop(agents: list[Agent]) -> None:
    """SIGTERM every agent's process group (torchrun passes it on to its workers, which save and
    exit), then SIGKILL what is left after the grace period: the agents' groups and their workers,
    which torchrun starts in sessions of their own (killing an agent alone would orphan them)."""
    workers: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        workers |= descendants([agent.process.pid for agent in agents])
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, sig)
        if sig == signal.SIGKILL:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.process.wait(timeout=max(0.0, deadline - time.monotonic()))


def supervise(agents: list[Agent]) -> Agent | None:
    """Wait for all agents; return the first that failed (the others are then stopped).

    First in the order they exit: when one node fails, the others fail soon after, on their
    next collective, and the first to exit is the cause.
    """
    exited: queue.Queue[Agent] = queue.Queue()

    def wait(agent: Agent) -> None:
        agent.process.wait()
        exited.put(agent)

    for agent in agents:
        threading.Thread(target=wait, args=(agent,), daemon=True).start()
    for _ in agents:
        agent = exited.get()  # Ctrl-C interrupts the wait (KeyboardInterrupt)
        if agent.process.returncode != 0:
            stop(agents)
            return agent
    return None


def run_local(spec: JobSpec, run_dir: Path, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the job on this machine; returns the exit code for `ctl run`."""
    training = spec.training.to_values()
    training["checkpoint"]["dir"] = str(run_dir)
    port = free_port()
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="ddpjob-") as tmp:
        config = Path(tmp) / "training.yaml"
        config.write_text(yaml.safe_dump(training, sort_keys=False), encoding="utf-8")
        agents: list[Agent] = []
        for node, replica in enumerate(replicas(spec)):
            pod = replica.pod_name(spec.name)
            error_file = Path(tmp) / f"error-{pod}.json"
            metrics_port = free_port()
            process = subprocess.Popen(
                [sys.executable, "-m", "trainer.launch", "-m", "trainer", "--config", str(config)],
                env=agent_env(spec, replica, port, error_file, metrics_port, Path(tmp) / f"metrics-{pod}"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own process group, so stop() reaches its workers too
            )
            agents.append(Agent(node, replica, process, error_file))
            print(f"ctl: metrics of node {node} at http://{LOCAL_ADDRESS}:{metrics_port}/metrics", file=err)
        print(
            f"ctl: started {len(agents)} node(s) x {spec.procs_per_node} process(es); run directory {run_dir}",
            file=err,
        )
        pumps = [threading.Thread(target=pump, args=(a, out, lock), daemon=True) for a in agents]
        for thread in pumps:
            thread.start()
        try:
            failed = supervise(agents)
        except KeyboardInterrupt:
            stop(agents)
            print(
                "ctl: interrupted; stopped all nodes (run the same command to resume from the last checkpoint)",
                file=err,
            )
            return 130
        finally:
            for thread in pumps:
                thread.join(timeout=5)
        if failed is None:
            return 0
        code, message = failed.failure()
        if code == EXIT_HUNG:  # the watchdog's report names the ranks behind; a rerun resumes, as a pod restart would
            print(
                f"ctl: the job hung (exit code {EXIT_HUNG}, retryable); rerun the same command to resume from the"
                f" last checkpoint: {message}",
                file=err,
            )
            return 1
        print(f"ctl: node {failed.node} ({failed.replica.pod_name(spec.name)}) failed: {message}", file=err)
        return EXIT_BAD_INPUT if code == EXIT_BAD_INPUT else 1
