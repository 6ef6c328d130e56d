"""Every failure told right, through `ctl run` with real processes: one line on the terminal (stdout and
stderr together), the right exit code, nothing written for bad input, the root cause when ranks race to
fail, and SIGTERM handled as Ctrl-C."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from certs import private_ca
from conftest import (
    MARKER_ENV,
    TEMPORARY,
    CtlHere,
    import_hook,
    processes_with_marker,
    run_ctl,
    scratch_folders,
    sigterm_as_pid_1,
    start_ctl,
    tiny_spec,
)
from s3server import listening
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from ctl import cluster
from ctl.cli import app
from ctl.commands.common import seconds
from ctl.local import keep_logs
from ctl.processes import free_port
from trainer import owned, scratch
from trainer.failures import Failure, first_line, read_record, root_cause
from trainer.location import NODE_CACHE_ENV
from trainer.models import gpt_config
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_HUNG, EXIT_INTERRUPTED, EXIT_PREEMPTED, LATEST_CHECKPOINT
from trainer.rendezvous import unresolved
from trainer.spec import ModelSpec, SpecError
from trainer.text import hub_out_of_reach, load_tokenizer, pretrained_options

STOPPED = re.compile(r"stopped at step (\d+), resumable")


def terminal(result: subprocess.CompletedProcess) -> list[str]:
    return (result.stdout + result.stderr).splitlines()


def tree(path: Path) -> dict[str, int]:
    """Every file and folder under `path`, with each file's modification time: what bad input must leave alone
    (a folder's own time changes with the trainer's write test, which leaves nothing). In the temporary
    directory only ctl's own files count (ddpjob-*): torch keeps caches there."""
    found = {}
    for child in path.rglob("*"):
        parts = child.relative_to(path).parts
        if parts[0] != TEMPORARY or (len(parts) > 1 and parts[1].startswith("ddpjob-")):
            found["/".join(parts)] = 0 if child.is_dir() else child.stat().st_mtime_ns
    return found


@pytest.fixture
def workdir(tmp_path: Path, temporary: Path) -> tuple[Path, dict[str, str]]:
    """A working directory, and an env whose temporary files (ctl's logs among them) stay inside it."""
    return tmp_path, os.environ | {"TMPDIR": str(temporary)}


def exact_tree(path: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under `path` and `path` itself: (modification time, inode, a file's content). A refused
    run leaves them all as they were, folders' times included (nothing created and removed again)."""
    return {
        str(entry.relative_to(path)): (info.st_mtime_ns, info.st_ino, entry.read_bytes() if entry.is_file() else None)
        for entry in (path, *sorted(path.rglob("*")))
        if (info := entry.lstat())
    }


def assert_one_line(result: subprocess.CompletedProcess, code: int, expected: str) -> None:
    lines = terminal(result)
    assert result.returncode == code, "\n".join(lines)
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], "\n".join(lines)


def run_bad_input(
    workdir: tuple[Path, dict[str, str]], spec: dict, flags: list[str], expected: str, times: int
) -> None:
    """`ctl run` `times` times (rank races differ from run to run): one line naming the key, exit 2, nothing written."""
    path, env = workdir
    (path / "spec.yaml").write_text(yaml.safe_dump(spec))
    before = tree(path)
    for _ in range(times):
        assert_one_line(run_ctl("run", "spec.yaml", *flags, cwd=path, env=env), EXIT_BAD_INPUT, expected)
        assert tree(path) == before


# -- found by ctl: the spec and the command line ------------------------------------------------------------

SPEC_CASES = {
    "infinite-lr": (["training.optimizer.lr=.inf"], "training.optimizer.lr: Input should be a finite number"),
    "nan-beta": (["training.optimizer.betas=[.nan, 0.9]"], "training.optimizer.betas.0: Input should be a finite"),
    "infinite-chart-value": (
        ["metrics.alerts.lossExplosionFactor=.inf"],
        "metrics.alerts.lossExplosionFactor: Input should be a finite number",
    ),
    "beta-of-one": (["training.optimizer.betas=[0.9, 1.0]"], "training.optimizer.betas.1: Input should be less than 1"),
    "block-size-beyond-gpt2": (
        ["training.task=causal-lm", "training.model.size=gpt2", "training.model.blockSize=2048"],
        "training.model.blockSize: 2048 is more than the 1024 positions of gpt2",
    ),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_bad_spec_values_are_one_line_and_exit_2(workdir, corpus_file: Path, case: str) -> None:
    overrides, expected = SPEC_CASES[case]
    flags = [arg for override in overrides for arg in ("--set", override)]
    run_bad_input(workdir, tiny_spec(corpus_file), flags, expected, times=1)


COMMANDS = sorted(
    command.name or command.callback.__name__.removesuffix("_command") for command in app.registered_commands
)


@pytest.mark.parametrize("command", COMMANDS)
def test_usage_errors_of_every_command_are_one_line_and_exit_2(tmp_path: Path, command: str, ctl_here: CtlHere) -> None:
    result = ctl_here(command, "--bogus", cwd=tmp_path)
    assert_one_line(result, EXIT_BAD_INPUT, f"ctl {command}: No such option: --bogus")
    assert f"ctl {command} --help" in result.stderr


@pytest.mark.parametrize(
    "args", [["render", "spec.yaml", "-o"], ["submit", "spec.yaml", "--dry-run"], ["logs", "x", "--tail"]]
)
def test_an_option_without_its_value_names_its_command(tmp_path: Path, args: list[str]) -> None:
    """Click fails such an option before the command has a context: the line named `ctl` and its --help."""
    result = run_ctl(*args, cwd=tmp_path)
    assert_one_line(result, EXIT_BAD_INPUT, f"ctl {args[0]}: Option '{args[-1]}' requires an argument")
    assert f"(see 'ctl {args[0]} --help')" in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["status", "Foo_Bad"], "ctl status: Invalid value for 'name': 'Foo_Bad' is not a Kubernetes object name"),
        (["submit", "spec.yaml", "-n", "Team"], "ctl submit: Invalid value for '--namespace' / '-n': 'Team' is not a"),
        (["list", "-n", "a" * 64], "ctl list: Invalid value for '--namespace' / '-n': '" + "a" * 64 + "' is not a"),
    ],
    ids=["job-name", "capitals", "too-long"],
)
def test_a_name_or_namespace_nothing_can_have_is_refused_before_the_cluster_is_asked(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    """The cluster answered not found (exit 102), or `PATCH /api/v1/namespaces/Team/...: not found` (exit 1). With
    no kubeconfig at all, the line is the flag's, not the kubeconfig's: nothing was read before it."""
    env = os.environ | {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "absent.yaml")}
    assert_one_line(run_ctl(*args, cwd=tmp_path, env=env), EXIT_BAD_INPUT, expected)


def test_a_timeout_is_seconds_or_a_duration_as_kubectl_takes(tmp_path: Path) -> None:
    written = ("90", "1.5", "1e3", "90s", "30m", "1h30m", "1.5h", "500ms", ".5m", "1m0.5s")
    assert [seconds(text) for text in written] == [90, 1.5, 1000, 90, 1800, 5400, 5400, 0.5, 30, 60.5]
    for command in (["wait", "x"], ["submit", "spec.yaml", "--wait"]):
        for text, problem in (("30M", "expected seconds or a duration such as 90s, 30m or 1h30m"), ("-1m", "")):
            result = run_ctl(*command, "--timeout", text, cwd=tmp_path)
            assert_one_line(result, EXIT_BAD_INPUT, f"ctl {command[0]}: Invalid value for '--timeout': {text!r}: ")
            assert problem in result.stderr
    assert "expected a duration of 0 or more" in run_ctl("wait", "x", "--timeout", "-5", cwd=tmp_path).stderr


def test_run_without_a_spec_is_one_line_and_exit_2(tmp_path: Path) -> None:
    assert_one_line(run_ctl("run", cwd=tmp_path), EXIT_BAD_INPUT, "ctl run: Missing argument")


# (arguments, the line's problem): paths as typed, refused before anything runs. An empty path was the current
# directory: `ctl run spec.yaml --run-dir ''` trained into it.
PATH_CASES = {
    "empty-spec": (["render", ""], "ctl render: Invalid value for 'spec': an empty path"),
    "empty-values": (["render", "spec.yaml", "--values", " "], "ctl render: Invalid value for '--values': an empty"),
    "empty-set-file": (
        ["render", "spec.yaml", "--set-file", "storage.caBundle="],
        "--set-file 'storage.caBundle=': expected dotted.key=path, and the path is empty",
    ),
    "empty-run-dir": (["run", "spec.yaml", "--run-dir", ""], "ctl run: Invalid value for '--run-dir': an empty path"),
    "run-dir-a-file": (
        ["run", "spec.yaml", "--run-dir", "spec.yaml"],
        "ctl run: Invalid value for '--run-dir': spec.yaml is a file, not a directory",
    ),
    "run-dir-in-a-file": (
        ["prepare", "spec.yaml", "--run-dir", "spec.yaml/run"],
        "ctl prepare: Invalid value for '--run-dir': spec.yaml is a file, not a directory",
    ),
    # A path, `s3:/bucket/x`, where the run's data and checkpoints were written (the spec's key takes the URI).
    "run-dir-an-s3-uri": (
        ["run", "spec.yaml", "--run-dir", "s3://runs/x"],
        "ctl run: Invalid value for '--run-dir': a local directory, not an S3 URI: a run directory in a bucket is",
    ),
    "empty-kubeconfig": (["status", "tiny", "--kubeconfig", ""], "Invalid value for '--kubeconfig': an empty path"),
    # Python's words were the line: `cannot read: [Errno 21] Is a directory: '.'`, `'utf-8' codec can't decode ...`
    "spec-a-directory": (["render", "."], "error: .: a directory, not a file"),
    "spec-not-utf-8": (["render", "latin1.yaml"], "error: latin1.yaml: not UTF-8 text (byte 9)"),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_an_empty_path_or_a_file_as_the_run_directory_is_refused_before_anything_runs(
    workdir, corpus_file: Path, case: str
) -> None:
    path, env = workdir
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file)))
    (path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    args, expected = PATH_CASES[case]
    before = tree(path)
    assert_one_line(run_ctl(*args, cwd=path, env=env), EXIT_BAD_INPUT, expected)
    assert tree(path) == before


def test_a_tilde_in_a_path_flag_is_the_home_folder_as_a_shell_gives_it(workdir, corpus_file: Path) -> None:
    """`--run-dir=~/runs` reaches ctl as typed (a shell expands only a word's leading ~): it was a folder named ~."""
    path, env = workdir
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file)))
    home = path / "home"
    home.mkdir()
    (home / "taken").write_text("")
    result = run_ctl("run", "spec.yaml", "--run-dir=~/taken", cwd=path, env=env | {"HOME": str(home)})
    assert_one_line(result, EXIT_BAD_INPUT, f"Invalid value for '--run-dir': {home}/taken is a file, not a directory")


def test_a_flag_s_value_is_checked_before_the_cluster_is_asked(tmp_path: Path) -> None:
    """An -o or --dry-run no command takes is a usage error (exit 2), not a failure to reach the cluster (exit 1)."""
    (tmp_path / "config.yaml").write_text(KUBECONFIG)  # its server's port answers nothing
    (tmp_path / "spec.yaml").write_text("name: tiny\n")
    for args, problem in (
        (["list", "-o", "xml"], "'xml': expected table, yaml or json"),
        (["status", "tiny", "-o", "wide"], "'wide': expected table, yaml or json"),
        (["submit", "spec.yaml", "--dry-run", "true"], "'true': expected none, client or server"),
        (["logs", "tiny", "--rank", "-1"], "greater than or equal to 0"),
        # Ignored before: the objects were printed, or checked, and nothing was waited for.
        (["submit", "spec.yaml", "--dry-run", "client", "-f"], "follow': a dry run (--dry-run client) creates no job"),
        (["submit", "spec.yaml", "--dry-run", "server", "--wait"], "wait': a dry run (--dry-run server) creates no"),
        (["submit", "spec.yaml", "--dry-run", "client", "--replace"], "replace': --dry-run client only prints"),
    ):
        result = run_ctl(*args, "--kubeconfig", "config.yaml", cwd=tmp_path)
        assert_one_line(result, EXIT_BAD_INPUT, f"ctl {args[0]}: Invalid value for '--")
        assert problem in result.stderr


KUBECONFIG = """apiVersion: v1
current-context: here
contexts:
- {name: here, context: {cluster: here, user: here}}
- {name: missing-plugin, context: {cluster: here, user: missing-plugin}}
- {name: expired, context: {cluster: here, user: expired}}
- {name: expiring, context: {cluster: here, user: expiring}}
clusters: [{name: here, cluster: {server: "https://127.0.0.1:1"}}]
users:
- {name: here, user: {token: t}}
- {name: missing-plugin, user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: no-such-plugin}}}
- {name: expired, user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: ./expired.sh}}}
- {name: expiring, user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: ./expiring.sh}}}
"""
# (arguments, environment, the line): the kubeconfig as the user points at it; files in the test's directory.
KUBECONFIG_CASES = {
    "missing-file": (["--kubeconfig", "nowhere.yaml"], {}, "error: --kubeconfig nowhere.yaml: no such file"),
    "a-directory": (["--kubeconfig", "."], {}, "error: --kubeconfig .: a directory, not a file"),
    "none-at-all": (
        [],
        {"KUBECONFIG": None, "KUBERNETES_SERVICE_HOST": None},
        "error: kubeconfig: none found: no ~/.kube/config, $KUBECONFIG is not set, and this is not a pod"
        " (--kubeconfig FILE names one)",
    ),
    "env-names-no-file": ([], {"KUBECONFIG": "a.yaml:b.yaml"}, "error: $KUBECONFIG: none of its files exists"),
    "not-yaml": (
        ["--kubeconfig", "broken.yaml"],
        {},
        "error: kubeconfig broken.yaml, line 2: not valid YAML: expected the node content, but found '<stream end>'",
    ),
    "not-a-kubeconfig": (["--kubeconfig", "list.yaml"], {}, "error: kubeconfig list.yaml: not a kubeconfig (TypeError"),
    # It was a failure to reach it (exit 1): `cannot reach the API server not a url: Failed to parse: ...`.
    "server-not-a-url": (
        ["--kubeconfig", "badurl.yaml"],
        {},
        "error: kubeconfig: context 'here': its cluster's server 'not a url' is not a URL",
    ),
    "no-such-current-context": (
        ["--kubeconfig", "elsewhere.yaml"],
        {},
        "error: kubeconfig elsewhere.yaml: its current-context 'there' is none of its contexts (--context names one)",
    ),
    "no-current-context": (
        ["--kubeconfig", "unset.yaml"],
        {},
        "error: kubeconfig unset.yaml: no current-context (--context names one)",
    ),
    "no-such-context": (
        ["--kubeconfig", "config.yaml", "--context", "there"],
        {},
        "error: --context 'there': no such context in the kubeconfig",
    ),
    # The client logs a failed plugin (its own ERROR line, and from then on urllib3's retries) and goes on without.
    "credentials-plugin-missing": (
        ["--kubeconfig", "config.yaml", "--context", "missing-plugin"],
        {},
        "error: kubeconfig: user 'missing-plugin': its credentials plugin failed: [Errno 2] No such file or"
        " directory: 'no-such-plugin'",
    ),
    "credentials-plugin-fails": (
        ["--kubeconfig", "config.yaml", "--context", "expired"],
        {},
        "error: kubeconfig: user 'expired': its credentials plugin failed: exec: process returned 1. the login"
        " expired: run sso login",
    ),
    # Its token has expired at the first request: the client runs it again, which fails; it would log that and send
    # the expired token.
    "credentials-plugin-fails-on-refresh": (
        ["--kubeconfig", "config.yaml", "--context", "expiring"],
        {},
        "error: kubeconfig: user 'expiring': its credentials plugin failed: exec: process returned 1. the login"
        " expired: run sso login",
    ),
}
# A plugin that gives each ctl process (its parent) a token that expired long ago, and fails when run again.
EXPIRING = """#!/bin/sh
[ -e "ran-$PPID" ] && exec ./expired.sh
touch "ran-$PPID"
echo '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
  "status": {"token": "t", "expirationTimestamp": "2000-01-01T00:00:00Z"}}'
"""


@pytest.mark.parametrize("case", list(KUBECONFIG_CASES))
def test_a_kubeconfig_ctl_cannot_use_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    """Before any request: a file that is not there, not YAML or not a kubeconfig, a context it lacks (kubectl's
    own sources and order: --kubeconfig, $KUBECONFIG, ~/.kube/config, in-cluster)."""
    args, changes, expected = KUBECONFIG_CASES[case]
    (tmp_path / "broken.yaml").write_text("clusters: [\n")
    (tmp_path / "list.yaml").write_text("- a\n")
    (tmp_path / "config.yaml").write_text(KUBECONFIG)
    (tmp_path / "elsewhere.yaml").write_text(KUBECONFIG.replace("current-context: here", "current-context: there"))
    (tmp_path / "unset.yaml").write_text(KUBECONFIG.replace("current-context: here\n", ""))
    (tmp_path / "badurl.yaml").write_text(KUBECONFIG.replace("https://127.0.0.1:1", "not a url"))
    (tmp_path / "expired.sh").write_text("#!/bin/sh\necho 'the login expired:' >&2\necho 'run sso login' >&2\nexit 1\n")
    (tmp_path / "expiring.sh").write_text(EXPIRING)
    for plugin in ("expired.sh", "expiring.sh"):
        (tmp_path / plugin).chmod(0o755)
    env = {name: value for name, value in (os.environ | {"HOME": str(tmp_path)} | changes).items() if value is not None}
    for command in (["list"], ["status", "tiny"]):
        assert_one_line(run_ctl(*command, *args, cwd=tmp_path, env=env), EXIT_BAD_INPUT, expected)


@contextlib.contextmanager
def silent_server(accept: bool) -> Iterator[int]:
    """A port that takes connections and never answers (a hung API server, a proxy in the way): with `accept`
    each connection is taken as it comes, else they wait in the kernel's queue, which takes one."""
    held: list[socket.socket] = []

    def take(server: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed: the test is over
            while True:
                held.append(server.accept()[0])

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8 if accept else 0)
        taker = threading.Thread(target=take, args=(server,), daemon=True)
        if accept:
            taker.start()
        try:
            yield server.getsockname()[1]
        finally:  # a client still waiting gets its answer: the connection closed
            # A close does not wake a thread blocked in accept (it stayed for the rest of the session); a shutdown does.
            server.shutdown(socket.SHUT_RDWR)
            if accept:
                taker.join(timeout=10)
                assert not taker.is_alive(), "the accepting thread did not end"
            for connection in held:
                connection.close()


def test_an_api_server_that_never_answers_is_one_line_not_a_hang(tmp_path: Path) -> None:
    """Reaching it is bounded (10 s, tried twice) as kubectl bounds its TLS handshake; ctl waited for good."""
    with silent_server(accept=False) as port:
        server = f"https://127.0.0.1:{port}"
        (tmp_path / "config.yaml").write_text(KUBECONFIG.replace("https://127.0.0.1:1", server))
        result = run_ctl("list", "--kubeconfig", "config.yaml", cwd=tmp_path, timeout=60)
    expected = f"error: cannot reach the API server {server}: Connection to 127.0.0.1 timed out. (connect timeout=10.0)"
    assert_one_line(result, EXIT_ERROR, expected)


def test_an_answer_that_never_comes_ends_at_the_read_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request's read is bounded, a metrics page's by its own timeout (a lone float, which the client
    ignored: `ctl status` waited for a pod's metrics for as long as the API server's proxy did)."""
    monkeypatch.setattr(cluster, "READ_TIMEOUT_S", 0.5)
    metrics = "/api/v1/namespaces/default/pods/tiny-master-0:9090/proxy/metrics"
    # In a thread: a request without a bound would hang the test, not fail it, until the server closes.
    with ThreadPoolExecutor(1) as pool, silent_server(accept=True) as port:
        (tmp_path / "config.yaml").write_text(KUBECONFIG.replace("https://127.0.0.1:1", f"http://127.0.0.1:{port}"))
        target = cluster.connect(str(tmp_path / "config.yaml"), None, None)
        # Reached, and it did not answer: not "cannot reach".
        no_answer = rf"^no answer from the API server http://127.0.0.1:{port}: Read timed out. \(read timeout=0.5\)$"
        with pytest.raises(cluster.ClusterError, match=no_answer):
            pool.submit(target.call, "/api/v1/namespaces").result(timeout=10)
        with pytest.raises(cluster.ClusterError, match=r": Read timed out. \(read timeout=0.25\)$"):
            pool.submit(target.open, metrics, [], timeout=0.25).result(timeout=10)


@contextlib.contextmanager
def answering_server(status: int, body: bytes, tls: Any = None) -> Iterator[str]:
    """An HTTP(S) server that answers every request with `status` and `body` (JSON, or text where it is not): a
    login page or another service at a kubeconfig's address, a cluster without some API. Its URL."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if body.startswith(b"{") else "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    if tls is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.cert_file, tls.key_file)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize(
    ("body", "shown"),
    [(b"<html><body>Sign in</body></html>", "<html><body>Sign in</body></html>"), (b'{"a": 1}', '{"a": 1}')],
    ids=["a-login-page", "json-of-another-shape"],
)
def test_an_answer_that_is_no_api_object_is_one_line(tmp_path: Path, body: bytes, shown: str) -> None:
    """A kubeconfig's address answered by a login page or another service: each command ended in a traceback of
    about 45 lines (`string indices must be integers`, `KeyError: 'kind'`)."""
    with answering_server(200, body) as server:
        (tmp_path / "config.yaml").write_text(KUBECONFIG.replace("https://127.0.0.1:1", server))
        for command in (["status", "tiny"], ["list"], ["wait", "tiny", "--timeout", "5"]):
            result = run_ctl(*command, "--kubeconfig", "config.yaml", cwd=tmp_path)
            expected = f"the answer is not a Kubernetes API object ({shown}): is {server} the API server?"
            assert_one_line(result, EXIT_ERROR, expected)


def test_a_job_on_a_cluster_without_the_operator_is_said_so_not_not_found(tmp_path: Path) -> None:
    """status, logs, wait and delete said `job tiny not found` (exit 102) where list and submit named the install."""
    missing = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
    body = json.dumps(missing | {"message": "the server could not find the requested resource"}).encode()
    with answering_server(404, body) as server:
        (tmp_path / "config.yaml").write_text(KUBECONFIG.replace("https://127.0.0.1:1", server))
        for command in (["status", "tiny"], ["logs", "tiny"], ["wait", "tiny"], ["delete", "tiny", "-y"]):
            result = run_ctl(*command, "--kubeconfig", "config.yaml", cwd=tmp_path)
            assert_one_line(result, EXIT_ERROR, "error: the cluster has no PyTorchJob resource (pytorchjobs.")


def test_context_is_taken_from_a_kubeconfig_without_a_current_one_and_insecure_tls_warns_nothing(
    tmp_path: Path,
) -> None:
    """--context was refused ("no current-context (--context names one)", or a current-context that names no
    context) where kubectl takes it; and with insecure-skip-tls-verify, urllib3 wrote two warning lines per request."""
    unset = KUBECONFIG.replace("current-context: here\n", "")
    (tmp_path / "unset.yaml").write_text(unset)
    (tmp_path / "elsewhere.yaml").write_text(KUBECONFIG.replace("current-context: here", "current-context: there"))
    for kubeconfig in ("unset.yaml", "elsewhere.yaml"):
        result = run_ctl("status", "tiny", "--kubeconfig", kubeconfig, "--context", "here", cwd=tmp_path)
        assert_one_line(result, EXIT_ERROR, "error: cannot reach the API server https://127.0.0.1:1: ")
    result = run_ctl("status", "tiny", "--kubeconfig", "unset.yaml", "--context", "there", cwd=tmp_path)
    assert_one_line(result, EXIT_BAD_INPUT, "error: --context 'there': no such context in the kubeconfig")
    missing = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404, "details": {"name": "tiny"}}
    with answering_server(404, json.dumps(missing).encode(), private_ca(tmp_path / "tls", "ctl-test")) as server:
        insecure = f"{{server: {server}, insecure-skip-tls-verify: true}}"
        (tmp_path / "config.yaml").write_text(KUBECONFIG.replace('{server: "https://127.0.0.1:1"}', insecure))
        result = run_ctl("status", "tiny", "--kubeconfig", "config.yaml", cwd=tmp_path)
    assert_one_line(result, EXIT_ERROR, "error: the cluster has no PyTorchJob resource")


# -- found by the trainer, on any rank ----------------------------------------------------------------------


def causal_lm(corpus: Path, procs: int, **model: object) -> dict:
    """The tiny spec as causal-lm; `model` keys (a pretrained directory) in place of its dimensions."""
    spec = tiny_spec(corpus, task="causal-lm", sample={"maxNewTokens": 0}) | {"procsPerNode": procs}
    if model:
        spec["training"]["model"] = model
    return spec


def test_block_size_beyond_the_data_names_model_block_size(workdir, corpus_file: Path) -> None:
    spec = tiny_spec(corpus_file, model={"nLayer": 1, "nHead": 2, "nEmbd": 32, "blockSize": 1_000_000_000})
    # Found once the data is tokenized: prepared first (its own step; a complete dataset, whatever the blockSize),
    # so that the run itself must write nothing.
    path, env = workdir
    (path / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert run_ctl("prepare", "spec.yaml", cwd=path, env=env).returncode == 0
    run_bad_input(
        workdir, spec, [], "training.model.blockSize: 1000000000 is too long for the validation text", times=1
    )


def test_missing_tokenizer_directory_is_named_as_such(workdir, corpus_file: Path) -> None:
    missing = workdir[0] / "no-tokenizer"
    spec = causal_lm(corpus_file, procs=1)
    spec["training"]["tokenizer"] = {"path": str(missing)}
    run_bad_input(workdir, spec, [], f"error: training.tokenizer.path: {missing}: no such directory", times=1)


def test_a_directory_without_a_tokenizer_is_named_as_such(tmp_path: Path) -> None:
    """An empty folder (transformers says to install sentencepiece or tiktoken, which would not help), or a model
    saved without its tokenizer (transformers makes an empty GPT-2 tokenizer of its config.json)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    for directory in (tmp_path / "empty", model):
        directory.mkdir(exist_ok=True)
        with pytest.raises(SpecError) as refused:
            load_tokenizer(str(directory), "training.tokenizer.path")
        assert str(refused.value) == (
            f"training.tokenizer.path: cannot load a tokenizer from '{directory}': no tokenizer in the"
            " directory (none of"
            " tokenizer.json, tokenizer_config.json, vocab.json, vocab.txt, tokenizer.model)"
        )


def test_a_model_directory_with_broken_files_is_named_in_one_line(tmp_path: Path, corpus_file: Path) -> None:
    """Weights cut short (a copy that ended early) and a config value of the wrong type: each was a rank's exit 1 with
    the library's error, the key unnamed (for the config, only its first line: the cause was on the next)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from trainer.models import from_pretrained
    from trainer.text import train_tokenizer

    model = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(model)
    train_tokenizer([corpus_file.read_text()], 300).save_pretrained(model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(SpecError) as refused:
        from_pretrained(AutoModelForCausalLM, ModelSpec(pretrained=str(model)))
    assert str(refused.value) == (
        f"training.model.pretrained: cannot load '{model}': Error while deserializing header: incomplete metadata,"
        " file not fully covered"
    )
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"n_layer": "x"}))
    with pytest.raises(SpecError) as refused:
        load_tokenizer(str(model), "training.model.pretrained")
    assert str(refused.value).startswith(f"training.model.pretrained: cannot load a tokenizer from '{model}': ")
    assert str(refused.value).endswith("Field 'n_layer' expected int, got str (value: 'x')"), refused.value


def test_a_hub_id_where_the_hub_cannot_be_reached_is_looked_for_in_its_cache_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mistyped relative path (`models/gpt2-smal`) is a valid hub id too: without a network the hub client
    retried each file for ~25 s (a tokenizer: 50 s) before failing. Where the hub cannot be reached, only its
    cache is asked, at once; where it can, the hub is asked as before."""
    monkeypatch.chdir(tmp_path)
    for name in ("https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{free_port()}")  # no one there
    hub_out_of_reach.cache_clear()  # asked once a process: each endpoint here is asked anew
    started = time.monotonic()
    with pytest.raises(SpecError) as refused:
        load_tokenizer("models/gpt2-smal", "training.tokenizer.path")
    assert time.monotonic() - started < 10
    assert str(refused.value).startswith(
        "training.tokenizer.path: cannot load a tokenizer from 'models/gpt2-smal': no such directory here, nor"
        " in the hub's"
        " local cache (the hub cannot be reached): "
    )
    assert "\n" not in str(refused.value)
    with silent_server(accept=True) as port:  # reachable
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{port}")
        hub_out_of_reach.cache_clear()
        assert pretrained_options("models/gpt2-smal", "training.model.pretrained") == {}
    (tmp_path / "models" / "gpt2-small").mkdir(parents=True)
    assert pretrained_options("models/gpt2-small", "training.model.pretrained") == {}


def test_compile_without_a_cpp_compiler_is_found_before_any_work(workdir, corpus_file: Path) -> None:
    """Both ranks find it as they start (torch's own error came at the first step, exit 1)."""
    path, env = workdir
    spec = tiny_spec(corpus_file, compile=True) | {"procsPerNode": 2}
    expected = (
        "error: training.compile: torch.compile needs a C++ compiler for its CPU kernels (CXX, g++), and none"
        " was found: install g++, or set training.compile: false"
    )
    run_bad_input((path, env | {"CXX": str(path / "no-g++")}), spec, [], expected, times=1)


# Rank 0 rejects the input while the other rank waits for it in a collective, and loses its connection to
# rank 0, maybe before rank 0's agent has reported: rank 0's line must win, every time.


def test_race_run_dir_is_an_existing_file(workdir, corpus_file: Path) -> None:
    """Two nodes: `ctl run` picks the root cause among them."""
    (workdir[0] / "taken").write_text("a file, not a directory\n")
    spec = tiny_spec(corpus_file) | {"nodes": 2}
    expected = f"error: training.checkpoint.dir: cannot create {workdir[0] / 'taken'}: File exists"
    # The spec's key, which the trainers find: ctl refuses a --run-dir that is a file itself (PATH_CASES).
    flags = ["--set", f"training.checkpoint.dir={workdir[0] / 'taken'}"]
    run_bad_input(workdir, spec, flags, expected, times=3)


def test_race_missing_pretrained_directory(workdir, corpus_file: Path) -> None:
    """Two processes on one node: the launcher picks the root cause among them."""
    missing = workdir[0] / "no-model"
    spec = causal_lm(corpus_file, procs=2, pretrained=str(missing))
    run_bad_input(workdir, spec, [], f"error: training.model.pretrained: {missing}: no such directory", times=3)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory no run may write to: a read-only mount for root (who ignores permissions), else mode 555."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
    else:
        path.chmod(0o555)
    try:
        yield path
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(path)], check=True)


def test_race_read_only_run_dir(workdir, corpus_file: Path, read_only_dir: Path) -> None:
    spec = tiny_spec(corpus_file) | {"nodes": 2}
    expected = f"error: training.checkpoint.dir: {read_only_dir} is not writable: "
    run_bad_input(workdir, spec, ["--run-dir", str(read_only_dir)], expected, times=2)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a full tmpfs (the suite runs as root)")
def test_a_full_disk_is_one_line_and_leaves_nothing_on_it(workdir, corpus_file: Path, tmp_path: Path) -> None:
    """The write test's file was left behind, and the run directory it was written in (rank 0 alone: a race of one)."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={full / 'filler'}", "bs=4k"], capture_output=True)
        expected = f"error: training.checkpoint.dir: {full / 'runs' / 'x'} is not writable: No space left on device"
        run_bad_input(workdir, tiny_spec(corpus_file), ["--run-dir", str(full / "runs" / "x")], expected, times=1)
        assert [path.name for path in full.iterdir()] == ["filler"]
    finally:
        subprocess.run(["umount", str(full)], check=True)


def test_changed_setting_on_resume_is_one_line_and_writes_nothing(workdir, corpus_file: Path) -> None:
    path, env = workdir
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file, maxSteps=2, sample={"maxNewTokens": 0})))
    assert run_ctl("run", "spec.yaml", cwd=path, env=env).returncode == 0
    before, run_before = tree(path), exact_tree(path / "runs" / "tiny")
    flags = ["--set", "training.optimizer.lr=0.01"]
    expected = (
        "error: training.checkpoint: step-00000002 was written with different settings"
        " (changed: training.optimizer.lr);"
    )
    assert_one_line(run_ctl("run", "spec.yaml", *flags, cwd=path, env=env), EXIT_BAD_INPUT, expected)
    assert tree(path) == before
    assert exact_tree(path / "runs" / "tiny") == run_before
    # --verbose: every rank's own output and torchrun's, on the terminal.
    verbose = run_ctl("run", "spec.yaml", *flags, "--verbose", cwd=path, env=env)
    assert verbose.returncode == EXIT_BAD_INPUT
    assert (
        "[rank 0] rank 0 of 1 on " in verbose.stderr
        and "[rank 0] error: training.checkpoint: step-00000002" in verbose.stderr
    )


def test_changed_data_on_resume_is_one_line_and_writes_nothing(workdir, corpus_file: Path) -> None:
    path, env = workdir
    corpus = path / "corpus.txt"
    corpus.write_text(corpus_file.read_text())
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus, maxSteps=2, sample={"maxNewTokens": 0})))
    assert run_ctl("run", "spec.yaml", cwd=path, env=env).returncode == 0
    with corpus.open("a") as file:  # the resume would train on other data
        file.write("\nmore text\n")
    before, run_before = tree(path), exact_tree(path / "runs" / "tiny")
    expected = f"error: training.data.train: {corpus} changed since this run's checkpoints were written"
    assert_one_line(run_ctl("run", "spec.yaml", cwd=path, env=env), EXIT_BAD_INPUT, f"{expected} (size ")
    assert tree(path) == before
    assert exact_tree(path / "runs" / "tiny") == run_before
    # Its text again: the size is the checkpoints', the time is not, which the line says (not "size 5402 -> 5402").
    corpus.write_text(corpus_file.read_text())
    os.utime(corpus, ns=(0, 10**18))
    again = f"{expected} (the same size, modified at 2001-09-09 01:46:40 UTC, not "
    assert_one_line(run_ctl("run", "spec.yaml", cwd=path, env=env), EXIT_BAD_INPUT, again)


def test_with_content_fingerprints_a_resume_compares_contents_not_modification_times(workdir, corpus_file) -> None:
    """`data.fingerprint: content` is for modification times that cannot be trusted, yet the resume compared them:
    other contents at the same size and time trained on, a file only touched was refused, and prepared again."""
    path, env = workdir
    corpus = path / "corpus.txt"
    text = corpus_file.read_text()
    corpus.write_text(text)
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus, maxSteps=2, sample={"maxNewTokens": 0})))
    flags = ("--set", "training.data.fingerprint=content")
    assert run_ctl("run", "spec.yaml", *flags, cwd=path, env=env).returncode == 0
    datasets = sorted((path / "runs" / "_datasets").iterdir())
    os.utime(corpus, ns=(0, 10**18))  # touched: the same contents
    resumed = run_ctl("run", "spec.yaml", *flags, cwd=path, env=env)
    assert resumed.returncode == 0 and "resuming from step-00000002" in resumed.stdout, resumed.stdout + resumed.stderr
    assert sorted((path / "runs" / "_datasets").iterdir()) == datasets  # not prepared again
    corpus.write_text(text.replace("e", "E", 1))  # the same size, and the time it had
    os.utime(corpus, ns=(0, 10**18))
    before, run_before = tree(path), exact_tree(path / "runs" / "tiny")
    expected = (
        f"error: training.data.train: {corpus} changed since this run's checkpoints were written (the same size,"
        " other contents)"
    )
    assert_one_line(run_ctl("run", "spec.yaml", *flags, cwd=path, env=env), EXIT_BAD_INPUT, expected)
    assert tree(path) == before
    assert exact_tree(path / "runs" / "tiny") == run_before


def test_a_resume_on_another_vocabulary_is_refused_even_when_settings_may_change(workdir, corpus_file: Path) -> None:
    """allowConfigChange lets a resume read changed data; new characters there are another vocabulary, under which
    the checkpoint's embeddings would stand for other tokens (with a trained BPE, silently: the same size)."""
    path, env = workdir
    corpus = path / "corpus.txt"
    corpus.write_text(corpus_file.read_text())
    (path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus, maxSteps=2, sample={"maxNewTokens": 0})))
    assert run_ctl("run", "spec.yaml", cwd=path, env=env).returncode == 0
    with corpus.open("a") as file:
        file.write("\n\u00e9t\u00e9 \u00e0 No\u00ebl\n")  # characters the corpus has not had
    run_before = tree(path / "runs" / "tiny")  # found after the trainer's write test, which leaves nothing
    flags = ("--set", "training.checkpoint.allowConfigChange=true", "--set", "training.maxSteps=3")
    expected = "error: training.data: the vocabulary differs from the one this run's checkpoints were trained on"
    assert_one_line(run_ctl("run", "spec.yaml", *flags, cwd=path, env=env), EXIT_BAD_INPUT, expected)
    assert tree(path / "runs" / "tiny") == run_before


# -- the root cause, and where the rest is --------------------------------------------------------------------


def test_a_cause_quotes_the_first_line_with_text_and_names_an_exception_without_any() -> None:
    """What every one-line cause quotes of a longer message (a client's, a reader's, a rank's record): blank lines
    skipped; an exception without text is its type, where `str(exc).splitlines()[0]` raised IndexError."""
    assert first_line("\n  Connection refused  \nTraceback (most recent call last):") == "Connection refused"
    assert first_line(OSError()) == "OSError" and first_line(ValueError(" \n")) == "ValueError"
    assert first_line(KeyError("sources")) == "'sources'"
    assert first_line("", "exited with code 3") == "exited with code 3" and first_line("") == ""


def test_root_cause_prefers_bad_input_then_own_errors_then_stops_then_lost_peers() -> None:
    peer = Failure(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:5", time=1.0, rank=1)
    stop = Failure(EXIT_PREEMPTED, "stopped", time=1.5, rank=2)
    own = Failure(1, "FloatingPointError: training loss is nan", time=2.0, rank=0)
    killed = Failure(137, "killed by SIGKILL", time=3.0, rank=3)
    bad = Failure(EXIT_BAD_INPUT, "training.data.train: no file matches 'x'", time=4.0, rank=0)
    assert root_cause([peer, stop, own, killed, bad]) == bad
    assert root_cause([peer, stop, killed, own]) == own  # the earliest own error
    assert root_cause([peer, killed]) == killed and root_cause([peer, stop]) == stop
    assert [f.exit_code for f in (bad, own, stop, peer)] == [EXIT_BAD_INPUT, 1, EXIT_PREEMPTED, 1]
    # A hang found by a watchdog explains the ranks torchrun kills after it, not a rank's own error.
    hung = Failure(EXIT_HUNG, "hang: rank 0 completed no step for 130 s", time=5.0, rank=0)
    assert root_cause([peer, killed, stop, hung]) == hung and root_cause([hung, own]) == own
    assert hung.exit_code == EXIT_HUNG and killed.exit_code == 1


def launch_a_failing_rank(folder: Path) -> list[str]:
    """trainer.launch's arguments for one rank that fails with its own error, recorded by torch's @record."""
    script = folder / "fail.py"
    script.write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n\n"
        "@record\ndef main() -> None:\n    raise RuntimeError('the data was not prepared')\n\n\nmain()\n"
    )
    return ["--standalone", "--nproc-per-node=1", str(script)]


def test_the_launchers_last_line_is_the_root_cause_of_a_failed_rank(tmp_path: Path) -> None:
    """A rank's own error (exit 1): torchrun's report, then the root cause in one line, last. A pod's log tail is its
    termination message (the chart's FallbackToLogsOnError), whose last line `ctl status` shows. The error files it
    was read from go with the launcher: in a pod, /tmp outlives the container, and every restart would add them."""
    launch, rank = [sys.executable, "-m", "trainer.launch"], launch_a_failing_rank(tmp_path)
    env = os.environ | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([*launch, *rank], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Root Cause (first observed failure)" in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == "error: RuntimeError: the data was not prepared", done.stderr
    assert scratch_folders(tmp_path) == []
    (tmp_path / "done.py").write_text("print('done')\n")
    done = subprocess.run([*launch, "--standalone", "done.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and scratch_folders(tmp_path) == [], done.stderr
    # Its ranks' output, redirected to files in a folder torchrun chose (and named in its report), is kept.
    done = subprocess.run([*launch, "--redirects=3", *rank], cwd=tmp_path, env=env, capture_output=True, text=True)
    [logs] = tmp_path.glob("torchelastic_*/*/attempt_0/0")
    assert done.stderr.splitlines()[-1] == "error: RuntimeError: the data was not prepared", done.stderr
    assert "the data was not prepared" in (logs / "stderr.log").read_text() and str(logs.parent.parent) in done.stderr


@pytest.mark.parametrize("when", ["importing", "rendezvous"])
def test_a_launcher_as_pid_1_stops_at_sigterm_before_its_trainers_start(
    tmp_path: Path, when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher as its container's PID 1 (the image run by itself) that has not started its trainers yet, torch
    still importing or its node waiting at the rendezvous for a peer (here for ever): it exits 143 at once with one
    line, instead of ignoring SIGTERM and holding the container until SIGKILL. It leaves no heartbeat directory, and
    no folder of torchrun's."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    port = free_port()
    launch = [sys.executable, "-m", "trainer.launch", "--nnodes=2", "--nproc-per-node=1", "--node-rank=0"]
    launch += ["--master-addr=127.0.0.1", f"--master-port={port}", "-m", "trainer", "--config", "unused.yaml"]
    # Node 0 serves the rendezvous store on that port.
    code, stderr = sigterm_as_pid_1(launch, tmp_path, lambda: when == "importing" or listening("127.0.0.1", port))
    assert code == EXIT_PREEMPTED, stderr
    assert stderr.splitlines()[-1] == (
        "trainer.launch: stopped by SIGTERM before the trainers started; exiting with code 143"
    ), stderr
    assert scratch_folders(tmp_path) == []


@pytest.mark.parametrize(
    "rendezvous",
    [
        ["--nnodes=2", "--node-rank=1", "--master-addr=master.invalid", "--rdzv-conf=timeout=2"],
        # An elastic job's: c10d's time to join; its other timeouts are not this wait's.
        [
            *("--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=master.invalid:29400", "--rdzv-id=job"),
            "--rdzv-conf=join_timeout=2,timeout=30,read_timeout=30",
        ],
    ],
    ids=["static", "c10d"],
)
def test_a_launcher_whose_rendezvous_host_never_resolves_says_so_in_one_line(
    tmp_path: Path, rendezvous: list[str]
) -> None:
    """Before torchrun, the launcher looks the rendezvous host up until it has an address (a TrainJob's worker can
    start before its master's pod has one). One that never resolves ends when the rendezvous would stop waiting
    for a node to join (torchrun's `--rdzv-conf timeout=`, c10d's `join_timeout=`) with the host and the lookup's
    error, in one line and in the error file; torch never tried, so its `gai error` warnings are not there either,
    and nothing is left in the temporary directory."""
    error_file = tmp_path / "error.json"
    env = os.environ | {"TMPDIR": str(tmp_path), "TORCHELASTIC_ERROR_FILE": str(error_file)}
    launch = [sys.executable, "-m", "trainer.launch", "--nproc-per-node=1", *rendezvous]
    launch += ["-m", "trainer", "--config", "unused.yaml"]
    done = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    with pytest.raises(socket.gaierror) as lookup:  # RFC 6761: a `.invalid` name never resolves
        socket.getaddrinfo("master.invalid", 29500, type=socket.SOCK_STREAM)
    cause = f"the rendezvous host master.invalid has no address after 2 s: {lookup.value.strerror}"
    assert done.returncode == EXIT_ERROR and done.stderr.splitlines() == [f"error: {cause}"], done.stderr
    recorded = read_record(error_file, EXIT_ERROR)
    assert recorded is not None and recorded.message == cause
    assert scratch_folders(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["error.json"]


def test_the_rendezvous_host_is_looked_up_until_it_resolves_quietly(capfd: pytest.CaptureFixture[str]) -> None:
    """A name that resolves on the third lookup (the master's pod got its address meanwhile): no word of the two that
    failed. One that never does: after the timeout, the last lookup's error."""
    lookups: list[str] = []

    def resolve(host: str, port: int, type: int) -> list:
        lookups.append(host)
        if len(lookups) < 3:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, type, 6, "", ("10.0.0.7", port))]

    assert unresolved("job-node-0-0.job", 29500, timeout=60, resolve=resolve, poll_seconds=0.01) is None
    assert lookups == ["job-node-0-0.job"] * 3
    assert capfd.readouterr() == ("", "")
    lookups.clear()

    def never(host: str, port: int, type: int) -> list:
        lookups.append(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    started = time.monotonic()
    assert unresolved("job-node-0-0.job", 29500, timeout=0.2, resolve=never, poll_seconds=0.05) == (
        "Temporary failure in name resolution"
    )
    assert 0.2 <= time.monotonic() - started < 5 and len(lookups) >= 2


def test_a_killed_launchers_scratch_folders_stay_until_the_next_launcher_and_a_live_ones_stay(tmp_path: Path) -> None:
    """A launcher killed (SIGKILL after a pod's grace period, the OOM killer) runs no exit handler: its folders stay
    in the scratch volume, which outlives the container. The next launcher removes them as it makes its own, and
    leaves a live launcher's (ctl run's nodes share one /tmp) and folders without an owner (another program's)."""
    env = os.environ | {"TMPDIR": str(tmp_path)}
    make = "import os, signal, sys\nfrom trainer import scratch\n"
    make += "for prefix in scratch.PREFIXES:\n    print(scratch.make(prefix), flush=True)\n"

    def launcher(then: str, **options: Any) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", make + then], env=env, stdout=subprocess.PIPE, text=True, **options
        )

    killed = launcher("os.kill(os.getpid(), signal.SIGKILL)")
    abandoned = [Path(line) for line in killed.communicate(timeout=60)[0].split()]
    assert killed.returncode == -signal.SIGKILL and len(abandoned) == len(scratch.PREFIXES)
    assert all(p.is_dir() for p in abandoned)
    live = launcher("sys.stdin.read()", stdin=subprocess.PIPE)
    assert live.stdout is not None
    alive = [Path(live.stdout.readline().strip()) for _ in scratch.PREFIXES]
    others = [tmp_path / f"{scratch.TORCHRUN}other", tmp_path / "torchelastic_other"]
    for folder in others:
        folder.mkdir()
    following = launcher("")
    made = [Path(line) for line in following.communicate(timeout=60)[0].split()]
    assert following.returncode == 0 and len(made) == len(scratch.PREFIXES)
    # Gone: the killed launcher's (swept by the following one) and the following one's (removed at its exit).
    assert sorted(scratch_folders(tmp_path)) == sorted(alive + others)
    live.communicate("", timeout=60)
    assert live.returncode == 0 and sorted(scratch_folders(tmp_path)) == sorted(others)


def test_a_swept_folder_keeps_its_owner_file_while_any_of_it_stays_and_read_only_folders_go(tmp_path: Path) -> None:
    """A pod's launchers run as one uid without root's override of file permissions. A rank may leave read-only or
    unlistable folders in its temporary directory (a copy of a read-only tree): the sweep makes them writable, as
    TemporaryDirectory does, and removes them. What the uid may not remove at all (another uid's) keeps the folder's
    owner file, so a later sweep tries again; without it the folder would be taken for another program's and stay for
    ever. Here root without those capabilities (setpriv) is that uid: the kernel's refusals are real."""
    env = os.environ | {"TMPDIR": str(tmp_path)}
    make = "from trainer import scratch\nfor prefix in scratch.PREFIXES:\n    print(scratch.make(prefix), flush=True)\n"
    as_the_pods_uid = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", sys.executable, "-c"]

    def launcher(then: str = "") -> list[Path]:
        run = subprocess.run([*as_the_pods_uid, make + then], env=env, capture_output=True, text=True, timeout=60)
        assert run.stderr == "", run.stderr
        return [Path(line) for line in run.stdout.split()]

    killed = launcher("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    ranks = next(folder for folder in killed if folder.name.startswith(scratch.RANKS))
    copy, foreign = ranks / "copy", ranks / "foreign"
    for folder, mode in ((copy / "tree", 0o000), (copy, 0o555)):  # the tree unlistable, the copy read-only
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "file").touch()
        folder.chmod(mode)
    foreign.mkdir()
    (foreign / "file").touch()
    for path in (foreign / "file", foreign):
        os.chown(path, 1000, 1000)
    launcher()
    assert scratch_folders(tmp_path) == [ranks]
    assert sorted(path.name for path in ranks.iterdir()) == sorted([owned.OWNER, foreign.name])
    for path in (foreign / "file", foreign):  # now the uid's to remove
        os.chown(path, 0, 0)
    launcher()
    assert scratch_folders(tmp_path) == []


def test_a_temporary_directory_the_sweep_cannot_list_still_gets_the_launchers_folders(tmp_path: Path) -> None:
    """A temporary directory its user may write but not list (mode 0333 for the pod's uid 1000): the sweep is tidying,
    never a reason for the launcher to fail. Root lists any directory, so the kernel's refusal, the one uid 1000
    would get, is raised here by the listing itself, for the sweep only."""
    code = "import os\nfrom trainer import scratch\nlisting = os.scandir\n"
    code += "def refused(path):\n    raise PermissionError(13, 'Permission denied', path)\n"
    code += "os.scandir = refused\nprint(scratch.make(scratch.HEARTBEATS), flush=True)\nos.scandir = listing\n"
    env = os.environ | {"TMPDIR": str(tmp_path)}
    made = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and Path(made.stdout.strip()).parent == tmp_path, made.stderr
    assert scratch_folders(tmp_path) == []  # removed at its exit


def test_what_the_ranks_leave_in_the_temporary_directory_goes_with_their_launcher(
    tmp_path: Path, temporary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that ends without its exit handlers (its watchdog's os._exit, a kill) leaves its temporary files behind
    (W&B's folders, multiprocessing's): they are in a folder of its launcher's, removed with it. torch.compile's
    cache stays where torch puts it by default, in the temporary directory, or where it is chosen."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "rank.py").write_text(
        "import os, tempfile\nfrom torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "tempfile.mkdtemp()\nprint(tempfile.gettempdir(), cache_dir(), flush=True)\nos._exit(0)\n"
    )
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    default = Path(default_cache_dir())  # torch's, for that temporary directory
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": str(temporary)}
    launch = [sys.executable, "-m", "trainer.launch", "--standalone", "--nproc-per-node=2", "rank.py"]
    for chosen in (None, work / "cache"):
        options = {} if chosen is None else {"TORCHINDUCTOR_CACHE_DIR": str(chosen)}
        done = subprocess.run(launch, cwd=work, env=env | options, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        printed = {tuple(map(Path, line.split())) for line in done.stdout.splitlines()}
        assert len(printed) == 1, f"the ranks printed other lines:\n{done.stdout}{done.stderr}"  # the same for both
        [(ranks, cache)] = printed
        assert ranks.parent == temporary and ranks.name.startswith(scratch.RANKS), ranks
        assert cache == (chosen or default)
        assert list(temporary.iterdir()) == [default], done.stderr


def test_nothing_a_thread_writes_while_the_launcher_ends_comes_after_its_last_line(tmp_path: Path) -> None:
    """torch's TCPStore server thread, in the launcher, warns on stderr about every peer whose hostname it cannot
    look up, also while the launcher ends: on a node such a warning came after the root cause and became the pod's
    termination message. Here a thread of the launcher's writes to both streams every millisecond until the process
    is gone, and the root cause is still the last line. (Not in a tight loop: a write blocked on a full pipe when
    the launcher silences its streams may still land after the last line; the pods' warnings are far apart.)"""
    launcher = (
        "import os, sys, threading, time\nfrom trainer.launch import main\n\n\ndef noise() -> None:\n"
        "    while True:\n        os.write(2, b'[W socket.cpp:207] hostname\\n')\n        os.write(1, b'out\\n')\n"
        "        time.sleep(0.001)\n\n\n"
        "threading.Thread(target=noise, daemon=True).start()\n"
        f"sys.argv = ['trainer.launch', *{launch_a_failing_rank(tmp_path)!r}]\nmain()\n"
    )
    done = subprocess.run([sys.executable, "-c", launcher], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "hostname" in done.stderr and "out" in done.stdout, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "error: RuntimeError: the data was not prepared", done.stderr[-2000:]


def test_a_position_table_larger_than_the_machine_names_model_block_size() -> None:
    # The most positions an int32 holds, 4,096 wide: 32 TiB of weights, which no machine has.
    spec = ModelSpec(nLayer=1, nHead=2, nEmbd=4096, blockSize=2**31 - 1)
    with pytest.raises(SpecError, match=r"^training\.model\.blockSize: 2147483647 positions x nEmbd 4096 take \d+ GiB"):
        gpt_config(spec, vocab_size=100, eos_id=0)


def test_logs_stay_where_they_are_when_there_is_no_run_directory(tmp_path: Path) -> None:
    logs = tmp_path / "logs-tmp"
    (logs / "node-0").mkdir(parents=True)
    (logs / "node-0.log").write_text("torchrun\n")
    (tmp_path / "file").write_text("")
    assert keep_logs(logs, tmp_path / "file", "20260101-000000") == logs
    assert keep_logs(logs, tmp_path / "absent", "20260101-000000") == logs and not (tmp_path / "absent").exists()
    (tmp_path / "run").mkdir()
    kept = keep_logs(logs, tmp_path / "run", "20260101-000000")
    assert kept == tmp_path / "run" / "logs" / "20260101-000000" and (kept / "node-0.log").read_text() == "torchrun\n"
    assert not logs.exists()
    (logs / "node-0").mkdir(parents=True)  # a second run, started in the same second, keeps both
    again = keep_logs(logs, tmp_path / "run", "20260101-000000")
    assert again.name.startswith("20260101-000000-") and (kept / "node-0.log").exists()


# -- signals ---------------------------------------------------------------------------------------------------


def start_long_run(
    path: Path, env: dict[str, str], corpus: Path, hooks: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """A 2-node `ctl run` that trains until stopped, once it has logged its first step: (ctl, its stdout so far)."""
    spec = tiny_spec(corpus, maxSteps=100_000, checkpoint={"every": 0}, sample={"maxNewTokens": 0}) | {"nodes": 2}
    (path / "spec.yaml").write_text(yaml.safe_dump(spec))
    ctl = start_ctl("run", "spec.yaml", cwd=path, env=env, merge_stderr=False, hooks=hooks)
    assert ctl.stdout is not None
    seen = []
    for line in ctl.stdout:
        seen.append(line)
        if "| loss " in line:
            return ctl, "".join(seen)
    raise AssertionError(f"the run ended before its first step: {ctl.communicate()}")


def assert_stopped(ctl: subprocess.Popen, run_dir: Path, how: str) -> int:
    """ctl exited 143 and said `how` the run stopped, and where it resumes: that step, the newest checkpoint's."""
    _, stderr = ctl.communicate(timeout=120)
    assert ctl.returncode == EXIT_PREEMPTED, stderr
    assert "error" not in stderr and "failed" not in stderr and f"ctl: {how}: stopped" in stderr, stderr
    stopped = STOPPED.search(stderr)
    assert stopped, stderr
    assert (run_dir / LATEST_CHECKPOINT).read_text().strip() == f"step-{int(stopped.group(1)):08d}"
    return int(stopped.group(1))


# Rank 0's checkpoint writes take 20 s (a big model's), from a sitecustomize module every Python process of the run
# imports; with checkpoint.every 0 the only one is the save at a stop.
SLOW_SAVE = import_hook(
    "trainer.checkpoint",
    """
    write = module.Checkpointer.write

    def slow(self, snapshot):
        time.sleep(20)
        return write(self, snapshot)

    module.Checkpointer.write = slow
    """,
)


@pytest.mark.timeout(300)
def test_ctl_run_gives_a_slow_save_the_spec_s_grace_period_and_a_second_ctrl_c_kills_at_once(
    workdir, corpus_file, marked_env
) -> None:
    """ctl killed the nodes 15 s after SIGTERM, whatever terminationGracePeriodSeconds said: a save longer than that
    was lost. Now they have the grace period a pod has (120 s by default); a second Ctrl-C kills them at once."""
    path, env = workdir
    marker = marked_env[1]
    (path / "hook").mkdir()
    (path / "hook" / "sitecustomize.py").write_text(SLOW_SAVE)
    env |= {MARKER_ENV: marker}
    run_dir = path / "runs" / "tiny"
    ctl, _ = start_long_run(path, env, corpus_file, hooks=path / "hook")
    try:
        asked = time.monotonic()
        ctl.send_signal(signal.SIGINT)
        _, stderr = ctl.communicate(timeout=120)
        assert ctl.returncode == EXIT_INTERRUPTED and time.monotonic() - asked > 20, stderr
        assert "ctl: stopping: the nodes save and exit within 120 s (terminationGracePeriodSeconds)" in stderr
        saved = STOPPED.search(stderr)
        assert saved and (run_dir / LATEST_CHECKPOINT).read_text().strip() == f"step-{int(saved[1]):08d}", stderr

        ctl, started = start_long_run(path, env, corpus_file, hooks=path / "hook")
        assert f"resuming from step-{int(saved[1]):08d}" in started
        ctl.send_signal(signal.SIGINT)
        time.sleep(3)  # rank 0 is writing its checkpoint
        asked = time.monotonic()
        ctl.send_signal(signal.SIGINT)
        _, stderr = ctl.communicate(timeout=60)
        assert ctl.returncode == EXIT_INTERRUPTED and time.monotonic() - asked < 15, stderr
        assert "ctl: killed the nodes at a second signal, before they had all saved and exited" in stderr
        assert f"stopped at step {saved[1]}, resumable" in stderr  # the save was cut short: the first run's step
    finally:
        if ctl.poll() is None:
            ctl.kill()
    assert processes_with_marker(marker) == []


def test_a_second_run_into_a_run_directory_in_use_is_refused(workdir, corpus_file, marked_env) -> None:
    """Both runs trained, wrote checkpoints, final/ and report.json, and exited 0. The first run's nodes hold the run
    directory while they live: with ctl itself killed (SIGKILL) too, when they train on by themselves. A run that
    ends leaves no lock file in the node cache (one was left for every run directory ever used)."""
    path, env = workdir
    marker = marked_env[1]
    env |= {MARKER_ENV: marker, NODE_CACHE_ENV: str(path / "node")}
    ctl, _ = start_long_run(path, env, corpus_file)
    in_use = f"error: {path / 'runs' / 'tiny'}: another ctl run trains there (process {ctl.pid}): wait for it"
    try:
        assert_one_line(run_ctl("run", "spec.yaml", cwd=path, env=env), EXIT_ERROR, in_use)
        ctl.kill()
        ctl.communicate()
        assert processes_with_marker(marker)  # its nodes, training on
        assert_one_line(run_ctl("run", "spec.yaml", cwd=path, env=env), EXIT_ERROR, in_use)
    finally:
        ctl.kill()
        for pid in processes_with_marker(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []
    finished = run_ctl("run", "spec.yaml", "--set", "training.maxSteps=2", cwd=path, env=env)
    assert finished.returncode == 0, finished.stderr
    assert list((path / "node" / "locks").iterdir()) == []


@pytest.mark.timeout(400)
def test_sigterm_to_the_nodes_or_to_ctl_stops_at_a_saved_step_and_resumes(workdir, corpus_file, marked_env) -> None:
    """Preemption (SIGTERM to every agent, as pods get it), then SIGTERM to ctl itself (a CI runner's cancel,
    `timeout`): each time every rank saves at one agreed step; exit 143 with the step, never a failure."""
    path, env = workdir
    marker = marked_env[1]
    env |= {MARKER_ENV: marker}
    run_dir = path / "runs" / "tiny"
    ctl, _ = start_long_run(path, env, corpus_file)
    try:
        agents = subprocess.run(["pgrep", "-P", str(ctl.pid)], capture_output=True, text=True).stdout.split()
        assert len(agents) == 2, agents
        for agent in agents:
            os.killpg(int(agent), signal.SIGTERM)
        preempted = assert_stopped(ctl, run_dir, "the nodes got SIGTERM")

        ctl, started = start_long_run(path, env, corpus_file)
        assert f"resuming from step-{preempted:08d}" in started
        time.sleep(1)
        ctl.send_signal(signal.SIGTERM)
        terminated = assert_stopped(ctl, run_dir, "terminated (SIGTERM)")
        assert terminated > preempted

        # SIGHUP (its terminal closed, an ssh session lost) too: the nodes, in sessions of their own, trained on.
        ctl, started = start_long_run(path, env, corpus_file)
        time.sleep(1)
        ctl.send_signal(signal.SIGHUP)
        assert assert_stopped(ctl, run_dir, "terminated (SIGHUP)") > terminated
    finally:
        if ctl.poll() is None:
            ctl.kill()
    assert processes_with_marker(marker) == []
