"""Shared fixtures: the installed `ctl`, a small real-text corpus and tiny job specs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from s3server import S3Server, s3_server

from trainer import scratch

CTL = [sys.executable, "-m", "ctl"]
REPO = Path(__file__).resolve().parent.parent
# Every process a test starts carries it, with a value of the test's own: what finds the processes a run left behind.
MARKER_ENV = "DDPJOB_TEST_MARKER"


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (`kill`, `kill %1`) stops a test run as Ctrl-C does: the tests' teardown still runs, which stops the
    control plane and its node (containers, mounts, cgroups, links). A run started in the background (`make test
    &`) ignores SIGINT, so SIGTERM is the way to stop it; by default it would end pytest alone and leave all that
    behind. A second SIGTERM during the teardown is ignored: SIGKILL stops at once, leaving it."""
    main = os.getpid()

    def interrupt(signum: int, frame: object) -> None:
        if os.getpid() != main:  # a child forked by a test keeps this handler: it ends as SIGTERM would end it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        signal.signal(signum, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~50 KB of real text: the standard library's json package sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "json_sources.txt"
    path.write_text("\n".join(p.read_text(encoding="utf-8") for p in sorted((stdlib / "json").glob("*.py"))))
    return path


def tiny_spec(corpus: Path, **training: Any) -> dict[str, Any]:
    """A job spec small enough to train in seconds on one CPU core per process."""
    return {
        "name": "tiny",
        "nodes": 1,
        "procsPerNode": 1,
        "training": {
            "task": "char-gpt",
            "model": {"nLayer": 1, "nHead": 2, "nEmbd": 32, "blockSize": 32},
            "data": {"train": str(corpus), "valFraction": 0.1},
            "maxSteps": 5,
            "batchSize": 4,
            "logEvery": 1,
            "sample": {"maxNewTokens": 20},
        }
        | training,
    }


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar in the run's TensorBoard event files, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wait_for(what: str, check: Any, deadline: float, interval: float = 0.5) -> Any:
    """check() until it returns something truthy (an endpoint not up yet counts as nothing); fail naming `what` at
    the deadline."""
    while True:
        try:
            result = check()
        except OSError:  # URLError too
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


def rank_log(run_dir: Path, node: int, local_rank: int) -> Path:
    """A rank's own stderr from `ctl run`'s first attempt (torchrun's log layout under the run's logs/): exactly one."""
    (log,) = run_dir.glob(f"logs/*/node-{node}/*/attempt_0/{local_rank}/stderr.log")
    return log


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[[dict[str, Any]], Path]:
    def write(spec: dict[str, Any], name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(spec), encoding="utf-8")
        return path

    return write


def prometheus_tool(name: str) -> str:
    """`prometheus` or `promtool` from PATH; `make test` installs them (.ci/install-prometheus)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run .ci/install-prometheus (a prerequisite of `make test`)")
    return path


@contextlib.contextmanager
def prometheus_server(config: Path, work_dir: Path) -> Iterator[str]:
    """A real Prometheus server on a free loopback port reading `config`, its data and log under `work_dir`;
    yields its URL and stops it afterwards."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    command = [
        prometheus_tool("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={work_dir / 'tsdb'}",
        f"--web.listen-address={address}",
        "--log.level=warn",
    ]
    with (work_dir / "prometheus.log").open("w") as log:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            yield f"http://{address}"
        finally:
            server.terminate()
            server.wait(timeout=30)


def run_ctl(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300, stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CTL, *args],
        cwd=cwd,
        env=(env or os.environ) | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


# What the ctl_here fixture gives: run(*args, cwd=...) -> ctl's output and exit code.
CtlHere = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def ctl_here(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> CtlHere:
    """`run_ctl` for a command that ctl itself refuses (bad input, before anything runs): its main() in this process,
    where a new interpreter takes a second on a slow machine, and the hundred-odd such cases add up. What it printed
    and its exit code, as `run_ctl` gives them."""
    from ctl import cli

    def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
        capfd.readouterr()  # what came before is not this command's
        with monkeypatch.context() as patched, pytest.raises(SystemExit) as exited:
            patched.chdir(cwd)
            patched.setattr(sys, "argv", ["ctl", *args])
            cli.main()
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["ctl", *args], exited.value.code, out, err)

    return run


# A sitecustomize module: once `module` is imported by a process where `when` holds, `patch` runs with it as
# `module`. Every Python process of a run imports it when its folder leads PYTHONPATH (start_ctl's `hooks`).
IMPORT_HOOK = """
import importlib.abc, importlib.util, os, sys, time


class Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "{module}" or not ({when}):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
{patch}

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Patch())
"""


def import_hook(module: str, patch: str, when: str = "True") -> str:
    """IMPORT_HOOK's source for `module`, `patch` (code of its own, `module` in scope) and `when`."""
    return IMPORT_HOOK.format(module=module, when=when, patch=textwrap.indent(textwrap.dedent(patch), " " * 12))


def start_ctl(
    *args: str, cwd: Path, env: dict[str, str], merge_stderr: bool = True, hooks: Path | None = None
) -> subprocess.Popen:
    """`ctl` in the background, its output read as text (stderr into stdout unless `merge_stderr` is off); `hooks`: a
    folder on the path before the repository (a sitecustomize module that every Python process of the run imports)."""
    return subprocess.Popen(
        [*CTL, *args],
        cwd=cwd,
        env=env | {"PYTHONPATH": os.pathsep.join(str(p) for p in (hooks, REPO) if p)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_reaches,
    )


def ctrl_c_reaches() -> None:
    """preexec_fn: SIGINT and SIGHUP act as in a terminal's foreground job. A test run started in the background
    (`make test &`) ignores SIGINT, and one under `nohup` SIGHUP, and children inherit that: a test's Ctrl-C or
    hangup would never reach ctl."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def processes_with_marker(marker: str) -> list[int]:
    """PIDs whose environment carries `DDPJOB_TEST_MARKER=marker` (what a run left behind)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def scratch_folders(tmp: Path) -> list[Path]:
    """The launchers' scratch folders in `tmp`, and torchrun's own (what it makes when not given one)."""
    return [p for prefix in (*scratch.PREFIXES, "torchelastic_") for p in tmp.glob(f"{prefix}*")]


def trainer_pids(marker: str, rank: int, local_rank: int = 0) -> list[int]:
    """Trainer processes (not torchrun agents) of this run with the given global (and local) rank."""
    pids = []
    for pid in processes_with_marker(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            f"RANK={rank}".encode() in environ
            and f"LOCAL_RANK={local_rank}".encode() in environ
            and b"torch.distributed.run" not in cmdline
            and b"trainer.launch" not in cmdline
        ):
            pids.append(pid)
    return pids


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    (mask,) = [line.split()[1] for line in status if line.startswith("SigCgt")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def sigterm_as_pid_1(command: list[str], cwd: Path, ready: Callable[[], bool]) -> tuple[int, str]:
    """`command` run as the first process of a PID namespace of its own, as a container runs a pod's command (the
    kernel then delivers it no signal it has no handler for), sent SIGTERM once it has a handler and `ready()`; (its
    exit code, its stderr). Needs root."""
    namespace = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    unshare = subprocess.Popen([*namespace, *command], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
        deadline = time.monotonic() + 60
        while not ((pids := children.read_text().split()) and catches(int(pids[0]), signal.SIGTERM) and ready()):
            assert unshare.poll() is None and time.monotonic() < deadline, "no SIGTERM handler, or never ready"
            time.sleep(0.02)
        os.kill(int(pids[0]), signal.SIGTERM)
        _, stderr = unshare.communicate(timeout=30)
        return unshare.returncode, stderr
    finally:
        unshare.kill()
        unshare.wait()


TEMPORARY = "tmp"  # the `temporary` fixture's folder in the test's tmp_path


@pytest.fixture
def temporary(tmp_path: Path) -> Path:
    """A temporary directory of the test's own, in its folder: the TMPDIR for what it runs, whose leftovers are the
    test's to check."""
    folder = tmp_path / TEMPORARY
    folder.mkdir()
    return folder


@pytest.fixture
def marked_env() -> tuple[dict[str, str], str]:
    marker = uuid.uuid4().hex
    return os.environ | {MARKER_ENV: marker}, marker


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (versitygw) on the loopback address for the whole session."""
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def bucket(s3: S3Server) -> str:
    """A new, empty bucket of the session's S3 server; its name."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.bucket(name)
    return name
