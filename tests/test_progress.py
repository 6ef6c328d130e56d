"""Progress in a TrainJob's status (Trainer v2.3's TrainJobStatus, KEP-2779): rank 0's reports match what the
status server decodes and the CRD admits, a slow, refusing or absent server costs training nothing, and a real
2-process run reports to an HTTPS server (a stand-in for the controller's, with its own CA) with a bearer token."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from certs import Tls, private_ca
from conftest import run_ctl, tiny_spec
from test_chart import crd_schema, go_module_dir
from test_trainjob import CRDS, TRAINER

from ctl.kinds import TRAINJOB
from trainer.names import PROGRESS_CA_CERT_ENV, PROGRESS_TOKEN_ENV, PROGRESS_URL_ENV
from trainer.progress import ProgressReporter, trainer_status

STATUS_PATH = TRAINJOB.path("default", "tiny") + "/status"


@pytest.fixture(scope="module")
def status_schema() -> dict[str, Any]:
    """The TrainJob's `status` schema from Trainer v2.3's own CRD (strict: unknown fields fail)."""
    schema = crd_schema(TRAINER, CRDS.format(TRAINJOB.plural), TRAINJOB.kind, version=TRAINJOB.version)
    return schema["properties"]["status"]


def check_body(body: dict[str, Any], status_schema: dict[str, Any]) -> None:
    """What the server decodes into UpdateTrainJobStatusRequest and applies as the TrainJob's status."""
    jsonschema.Draft7Validator(status_schema, format_checker=jsonschema.FormatChecker()).validate(body)
    rule = status_schema["properties"]["trainerStatus"]["x-kubernetes-validations"][0]["rule"]
    assert rule == "has(self.lastUpdatedTime)" and "lastUpdatedTime" in body["trainerStatus"]


def test_the_request_is_what_the_status_server_decodes(status_schema: dict[str, Any]) -> None:
    # The body is UpdateTrainJobStatusRequest: one field, trainerStatus, of the type the CRD's status carries.
    types = (go_module_dir(TRAINER) / "pkg/apis/trainer/v1alpha1/trainjob_types.go").read_text()
    request = re.search(r"type UpdateTrainJobStatusRequest struct \{(.*?)\n\}", types, re.S)
    assert request is not None
    assert re.findall(r"^\s*(\w+ \*?\w+ `json:\"[^\"]+\"`)", request.group(1), re.M) == [
        'TrainerStatus *TrainerStatus `json:"trainerStatus,omitempty"`'
    ]

    metrics = {"loss": 2.718281828459045, "step": 7, "tokens_per_second": 1.5e300, "accuracy": float("nan")}
    body = trainer_status(7, 20, 12.6, metrics)
    check_body(body, status_schema)
    status = body["trainerStatus"]
    assert (status["progressPercentage"], status["estimatedRemainingSeconds"]) == (35, 13)
    assert status["metrics"] == [
        {"name": "loss", "value": "2.71828"},
        {"name": "step", "value": "7"},
        {"name": "tokens_per_second", "value": "1.5e+300"},
        {"name": "accuracy", "value": "nan"},
    ]
    # Unknown remaining time is left out; progress stays within 0..100.
    assert "estimatedRemainingSeconds" not in trainer_status(0, 20, None, {})["trainerStatus"]
    assert trainer_status(25, 20, -3, {})["trainerStatus"]["progressPercentage"] == 100
    check_body(trainer_status(25, 20, -3, {}), status_schema)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A CA of its own and a server certificate it signed for 127.0.0.1, as the controller's webhook CA signs its."""
    return private_ca(tmp_path_factory.mktemp("tls"), "test status server CA")


@dataclass
class StatusServer:
    """An HTTPS server recording each request; `answer` is what it does (by default: 200 and the body back)."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    entered: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    release: threading.Event = field(default_factory=threading.Event)
    status: int = 200
    hold: bool = False  # each request waits for `release` before it is answered


@pytest.fixture
def status_server(tls: Tls) -> Iterator[StatusServer]:
    state = StatusServer(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append({"path": self.path, "authorization": self.headers["Authorization"], "body": body})
            state.entered.release()
            if state.hold:
                state.release.wait()
            reply = body if state.status == 200 else {"kind": "Status", "message": "Forbidden", "code": state.status}
            data = json.dumps(reply).encode()
            try:
                self.send_response(state.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # a client that gave up on a held request closed its end
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    state.url = f"https://127.0.0.1:{server.server_address[1]}{STATUS_PATH}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()


def reporter(url: str, tls: Tls, tmp_path: Path, warnings: list[str], **options: float) -> ProgressReporter:
    token = tmp_path / "token"
    token.write_text("projected-token\n")
    return ProgressReporter(url, str(tls.ca_file), str(token), warn=warnings.append, **options)


def test_updates_made_while_one_is_in_flight_are_replaced_by_the_newest(
    status_server: StatusServer, tls: Tls, tmp_path: Path, status_schema: dict[str, Any]
) -> None:
    status_server.hold = True
    warnings: list[str] = []
    with reporter(status_server.url, tls, tmp_path, warnings, min_interval=0) as progress:
        progress.report(1, 100, {"loss": 3.0})
        assert status_server.entered.acquire(timeout=60)  # the first request is in the server, held there
        for step in range(2, 101):
            progress.report(step, 100, {"loss": 3.0 - step / 100, "step": step})
        status_server.release.set()
        assert status_server.entered.acquire(timeout=60)
    assert [r["body"]["trainerStatus"]["progressPercentage"] for r in status_server.requests] == [1, 100]
    assert {"name": "step", "value": "100"} in status_server.requests[1]["body"]["trainerStatus"]["metrics"]
    assert all(
        r["path"] == STATUS_PATH and r["authorization"] == "Bearer projected-token" for r in status_server.requests
    )
    for request in status_server.requests:
        check_body(request["body"], status_schema)
    assert warnings == []


def test_a_server_that_never_answers_holds_neither_the_loop_nor_its_end(
    status_server: StatusServer, tls: Tls, tmp_path: Path
) -> None:
    status_server.hold = True
    warnings: list[str] = []
    with reporter(status_server.url, tls, tmp_path, warnings, min_interval=0, timeout=1) as progress:
        for step in range(1, 101):
            progress.report(step, 100, {"loss": 1.0})
    assert not status_server.release.is_set()  # training is over while the server still holds its request
    assert progress.thread is not None
    progress.thread.join(timeout=60)  # each request gave up after its timeout; the sender is done
    assert not progress.thread.is_alive()
    assert len(warnings) == 1 and "timed out" in warnings[0], warnings


def test_a_refusing_or_absent_server_is_one_warning_line(status_server: StatusServer, tls: Tls, tmp_path: Path) -> None:
    status_server.status = 403
    warnings: list[str] = []
    with reporter(status_server.url, tls, tmp_path, warnings, min_interval=0) as progress:
        for step in range(1, 51):
            progress.report(step, 50, {"loss": 1.0})
    assert status_server.requests and warnings == [
        f"warning: cannot report progress to the TrainJob status at {status_server.url}: HTTP 403: Forbidden;"
        " training goes on (further failures are not logged)"
    ]

    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        absent = f"https://127.0.0.1:{unused.getsockname()[1]}{STATUS_PATH}"
    warnings.clear()
    with reporter(absent, tls, tmp_path, warnings, min_interval=0) as progress:
        for step in range(1, 51):
            progress.report(step, 50, {"loss": 1.0})
    assert len(warnings) == 1 and "Connection refused" in warnings[0]


def test_without_the_environment_nothing_is_sent(status_server: StatusServer) -> None:
    with ProgressReporter.from_env({}) as progress:
        progress.report(1, 1, {"loss": 1.0})
    assert progress.thread is None and not status_server.requests


def test_a_two_process_run_reports_progress_from_rank_0(
    status_server: StatusServer, tls: Tls, tmp_path: Path, write_spec, corpus_file: Path, status_schema: dict[str, Any]
) -> None:
    token = tmp_path / "token"
    token.write_text("projected-token")
    # What Trainer v2's TrainJobStatus plugin gives the trainer container: a URL, the CA's and the token's paths.
    env = {PROGRESS_URL_ENV: status_server.url, PROGRESS_CA_CERT_ENV: str(tls.ca_file), PROGRESS_TOKEN_ENV: str(token)}
    spec = tiny_spec(corpus_file, maxSteps=6) | {"procsPerNode": 2}
    run = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=os.environ | env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cannot report progress" not in run.stdout + run.stderr
    bodies = [request["body"] for request in status_server.requests]
    assert bodies, "no progress report reached the server"
    for request in status_server.requests:
        assert (request["path"], request["authorization"]) == (STATUS_PATH, "Bearer projected-token")
        check_body(request["body"], status_schema)
    # Only rank 0 reports: one final update, 100% with nothing left, and the last step's metrics.
    final = [b["trainerStatus"] for b in bodies if b["trainerStatus"]["progressPercentage"] == 100]
    assert len(final) == 1 and final[0] == bodies[-1]["trainerStatus"]
    assert final[0]["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in final[0]["metrics"]}
    assert metrics["step"] == "6" and float(metrics["loss"]) > 0 and float(metrics["tokens_per_second"]) > 0
    report = json.loads((tmp_path / "runs" / "tiny" / "report.json").read_text())
    assert report["world_size"] == 2
