"""`ctl run`: a job's pods as local torchrun agents, each started from the rendered pod template.

The chart is rendered as for a cluster and each pod becomes a local process through ctl/pod.py, the code the e2e
pod executor uses too: the trainer container's command, args and env as rendered, its mounted ConfigMap's files
(training.yaml) in a directory of the run, and every mount path rewritten to its local directory. Then the env
the chosen operator injects (ctl/operator_env.py) with the master on 127.0.0.1. What stands in for a node:
a claim is ./runs (so the chart's run directory, <storage.mountPath>/<name>, is ./runs/<name>); the pod's HOME
is this user's home, with its caches; an emptyDir is this machine's directory of that path where one exists
(/tmp, /dev/shm), else a directory of the run per node; a variable exported here keeps its value (credentials,
a chosen TMPDIR or TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and references to Secrets or ConfigMaps in `env`/`envFrom`
are the variables exported here or nothing. When any agent fails, the others are stopped: no process outlives
the run.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ctl.kinds import Replica
from ctl.kinds.trainjob import COMPLETION_INDEX_LABEL
from ctl.operator_env import operator_env
from ctl.pod import LocalContainer, PodSetupError, Volume, image_path, local_container
from ctl.render import Manifest, chart_values, render_chart, split_manifests
from ctl.spec import JobSpec
from trainer.failures import Failure, Kind, read_record, root_cause
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
)

LOCAL_ADDRESS = "127.0.0.1"
NAMESPACE = "default"
# Every PersistentVolumeClaim of a local run: the chart's run directory <mountPath>/<name> is ./runs/<name> here.
LOCAL_CLAIMS = Path("runs")
# The pod label holding a TrainJob node's completion index (a fieldRef a pod may read).
COMPLETION_INDEX_FIELD = f"metadata.labels['{COMPLETION_INDEX_LABEL}']"
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


@dataclass(frozen=True)
class LocalNode:
    """One pod of the job, ready to start here: which replica, and its container as a local process."""

    replica: Replica
    container: LocalContainer


@dataclass(frozen=True)
class LocalJob:
    """The job's pods as rendered, materialised under `work_dir` (ConfigMaps written, mount paths rewritten)."""

    nodes: list[LocalNode]
    run_dir: Path  # the checkpoint directory the nodes' training config names, on this machine
    work_dir: Path


def rendered_pods(manifests: list[Manifest], spec: JobSpec) -> dict[Replica, dict[str, Any]]:
    """Each replica's pod spec as the operator creates it from the rendered job object."""
    return spec.kind.replica_pods({m.kind: m.obj for m in manifests}, spec)


@contextlib.contextmanager
def local_job(spec: JobSpec, run_dir: Path | None = None) -> Iterator[LocalJob]:
    """Render the job (`run_dir`: its training.checkpoint.dir, as `--run-dir` asks) and materialise its pods in a
    temporary directory, removed afterwards. PodSetupError when a pod needs what this machine cannot give."""
    values = chart_values(spec)
    if run_dir is not None:
        values["training"].setdefault("checkpoint", {})["dir"] = str(run_dir.absolute())
    manifests = split_manifests(render_chart(values, spec.name, NAMESPACE))
    config_maps = {m.name: m.obj for m in manifests if m.kind == "ConfigMap"}
    with tempfile.TemporaryDirectory(prefix="ddpjob-") as tmp:
        work_dir = Path(tmp)
        nodes = []
        for replica, pod in rendered_pods(manifests, spec).items():
            pod_dir = work_dir / replica.pod_name(spec.name)

            def volume_dir(volume: Volume, pod_dir: Path = pod_dir) -> Path:
                return local_volume(volume, pod_dir, config_maps)

            fields = {
                "metadata.name": replica.pod_name(spec.name),
                "metadata.namespace": NAMESPACE,
                "spec.nodeName": socket.gethostname(),
                "status.podIP": LOCAL_ADDRESS,
                "status.hostIP": LOCAL_ADDRESS,
                COMPLETION_INDEX_FIELD: str(replica.index),
            }
            container = local_container(pod, volume_dir, fields, lambda name, source: None, provided_dirs(pod))
            nodes.append(LocalNode(replica, container))
        yield LocalJob(nodes, training_run_dir(pod, container), work_dir)  # every node's config names the same


def local_volume(volume: Volume, pod_dir: Path, config_maps: dict[str, dict[str, Any]]) -> Path:
    """A volume of a local pod: a claim is ./runs; a ConfigMap the chart rendered, its files in the pod's directory;
    an emptyDir, a directory of the pod's."""
    if "persistentVolumeClaim" in volume:
        return LOCAL_CLAIMS.absolute()
    directory = pod_dir / "volumes" / volume["name"]
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        if name not in config_maps:
            raise PodSetupError(f"volume {volume['name']}: ConfigMap {name} is not one the chart renders")
        directory.mkdir(parents=True)
        for key, text in (config_maps[name].get("data") or {}).items():
            (directory / key).write_text(text, encoding="utf-8")
    elif "emptyDir" in volume:
        directory.mkdir(parents=True)
    else:
        kind = next((key for key in volume if key != "name"), "unknown")
        raise PodSetupError(f"volume {volume['name']}: ctl run cannot provide a {kind} volume")
    return directory


def provided_dirs(pod: dict[str, Any]) -> dict[str, Path]:
    """Mounts that are this machine's own directories: the pod's HOME is this user's (a laptop keeps its caches),
    and an emptyDir mounted where this machine has a directory (/tmp, /dev/shm) is that directory."""
    container = pod["containers"][0]
    empty_dirs = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    provided = {
        m["mountPath"]: Path(m["mountPath"])
        for m in container.get("volumeMounts") or []
        if m["name"] in empty_dirs and Path(m["mountPath"]).is_dir()
    }
    home = next((var.get("value") for var in container.get("env") or [] if var["name"] == "HOME"), None)
    return provided | ({home.rstrip("/"): Path.home()} if home else {})


def training_run_dir(pod: dict[str, Any], container: LocalContainer) -> Path:
    """The run directory named by the training config: the mounted ConfigMap file that the command reads."""
    config_volumes = {v["name"] for v in pod.get("volumes") or [] if "configMap" in v}
    config_dirs = [
        container.mounts[m["mountPath"].rstrip("/")]
        for m in pod["containers"][0].get("volumeMounts") or []
        if m["name"] in config_volumes
    ]
    for arg in container.command:
        path = Path(arg)
        if path.is_file() and any(path.is_relative_to(directory) for directory in config_dirs):
            checkpoint = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("checkpoint") or {}
            return Path(checkpoint.get("dir") or LOCAL_CLAIMS).absolute()
    raise PodSetupError(f"the trainer's command reads no file of its mounted ConfigMap: {container.command}")


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
    # next to them; the terminal gets local rank 0's stdout (rank 0's progress), or with --verbose everything.
    env |= {"PET_LOG_DIR": str(log_dir), "PET_REDIRECTS": "3", "PET_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX}
    env |= {"PET_TEE": "3"} if verbose else {"PET_TEE": "1", "PET_LOCAL_RANKS_FILTER": "0"}
    if METRICS_PORT_ENV in node.container.env:  # the pod serves metrics: all nodes share loopback, a port each
        env |= {METRICS_PORT_ENV: str(metrics_port), METRICS_HOST_ENV: LOCAL_ADDRESS}
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
    spec: JobSpec, job: LocalJob, verbose: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """Run the job's materialised pods on this machine; returns the exit code for `ctl run`."""
    run_dir = job.run_dir
    port = free_port()
    started = time.strftime("%Y%m%d-%H%M%S")
    logs = Path(tempfile.mkdtemp(prefix="ddpjob-logs-"))
    console = Console(out, err)
    agents: list[Agent] = []
    previous_handler = signal.signal(signal.SIGTERM, terminate)
    pumps: list[threading.Thread] = []
    try:
        for node_index, node in enumerate(job.nodes):
            pod = node.replica.pod_name(spec.name)
            metrics_port = free_port()
            error_file = job.work_dir / f"error-{pod}.json"
            env = agent_env(spec, node, port, error_file, metrics_port, logs / f"node-{node_index}", verbose)
            process = subprocess.Popen(
                node.container.command,
                env=env,
                cwd=node.container.working_dir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own process group, so stop() reaches its workers too
            )
            agent = Agent(node_index, node.replica, process, error_file)
            agents.append(agent)
            pumps += [
                threading.Thread(target=pump_stdout, args=(agent, console), daemon=True),
                threading.Thread(
                    target=pump_stderr,
                    args=(agent, logs / f"node-{node_index}.log", console if verbose else None),
                    daemon=True,
                ),
            ]
            if METRICS_PORT_ENV in node.container.env:
                console.held.append(
                    f"ctl: metrics of node {node_index} at http://{LOCAL_ADDRESS}:{metrics_port}/metrics"
                )
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
    by_failure = {agent.failure(): agent for agent in failed}  # their records are in the work directory
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
