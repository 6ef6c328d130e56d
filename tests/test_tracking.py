"""Experiment tracking (`training.reportTo`): MLflow through a real local store, a resume that continues its run;
Weights & Biases offline, read back from its own run file; failed, hung and stopped runs closed as such in both;
a tracker named but not installed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    MARKER_ENV,
    REPO,
    processes_with_marker,
    rank_log,
    run_ctl,
    start_ctl,
    tensorboard_scalars,
    tiny_spec,
    trainer_pids,
)

from ctl.spec import CREDENTIAL_ENV
from trainer.checkpoint import SaveStats
from trainer.names import EXIT_ERROR, EXIT_HUNG, EXIT_PREEMPTED, SLOW_RANK_ENV
from trainer.preparation.plan import CACHE_DIR_NAME
from trainer.spec import TrainingSpec
from trainer.tracking import SLOW_ANSWER_SECONDS, WANDB_STEP, Tracker, finish

# W&B's run file (`run-<id>.wandb`): a 7-byte header, then 32 KiB blocks of records, each a 7-byte header
# (CRC-32, length, kind) and a piece of one serialized wandb_internal_pb2.Record (LevelDB's log format).
WANDB_HEADER = b":W&B\xe1\xbe\x00"
WANDB_BLOCK = 32 * 1024
RECORD_HEADER = struct.Struct("<IHB")
WHOLE, LAST = 1, 4  # record kinds that end a record (first and middle pieces continue it)


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The records of a W&B run file, parsed with the SDK's own protobuf message."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = run_file.read_bytes()
    assert data.startswith(WANDB_HEADER), f"{run_file}: not a W&B run file of the version this reader knows"
    position, pieces = len(WANDB_HEADER), b""
    while position + RECORD_HEADER.size <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        if left_in_block < RECORD_HEADER.size:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, position)
        start = position + RECORD_HEADER.size
        pieces += data[start : start + length]
        position = start + length
        if kind in (WHOLE, LAST):
            record = Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_run(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
    """({name: [(step, value)]} of every logged value, [exit codes]) from the run's offline W&B files."""
    series: dict[str, list[tuple[int, float]]] = {}
    exit_codes = []
    for run_file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            if record.HasField("history"):
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                for name, value in row.items():
                    if not name.startswith("_") and name != WANDB_STEP:
                        series.setdefault(name, []).append((row[WANDB_STEP], value))
            elif record.HasField("exit"):
                exit_codes.append(record.exit.exit_code)
    return series, exit_codes


# What the loop reports (every name the issue lists: losses, accuracy, learning rate, grad norm, tokens/s,
# checkpoint events).
LOGGED = {
    "train/loss",
    "train/accuracy",
    "train/learning_rate",
    "train/grad_norm",
    "train/tokens_per_second",
    "eval/loss",
    "eval/accuracy",
    "checkpoint/save_seconds",
    "checkpoint/size_bytes",
}


@pytest.fixture
def mlflow_env(tmp_path: Path) -> dict[str, str]:
    """MLflow's own configuration, as a pod gets it from the spec's env; its file store needs an opt-in since 3.x."""
    return {"MLFLOW_TRACKING_URI": f"file://{tmp_path / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true"}


@pytest.fixture
def wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B offline: nothing leaves the machine, and its own settings and caches stay in the test's directory."""
    home = tmp_path / "wandb-home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(home),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }


def test_mlflow_gets_every_logged_value_and_a_resume_goes_on_in_the_same_run(
    tmp_path: Path, write_spec, corpus_file: Path, mlflow_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    env = mlflow_env
    spec = tiny_spec(corpus_file, maxSteps=3, reportTo=["tensorboard", "mlflow"])
    first = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=os.environ | env)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = tmp_path / "runs" / "tiny"
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]

    # Two more steps from the step-3 checkpoint (maxSteps is a setting the checkpoint was written with).
    spec["training"] |= {"maxSteps": 5, "checkpoint": {"allowConfigChange": True}}
    second = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=os.environ | env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step-00000003" in second.stdout
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow"] == run_id

    for name, value in env.items():  # the reader here opens the same store
        monkeypatch.setenv(name, value)
    client = MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(run_id, "checkpoint/size_bytes")] == [3, 5]
    # TensorBoard continued too, without repeating a step; both got the same values (TensorBoard's are 32-bit).
    expected = tensorboard_scalars(run_dir)
    assert [step for step, _ in expected["train/loss"]] == [1, 2, 3, 4, 5]
    assert run.data.metrics.keys() == expected.keys() >= LOGGED
    for name, points in expected.items():
        history = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, name))
        assert [(step, value) for step, _, value in history] == [(s, pytest.approx(v, rel=1e-6)) for s, v in points]


def test_a_tracker_that_cannot_end_its_run_is_a_warning_and_the_run_still_succeeds(
    tmp_path: Path, write_spec, corpus_file: Path, mlflow_env: dict[str, str]
) -> None:
    """The MLflow run is gone from its store once training is done (report.json written, the sample still being
    generated): MLflow's own error at the end is one warning line naming the tracker, on `ctl run`'s terminal without
    --verbose (the rest of rank 0's stderr stays in its log); `ctl run` exits 0."""
    spec = tiny_spec(corpus_file, maxSteps=2, reportTo=["tensorboard", "mlflow"], sample={"maxNewTokens": 3000})
    ctl = start_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=os.environ | mlflow_env, merge_stderr=False)
    run_dir = tmp_path / "runs" / "tiny"
    deadline = time.monotonic() + 240
    while not (run_dir / "report.json").exists():
        assert ctl.poll() is None and time.monotonic() < deadline, ctl.communicate()
        time.sleep(0.01)
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    (stored,) = (tmp_path / "mlruns").glob(f"*/{run_id}")
    shutil.rmtree(stored)
    output, errors = ctl.communicate(timeout=240)
    assert ctl.returncode == 0, output + errors
    assert "Traceback" not in output + errors, errors
    (warning,) = [line for line in errors.splitlines() if "warning: mlflow" in line]
    assert warning == f"[rank 0] warning: mlflow: cannot end its run: MlflowException: Run '{run_id}' not found", errors
    assert "[rank 0] rank 0 of 1 on " not in errors  # rank 0's own stderr line: in its log, not on the terminal
    assert "rank 0 of 1 on " in rank_log(run_dir, 0, 0).read_text()
    (node_log,) = run_dir.glob("logs/*/node-0.log")
    assert warning in node_log.read_text()


def venv_without(root: Path, distribution: str) -> Path:
    """The python of a venv that has this one's packages but `distribution` (links to each, less its own)."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    ours = Path(sysconfig.get_path("purelib"))
    theirs = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    for entry in ours.iterdir():
        if entry.name != distribution and not entry.name.startswith(f"{distribution}-"):
            (theirs / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


def test_a_tracker_named_but_not_installed_is_one_line_and_exit_2(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    python = venv_without(tmp_path, "wandb")
    spec = tiny_spec(corpus_file, reportTo=["tensorboard", "wandb"])
    result = subprocess.run(
        [python, "-m", "ctl", "run", write_spec(spec)],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    line = "training.reportTo: wandb is not installed: pip install 'wandb', or leave it out"
    assert result.stderr.splitlines() == [f"error: {line}"] and result.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_wandb_online_without_an_api_key_is_one_line_and_exit_2(
    tmp_path: Path, write_spec, corpus_file: Path, wandb_env: dict[str, str]
) -> None:
    """Online (WANDB_MODE unset) with no key anywhere W&B looks: bad input on rank 0, which the other rank follows,
    before rank 0's first line; the run directory is left as it was (none)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "NETRC"))}
    env |= {key: value for key, value in wandb_env.items() if key != "WANDB_MODE"} | {"HOME": str(tmp_path)}
    spec = tiny_spec(corpus_file, reportTo=["wandb"])
    spec["procsPerNode"] = 2
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    line = (
        "error: training.reportTo: wandb cannot start its run: No API key configured. Use `wandb login` to log in."
        " (set WANDB_API_KEY from a Secret in the spec's env, or WANDB_MODE=offline)"
    )
    assert result.stderr.splitlines() == [line] and result.stdout == "", result.stdout + result.stderr
    # The run directory is gone again; the dataset prepared beside it stays, for the next start.
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == [CACHE_DIR_NAME]


def test_an_mlflow_server_that_does_not_answer_is_said_while_mlflow_retries_then_one_line_and_exit_1(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """Nothing listens at the tracking URI (whose password stays out of every line): a warning once MLflow has
    tried for SLOW_ANSWER_SECONDS, then, when its retries (here 3: 4 and 8 s apart) give up, the root cause."""
    env = os.environ | {
        "MLFLOW_TRACKING_URI": "http://someone:s3cret@127.0.0.1:1",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    }
    spec = tiny_spec(corpus_file, reportTo=["mlflow"])
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == EXIT_ERROR, result.stdout + result.stderr
    assert "s3cret" not in result.stdout + result.stderr + "".join(
        path.read_text() for path in (tmp_path / "runs").rglob("*.log")
    )
    slow = f"[rank 0] warning: mlflow: no answer from http://127.0.0.1:1 in {SLOW_ANSWER_SECONDS:g} s; MLflow goes on"
    lines = result.stderr.splitlines()
    assert [line for line in lines if line.startswith(slow)] == [lines[-2]], result.stderr
    cause = "failed: training.reportTo: mlflow cannot reach http://127.0.0.1:1: [Errno 111] Connection refused (output"
    assert lines[-1].startswith("error: rank 0 on node 0 ") and cause in lines[-1], result.stderr


def test_an_mlflow_server_that_refuses_the_run_is_one_line_and_exit_2(
    tmp_path: Path, write_spec, corpus_file: Path, mlflow_env: dict[str, str], wandb_env: dict[str, str]
) -> None:
    """MLFLOW_EXPERIMENT_ID names no experiment of the store: bad input, in MLflow's words, and no run directory,
    though W&B's run had started, with its files in it."""
    spec = tiny_spec(corpus_file, reportTo=["tensorboard", "wandb", "mlflow"])
    env = os.environ | mlflow_env | wandb_env | {"MLFLOW_EXPERIMENT_ID": "999"}
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    store = mlflow_env["MLFLOW_TRACKING_URI"]
    line = (
        f"error: training.reportTo: mlflow cannot start its run at {store}: The provided MLFLOW_EXPERIMENT_ID"
        " environment variable value `999` does not exist in the tracking server. Provide a valid experiment_id."
    )
    assert result.stderr.splitlines() == [line] and result.stdout == "", result.stdout + result.stderr
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == [CACHE_DIR_NAME]


def test_wandb_offline_gets_the_values_tensorboard_gets_and_a_finished_exit(
    tmp_path: Path, write_spec, corpus_file: Path, wandb_env: dict[str, str]
) -> None:
    # Two ranks; checkpoints at steps 2 and 4 saved in the background, so step 2's is reported at a later step.
    spec = tiny_spec(corpus_file, maxSteps=4, reportTo=["tensorboard", "wandb"], checkpoint={"every": 2})
    spec["procsPerNode"] = 2
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=os.environ | wandb_env)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "tiny"

    logged, exit_codes = wandb_run(run_dir)
    assert exit_codes == [0]
    assert [step for step, _ in logged["train/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in logged["checkpoint/size_bytes"]] == [2, 4]
    assert [step for step, _ in logged["eval/loss"]] == [2, 4]  # keepBest evaluates at every checkpoint
    expected = tensorboard_scalars(run_dir)
    assert logged.keys() == expected.keys() >= LOGGED
    for name, points in expected.items():  # TensorBoard keeps 32-bit floats
        assert logged[name] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], name


def test_the_final_evaluation_reaches_the_trackers_without_keep_best(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """The final model's evaluation, report.json's, is the run's last eval/ point whatever keepBest says."""
    spec = tiny_spec(corpus_file, maxSteps=3, checkpoint={"keepBest": False}, sample={"maxNewTokens": 0})
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "tiny"
    report = json.loads((run_dir / "report.json").read_text())
    scalars = tensorboard_scalars(run_dir)
    assert scalars["eval/loss"] == [(3, pytest.approx(report["eval_loss"], rel=1e-6))]
    assert scalars["eval/accuracy"] == [(3, pytest.approx(report["token_accuracy"], rel=1e-6))]


def test_wandb_keeps_a_checkpoint_reported_after_later_steps(
    tmp_path: Path, wandb_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background save is reported at the first log step after it finished: W&B, whose own step only grows,
    still plots it at the step it saved."""
    import wandb

    for name, value in wandb_env.items():
        monkeypatch.setenv(name, value)
    spec = TrainingSpec.model_validate({"task": "char-gpt", "data": {"train": "corpus.txt"}, "reportTo": ["wandb"]})
    tracker = Tracker(spec, True, tmp_path)
    tracker.log(3, {"train/loss": 2.5})
    tracker.checkpoint_saved(SaveStats(step=2, seconds=0.25, size_bytes=4096, finished_at=0.0))
    tracker.log(4, {"train/loss": 2.0})
    finish(0)
    wandb.teardown()  # W&B's service writes the run file after finish returns; its shutdown waits for that
    logged, exit_codes = wandb_run(tmp_path)
    assert logged == {
        "train/loss": [(3, 2.5), (4, 2.0)],
        "checkpoint/save_seconds": [(2, 0.25)],
        "checkpoint/size_bytes": [(2, 4096)],
    }
    assert exit_codes == [0]


def mlflow_status(run_dir: Path) -> str:
    """The status of the run's MLflow run (MLFLOW_TRACKING_URI names the store)."""
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    return MlflowClient().get_run(run_id).info.status


def interrupted_run(path: Path, corpus: Path, case: str, env: dict[str, str], marker: str) -> tuple[int, str]:
    """A 2-rank `ctl run` reporting to MLflow and W&B that ends in `case`: (ctl's exit code, its output)."""
    # Rank 1 sleeps in every step: the run is still going when the test stops it or stops rank 1.
    training: dict[str, Any] = {"maxSteps": 1000, "reportTo": ["mlflow", "wandb"], "timeouts": {"hangFloorSeconds": 5}}
    if case == "error":
        training["optimizer"] = {"lr": 1e30}  # the loss is no longer finite after the first update
    spec = tiny_spec(corpus, **training) | {"procsPerNode": 2, "terminationGracePeriodSeconds": 8}
    (path / "spec.yaml").write_text(json.dumps(spec))
    env |= {MARKER_ENV: marker, SLOW_RANK_ENV: "1:0.2", "OMP_NUM_THREADS": "1"}
    ctl = start_ctl("run", "spec.yaml", cwd=path, env=env)
    assert ctl.stdout is not None
    try:
        seen = []
        for line in ctl.stdout:
            seen.append(line)
            if "| loss " in line:
                break
        if case == "stop":
            ctl.send_signal(signal.SIGTERM)  # ctl stops every node, as the kubelet stops a pod
        elif case == "hang":
            (rank_1,) = trainer_pids(marker, rank=1, local_rank=1)
            os.kill(rank_1, signal.SIGSTOP)
            # torchrun gives a stopped rank 30 s before it kills it: once rank 0's watchdog has ended the
            # MLflow run (just before it exits), rank 1 goes on, to take torchrun's SIGTERM at once.
            deadline = time.monotonic() + 120
            while mlflow_status(path / "runs" / "tiny") == "RUNNING":
                assert time.monotonic() < deadline, "the hang was not found, or its MLflow run not ended"
                time.sleep(0.5)
            os.kill(rank_1, signal.SIGCONT)
        output, _ = ctl.communicate(timeout=180)
    finally:
        if ctl.poll() is None:
            ctl.kill()
    return ctl.returncode, "".join(seen) + output


@pytest.mark.parametrize(
    ("case", "status", "exit_code", "ctl_exit_code"),
    [
        ("error", "FAILED", EXIT_ERROR, EXIT_ERROR),
        ("stop", "KILLED", EXIT_PREEMPTED, EXIT_PREEMPTED),
        ("hang", "FAILED", EXIT_HUNG, EXIT_ERROR),  # rank 0's exit code; the job failed (retryably)
    ],
)
def test_a_run_that_fails_is_stopped_or_hangs_ends_so_in_mlflow_and_wandb(
    tmp_path: Path,
    temporary: Path,
    corpus_file: Path,
    mlflow_env: dict[str, str],
    wandb_env: dict[str, str],
    marked_env: tuple[dict[str, str], str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    status: str,
    exit_code: int,
    ctl_exit_code: int,
) -> None:
    env, marker = marked_env
    for name, value in mlflow_env.items():  # the reader here opens the same store
        monkeypatch.setenv(name, value)
    env |= mlflow_env | wandb_env | {"TMPDIR": str(temporary)}
    returncode, output = interrupted_run(tmp_path, corpus_file, case, env, marker)
    assert returncode == ctl_exit_code, output
    assert not processes_with_marker(marker), "a process of the run outlived `ctl run`"
    # W&B's temporary folders too, which a rank that exits at once (hung) leaves: they were in its launcher's.
    assert list(temporary.iterdir()) == [], output
    run_dir = tmp_path / "runs" / "tiny"
    assert mlflow_status(run_dir) == status, output
    assert wandb_run(run_dir)[1] == [exit_code], output


def containers(document: Any) -> Iterator[dict[str, Any]]:
    """Every container (and init container) of every pod template in a rendered object."""
    if isinstance(document, dict):
        for key, value in document.items():
            if key in ("containers", "initContainers"):
                yield from value
            else:
                yield from containers(value)
    elif isinstance(document, list):
        for item in document:
            yield from containers(item)


@pytest.mark.parametrize("api_kind", ["PyTorchJob", "TrainJob"])
def test_tracker_credentials_reach_the_pods_only_by_reference(
    tmp_path: Path, write_spec, corpus_file: Path, api_kind: str
) -> None:
    key = "0123456789abcdef0123456789abcdef01234567"  # what a literal W&B key would look like
    literal = {"name": "WANDB_API_KEY", "value": key}
    spec = tiny_spec(corpus_file, reportTo=["mlflow", "wandb"]) | {"apiKind": api_kind, "env": [literal]}
    refused = run_ctl("render", str(write_spec(spec)), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    (line,) = refused.stderr.splitlines()
    assert "env: WANDB_API_KEY: a credential is not given as a value: use valueFrom.secretKeyRef" in line
    assert key not in line

    by_reference = {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}}
    spec |= {
        "env": [{"name": "MLFLOW_TRACKING_URI", "value": "https://mlflow.example.com"}, by_reference],
        "envFrom": [{"secretRef": {"name": "wandb"}}],  # WANDB_API_KEY and WANDB_PROJECT from one Secret
        "prepare": {"enabled": True},  # the data preparation Job's pods too
    }
    rendered = run_ctl("render", str(write_spec(spec)), cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    every = [c for document in yaml.safe_load_all(rendered.stdout) for c in containers(document)]
    trainers = [c for c in every if by_reference in c.get("env", [])]
    assert len(trainers) == 2  # the trainer's and the data preparation's
    assert all({"secretRef": {"name": "wandb"}} in c["envFrom"] for c in trainers)
    credentials = [var for c in every for var in c.get("env", []) if CREDENTIAL_ENV.search(var["name"])]
    assert credentials and all("value" not in var for var in credentials), credentials
