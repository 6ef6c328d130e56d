"""Runs on object storage (`training.checkpoint.dir: s3://bucket/prefix`) against a real S3 server (versitygw,
tests/s3server.py): checkpoints committed by their marker object, retention after the commit, resume from the
bucket, bad buckets and credentials refused with one line."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import yaml
from certs import Tls, private_ca
from conftest import REPO, rank_log, run_ctl, start_ctl, tensorboard_scalars, tiny_spec
from s3server import S3Server, s3_server
from test_checkpoint import (
    EVERY,
    EXIT_PREEMPTED,
    STEPS,
    STOPPED,
    assert_bitwise_equal,
    finish,
    kill_all,
    processes_with_marker,
    read_until_step,
    save_steps_with_losses,
    start,
    training,
    uninterrupted,  # noqa: F401 (a fixture: the weights of the same run, uninterrupted, on the local disk)
)
from test_failures import silent_server
from test_tracking import mlflow_env  # noqa: F401 (a fixture: MLflow's file store in the test's directory)

from ctl.processes import LOCAL_ADDRESS, free_port
from trainer.checkpoint import MARKER, Checkpointer, TrainerState
from trainer.dist import Dist
from trainer.location import NODE_CACHE_ENV, S3_CA_BUNDLE_ENV, S3_ENDPOINT_ENV, S3_REGION_ENV, S3_SECRET_KEY_ENV
from trainer.names import EXIT_BAD_INPUT
from trainer.preparation.readers import Skipped, documents, read_texts
from trainer.prepare import prepare_spec
from trainer.rundir import publish
from trainer.spec import CheckpointSpec, DataSpec, SpecError, TrainingSpec
from trainer.storage import StorageUnreachable, matching_objects, reason, s3_client, s3_sources
from trainer.text import expand_paths
from trainer.tracking import Tracker


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """This process talks to the test server through the standard AWS variables; its run cache is `tmp_path`."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(NODE_CACHE_ENV, str(tmp_path / "cache"))
    return s3


def checkpointer(uri: str, tmp_path: Path, **spec: Any) -> Checkpointer:
    dist = Dist(0, 0, 1, torch.device("cpu"))
    return Checkpointer(tmp_path / "local", CheckpointSpec(dir=uri, **spec), dist, {"maxSteps": 10})


def training_state(size: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = torch.nn.Linear(size, size)
    return model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)


def test_keeps_the_newest_and_the_best_in_the_bucket_and_prunes_only_after_a_commit(
    s3_env: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, optimizer, scaler = training_state()
    checkpoints = checkpointer(f"s3://{bucket}/runs/a", tmp_path, keepLast=2, keepBest=True)
    save_steps_with_losses(checkpoints, model, optimizer, scaler)
    run = s3_env.root / bucket / "runs" / "a"
    assert sorted(path.name for path in run.iterdir()) == ["latest", "step-00000002", "step-00000004", "step-00000005"]
    assert (run / "latest").read_text() == "step-00000005\n"
    assert not list((tmp_path / "local").rglob("*.safetensors"))  # each upload's local staging is gone


def test_resumes_from_the_bucket_exactly_and_ignores_a_folder_without_its_marker(
    s3_env: S3Server, bucket: str, tmp_path: Path
) -> None:
    """An upload cut before its marker (here: step 3's files without it) is no checkpoint: the resume takes step 2,
    whose tensors come back bitwise from the bucket into another process's cache."""
    model, optimizer, scaler = training_state()
    uri = f"s3://{bucket}/run"
    checkpoints = checkpointer(uri, tmp_path, asyncSave=True)
    checkpoints.attach(model, optimizer, scaler, TrainerState(step=2))
    checkpoints.save()
    checkpoints.wait()
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    run = s3_env.root / bucket / "run"
    torn = run / "step-00000003"
    torn.mkdir()
    for name in ("model.safetensors", "state.json"):
        (torn / name).write_bytes((run / "step-00000002" / name).read_bytes())
    with torch.no_grad():
        model.weight.add_(1.0)
    other = checkpointer(uri, tmp_path / "elsewhere")
    assert [name for _, name in other.committed()] == ["step-00000002"]
    other.attach(model, optimizer, scaler, TrainerState())
    state, _ = other.load_latest()
    assert state.step == 2
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items())
    other.clean()  # what a start does before training: the torn upload goes
    assert sorted(path.name for path in run.iterdir()) == ["latest", "step-00000002"]


def test_each_checkpoint_uploads_only_the_event_files_closed_since_the_one_before(
    s3_env: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer closes the TensorBoard event file before each save on object storage; the save uploads the files
    the bucket lacks: one more object per checkpoint, the earlier ones never written again, however long the run.
    The bucket's event files are listed once, not at each checkpoint. Every value comes back from the bucket after
    the end's upload."""
    model, optimizer, scaler = training_state()
    checkpoints = checkpointer(f"s3://{bucket}/run", tmp_path)
    listed: list[str] = []
    listing = checkpoints.store.listing
    monkeypatch.setattr(checkpoints.store, "listing", lambda folder: listed.append(folder) or listing(folder))
    state = TrainerState()
    checkpoints.attach(model, optimizer, scaler, state)
    spec = TrainingSpec.model_validate({"task": "char-gpt", "data": {"train": "corpus.txt"}})
    tracker = Tracker(spec, True, checkpoints.run_dir)
    tracker.start_events(None)
    events = s3_env.root / bucket / "run" / "tensorboard"

    def objects() -> dict[str, tuple[int, int]]:
        """Each event object's file in the server's store: a new upload of it would be a new inode or mtime."""
        return {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in events.iterdir()}

    uploaded: dict[str, tuple[int, int]] = {}
    for step in range(1, 8):
        tracker.log(step, {"train/loss": 1 / step})
        if step % 2 == 0:
            state.step = step
            tracker.seal_events()  # as the trainer does before each save on object storage
            checkpoints.save()
            now = objects()
            assert now.items() >= uploaded.items() and len(now) == len(uploaded) + 1
            uploaded = now
    publish(checkpoints.run_dir, checkpoints.store)  # the end's upload: the file still open, step 7
    assert objects().items() >= uploaded.items() and len(objects()) == len(uploaded) + 1
    assert len({name.split(".")[3] for name in objects()}) == 4  # each opened in its own second: read in order
    assert listed.count("tensorboard") == 1
    tracker.close(0)
    assert tensorboard_scalars(events.parent)["train/loss"] == [(step, pytest.approx(1 / step)) for step in range(1, 8)]


def test_a_missing_bucket_and_refused_credentials_are_one_line_naming_the_key(
    s3: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env(secret="not-the-secret").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        SpecError, match=r"^training\.checkpoint\.dir: cannot use s3://[\w-]+/run: SignatureDoesNotMatch: "
    ):
        checkpointer(f"s3://{bucket}/run", tmp_path).store.check(writable=True)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(
        SpecError, match=r"^training\.checkpoint\.dir: cannot use s3://no-such-bucket/run: NoSuchBucket: "
    ):
        checkpointer("s3://no-such-bucket/run", tmp_path).store.check(writable=True)
    monkeypatch.setenv(S3_REGION_ENV, "eu-west-1")  # the server's message quotes it, escaped in its XML (&#34;)
    with pytest.raises(SpecError, match=r': AuthorizationHeaderMalformed: .*"eu-west-1"') as wrong_region:
        checkpointer(f"s3://{bucket}/run", tmp_path).store.check(writable=True)
    assert "&" not in str(wrong_region.value)


def test_a_server_that_is_not_there_is_its_root_cause_in_one_line(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No server at the endpoint: the request and the system's reason, not the client's 'error sending request'
    and its error chain. Not bad input (exit 2, never retried): an S3 server restarting as the job starts is no
    answer too, so the rank exits 1 with the line, and the job's restart policy tries again; s3:// data alike."""
    endpoint = f"http://{LOCAL_ADDRESS}:{free_port()}"
    monkeypatch.setenv(S3_ENDPOINT_ENV, endpoint)
    with pytest.raises(StorageUnreachable) as refused:
        checkpointer("s3://runs/a", tmp_path).store.check(writable=True)
    expected = rf"(GET|HEAD) {endpoint}/runs\S*: Connection refused \(after \d+ retries in [\d.]+ s\)"
    assert re.fullmatch(rf"training\.checkpoint\.dir: cannot reach s3://runs/a: {expected}", str(refused.value)), (
        refused.value
    )
    with pytest.raises(
        StorageUnreachable, match=rf"^training\.data\.train: cannot reach s3://runs/corpus/: {expected}$"
    ):
        s3_sources("s3://runs/corpus/", "training.data.train")


@contextlib.contextmanager
def web_server() -> Iterator[int]:
    """A web server that is no S3 server on a free port: it answers 404 to everything; its port."""

    class NotS3(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((LOCAL_ADDRESS, 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ("silent", "no answer, timed out"),
        ("404", "404 Not Found, an answer that is no S3 error (is the endpoint an S3 server?)"),
    ],
)
def test_an_endpoint_that_is_no_s3_server_is_named_with_what_it_did(
    s3_env: S3Server, monkeypatch: pytest.MonkeyPatch, answer: str, cause: str
) -> None:
    """The client as the trainer builds it, its request timeout and retries lowered (by default a silent server
    takes 3 minutes: 30 s a request, retried for 180 s)."""
    import obstore
    import obstore.store

    with silent_server(accept=True) if answer == "silent" else web_server() as port:
        endpoint = f"http://{LOCAL_ADDRESS}:{port}"
        monkeypatch.setenv(S3_ENDPOINT_ENV, endpoint)
        store = obstore.store.S3Store(
            "runs",
            client_options={"allow_http": True, "timeout": "1s"},
            retry_config={"max_retries": 1, "retry_timeout": datetime.timedelta(seconds=3)},
        )
        with pytest.raises(obstore.exceptions.BaseError) as failed:
            obstore.list_with_delimiter(store, "a/")
    assert re.fullmatch(
        rf"GET {endpoint}/runs: {re.escape(cause)} \((after 1 retries )?in [\d.]+ s\)", reason(failed.value)
    )


@pytest.fixture(scope="module")
def s3_private_ca(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Tls]]:
    """The S3 server over HTTPS, its certificate signed by a CA of the test's own (as an on-premises one's is)."""
    tls = private_ca(tmp_path_factory.mktemp("s3-ca"), "test S3 CA")
    with s3_server(tmp_path_factory.mktemp("s3-tls"), tls=tls) as server:
        yield server, tls


def test_aws_ca_bundle_names_the_private_ca_that_signed_the_endpoint(
    s3_private_ca: tuple[S3Server, Tls], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it the line says what is wrong and where the CA goes; with it the bucket is used; a file that is not
    there or holds no certificate is bad input naming the variable."""
    s3, tls = s3_private_ca
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(NODE_CACHE_ENV, str(tmp_path / "cache"))
    s3.bucket("private")
    with pytest.raises(SpecError) as untrusted:
        checkpointer("s3://private/run", tmp_path).store.check(writable=True)
    assert str(untrusted.value).startswith(
        f"training.checkpoint.dir: cannot use s3://private/run: GET {s3.endpoint}/private: the server's TLS"
        " certificate is not"
        f" trusted (UnknownIssuer): a private CA's certificates go in AWS_CA_BUNDLE (the chart's storage.caBundle)"
    ), untrusted.value
    monkeypatch.setenv(S3_CA_BUNDLE_ENV, str(tls.ca_file))
    checkpointer("s3://private/run", tmp_path).store.check(writable=True)
    other_name = s3.endpoint.replace(LOCAL_ADDRESS, "localhost")  # the certificate names 127.0.0.1 only
    monkeypatch.setenv(S3_ENDPOINT_ENV, other_name)
    with pytest.raises(SpecError) as refused:
        checkpointer("s3://private/run", tmp_path).store.check(writable=True)
    assert f"GET {other_name}/private: the server's TLS certificate is refused (NotValidFor" in str(refused.value)
    monkeypatch.setenv(S3_ENDPOINT_ENV, s3.endpoint)
    for bundle, problem in [
        (tmp_path / "missing.crt", "cannot read '{}': No such file or directory"),
        (tls.key_file, "'{}' holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
    ]:
        monkeypatch.setenv(S3_CA_BUNDLE_ENV, str(bundle))
        with pytest.raises(SpecError, match=f"^AWS_CA_BUNDLE: {re.escape(problem.format(bundle))}$"):
            checkpointer("s3://private/run", tmp_path)
    broken = tmp_path / "broken.crt"
    broken.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv(S3_CA_BUNDLE_ENV, str(broken))
    with pytest.raises(SpecError, match=r"^AWS_CA_BUNDLE: '.*broken\.crt': a certificate it holds is invalid \(\w+\)$"):
        checkpointer("s3://private/run", tmp_path)
    # Not base64 between the PEM lines: the client's `builder error`, with a traceback, at its first request.
    broken.write_text("-----BEGIN CERTIFICATE-----\nnot*base64!\n-----END CERTIFICATE-----\n")
    not_pem = r"^AWS_CA_BUNDLE: '.*broken\.crt': a certificate it holds is not PEM \(base64\)$"
    with pytest.raises(SpecError, match=not_pem):
        checkpointer("s3://private/run", tmp_path)


def test_no_keys_and_no_cloud_identity_is_said_so_not_blamed_on_the_endpoint() -> None:
    """Without keys the client asks the node's cloud identity (AWS's instance metadata service), whose refusal was
    `PUT http://169.254.169.254/...: 403 Forbidden, an answer that is no S3 error (is the endpoint an S3 server?)`.
    The client's own words (a machine whose proxy refuses that address), not a server of the test's."""
    refused = RuntimeError(
        "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in 1.457108ms - Server"
        " returned non-2xx status code: 403 Forbidden: resolve_deny: denied destination\n\nDebug source:\nGeneric"
        ' {\n    store: "S3",\n    source: RetryError(\n        RetryErrorImpl {\n            method: PUT,\n'
    )
    assert reason(refused) == (
        "no S3 keys: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are not set (storage.secretName names a Secret of"
        " them), and the node's cloud identity gave none (PUT http://169.254.169.254/latest/api/token: 403 Forbidden)"
    )


@pytest.mark.parametrize(("elapsed", "seconds"), [("1.2s", "1.2"), ("420.5ms", "0.4"), ("997.611\u00b5s", "0.0")])
def test_a_request_answered_in_any_unit_of_time_is_named_with_its_cause(elapsed: str, seconds: str) -> None:
    """The client writes the request's time in Rust's units: a local server's 404 came back in `997.611\u00b5s`, and the
    line was the client's first, with no cause (CI, once in the 404 case of the test above)."""
    answered = RuntimeError(
        f"Generic S3 error: Error performing list request: Error performing GET http://127.0.0.1:33115/runs?delimiter"
        f"=%2F&list-type=2&prefix=a%2F in {elapsed} - Server returned non-2xx status code: 404 Not Found: <!DOCTYPE"
    )
    assert reason(answered) == (
        f"GET http://127.0.0.1:33115/runs: 404 Not Found, an answer that is no S3 error (is the endpoint an S3 server?)"
        f" (in {seconds} s)"
    )


def test_one_key_without_the_other_is_bad_input_naming_the_missing_one(
    monkeypatch: pytest.MonkeyPatch, s3: S3Server, tmp_path: Path
) -> None:
    """The client said `Missing SecretAccessKey`, with a traceback, at its first request: exit 1."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(S3_SECRET_KEY_ENV)
    with pytest.raises(SpecError, match=r"^AWS_SECRET_ACCESS_KEY: not set, and AWS_ACCESS_KEY_ID is: the two keys go"):
        checkpointer("s3://runs/one-key", tmp_path)


@pytest.mark.parametrize(
    "endpoint", ["http://127.0.0.1:99999", "http://:9000", "s3.example.com", "http://a b", "http://h:9000\n"]
)
def test_an_endpoint_the_client_cannot_use_is_bad_input_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, s3: S3Server, tmp_path: Path, endpoint: str
) -> None:
    """One the user exported for `ctl run` (the spec's is checked by ctl and the chart): the client panicked
    (`InvalidPort`, `EmptyHost`, `InvalidUri`) with a Rust backtrace, at its first request."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(S3_ENDPOINT_ENV, endpoint)
    with pytest.raises(SpecError, match=rf"^AWS_ENDPOINT_URL: {re.escape(repr(endpoint))} is not an http:// or https"):
        checkpointer("s3://runs/bad-endpoint", tmp_path)


def keys_exported_only(s3: S3Server, cache: Path) -> dict[str, str]:
    """This process's environment with the server's keys exported, and neither its endpoint nor a CA file: what the
    spec names must reach the ranks by itself. The node cache is `cache`."""
    exported = {k: v for k, v in os.environ.items() if k not in (S3_CA_BUNDLE_ENV, S3_ENDPOINT_ENV)}
    keys = {k: v for k, v in s3.env().items() if k != S3_ENDPOINT_ENV}
    return exported | keys | {NODE_CACHE_ENV: str(cache)}


@pytest.mark.timeout(300)
def test_ctl_run_trusts_the_private_ca_of_storage_ca_bundle_and_reads_its_stop_step_there(
    s3_private_ca: tuple[S3Server, Tls], tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """storage.caBundle reaches the ranks as a file of the job's ConfigMap (as in a pod): the run keeps its
    checkpoints in a bucket whose endpoint's certificate no system CA signed. Stopped, ctl reads the step it
    resumes from in the bucket as the ranks reach it: the endpoint and the CA of the spec alone, none exported."""
    s3, tls = s3_private_ca
    s3.bucket("private-run")
    spec = object_storage_spec(corpus_file, s3, "private-run")
    spec["storage"]["caBundle"] = tls.ca_file.read_text()
    spec["training"] |= {"maxSteps": 100_000, "checkpoint": {"every": 2, "keepLast": 2}}
    env = keys_exported_only(s3, tmp_path / "cache")
    ctl = start_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env, merge_stderr=False)
    try:
        assert ctl.stdout is not None
        for line in ctl.stdout:
            if (step := re.search(r"step (\d+)/", line)) and int(step[1]) >= 5:  # after the checkpoint of step 4
                break
        ctl.send_signal(signal.SIGTERM)
        _, stderr = ctl.communicate(timeout=120)
    finally:
        ctl.kill()
    assert ctl.returncode == EXIT_PREEMPTED, stderr
    stopped = re.search(r"stopped at step (\d+), resumable", stderr)
    assert stopped, stderr
    latest = s3.root / "private-run" / "team" / "tiny" / "latest"
    assert latest.read_text().strip() == f"step-{int(stopped[1]):08d}"


def test_sigkill_at_a_random_moment_then_resume_on_another_node_from_the_bucket_is_bitwise_exact(
    s3: S3Server,
    bucket: str,
    tmp_path: Path,
    corpus_file: Path,
    uninterrupted: dict[str, torch.Tensor],  # noqa: F811 (the fixture imported above)
    marked_env: tuple[dict[str, str], str],
) -> None:
    """2 processes save asynchronously to the bucket and are killed at once at a random moment (mid-upload or
    not); a run on an empty node cache resumes from the newest committed checkpoint in the bucket and ends with
    the weights of the uninterrupted local run, its export and report in the bucket."""
    env, marker = marked_env
    uri = f"s3://{bucket}/run"
    section = training(corpus_file, tmp_path / "unused", checkpoint={"dir": uri, "asyncSave": True})
    config = tmp_path / "training.yaml"
    first_node = env | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "node-a")}
    process = start(section, env=first_node, config=config)
    read_until_step(process, 1)
    pids = processes_with_marker(marker)
    moment = random.Random(7)
    read_until_step(process, moment.randint(EVERY + 1, STEPS - 2 * EVERY))
    time.sleep(moment.uniform(0, 0.3))  # between log lines: maybe mid-upload
    kill_all(pids)
    finish(process)
    assert process.returncode == -signal.SIGKILL
    run = s3.root / bucket / "run"
    assert not (run / "report.json").exists()
    committed = sorted(path.name for path in run.glob("step-*") if (path / MARKER).exists())
    # Each checkpoint uploads the events so far before its marker: a kill loses none from before the newest one.
    assert bool(committed) <= bool(list((run / "tensorboard").glob("events.out.tfevents.*")))

    second_node = os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "node-b")}
    output = finish(start(section, env=second_node, config=config))
    assert (f"resuming from {committed[-1]}:" in output) if committed else ("resuming" not in output), output
    assert_bitwise_equal(safetensors.torch.load_file(run / "final" / "model.safetensors"), uninterrupted)
    assert json.loads((run / "report.json").read_text())["steps"] == STEPS
    # From both nodes' event files, each step once: the resume drops what the killed run logged after its checkpoint.
    assert [step for step, _ in tensorboard_scalars(run)["train/loss"]] == list(range(1, STEPS + 1))


SAVER = """
import sys, torch
from pathlib import Path
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.dist import Dist
from trainer.spec import CheckpointSpec

torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights, 48 MiB with AdamW's moments: several multipart parts
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 2048)).sum().backward()
optimizer.step()
scaler = torch.amp.GradScaler("cpu", enabled=False)
spec = CheckpointSpec(dir=sys.argv[1], keepLast=2)
checkpoints = Checkpointer(Path(sys.argv[2]), spec, Dist(0, 0, 1, torch.device("cpu")), {})
state = TrainerState()
checkpoints.attach(model, optimizer, scaler, state)
for step in range(1, 1000):
    state.step = step
    checkpoints.save()
    print(step, flush=True)
"""


def test_an_upload_killed_midway_leaves_no_committed_checkpoint_that_does_not_load(
    s3_env: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A process saving 48 MiB checkpoints again and again is SIGKILLed at a random moment of an upload: every
    checkpoint the bucket calls committed loads completely, and the newest is the last one the saver finished."""
    uri = f"s3://{bucket}/run"
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, uri, str(tmp_path / "saver")],
        env=os.environ | {"PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    finished = [int(saver.stdout.readline()) for _ in range(2)]
    time.sleep(random.uniform(0, 0.5))
    saver.kill()
    finished += [int(line) for line in saver.stdout.read().split()]
    saver.wait()
    reader = checkpointer(uri, tmp_path / "reader")
    committed = reader.committed()
    assert committed and committed[-1][0] in (finished[-1], finished[-1] + 1)  # the kill may follow the marker
    model, optimizer, _ = training_state(2048)
    for _, name in committed:
        folder = reader.store.local(name)
        safetensors.torch.load_model(model, folder / "model.safetensors", strict=True)
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True)["optimizer"])


def object_storage_spec(corpus: Path, s3: S3Server, bucket: str) -> dict[str, Any]:
    spec = tiny_spec(corpus, maxSteps=6, checkpoint={"every": 2, "keepLast": 2}, sample={"maxNewTokens": 0})
    return spec | {"procsPerNode": 2, "storage": {"uri": f"s3://{bucket}/team", "endpoint": s3.endpoint}}


def test_ctl_run_with_storage_uri_keeps_the_run_in_the_bucket(
    s3: S3Server, bucket: str, tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """2 processes under `ctl run`: the chart's run directory <uri>/<name>, checkpoints, export, report and
    TensorBoard events in the bucket; the keys come from the user's environment (no Secret locally)."""
    env = os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "cache")}
    result = run_ctl("run", str(write_spec(object_storage_spec(corpus_file, s3, bucket))), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"[rank 0] run directory: s3://{bucket}/team/tiny" in result.stdout
    run = s3.root / bucket / "team" / "tiny"
    assert sorted(path.name for path in run.iterdir()) == [
        "dataset.json",
        "final",
        "latest",
        "report.json",
        "step-00000004",
        "step-00000006",
        "tensorboard",
    ]
    assert json.loads((run / "report.json").read_text())["world_size"] == 2
    # An event file per checkpoint and one for the rest: every logged step comes back from the bucket.
    assert len(list((run / "tensorboard").iterdir())) == 4
    assert [step for step, _ in tensorboard_scalars(run)["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert (run / "final" / "model.safetensors").is_file() and (run / "step-00000006" / MARKER).is_file()
    assert not (tmp_path / "runs").exists()  # no claim stands in locally: nothing on the volume's path


def test_a_resume_on_another_node_goes_on_in_the_same_mlflow_run(
    s3: S3Server,
    bucket: str,
    tmp_path: Path,
    write_spec,
    corpus_file: Path,
    mlflow_env: dict[str, str],  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trackers' run ids go to the bucket with the checkpoints: a resume on an empty node cache reports to the
    run it started, as a resume on the volume does."""
    spec = object_storage_spec(corpus_file, s3, bucket)
    spec["training"] |= {"maxSteps": 2, "reportTo": ["tensorboard", "mlflow"]}
    env = os.environ | s3.env() | mlflow_env
    first = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env | {NODE_CACHE_ENV: str(tmp_path / "node-a")})
    assert first.returncode == 0, first.stdout + first.stderr
    run = s3.root / bucket / "team" / "tiny"
    run_id = json.loads((run / "tracking.json").read_text())["mlflow"]

    spec["training"] |= {"maxSteps": 4, "checkpoint": {"every": 2, "allowConfigChange": True}}
    second = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env | {NODE_CACHE_ENV: str(tmp_path / "node-b")})
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step-00000002" in second.stdout
    assert json.loads((run / "tracking.json").read_text()) == {"mlflow": run_id}
    from mlflow.tracking import MlflowClient

    for name, value in mlflow_env.items():  # the reader here opens the same store
        monkeypatch.setenv(name, value)
    history = MlflowClient().get_metric_history(run_id, "train/loss")
    assert [metric.step for metric in history] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("bucket_name", "secret", "reason"),
    [
        (None, "not-the-secret", "SignatureDoesNotMatch: "),
        ("no-such-bucket", None, "NoSuchBucket: "),
    ],
)
def test_refused_credentials_and_a_missing_bucket_stop_ctl_run_with_one_line(
    s3: S3Server,
    bucket: str,
    tmp_path: Path,
    write_spec,
    corpus_file: Path,
    bucket_name: str | None,
    secret: str | None,
    reason: str,
) -> None:
    """`ctl prepare` too, before it prepares: it told of neither, and the run that followed found them."""
    bucket = bucket_name or bucket
    env = os.environ | s3.env(**({"secret": secret} if secret else {})) | {NODE_CACHE_ENV: str(tmp_path / "cache")}
    spec = write_spec(object_storage_spec(corpus_file, s3, bucket))
    for command in ("run", "prepare"):
        result = run_ctl(command, str(spec), cwd=tmp_path, env=env)
        assert result.returncode == EXIT_BAD_INPUT, result.stdout + result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"error: training.checkpoint.dir: cannot use s3://{bucket}/team/tiny: {reason}"), line
        assert not (s3.root / bucket).exists() or not any((s3.root / bucket).iterdir())  # nothing written
    assert not (tmp_path / "cache" / "runs" / bucket / "team" / "_datasets").exists()


def test_sigterm_waits_for_the_upload_and_the_saved_step_is_committed_in_the_bucket(
    s3: S3Server, bucket: str, tmp_path: Path, corpus_file: Path
) -> None:
    """SIGTERM to torchrun (the kubelet's, to PID 1) mid-run with background uploads: the ranks agree on a step,
    save it, and exit 143 only once its marker is in the bucket and `latest` names it."""
    section = training(corpus_file, tmp_path / "unused", checkpoint={"dir": f"s3://{bucket}/run", "asyncSave": True})
    env = os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "cache")}
    process = start(section, env=env, config=tmp_path / "training.yaml")
    before = read_until_step(process, random.Random(8).randint(EVERY + 1, STEPS - 2 * EVERY))
    os.kill(process.pid, signal.SIGTERM)
    output = before + finish(process, timeout=60)
    stopped = STOPPED.search(output)
    assert process.returncode == EXIT_PREEMPTED and stopped, output
    run = s3.root / bucket / "run"
    assert (run / stopped.group(1) / MARKER).is_file()
    assert (run / "latest").read_text().strip() == stopped.group(1)
    assert list((run / "tensorboard").glob("events.out.tfevents.*")) and not (run / "report.json").exists()


def test_training_data_from_a_bucket_prefix_is_downloaded_once_per_node(
    s3: S3Server, bucket: str, tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """training.data.train names an s3:// prefix: its objects are downloaded once into the node's cache and prepared; a
    second job on the same node finds both the files and the prepared dataset there and reads nothing again."""
    text = corpus_file.read_text()
    corpus = s3.bucket(bucket) / "corpus"
    corpus.mkdir()
    for index, part in enumerate((text[: len(text) // 2], text[len(text) // 2 :])):
        (corpus / f"part-{index}.txt").write_text(part)
    spec = object_storage_spec(corpus_file, s3, bucket)
    spec["training"]["data"] = {"train": [f"s3://{bucket}/corpus/"], "valFraction": 0.1}
    env = os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "cache")}
    logs = []
    for name in ("first", "second"):
        result = run_ctl("run", str(write_spec(spec | {"name": name})), cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        run_cache = tmp_path / "cache" / "runs" / bucket / "team" / name  # the run's node-local side: its logs
        logs.append(rank_log(run_cache, 0, 0).read_text())
    assert "preparing " in logs[0] and "preparing " not in logs[1] and "prepared data " in logs[1]
    downloads = [line for line in (s3.root.parent / "versitygw.log").read_text().splitlines() if "| GET |" in line]
    for index in range(2):
        assert len([line for line in downloads if f"/{bucket}/corpus/part-{index}.txt " in line]) == 1
    local = tmp_path / "cache" / "sources" / bucket / "corpus"
    assert sorted(path.name for path in local.glob("part-*")) == ["part-0.txt", "part-1.txt"]
    assert json.loads((s3.root / bucket / "team" / "second" / "report.json").read_text())["steps"] == 6


def test_a_data_uri_names_an_object_a_folder_the_whole_bucket_or_a_glob(s3_env: S3Server, bucket: str) -> None:
    """The client lists a prefix as a folder (`corpus` lists corpus/...): an object's own key is asked for by itself.
    A folder or glob of the bucket names the objects that the same folder or glob names on disk (expand_paths):
    `*` within a folder, `**` across none or more, hidden names only where the pattern spells the dot."""
    root = s3_env.bucket(bucket)
    keys = ("corpus/a.txt", "corpus/b.jsonl", "corpus/sub/c.txt", "corpus/.hidden.txt", "corpus/.git/d.txt", "top.txt")
    for key in keys:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(key)
    named = {
        key: sorted(meta["path"] for meta in matching_objects(s3_client(bucket), key))
        for key in ("corpus/a.txt", "top.txt", "corpus", "corpus/", "", "corpus/*.txt", "corpus/a", "nothing")
    }
    assert named == {
        "corpus/a.txt": ["corpus/a.txt"],
        "top.txt": ["top.txt"],
        "corpus": ["corpus/a.txt", "corpus/b.jsonl", "corpus/sub/c.txt"],
        "corpus/": ["corpus/a.txt", "corpus/b.jsonl", "corpus/sub/c.txt"],
        "": ["corpus/a.txt", "corpus/b.jsonl", "corpus/sub/c.txt", "top.txt"],
        "corpus/*.txt": ["corpus/a.txt"],
        "corpus/a": [],
        "nothing": [],
    }
    globs = ("**/*.txt", "corpus/**/*.txt", "corpus/**", "corpus/*", "*/s?b/*", "corpus/[ab].*", "corpus/.*", "*")
    on_disk = {
        pattern: sorted(path.relative_to(root).as_posix() for path in expand_paths([f"{root}/{pattern}"], "k"))
        for pattern in globs
    }
    assert {
        pattern: sorted(meta["path"] for meta in matching_objects(s3_client(bucket), pattern)) for pattern in globs
    } == on_disk
    assert on_disk["corpus/**/*.txt"] == ["corpus/a.txt", "corpus/sub/c.txt"] and on_disk["corpus/.*"] == [
        "corpus/.hidden.txt"
    ]


def test_a_dataset_saved_to_a_bucket_is_its_data_files(s3_env: S3Server, bucket: str) -> None:
    """`save_to_disk("s3://...")` as on disk: the folder's Arrow files in state.json's order, not its metadata."""
    import datasets

    texts = [f"row {i}" for i in range(100)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(s3_env.bucket(bucket) / "saved"), num_shards=2)
    for uri in (f"s3://{bucket}/saved", f"s3://{bucket}/saved/"):
        files = expand_paths([uri], "training.data.train")
        assert [path.name for path in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"], uri
        assert list(read_texts(files, "text", "training.data.train")) == texts
    # What the bucket has now, not what this node's cache kept of it: a shard gone is missing, state.json gone is a
    # folder of files.
    saved = s3_env.bucket(bucket) / "saved"
    (saved / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(
        SpecError, match=re.escape("saved dataset's data-00001-of-00002.arrow (in state.json) is missing")
    ):
        expand_paths([f"s3://{bucket}/saved"], "training.data.train")
    shutil.rmtree(saved)
    saved.mkdir()
    (saved / "a.txt").write_text("a note")
    assert [path.name for path in expand_paths([f"s3://{bucket}/saved"], "training.data.train")] == ["a.txt"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        str(s3_env.bucket(bucket) / "splits")
    )
    # Named by its URI, not by the copy in this node's cache.
    dataset_dict = f"training.data.train: s3://{bucket}/splits is a saved DatasetDict: name one split's folder"
    with pytest.raises(SpecError, match=re.escape(f"{dataset_dict} (s3://{bucket}/splits/train)")):
        expand_paths([f"s3://{bucket}/splits"], "training.data.train")


def test_bad_data_in_a_bucket_is_named_by_its_uri_not_by_this_nodes_copy(
    s3_env: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The line named the copy in the node's cache (`~/.cache/ddpjob/sources/<bucket>/...`), which the user never
    wrote; so did `onBadFile: skip`'s warning, and its line when every file is bad."""
    corpus = s3_env.bucket(bucket) / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("good text")
    (corpus / "b.txt").write_bytes(b"ab\xffcd")
    files = expand_paths([f"s3://{bucket}/corpus/"], "training.data.train")
    bad = f"s3://{bucket}/corpus/b.txt"
    with pytest.raises(SpecError, match=rf"^training\.data\.train: {re.escape(bad)} is not UTF-8 text \(byte 2\)$"):
        list(read_texts(files, "text", "training.data.train"))
    skipped = Skipped()
    data = DataSpec.model_validate({"train": [f"s3://{bucket}/corpus/"], "onBadFile": "skip"})
    assert [doc.text for doc in documents(files, data, False, "training.data.train", skipped)] == ["good text"]
    assert skipped.files == [bad] and skipped.reasons[0].startswith(f"training.data.train: {bad} is not UTF-8")
    only_bad = {"train": [bad], "onBadFile": "skip", "cacheDir": str(tmp_path / "datasets"), "prepareWorkers": 1}
    spec = TrainingSpec.model_validate({"task": "char-gpt", "model": {"blockSize": 8}, "data": only_bad})
    every = "training.data.train: every file was skipped as bad (training.data.onBadFile: skip), so it has no text;"
    with pytest.raises(SpecError, match=re.escape(f"{every} first: training.data.train: {bad} is not UTF-8")):
        prepare_spec(spec, tmp_path / "run", print)


def test_data_from_a_bucket_for_a_run_on_the_volume_reaches_the_s3_server_the_spec_names(
    s3: S3Server, bucket: str, tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """No storage.uri (the run directory on the volume, ./runs here) and s3:// data: storage.endpoint reaches the
    ranks all the same (only the keys are exported, as a Secret would give them)."""
    (s3.bucket(bucket) / "corpus.txt").write_text(corpus_file.read_text())
    spec = tiny_spec(corpus_file, maxSteps=2, sample={"maxNewTokens": 0}) | {"storage": {"endpoint": s3.endpoint}}
    spec["training"]["data"] = {"train": [f"s3://{bucket}/corpus.txt"], "valFraction": 0.1}
    env = keys_exported_only(s3, tmp_path / "c")
    prepared = run_ctl("prepare", str(write_spec(spec)), cwd=tmp_path, env=env)  # ctl's own process: the same server
    assert prepared.returncode == 0, prepared.stderr
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"prepared data {prepared.stdout.strip()}" in rank_log(tmp_path / "runs" / "tiny", 0, 0).read_text()
    assert json.loads((tmp_path / "runs" / "tiny" / "report.json").read_text())["steps"] == 2
    assert (tmp_path / "c" / "sources" / bucket / "corpus.txt").read_text() == corpus_file.read_text()


def test_an_s3_server_that_does_not_answer_fails_the_run_with_exit_1_not_as_bad_input(
    s3: S3Server, bucket: str, tmp_path: Path, temporary: Path, write_spec, corpus_file: Path
) -> None:
    """A restarting server is no answer too: the ranks (and `ctl prepare`) exit 1 with the line, which a job's
    restart policy retries; exit 2 would end the job for good."""
    closed = f"http://{LOCAL_ADDRESS}:{free_port()}"
    # The logs stay in the temporary directory: the run directory, in the bucket, has no local side yet.
    env = keys_exported_only(s3, tmp_path / "c") | {"TMPDIR": str(temporary)}
    on_s3 = object_storage_spec(corpus_file, s3, bucket) | {
        "storage": {"uri": f"s3://{bucket}/team", "endpoint": closed}
    }
    result = run_ctl("run", str(write_spec(on_s3)), cwd=tmp_path, env=env)
    assert result.returncode == 1 and result.stdout == "", result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert f"failed: training.checkpoint.dir: cannot reach s3://{bucket}/team/tiny: GET {closed}/{bucket}" in line, line
    kept = re.search(r"\(output in (\S+)/stderr\.log; logs of every rank in (\S+)\)$", line)  # no traceback
    assert kept and Path(kept[2]).parent == temporary and Path(kept[1]).is_relative_to(kept[2]), line
    assert (Path(kept[1]) / "stderr.log").is_file() and (Path(kept[2]) / "node-0.log").is_file(), line
    data = tiny_spec(corpus_file) | {"storage": {"endpoint": closed}}
    data["training"]["data"] = {"train": [f"s3://{bucket}/corpus.txt"], "valFraction": 0.1}
    prepared = run_ctl("prepare", str(write_spec(data)), cwd=tmp_path, env=env)
    assert prepared.returncode == 1 and prepared.stdout == "", prepared.stderr
    assert prepared.stderr.startswith(
        f"error: training.data.train: cannot reach s3://{bucket}/corpus.txt: HEAD {closed}/"
    )
    # The chart's prepare Job: its podFailurePolicy ends the job at exit 2, and retries exit 1.
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump(data["training"] | {"checkpoint": {"dir": str(tmp_path / "job")}}))
    command = [sys.executable, "-m", "trainer.prepare", "--config", str(config)]
    job = subprocess.run(command, capture_output=True, text=True, env=env | {S3_ENDPOINT_ENV: closed}, timeout=120)
    assert job.returncode == 1 and job.stderr.splitlines()[-1].startswith("error: training.data.train: cannot reach"), (
        job.stderr
    )


def test_a_dataset_prepared_on_one_node_is_fetched_from_the_bucket_on_another(
    s3: S3Server, bucket: str, tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """Node caches are not shared: rank 0 uploads the prepared dataset beside the run directories (manifest last)
    before the others go on; a job on another node downloads it instead of preparing the corpus again."""
    logs = []
    for name, node in (("first", "node-a"), ("second", "node-b")):
        env = os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / node)}
        result = run_ctl(
            "run", str(write_spec(object_storage_spec(corpus_file, s3, bucket) | {"name": name})), cwd=tmp_path, env=env
        )
        assert result.returncode == 0, result.stdout + result.stderr
        logs.append(rank_log(tmp_path / node / "runs" / bucket / "team" / name, 0, 0).read_text())
    assert "preparing " in logs[0] and "preparing " not in logs[1] and "prepared data " in logs[1]
    (dataset,) = (s3.root / bucket / "team" / "_datasets").iterdir()
    assert (dataset / "manifest.json").is_file()
    fetched = tmp_path / "node-b" / "runs" / bucket / "team" / "_datasets" / dataset.name
    assert sorted(path.name for path in fetched.iterdir()) == sorted(path.name for path in dataset.iterdir())


def test_a_resume_from_the_bucket_on_changed_data_is_refused_with_one_line(
    s3: S3Server, bucket: str, tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """The run's dataset record lives in the bucket beside its checkpoints: a resume on another node whose data
    changed meanwhile is refused as on the volume."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_file.read_text())
    spec = write_spec(object_storage_spec(corpus, s3, bucket))
    first = run_ctl("run", str(spec), cwd=tmp_path, env=os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "a")})
    assert first.returncode == 0, first.stdout + first.stderr
    assert (s3.root / bucket / "team" / "tiny" / "dataset.json").is_file()
    corpus.write_text(corpus.read_text() + "\nmore text\n")
    again = run_ctl("run", str(spec), cwd=tmp_path, env=os.environ | s3.env() | {NODE_CACHE_ENV: str(tmp_path / "b")})
    assert again.returncode == EXIT_BAD_INPUT, again.stdout + again.stderr
    (line,) = again.stderr.splitlines()
    assert line.startswith(f"error: training.data.train: {corpus} changed since this run's checkpoints"), line
