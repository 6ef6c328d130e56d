"""`ctl run`: a job's pods as local torchrun agents, each started from the rendered pod template.

Each pod is materialised as ctl/local_pods.py says; then the env the chosen operator injects (ctl/operator_env.py)
with the master on 127.0.0.1. A variable exported here keeps its value (credentials,
a chosen TMPDIR or TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and references to Secrets or ConfigMaps in `env`/`envFrom`
are the variables exported here or nothing. When any agent fails, the others are stopped: no process outlives
the run.

The terminal gets rank 0's progress (its stdout), the trainers' warning lines and one line for the outcome: bad
input's line (exit 2), the root cause of a failure (exit 1), or where a stopped run can resume (143 for SIGTERM, 130
for Ctrl-C). Every rank's output and torchrun's own go to log files (torchrun's `--log-dir` layout), moved into the
run directory's `logs/` at the end; `--verbose` also streams them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ctl.console import LINE_PREFIX, Console, pump_stderr, pump_stdout
from ctl.kinds import Replica
from ctl.local_pods import LocalJob, LocalNode
from ctl.operator_env import operator_env
from ctl.pod import expand_references, image_path
from ctl.processes import LOCAL_ADDRESS, free_port, join, stop
from ctl.spec import JobSpec
from trainer.failures import Failure, Kind, read_record, root_cause
from trainer.location import S3_VARIABLES, is_s3, node_cache
from trainer.names import (
    CHECKPOINT_NAME,
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_HUNG,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    LATEST_CHECKPOINT,
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    NEW_RUN_DIR,
)

# After one node fails, how long the others may take to fail by themselves: their own error may be the
# root cause (rank 0's bad input while rank 1 lost its connection to it and exited first).
FAILURE_GRACE_SECONDS = 5
LOGS = "logs"  # in the run directory: one folder per `ctl run`, named by its start time
LOGS_PREFIX = "ddpjob-logs-"  # the temporary folder of a run's logs until they are moved there
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


class RunDirInUse(RuntimeError):
    """Another `ctl run` on this machine trains into the same run directory: both would write its checkpoints."""


@contextlib.contextmanager
def run_dir_claimed(location: str) -> Iterator[int | None]:
    """An exclusive lock on the run directory `location` for this run's life, held by a file in this machine's node
    cache (none is created in the run directory: a refused run leaves it as it was); its descriptor, which the
    nodes' agents inherit, so that the lock holds while they live, ctl killed or not. None where the node cache
    cannot be written (a read-only home): the run goes on unguarded. The file is removed when the run ends as it
    should, so the node cache keeps none for each run directory ever used."""
    path = node_cache() / "locks" / f"{hashlib.sha256(location.encode()).hexdigest()[:32]}.lock"
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(
                f"{location}: another ctl run trains there (process {holder}): wait for it to end, or choose another"
                f" run directory ({NEW_RUN_DIR})"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)  # the run that held it ended and removed it meanwhile: lock the file there now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield fd
    except BaseException:  # nodes may live on (ctl failed while starting them): the file keeps them guarded
        os.close(fd)
        raise
    path.unlink(missing_ok=True)  # while still holding it: a run that opened it before finds it gone
    os.close(fd)


class Terminated(Exception):
    """ctl got SIGTERM, or SIGHUP (its terminal closed): the run stops as on Ctrl-C."""


def terminate(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


# Stop the run as SIGTERM does; left as they are where ignored (`nohup ctl run` ignores SIGHUP, and the run goes on).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


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
        # Killed itself (the OOM killer, a node's loss), it recorded nothing: the signal is its cause.
        reason = f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        code = code if code >= 0 else 128 - code
        return read_record(self.error_file, code) or Failure(code, reason, self.ended)


def signal_name(number: int) -> str:
    """SIGKILL; signal 40 for a real-time one, which has no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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


def agent_env(
    spec: JobSpec, node: LocalNode, port: int, error_file: Path, metrics_port: int, log_dir: Path, verbose: bool
) -> dict[str, str]:
    """The pod's env under this process's (less launcher variables), plus the operator's and torchrun's flags."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k not in LAUNCHER_VARIABLES}
    env = node.container.env | inherited  # a variable exported here keeps its value, as a spec's `env` would set it
    env["PATH"] = image_path(inherited.get("PATH", os.defpath))
    env |= operator_env(spec, node.replica, address=LOCAL_ADDRESS, port=port)
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    # torchrun's flags as variables: every rank's stdout and stderr into files, and their error records
    # next to them; ctl gets local rank 0's stdout (rank 0's progress) and stderr (its warnings), or with --verbose
    # every rank's.
    env |= {"PET_LOG_DIR": str(log_dir), "PET_REDIRECTS": "3", "PET_TEE": "3"}
    env["PET_LOG_LINE_PREFIX_TEMPLATE"] = LINE_PREFIX
    if not verbose:
        env["PET_LOCAL_RANKS_FILTER"] = "0"
    if METRICS_PORT_ENV in node.container.env:  # the pod serves metrics: all nodes share loopback, a port each
        env |= {METRICS_PORT_ENV: str(metrics_port), METRICS_HOST_ENV: LOCAL_ADDRESS}
    return env


def start_agent(
    spec: JobSpec,
    job: LocalJob,
    node_index: int,
    port: int,
    logs: Path,
    console: Console,
    verbose: bool,
    lock: int | None,
) -> tuple[Agent, list[threading.Thread]]:
    """Start one node's torchrun agent; its output threads, not started yet."""
    node = job.nodes[node_index]
    metrics_port = free_port()
    error_file = job.work_dir / f"error-{node.replica.pod_name(spec.name)}.json"
    env = agent_env(spec, node, port, error_file, metrics_port, logs / f"node-{node_index}", verbose)
    # The kubelet expands the pod's own variables only (the operator's among them), not this machine's.
    injected = operator_env(spec, node.replica, address=LOCAL_ADDRESS, port=port)
    variables = {name: env[name] for name in node.container.env.keys() | injected.keys()}
    process = subprocess.Popen(
        [expand_references(arg, variables) for arg in node.container.command],
        env=env,
        cwd=node.container.working_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        start_new_session=True,  # its own process group, so stop() reaches its workers too
        pass_fds=() if lock is None else (lock,),  # the run directory's lock (run_dir_claimed), while any agent lives
    )
    if METRICS_PORT_ENV in node.container.env:
        console.held.append(f"ctl: metrics of node {node_index} at http://{LOCAL_ADDRESS}:{metrics_port}/metrics")
    stderr_log = logs / f"node-{node_index}.log"
    pumps = [
        threading.Thread(target=pump_stdout, args=(process, console), daemon=True),
        threading.Thread(target=pump_stderr, args=(process, node_index, stderr_log, console, verbose), daemon=True),
    ]
    return Agent(node_index, node.replica, process, error_file), pumps


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
        stop([agent.process for agent in agents])
    return failed


def saved_step(job: LocalJob) -> int | None:
    """The step of the run directory's newest complete checkpoint (on this machine or in its bucket); None before
    the first."""
    with contextlib.suppress(OSError):
        if match := CHECKPOINT_NAME.fullmatch(latest_checkpoint(job).strip()):
            return int(match.group(1))
    return None


def latest_checkpoint(job: LocalJob) -> str:
    if is_s3(job.location):
        from trainer.storage import open_store  # the S3 client: ctl run has the trainer's install

        with pod_variables(job.nodes[0]):
            return open_store(job.location, job.run_dir).read_bytes(LATEST_CHECKPOINT).decode()
    return (job.run_dir / LATEST_CHECKPOINT).read_text(encoding="utf-8")


@contextlib.contextmanager
def pod_variables(node: LocalNode) -> Iterator[None]:
    """This process's environment with the pod's S3 variables it lacks (storage.endpoint's, storage.caBundle's file),
    as agent_env gives the ranks: the S3 client reads them when it is made."""
    pods = node.container.env
    added = {name: pods[name] for name in S3_VARIABLES if name in pods and name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def stopped(job: LocalJob, how: str) -> str:
    """ctl's line for a run that stopped after saving: where the next run resumes."""
    step = saved_step(job)
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
            target = target.with_name(f"{started}-{logs.name.removeprefix(LOGS_PREFIX)}")
        shutil.copytree(logs, target)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        return logs
    shutil.rmtree(logs, ignore_errors=True)
    return target


def failure_line(cause: Failure, agent: Agent, job: str, logs: Path, kept: Path) -> str:
    """The one line of a failed run: who failed (not when every rank did), its own first line, and the files with
    the rest."""
    where = f"logs of every rank in {kept}"
    if cause.everywhere:
        return f"error: {cause.message} ({where})"
    who = f"node {agent.node} ({agent.replica.pod_name(job)})"
    if cause.rank is not None:
        who = f"rank {cause.rank} on {who}"
    if cause.log:
        log = Path(cause.log)
        what = "traceback" if cause.traceback else "output"  # a signal or a one-line exit leaves no traceback
        where = f"{what} in {kept / log.relative_to(logs) if log.is_relative_to(logs) else log}/stderr.log; {where}"
    return f"error: {who} failed: {cause.message} ({where})"


def run_local(
    spec: JobSpec, job: LocalJob, verbose: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """Run the job's materialised pods on this machine, alone in its run directory; returns the exit code for
    `ctl run`."""
    with run_dir_claimed(job.location) as lock:
        return run_claimed(spec, job, lock, verbose, out, err)


def run_claimed(spec: JobSpec, job: LocalJob, lock: int | None, verbose: bool, out: TextIO, err: TextIO) -> int:
    run_dir = job.run_dir
    port = free_port()
    started = time.strftime("%Y%m%d-%H%M%S")
    logs = Path(tempfile.mkdtemp(prefix=LOGS_PREFIX))
    console = Console(out, err)
    agents: list[Agent] = []
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, terminate)
    pumps: list[threading.Thread] = []
    try:
        for node_index in range(len(job.nodes)):
            agent, threads = start_agent(spec, job, node_index, port, logs, console, verbose, lock)
            agents.append(agent)
            pumps += threads
        console.held.append(
            f"ctl: started {len(agents)} node(s) x {spec.procs_per_node} process(es); run directory {job.location}"
        )
        if verbose:
            console.release()
        for thread in pumps:
            thread.start()
        failed = supervise(agents)
    except (KeyboardInterrupt, Terminated) as exc:
        # Every node saves at one agreed step and exits, within the grace period a pod has; a second signal kills
        # them at once, as its sender asks (what was not saved is lost). The handler only sets a flag: a signal that
        # comes once the nodes have ended is ignored, not an exception in the middle of what follows.
        hurry = threading.Event()
        for sig in (signal.SIGINT, *STOP_SIGNALS):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, lambda signum, frame: hurry.set())
        grace = spec.termination_grace_period_seconds
        console.note(
            f"ctl: stopping: the nodes save and exit within {grace} s (terminationGracePeriodSeconds);"
            " a second Ctrl-C or SIGTERM kills them now"
        )
        killed = stop([agent.process for agent in agents], grace, hurry)
        join(pumps)
        kept = keep_logs(logs, run_dir, started)
        interrupted = isinstance(exc, KeyboardInterrupt)
        if killed:
            why = "at a second signal" if killed == "hurried" else f"{grace} s after SIGTERM"
            console.note(f"ctl: killed the nodes {why}, before they had all saved and exited")
        console.note(stopped(job, "interrupted (SIGINT)" if interrupted else f"terminated ({exc})"))
        console.note(f"ctl: logs of every rank in {kept}")
        return EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    join(pumps)
    return outcome(spec, failed, console, logs, job, started)


def outcome(spec: JobSpec, failed: list[Agent], console: Console, logs: Path, job: LocalJob, started: str) -> int:
    """The ended run's one line and exit code: its root cause when nodes failed; logs kept in the run directory."""
    by_failure = {agent.failure(): agent for agent in failed}  # their records are in the work directory
    run_dir = job.run_dir
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
        console.note(stopped(job, "the nodes got SIGTERM"))
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
