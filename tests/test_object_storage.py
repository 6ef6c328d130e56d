"""Runs on object storage (`checkpoint.dir: s3://bucket/prefix`) against a real S3 server (versitygw,
tests/s3server.py): checkpoints committed by their marker object, retention after the commit, resume from the
bucket, bad buckets and credentials refused with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from s3server import S3Server

from trainer.checkpoint import Checkpointer, TrainerState
from trainer.dist import Dist
from trainer.spec import CheckpointSpec, SpecError


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """This process talks to the test server through the standard AWS variables; its run cache is `tmp_path`."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DDPJOB_RUN_CACHE", str(tmp_path / "cache"))
    return s3


def checkpointer(uri: str, tmp_path: Path, **spec: Any) -> Checkpointer:
    dist = Dist(0, 0, 1, torch.device("cpu"))
    return Checkpointer(tmp_path / "local", CheckpointSpec(dir=uri, **spec), dist, {"maxSteps": 10})


def training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)


def test_keeps_the_newest_and_the_best_in_the_bucket_and_prunes_only_after_a_commit(
    s3_env: S3Server, bucket: str, tmp_path: Path
) -> None:
    model, optimizer, scaler = training_state()
    checkpoints = checkpointer(f"s3://{bucket}/runs/a", tmp_path, keepLast=2, keepBest=True)
    for step, val_loss in enumerate([3.0, 1.0, None, 2.0, 2.5], start=1):
        checkpoints.save(model, optimizer, scaler, TrainerState(step=step, val_loss=val_loss))
        assert checkpoints.committed()[-1][0] == step
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
    checkpoints.save(model, optimizer, scaler, TrainerState(step=2))
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
    state, _ = other.load_latest(model, optimizer, scaler)
    assert state.step == 2
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved.items())


def test_a_missing_bucket_and_refused_credentials_are_one_line_naming_the_key(
    s3: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env(secret="not-the-secret").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SpecError, match=r"^checkpoint\.dir: cannot use s3://[\w-]+/run: SignatureDoesNotMatch: "):
        checkpointer(f"s3://{bucket}/run", tmp_path).store.check(writable=True)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(SpecError, match=r"^checkpoint\.dir: cannot use s3://no-such-bucket/run: NoSuchBucket: "):
        checkpointer("s3://no-such-bucket/run", tmp_path).store.check(writable=True)
