"""`ctl run`: a job's pods as local torchrun agents, each with the env its pod would get.

The training config is written to a temporary file standing in for the mounted
ConfigMap; agents run `python -m trainer.launch -m trainer --config FILE` (torchrun with
signal exit codes) exactly as a pod does.
When any agent fails, the others are stopped: no process outlives the run.

The terminal gets rank 0's progress (its stdout) and one line for the outcome: bad input's line
(exit 2), the root cause of a failure (exit 1), or where a stopped run can resume (143 for SIGTERM,
130 for Ctrl-C). Every rank's output and torchrun's own go to log files (torchrun's `--log-dir`
layout), moved into the run directory's `logs/` at the end; `--verbose` also streams them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import queue
import re
import shutil
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

from ctl.operator_env import (
    ELASTIC_ENV,
    SHUTDOWN_TIMEOUT_ENV,
    TRAINJOB_ENV,
    Replica,
    operator_env,
    replicas,
    shutdown_timeout,
)
from ctl.spec import JobSpec
from trainer.failures import Failure, Kind, read_record, root_cause
from trainer.names import (
    CHECKPOINT_NAME,
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    JOB_NAME_ENV,
    LATEST_CHECKPOINT,
    METRICS_DIR_ENV,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
)

LOCAL_ADDRESS = "127.0.0.1"
STOP_GRACE_SECONDS = 15
# After one node fails, how long the others may take to fail by themselves: their own error may be the
# root cause (rank 0's bad input while rank 1 lost its connection to it and exited first).
FAILURE_GRACE_SECONDS = 5
LOGS = "logs"  # in the run directory: one folder per `ctl run`, named by its start time
# torchrun's prefix of every rank's line it shows (ranks are global, nodes may be several).
LINE_PREFIX = "[rank ${rank}] "
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


class Terminated(Exception):
    """ctl got SIGTERM: the run stops as on Ctrl-C."""


def terminate(signum: int, frame: object) -> None:
    raise Terminated


@dataclass
class Agent:
    """One simulated pod: a torchrun agent process and where it records its failure."""

    node: int
    replica: Replica
    process: subprocess.Popen
    error_file: Path
    ended: float = 0.0  # when it exited (time.time())

    def failure(self) -> Failure:
        """Its node's root cause, as trainer.launch (or torchrun) recorded it."""
        code = self.process.returncode
        code = code if code >= 0 else 128 - code
        return read_record(self.error_file, code) or Failure(code, f"exited with code {code}", self.ended)


def missing_trainer_requirements() -> list[str]:
    """The distributions of ddpjob's `train` extra that are not installed (`pip install ddpjob` leaves them out).

    Read from ddpjob's own installed metadata, so pyproject.toml stays the one list; none when ddpjob is
    not installed as a distribution (a source tree on PYTHONPATH), where the trainer reports its own import error.
    """
    try:
        requirements = importlib.metadata.requires("ddpjob") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        if re.search(r"""extra\s*==\s*['"]train['"]""", requirement):
            name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
            try:
                importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(name)
    return missing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL_ADDRESS, 0))
        return sock.getsockname()[1]


def agent_env(
    spec: JobSpec,
    replica: Replica,
    port: int,
    error_file: Path,
    metrics_port: int,
    metrics_dir: Path,
    log_dir: Path,
    verbose: bool,
) -> dict[str, str]:
    """This process's env, less launcher variables, plus what the operator and the chart give the pod."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in LAUNCHER_VARIABLES}
    env |= operator_env(spec, replica, address=LOCAL_ADDRESS, port=port)
    if spec.elastic.enabled:
        env |= ELASTIC_ENV
    if spec.api_kind == "TrainJob":
        env |= TRAINJOB_ENV
    # The grace period a pod would have; one exported here (like a spec's `env` in a pod) wins.
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, shutdown_timeout(spec))
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    # torchrun's flags as variables: every rank's stdout and stderr into files, and their error records
    # next to them; the terminal gets local rank 0's stdout (rank 0's progress), or with --verbose everything.
    env |= {"PET_LOG_DIR": str(log_dir), "PET_REDIRECTS": "3", "PET_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX}
    env |= {"PET_TEE": "3"} if verbose else {"PET_TEE": "1", "PET_LOCAL_RANKS_FILTER": "0"}
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


class Console:
    """The terminal: trainers' lines on stdout as they come, ctl's on stderr. ctl's start-up notes are held
    until the first trainer line, so that a run that fails before training prints its one line and nothing else."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err
        self.held: list[str] = []
        self.lock = threading.Lock()

    def release(self) -> None:
        """Print the held notes (once)."""
        with self.lock:
            for note in self.held:
                print(note, file=self.err, flush=True)
            self.held = []

    def trainer_line(self, line: str, stream: TextIO | None = None) -> None:
        self.release()
        with self.lock:
            (stream or self.out).write(line)
            (stream or self.out).flush()

    def note(self, message: str) -> None:
        with self.lock:
            print(message, file=self.err, flush=True)


def pump_stdout(agent: Agent, console: Console) -> None:
    """The agent's stdout: the ranks' lines torchrun shows (prefixed with their rank)."""
    assert agent.process.stdout is not None
    for line in agent.process.stdout:
        console.trainer_line(line)


def pump_stderr(agent: Agent, log: Path, console: Console | None) -> None:
    """The agent's stderr (torchrun's own messages and reports) into the node's log; to the terminal with --verbose."""
    assert agent.process.stderr is not None
    with log.open("w", encoding="utf-8") as file:
        for line in agent.process.stderr:
            file.write(line)
            file.flush()
            if console is not None:
                console.trainer_line(f"[node {agent.node}] {line}", console.err)


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


def supervise(agents: list[Agent]) -> list[Agent]:
    """Wait for all agents; return those that failed by themselves (every other is then stopped).

    After the first failure the others get FAILURE_GRACE_SECONDS to end: when one node fails, the
    others fail soon after, on their next collective, and the first to exit need not be the cause.
    """
    exited: queue.Queue[Agent] = queue.Queue()

    def wait(agent: Agent) -> None:
        agent.process.wait()
        agent.ended = time.time()
        exited.put(agent)

    for agent in agents:
        threading.Thread(target=wait, args=(agent,), daemon=True).start()
    failed: list[Agent] = []
    deadline: float | None = None
    for _ in agents:
        try:  # Ctrl-C and SIGTERM interrupt the wait (KeyboardInterrupt, Terminated)
            agent = exited.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if agent.process.returncode != 0:
            failed.append(agent)
            deadline = deadline or time.monotonic() + FAILURE_GRACE_SECONDS
    if failed:
        stop(agents)
    return failed


def saved_step(run_dir: Path) -> int | None:
    """The step of the run directory's newest complete checkpoint; None before the first."""
    with contextlib.suppress(OSError):
        if match := CHECKPOINT_NAME.fullmatch((run_dir / LATEST_CHECKPOINT).read_text(encoding="utf-8").strip()):
            return int(match.group(1))
    return None


def stopped(run_dir: Path, how: str) -> str:
    """ctl's line for a run that stopped after saving: where the next run resumes."""
    step = saved_step(run_dir)
    if step is None:
        return f"ctl: {how}: stopped before the first checkpoint; the next run starts from the beginning"
    return f"ctl: {how}: stopped at step {step}, resumable: run the same command to continue from there"


def keep_logs(logs: Path, run_dir: Path, started: str) -> Path:
    """Move this run's logs into the run directory (logs/<start time>/); where that cannot be (the run
    directory was never created, is a file or is read-only) they stay where they are."""
    target = run_dir / LOGS / started
    try:
        target.parent.mkdir(exist_ok=True)  # never creates the run directory itself
        if target.exists():  # another run started in the same second
            target = target.with_name(f"{started}-{logs.name.removeprefix('ddpjob-logs-')}")
        shutil.copytree(logs, target)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        return logs
    shutil.rmtree(logs, ignore_errors=True)
    return target


def failure_line(cause: Failure, agent: Agent, job: str, logs: Path, kept: Path) -> str:
    """The one line of a failed run: who failed, its own first line, and the files with the rest."""
    who = f"node {agent.node} ({agent.replica.pod_name(job)})"
    if cause.rank is not None:
        who = f"rank {cause.rank} on {who}"
    where = f"logs of every rank in {kept}"
    if cause.log:
        log = Path(cause.log)
        where = f"traceback in {kept / log.relative_to(logs) if log.is_relative_to(logs) else log}/stderr.log; {where}"
    return f"error: {who} failed: {cause.message} ({where})"


def run_local(
    spec: JobSpec, run_dir: Path, verbose: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """Run the job on this machine; returns the exit code for `ctl run`."""
    training = spec.training.to_values()
    training["checkpoint"]["dir"] = str(run_dir)
    port = free_port()
    started = time.strftime("%Y%m%d-%H%M%S")
    logs = Path(tempfile.mkdtemp(prefix="ddpjob-logs-"))
    console = Console(out, err)
    agents: list[Agent] = []
    previous_handler = signal.signal(signal.SIGTERM, terminate)
    with tempfile.TemporaryDirectory(prefix="ddpjob-") as tmp:
        config = Path(tmp) / "training.yaml"
        config.write_text(yaml.safe_dump(training, sort_keys=False), encoding="utf-8")
        pumps: list[threading.Thread] = []
        try:
            for node, replica in enumerate(replicas(spec)):
                pod = replica.pod_name(spec.name)
                metrics_port = free_port()
                env = agent_env(
                    spec,
                    replica,
                    port,
                    Path(tmp) / f"error-{pod}.json",
                    metrics_port,
                    Path(tmp) / f"metrics-{pod}",
                    logs / f"node-{node}",
                    verbose,
                )
                process = subprocess.Popen(
                    [sys.executable, "-m", "trainer.launch", "-m", "trainer", "--config", str(config)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    bufsize=1,
                    start_new_session=True,  # its own process group, so stop() reaches its workers too
                )
                agent = Agent(node, replica, process, Path(tmp) / f"error-{pod}.json")
                agents.append(agent)
                pumps += [
                    threading.Thread(target=pump_stdout, args=(agent, console), daemon=True),
                    threading.Thread(
                        target=pump_stderr,
                        args=(agent, logs / f"node-{node}.log", console if verbose else None),
                        daemon=True,
                    ),
                ]
                console.held.append(f"ctl: metrics of node {node} at http://{LOCAL_ADDRESS}:{metrics_port}/metrics")
            console.held.append(
                f"ctl: started {len(agents)} node(s) x {spec.procs_per_node} process(es); run directory {run_dir}"
            )
            if verbose:
                console.release()
            for thread in pumps:
                thread.start()
            failed = supervise(agents)
        except (KeyboardInterrupt, Terminated) as exc:
            # Every node saves at one agreed step and exits; a second signal must not cut that short.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stop(agents)
            join(pumps)
            kept = keep_logs(logs, run_dir, started)
            interrupted = isinstance(exc, KeyboardInterrupt)
            console.note(stopped(run_dir, "interrupted (SIGINT)" if interrupted else "terminated (SIGTERM)"))
            console.note(f"ctl: logs of every rank in {kept}")
            return EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
        join(pumps)
        by_failure = {agent.failure(): agent for agent in failed}  # their records are in `tmp`
    if not by_failure:
        console.note(f"ctl: logs of every rank in {keep_logs(logs, run_dir, started)}")
        return 0
    cause = root_cause(by_failure)
    if cause.kind == Kind.BAD_INPUT:  # nothing is written, logs included
        shutil.rmtree(logs, ignore_errors=True)
        console.note(f"error: {cause.message}")
        return EXIT_BAD_INPUT
    kept = keep_logs(logs, run_dir, started)
    if cause.kind == Kind.STOPPED:
        console.note(stopped(run_dir, "the nodes got SIGTERM"))
        console.note(f"ctl: logs of every rank in {kept}")
        return EXIT_PREEMPTED
    if cause.kind == Kind.HUNG:  # the watchdog's report names the ranks behind; a rerun resumes, as a pod restart would
        console.note(
            f"ctl: the job hung (exit code {EXIT_HUNG}, retryable); rerun the same command to resume from the last"
            f" checkpoint (logs of every rank in {kept}): {cause.message}"
        )
        return EXIT_ERROR
    console.note(failure_line(cause, by_failure[cause], spec.name, logs, kept))
    return cause.exit_code


def join(threads: list[threading.Thread]) -> None:
    """Let the output threads print what is left (an agent's children may keep a pipe open: not forever)."""
    for thread in threads:
        if thread.ident is not None:
            thread.join(timeout=5)
