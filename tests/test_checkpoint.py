"""Checkpoints on real runs: SIGKILL and SIGTERM at random steps, torn saves, resumes on another world
size or with changed settings, elastic restarts, full and unwritable disks.

Runs start the way a pod does (`python -m trainer.launch -m trainer --config training.yaml`) in their own
session, so a kill reaches every process of the "pod". Exactness is bitwise: the resumed run's
final weights equal those of one uninterrupted run with the same spec.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import yaml
from conftest import REPO, processes_with_marker, run_ctl, start_ctl, tiny_spec, trainer_pids

from trainer.checkpoint import (
    MARKER,
    MODEL,
    OPTIMIZER,
    RNG,
    STATE,
    Checkpointer,
    CheckpointError,
    TrainerState,
    step_name,
)
from trainer.data import TrainBatches
from trainer.dist import Dist
from trainer.spec import CheckpointSpec, SpecError
from trainer.storage import StorageError, StorageUnreachable
from trainer.totals import Sums

STEPS = 24
EVERY = 4
PROCS = 2
STOPPED = re.compile(r"stop requested \(SIGTERM\): saved (step-\d{8}) at step (\d+)/")
EXIT_PREEMPTED = 143


def training(corpus: Path, run_dir: Path, **overrides: Any) -> dict[str, Any]:
    """Dropout and gradient accumulation on, so RNG state and the position inside a step both matter."""
    section = tiny_spec(
        corpus,
        model={"nLayer": 2, "nHead": 2, "nEmbd": 48, "blockSize": 32, "dropout": 0.1},
        maxSteps=STEPS,
        gradAccum=2,
        evalEvery=6,
        sample={"maxNewTokens": 0},
    )["training"]
    checkpoint = {"dir": str(run_dir), "every": EVERY, "keepLast": 2} | overrides.pop("checkpoint", {})
    return section | {"checkpoint": checkpoint} | overrides


def start(
    section: dict[str, Any], procs: int = PROCS, env: dict[str, str] | None = None, config: Path | None = None
) -> subprocess.Popen:
    """One pod: torchrun over the trainer (`env` may carry a marker that finds all its processes); its training.yaml
    beside the run directory unless `config` names it. Its temporary folders go beside the training.yaml too: what
    a run killed as a whole leaves there (the ranks' heartbeats, as a dead node's) goes with the test's folder."""
    config = config or Path(section["checkpoint"]["dir"]).with_suffix(".yaml")
    config.write_text(yaml.safe_dump(section), encoding="utf-8")
    command = [sys.executable, "-m", "trainer.launch", "--standalone", f"--nproc-per-node={procs}"]
    return subprocess.Popen(
        [*command, "-m", "trainer", "--config", str(config)],
        env=(env or os.environ) | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(config.parent)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def kill_all(pids: list[int]) -> None:
    """SIGKILL every process of a run at once, as when its node dies. The pids are collected beforehand,
    so the kill lands right at the chosen step (torchrun's workers have their own sessions: a process
    group would not reach them)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(process: subprocess.Popen, timeout: float = 240) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{output}") from None
    return output


def run(section: dict[str, Any], procs: int = PROCS) -> str:
    process = start(section, procs)
    output = finish(process)
    assert process.returncode == 0, output
    return output


def read_until_step(process: subprocess.Popen, step: int) -> str:
    """Output up to the log line of `step` (or a later one)."""
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        match = re.match(r"(?:\[rank 0\] )?step (\d+)/", line)
        if match and int(match.group(1)) >= step:
            return "".join(seen)
    raise AssertionError(f"the run ended before step {step}:\n" + "".join(seen))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run_dir / "final" / "model.safetensors")


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"tensors differ from the uninterrupted run: {different}"


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in run_dir.glob("step-*") if (p / MARKER).exists())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    output = run(training(corpus_file, run_dir))
    assert f"step {STEPS}/{STEPS}" in output and "resuming" not in output
    assert committed_steps(run_dir) == [STEPS - EVERY, STEPS]  # keepLast 2; the best is among them here
    assert (run_dir / "latest").read_text().strip() == step_name(STEPS)
    return weights(run_dir)


@pytest.mark.parametrize(("seed", "async_save"), [(1, False), (2, True), (3, False)])
def test_sigkill_at_a_random_step_then_resume_is_bitwise_exact_and_ignores_torn_saves(
    tmp_path: Path,
    corpus_file: Path,
    uninterrupted: dict[str, torch.Tensor],
    marked_env: tuple[dict[str, str], str],
    seed: int,
    async_save: bool,
) -> None:
    env, marker = marked_env
    run_dir = tmp_path / "run"
    section = training(corpus_file, run_dir, checkpoint={"asyncSave": async_save})
    kill_step = random.Random(seed).randint(EVERY + 2, STEPS - 8)
    process = start(section, env=env)
    read_until_step(process, 1)
    pids = processes_with_marker(marker)
    read_until_step(process, kill_step)
    # An async save commits behind the steps: on a loaded machine the first may not have yet (the run goes on).
    deadline = time.monotonic() + 60
    while async_save and not committed_steps(run_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_all(pids)
    finish(process)
    assert process.returncode == -signal.SIGKILL and not (run_dir / "final").exists()

    # A save killed after writing some files but before its marker, and one killed before its rename.
    last = committed_steps(run_dir)[-1]
    torn = run_dir / step_name(last + 1)
    shutil.copytree(run_dir / step_name(last), torn)
    (torn / MARKER).unlink()
    staging = run_dir / f".{step_name(last + 2)}.tmp"
    staging.mkdir()
    shutil.copy(torn / "model.safetensors", staging)

    output = run(section)
    assert f"resuming from {step_name(last)}:" in output
    assert not torn.exists() and not staging.exists()
    assert_bitwise_equal(weights(run_dir), uninterrupted)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> tuple[Path, int, str]:
    """A run sent SIGTERM (to torchrun, as the kubelet does to PID 1) mid-run: (run dir, saved step, output)."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    process = start(training(corpus_file, run_dir))
    signal_step = random.Random(4).randint(EVERY + 1, STEPS - 8)
    before = read_until_step(process, signal_step)
    os.kill(process.pid, signal.SIGTERM)
    output = before + finish(process, timeout=60)
    stopped = STOPPED.search(output)
    assert stopped, output
    step = int(stopped.group(2))
    assert signal_step <= step < STEPS and committed_steps(run_dir)[-1] == step
    assert f"exiting with code {EXIT_PREEMPTED}" in output and not (run_dir / "final").exists()
    # The pod's own exit code: 143, which restartPolicy ExitCode retries (plain torchrun exits 1).
    assert process.returncode == EXIT_PREEMPTED, output
    return run_dir, step, output


@pytest.fixture
def preempted_copy(tmp_path: Path, preempted: tuple[Path, int, str]) -> tuple[Path, int]:
    """A private copy of the preempted run directory: (run dir, the step it stopped at)."""
    source, step, _ = preempted
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    return run_dir, step


def test_sigterm_saves_at_one_agreed_step_and_the_restart_finishes_exactly(
    corpus_file: Path,
    preempted: tuple[Path, int, str],
    preempted_copy: tuple[Path, int],
    uninterrupted: dict[str, torch.Tensor],
) -> None:
    _, step, output = preempted
    # Every rank stopped after the same step: it logged once and nothing ran past it.
    assert f"step {step + 1}/" not in output
    run_dir, _ = preempted_copy
    resumed = run(training(corpus_file, run_dir))
    assert f"resuming from {step_name(step)}: " in resumed and f"step {step + 1}/{STEPS}" in resumed
    assert_bitwise_equal(weights(run_dir), uninterrupted)


def test_resume_on_a_smaller_world_size_continues_from_the_same_step(
    corpus_file: Path, preempted_copy: tuple[Path, int]
) -> None:
    run_dir, step = preempted_copy
    before = json.loads((run_dir / step_name(step) / "state.json").read_text())["trainer"]["train_seconds"]
    output = run(training(corpus_file, run_dir), procs=1)
    assert f"resuming from {step_name(step)}: " in output and f"world size {PROCS} then, 1 now" in output
    assert f"step {step + 1}/{STEPS}" in output
    state = json.loads((run_dir / step_name(STEPS) / "state.json").read_text())["trainer"]
    per_rank_step = 4 * 2  # batchSize x gradAccum
    assert state["world_size"] == 1 and state["step"] == STEPS
    assert state["samples"] == step * PROCS * per_rank_step + (STEPS - step) * per_rank_step
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == STEPS and report["world_size"] == 1
    # Over both starts: it had been the last start's alone.
    resumed = json.loads((run_dir / step_name(STEPS) / "state.json").read_text())["trainer"]["train_seconds"]
    assert 0 < before < resumed and report["train_seconds"] >= resumed


@pytest.mark.parametrize(
    ("epochs", "step", "epoch", "position", "planned"),
    [
        *((2, 7, 1, 16, 8), (4, 7, 1, 16, 12), (1, 7, 1, 16, 7), (1, 3, 0, 12, 4), (2, 3, 0, 12, 6), (1, 9, 2, 0, 9)),
        # Saved past the end of this split (it shrank under allowConfigChange): the next epoch begins; never a plan
        # below the saved step.
        *((1, 7, 0, 48, 7), (2, 7, 0, 48, 9)),
    ],
)
def test_a_resume_on_another_global_batch_plans_the_epochs_the_spec_asks(
    epochs: int, step: int, epoch: int, position: int, planned: int
) -> None:
    """The plan kept the saved plan's samples, so more `epochs` (allowConfigChange) on another global batch were
    ignored: exit 0, training stopped short. And it counted the rest of an epoch in samples, not in the full batches
    the data gives: a step past `epochs`. 40 examples, saved with 4 or 8 a step, now 16 a step: 2 batches an epoch;
    12 examples into epoch 0, one batch is left of it (28 examples)."""
    from trainer.loop import planned_steps
    from trainer.spec import TrainingSpec

    spec = TrainingSpec.model_validate({"task": "char-gpt", "data": {"train": "a.txt"}, "epochs": epochs})
    saved = TrainerState(step=step, epoch=epoch, position=position, samples_per_step=4 if position == 12 else 8)
    assert planned_steps(spec, examples=40, global_batch=16, saved=saved) == planned
    # The same global batch: the epochs' steps, from epoch 0.
    saved.samples_per_step = 16
    assert planned_steps(spec, examples=40, global_batch=16, saved=saved) == 2 * epochs


@pytest.mark.parametrize(("epochs", "accum", "planned"), [(2, 2, 5), (10, 3, 16), (10, 6, 8), (3, 1, 15)])
def test_the_plan_with_gradient_accumulation_is_the_batches_the_data_gives(
    epochs: int, accum: int, planned: int
) -> None:
    """A step's gradAccum batches cross an epoch's end (TrainBatches is one stream): `epochs` epochs of 5 batches are
    epochs x 5 batches, and the plan rounded each epoch down (2 epochs, accum 2: 4 steps, 1.6 epochs; accum 6 over
    10 epochs: 1 step). A resume on another global batch counts the same."""
    from trainer.loop import planned_steps
    from trainer.spec import TrainingSpec

    values = {"task": "char-gpt", "data": {"train": "a.txt"}, "epochs": epochs, "gradAccum": accum}
    spec = TrainingSpec.model_validate(values)
    assert planned_steps(spec, examples=40, global_batch=8, saved=None) == planned
    resumed = TrainerState(step=0, epoch=0, position=0, samples_per_step=4 * accum)
    assert planned_steps(spec, examples=40, global_batch=8, saved=resumed) == planned


def test_resume_with_changed_settings_is_refused_unless_allowed(
    corpus_file: Path, preempted_copy: tuple[Path, int]
) -> None:
    run_dir, step = preempted_copy
    changed = training(corpus_file, run_dir, batchSize=8)
    changed["optimizer"] = {"lr": 3e-4}
    process = start(changed)
    output = finish(process)
    assert process.returncode != 0
    assert (
        f"error: training.checkpoint: {step_name(step)} was written with different settings (changed:"
        f" training.batchSize, training.optimizer.lr);" in output
    ), output
    assert committed_steps(run_dir)[-1] == step and not (run_dir / "final").exists()

    changed["checkpoint"]["allowConfigChange"] = True
    output = run(changed)
    assert f"resuming from {step_name(step)}: " in output and f"step {STEPS}/{STEPS}" in output
    # The plan's epochs count from where the checkpoint stood, whose steps were of the old global batch; they had been
    # every planned step at the new one.
    epoch, position = map(int, re.search(r"resuming from .*: epoch (\d+), (\d+) samples into it", output).groups())
    planned = re.search(
        r"training (\d+) steps \(([\d.]+) epochs\), (\d+) to go: .*, (\d+) examples per step, (\d+) train", output
    )
    steps, epochs, to_go, per_step, examples = (float(value) for value in planned.groups())
    per_epoch = examples // per_step  # full global batches
    assert (
        epochs == round(epoch + position / (per_epoch * per_step) + to_go / per_epoch, 2) != round(steps / per_epoch, 2)
    )


@pytest.mark.timeout(400)
def test_elastic_group_restarts_after_a_crash_and_finishes_from_the_checkpoint(
    tmp_path: Path, write_spec, corpus_file: Path, marked_env: tuple[dict[str, str], str]
) -> None:
    env, marker = marked_env
    run_dir = tmp_path / "run"
    spec = {
        "name": "elastic",
        "nodes": 2,
        "procsPerNode": 1,
        "elastic": {"enabled": True, "minNodes": 2, "maxNodes": 2, "maxRestarts": 2},
        "training": training(corpus_file, run_dir),
    }
    process = start_ctl("run", str(write_spec(spec)), "--run-dir", str(run_dir), cwd=tmp_path, env=env)
    try:
        read_until_step(process, 1)
        victims = trainer_pids(marker, rank=1)
        assert victims, "rank 1's trainer process not found"
        read_until_step(process, EVERY + 2)
        kill_all(victims)
        output = finish(process, timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    resumed = re.search(r"resuming from (step-\d{8}):", output)
    assert resumed and int(resumed.group(1)[5:]) >= EVERY, output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == STEPS and report["world_size"] == 2
    assert processes_with_marker(marker) == []


def test_training_batches_reshard_without_repeating_or_skipping_a_sample() -> None:
    """4 ranks take two steps, then 3 ranks go on from the same global position to the end of the epoch."""
    dataset = list(range(103))

    def streams(world_size: int, epoch: int, position: int) -> list[TrainBatches]:
        batches = [
            TrainBatches(dataset, Dist(rank, rank, world_size, torch.device("cpu")), 2, seed=7, collate=None)
            for rank in range(world_size)
        ]
        for stream in batches:
            stream.epoch, stream.position = epoch, position
        return batches

    def take(batches: list[TrainBatches], steps: int) -> list[int]:
        iterators = [iter(stream) for stream in batches]
        return [i for _ in range(steps) for it in iterators for i in next(it).tolist()]

    before = streams(4, epoch=0, position=0)
    seen = take(before, steps=2)
    after = streams(3, epoch=before[0].epoch, position=before[0].position)
    seen += take(after, steps=(len(dataset) - 16) // 6)
    assert sorted(seen) == sorted(before[0].epoch_order(0)[:100].tolist()) and len(set(seen)) == 100
    assert after[0].completed_epochs == 1 and next(iter(after[0]))[0] == before[0].epoch_order(1)[0]


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_keeps_the_previous_checkpoint_and_says_so(tmp_path: Path, async_save: bool) -> None:
    """A write that fails half-way (here: the file size limit, EFBIG) leaves the last commit in charge;
    a background save's failure is raised by the next save or the wait at the end of training."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    checkpoints = Checkpointer(tmp_path, CheckpointSpec(keepLast=3, asyncSave=async_save), dist, {"maxSteps": 10})
    state = TrainerState(step=1)
    checkpoints.attach(model, optimizer, scaler, state)
    checkpoints.save()
    checkpoints.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(CheckpointError) as failure:
            state.step = 2
            checkpoints.save()
            checkpoints.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(failure.value)
    assert message.startswith(f"training.checkpoint.dir: cannot save step-00000002 in {tmp_path}: ")
    assert "File too large" in message and message.endswith("; step-00000001 stays the latest checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert [step for step, _ in checkpoints.committed()] == [1]


def test_a_checkpoint_the_store_cannot_read_is_not_taken_for_a_torn_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket's 503 (or a volume's I/O error) on a checkpoint's marker made it incomplete: rank 0 deleted it, and
    the run trained again from step 1, silently. It is an error now, and the checkpoint stays. A save that meets a
    store that does not answer says so at once, not after asking the store again which checkpoint stays (minutes
    more of retries)."""
    model = torch.nn.Linear(4, 4)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    checkpoints = Checkpointer(tmp_path, CheckpointSpec(keepLast=2, keepBest=True), dist, {"maxSteps": 10})
    state = TrainerState(step=1)
    checkpoints.attach(model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False), state)
    checkpoints.save()
    read, asked = checkpoints.store.read_bytes, []

    def slow_down(path: str) -> bytes:
        if path.endswith(MARKER):
            raise StorageError(errno.EIO, f"GET {path}: SlowDown: Please reduce your request rate.")
        return read(path)

    monkeypatch.setattr(checkpoints.store, "read_bytes", slow_down)
    for reader in (checkpoints.clean, checkpoints.load_latest, checkpoints.committed):
        with pytest.raises(StorageError, match="SlowDown"):
            reader()
    assert committed_steps(tmp_path) == [1]

    def unanswered(path: str) -> bytes:
        asked.append(path)
        raise StorageUnreachable(errno.EIO, f"GET {path}: no answer, timed out (after 5 retries in 180.0 s)")

    monkeypatch.setattr(checkpoints.store, "read_bytes", unanswered)
    state.step = 2
    with pytest.raises(CheckpointError) as failure:
        checkpoints.save()
    assert str(failure.value).endswith(
        "cannot save step-00000002 in " + str(tmp_path) + ": GET step-00000002/COMMITTED: no answer, timed out (after 5"
        " retries in 180.0 s); the checkpoints saved before it stay as they were"
    )
    assert asked == [f"step-00000002/{MARKER}"] and committed_steps(tmp_path) == [1]


@pytest.mark.parametrize("file", [MODEL, OPTIMIZER, RNG, STATE])
def test_a_damaged_checkpoint_file_is_one_line_naming_it(tmp_path: Path, file: str) -> None:
    """A committed file whose bytes changed since, at the same size: the line was the library's own
    (`SafetensorError: header too large`, or torch's advice to load it with weights_only=False), naming no file."""
    model = torch.nn.Linear(4, 4)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    checkpoints = Checkpointer(tmp_path, CheckpointSpec(keepLast=2), dist, {"maxSteps": 10})
    optimizer, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    checkpoints.attach(model, optimizer, scaler, TrainerState(step=1))
    checkpoints.save()
    damaged = tmp_path / "step-00000001" / file
    damaged.write_bytes(random.Random(0).randbytes(damaged.stat().st_size))
    checkpoints.attach(model, optimizer, scaler, TrainerState())
    with pytest.raises(CheckpointError) as failure:
        checkpoints.load_latest()
    line = str(failure.value)
    assert line.startswith(f"training.checkpoint.dir: step-00000001/{file} is damaged (") and "\n" not in line, line
    assert line.endswith("); move step-00000001 away to resume from the checkpoint before it"), line
    assert "weights_only" not in line, line


def test_a_save_on_a_volume_lists_no_event_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TensorBoard event files are listed for an upload only (object storage): on a volume the run directory is
    the store, and a save leaves them where they are, however many the run has written."""
    listed: list[Path] = []
    monkeypatch.setattr("trainer.checkpoint.event_files", lambda run_dir: listed.append(run_dir) or [])
    model = torch.nn.Linear(4, 4)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    checkpoints = Checkpointer(tmp_path, CheckpointSpec(keepLast=2), dist, {"maxSteps": 10})
    checkpoints.attach(
        model, torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False), TrainerState(step=1)
    )
    checkpoints.save()
    assert committed_steps(tmp_path) == [1]
    assert listed == []


# Steps 1-5 and their val losses (3 without one): keepLast 2 with keepBest keeps steps 2 (the best), 4 and 5.
LOSSES = [3.0, 1.0, None, 2.0, 2.5]


def save_steps_with_losses(
    checkpoints: Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> None:
    """A checkpoint at each step of LOSSES, each one committed before the next."""
    state = TrainerState()
    checkpoints.attach(model, optimizer, scaler, state)
    for step, val_loss in enumerate(LOSSES, start=1):
        state.step, state.val_loss = step, val_loss
        checkpoints.save()
        assert checkpoints.committed()[-1][0] == step


def test_keeps_the_newest_and_the_best_and_prunes_only_after_a_commit(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    kept = {}
    for keep_best in (True, False):
        run_dir = tmp_path / f"best-{keep_best}"
        run_dir.mkdir()
        checkpoints = Checkpointer(run_dir, CheckpointSpec(keepLast=2, keepBest=keep_best), dist, {})
        save_steps_with_losses(checkpoints, model, optimizer, scaler)
        kept[keep_best] = sorted(p.name for p in run_dir.iterdir())
    assert kept[True] == ["latest", "step-00000002", "step-00000004", "step-00000005"]
    assert kept[False] == ["latest", "step-00000004", "step-00000005"]


def test_a_diverging_run_stops_with_the_step_and_saves_nothing_non_finite(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    spec = tiny_spec(
        corpus_file, optimizer={"lr": 1e30}, schedule={"warmupSteps": 0}, maxSteps=20, checkpoint={"every": 2}
    ) | {"procsPerNode": 2, "nodes": 2}
    result = run_ctl("run", str(write_spec(spec)), "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    # Every rank stops on the summed loss at the same step: the line names the step, not a rank or a node.
    failed = re.fullmatch(
        r"error: the (training|validation) loss went non-finite \(nan\) at step \d+;"
        r" (step-\d{8} in .* is the newest checkpoint|no checkpoint yet) \(lower training.optimizer.lr or set"
        r" training.gradClip\)"
        r" \(logs of every rank in (\S+)\)",
        result.stderr.splitlines()[-1],
    )
    assert failed, result.stderr
    assert len(list(Path(failed.group(3)).glob("**/stderr.log"))) == 4, result.stderr
    for step_dir in (tmp_path / "run").glob("step-*"):
        assert math.isfinite(json.loads((step_dir / "state.json").read_text())["trainer"]["val_loss"])


def test_a_state_saved_before_the_sums_had_names_still_loads() -> None:
    """state.json of older checkpoints holds the interval and epoch sums as lists in field order (three fields
    before tokens were summed per epoch); a resume reads them into the named Sums."""
    saved = asdict(TrainerState(step=4))
    saved |= {"interval_totals": [2.5, 3.0, 8.0], "epoch_totals": [5.0, 6.0, 16.0, 64.0]}
    state = TrainerState(**saved)
    assert state.interval_totals == Sums(loss_sum=2.5, correct=3.0, targets=8.0, tokens=0.0)
    assert state.epoch_totals == Sums(loss_sum=5.0, correct=6.0, targets=16.0, tokens=64.0)
    assert TrainerState(**json.loads(json.dumps(asdict(state)))) == state  # and the named form round-trips


def saved_linear(run_dir: Path, config: dict[str, Any]) -> Checkpointer:
    """A checkpoint step-00000001 of a Linear(4, 4) in `run_dir`, by the Checkpointer it returns."""
    model = torch.nn.Linear(4, 4)
    checkpoints = Checkpointer(run_dir, CheckpointSpec(), Dist(0, 0, 1, torch.device("cpu")), config)
    optimizer, scaler = torch.optim.AdamW(model.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    checkpoints.attach(model, optimizer, scaler, TrainerState(step=1))
    checkpoints.save()
    return checkpoints


def test_a_flipped_bit_in_a_weight_is_found_by_its_crc32(tmp_path: Path) -> None:
    """A committed file changed at its size in a way that still reads was loaded, and trained on."""
    checkpoints = saved_linear(tmp_path, {"maxSteps": 10})
    weights = tmp_path / step_name(1) / MODEL
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # in the last weight's mantissa: the file still reads, as the same tensors
    weights.write_bytes(bytes(data))
    safetensors.torch.load_file(weights)
    with pytest.raises(CheckpointError) as failure:
        checkpoints.load_latest()
    assert str(failure.value) == (
        "training.checkpoint.dir: step-00000001/model.safetensors is damaged (its CRC-32 is not the one its commit"
        " recorded); move step-00000001 away to resume from the checkpoint before it"
    )


def test_a_checkpoint_file_the_system_cannot_read_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.load's OSError (an I/O error; its zip reader's EINVAL on some damage) named no file."""
    checkpoints = saved_linear(tmp_path, {"maxSteps": 10})
    load = torch.load

    def failing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == RNG:
            raise OSError(errno.EINVAL, "Invalid argument")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", failing)
    with pytest.raises(CheckpointError) as failure:
        checkpoints.load_latest()
    assert str(failure.value) == (
        "training.checkpoint.dir: cannot read step-00000001/rng.pt (OSError: [Errno 22] Invalid argument); if it is"
        " damaged, move step-00000001 away to resume from the checkpoint before it"
    )


def test_weights_of_another_shape_are_refused_in_one_line_even_when_changes_are_allowed(tmp_path: Path) -> None:
    """load_state_dict's RuntimeError gave only its title line (`Error(s) in loading state_dict for Linear:`)."""
    saved_linear(tmp_path, {"maxSteps": 10})
    wider = torch.nn.Linear(4, 8)
    spec = CheckpointSpec(allowConfigChange=True)
    checkpoints = Checkpointer(tmp_path, spec, Dist(0, 0, 1, torch.device("cpu")), {"maxSteps": 20})
    optimizer, scaler = torch.optim.AdamW(wider.parameters()), torch.amp.GradScaler("cpu", enabled=False)
    checkpoints.attach(wider, optimizer, scaler, TrainerState())
    with pytest.raises(SpecError) as failure:
        checkpoints.load_latest()
    line = str(failure.value)
    assert line.startswith(
        "training.checkpoint: step-00000001/model.safetensors does not fit this run's model (size mismatch for weight:"
    ), line
    assert "\n" not in line and "cannot change on a resume, allowConfigChange or not; start a new run directory" in line


def test_how_and_where_the_data_is_prepared_may_change_on_a_resume(tmp_path: Path) -> None:
    data = {"train": ["a.txt"], "cacheDir": None, "fingerprint": "metadata", "prepareWorkers": 0}
    saved_linear(tmp_path, {"maxSteps": 10, "evalBatches": 0, "data": data})
    dist = Dist(0, 0, 1, torch.device("cpu"))
    faster = {"cacheDir": "/cache", "fingerprint": "content", "prepareWorkers": 2}
    Checkpointer(
        tmp_path, CheckpointSpec(), dist, {"maxSteps": 10, "evalBatches": 5, "data": data | faster}
    ).check_settings()
    other = Checkpointer(tmp_path, CheckpointSpec(), dist, {"maxSteps": 10, "data": data | {"train": ["b.txt"]}})
    with pytest.raises(SpecError, match=r"\(changed: training.data.train\);"):
        other.check_settings()


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (None, "is gone, and the run has checkpoints: the data they were trained on cannot be checked;"),
        (b'{"fingerprint": ', "is damaged (JSONDecodeError: Expecting value: line 1 column 17 (char 16));"),
        (b"{}", "is damaged (not the record a run writes);"),
    ],
)
def test_a_resume_without_a_readable_dataset_record_stops_on_a_line_naming_it(
    tmp_path: Path, record: bytes | None, why: str
) -> None:
    """Without dataset.json the data check was skipped (changed data trained on, silently); a damaged one gave
    JSONDecodeError or KeyError: 'sources', naming no file."""
    from trainer.spec import TrainingSpec
    from trainer.workloads import RUN_DATASET, resumed_dataset

    saved_linear(tmp_path, {"maxSteps": 10})
    (tmp_path / "latest").unlink()  # the checkpoint folders say that the run has checkpoints, whatever `latest` says
    if record is not None:
        (tmp_path / RUN_DATASET).write_bytes(record)
    spec = TrainingSpec.model_validate({"task": "char-gpt", "data": {"train": "a.txt"}})
    with pytest.raises(CheckpointError) as failure:
        resumed_dataset(spec, tmp_path)
    assert str(failure.value).startswith(f"training.checkpoint.dir: {RUN_DATASET} {why}"), str(failure.value)
    allowed = spec.model_copy(update={"checkpoint": CheckpointSpec(allowConfigChange=True)})
    if record is None:
        assert resumed_dataset(allowed, tmp_path) is None  # told to go on without it


def test_a_final_evaluation_that_is_not_finite_leaves_the_last_export_and_report(
    tmp_path: Path, write_spec, corpus_file: Path
) -> None:
    """Weights damaged in a way that still reads (NaN, same size): the export and report.json (with NaN, which JSON has
    not) replaced a good run's."""
    spec = write_spec(tiny_spec(corpus_file, maxSteps=2, sample={"maxNewTokens": 0}))
    assert run_ctl("run", str(spec), "--run-dir", "run", cwd=tmp_path).returncode == 0
    run_dir = tmp_path / "run"
    weights = run_dir / step_name(2) / MODEL
    tensors = safetensors.torch.load_file(weights)
    with safetensors.safe_open(weights, "pt") as saved:
        metadata = saved.metadata()
    size = weights.stat().st_size
    nan = {name: torch.full_like(t, math.nan) for name, t in tensors.items()}
    safetensors.torch.save_file(nan, weights, metadata=metadata)
    assert weights.stat().st_size == size
    marker = run_dir / step_name(2) / MARKER  # as a checkpoint saved before the marker held CRC-32s: it reads
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"crc32": {}}))
    before = {p: p.stat().st_mtime_ns for p in [run_dir / "report.json", *run_dir.glob("final/*")]}
    result = run_ctl("run", str(spec), "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "error: the final validation loss went non-finite (nan) at step 2; step-00000002 in "
    ), result.stderr
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_committed_checkpoint_removed_as_incomplete_is_named(tmp_path: Path) -> None:
    """A checkpoint whose file was cut after its commit went without a word, and the run resumed from the one before."""
    checkpoints = saved_linear(tmp_path, {"maxSteps": 10})
    checkpoints.attached().state.step = 2
    checkpoints.save()
    (tmp_path / step_name(2) / OPTIMIZER).write_bytes(b"cut")
    (tmp_path / ".step-00000003.tmp").mkdir()  # an interrupted save's folder: removed, but never a checkpoint
    assert checkpoints.clean() == [step_name(2)]
    assert committed_steps(tmp_path) == [1] and sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_name(1)]
    assert (tmp_path / "latest").read_text() == f"{step_name(1)}\n"  # it named the one removed
    (tmp_path / "latest").unlink()
    reads = []
    read_bytes = checkpoints.store.read_bytes
    checkpoints.store.read_bytes = lambda key: reads.append(key) or read_bytes(key)  # type: ignore[method-assign]
    assert checkpoints.clean() == [] and (tmp_path / "latest").read_text() == f"{step_name(1)}\n"
    # Each marker is read once (on a bucket, a GET each): naming `latest` had listed and read them all again.
    assert reads == [f"{step_name(1)}/{MARKER}", "latest"]
