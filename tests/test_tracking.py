"""Experiment tracking (`training.reportTo`): MLflow through a real local store, a resume that continues its run,
and a tracker named but not installed."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import run_ctl, tensorboard_scalars, tiny_spec


def test_mlflow_gets_every_logged_value_and_a_resume_goes_on_in_the_same_run(
    tmp_path: Path, write_spec, corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path / 'mlruns'}"
    # MLflow's own configuration, as a pod gets it from the spec's env; its file store needs an opt-in since 3.x.
    env = {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
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
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(run_id, "checkpoint/size_bytes")] == [3, 5]
    assert {"train/learning_rate", "train/grad_norm", "train/tokens_per_second", "eval/loss"} <= run.data.metrics.keys()
    # TensorBoard continued too, without repeating a step.
    assert [step for step, _ in tensorboard_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4, 5]


def test_a_tracker_named_but_not_installed_is_one_line_and_exit_2(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    assert importlib.util.find_spec("wandb") is None, "this test needs an environment without wandb (not a dev extra)"
    spec = tiny_spec(corpus_file, reportTo=["tensorboard", "wandb"])
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    line = "reportTo: wandb is not installed: pip install 'wandb', or leave it out of training.reportTo"
    assert result.stderr.splitlines() == [f"error: {line}"] and result.stdout == ""
    assert not (tmp_path / "runs").exists()
