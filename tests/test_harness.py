"""The test harness itself: a test run stopped by SIGTERM still tears down what its tests started, and the cache
of built binaries keeps what runs use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from e2e import cluster_binaries

# A test run in miniature: a module fixture standing for the control plane (it asks for the plane's SIGTERM handling
# as controlplane.start does), whose teardown takes a moment, and a test that forks a child (which must still end by
# SIGTERM as before) and then waits to be stopped.
STOPPED_RUN = """
import os, signal, time
from pathlib import Path
import controlplane
import pytest

HERE = Path(__file__).parent

class Plane:
    def stop(self):
        (HERE / "stopped-by-handler").touch()

@pytest.fixture(scope="module")
def plane():
    controlplane.stop_on_sigterm(Plane())
    yield
    (HERE / "tearing-down").touch()
    time.sleep(1)
    (HERE / "torn-down").touch()

def test_runs_until_stopped(plane):
    ready, readied = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(readied, b"r")
        time.sleep(60)
        os._exit(0)
    # Not before the child runs Python: CPython clears the signals a child got while its fork was ending.
    os.read(ready, 1)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    (HERE / "child").write_text(str(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1))
    (HERE / "running").touch()
    time.sleep(60)
"""


def wait_for(path: Path, run: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert run.poll() is None and time.monotonic() < deadline, f"no {path.name}: {run.communicate()[0]}"
        time.sleep(0.05)


def test_sigterm_stops_a_background_run_as_ctrl_c_does_and_its_teardown_runs(tmp_path: Path) -> None:
    (tmp_path / "test_stopped.py").write_text(STOPPED_RUN)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "test_stopped.py"],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": f"{REPO / 'tests'}:{REPO / 'tests' / 'e2e'}:{REPO}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As `make test &` starts it: SIGINT ignored, so SIGTERM is the signal that can stop it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    wait_for(tmp_path / "running", run)
    run.send_signal(signal.SIGTERM)
    wait_for(tmp_path / "tearing-down", run)
    run.send_signal(signal.SIGTERM)  # ignored: the teardown goes on
    output = run.communicate(timeout=60)[0]
    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt: stopped by SIGTERM" in output
    assert (tmp_path / "torn-down").exists(), output
    # The run's handler stayed: a plane is stopped by its fixture's teardown, as the run ends.
    assert not (tmp_path / "stopped-by-handler").exists(), output
    assert (tmp_path / "child").read_text() == str(int(signal.SIGTERM))


def test_the_binary_cache_keeps_what_runs_use_and_drops_what_none_has_used_for_a_month(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version bump leaves the old builds in ~/.cache/ddpjob/bin; ensure_binaries marks the ones it returns as
    used, and removes those unused for UNUSED_FOR_S (another checkout's, used lately, stay)."""
    monkeypatch.setattr(cluster_binaries, "CACHE", tmp_path)
    (tmp_path / "bin").mkdir()
    old = time.time() - cluster_binaries.UNUSED_FOR_S - 60
    names = ("kubelet-v1.36.3-stamped", "kubelet-v1.35.0-stamped", "kubelet-v1.37.0-stamped", ".kueue-v0.17.0.tmp")
    for name in names:
        (tmp_path / "bin" / name).touch()
    for name in names[:2] + names[3:]:  # all but the other checkout's are a month old
        os.utime(tmp_path / "bin" / name, (old, old))
    assert cluster_binaries.prune([tmp_path / "bin" / names[0]]) == [tmp_path / "bin" / names[1]]
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == sorted(names[:1] + names[2:])
    assert (tmp_path / "bin" / names[0]).stat().st_mtime > old + 60
