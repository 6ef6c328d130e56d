"""The run directory: what a finished run leaves behind (`final/`, `report.json`).

Everything is written under a temporary name and renamed into place, so a reader
never sees a half-written export or report. On object storage (`checkpoint.dir: s3://...`) the
run directory is a node-local cache whose export, TensorBoard events and report are uploaded at
the end, the report last: a report in the bucket means its export is complete there too. The
events and the trackers' run ids also go up with every checkpoint (RUN_RECORDS), each event file once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.models import config_positions
from trainer.names import RUN_IDS, TENSORBOARD_DIR
from trainer.spec import SpecError
from trainer.storage import Store

FINAL = "final"
REPORT = "report.json"
# What a finished run uploads to object storage from its local run directory after its TensorBoard events, in
# this order.
PUBLISHED = (FINAL, REPORT)
# What every checkpoint also uploads after the event files closed by then, before its marker: a run killed outright
# keeps its events up to its newest checkpoint, and a resume on another node goes on in the same MLflow/W&B runs.
RUN_RECORDS = (RUN_IDS,)


def event_files(run_dir: Path) -> list[Path]:
    """The run's TensorBoard event files, by name: a read of the folder, one per checkpoint on object storage, where
    the folder gains a file per checkpoint (a glob's pattern matching and sorting of paths cost 6x as much)."""
    folder = run_dir / TENSORBOARD_DIR
    if not folder.is_dir():
        return []
    with os.scandir(folder) as entries:
        names = sorted(entry.name for entry in entries if entry.name.startswith("events.out.tfevents."))
    return [folder / name for name in names]


def publish(run_dir: Path, store: Store, names: tuple[str, ...] = PUBLISHED, events: list[Path] | None = None) -> None:
    """Make the run's files durable in `store` (nothing to do where the run directory is the store): its TensorBoard
    `events` (every event file by default), then `names`.

    An event file goes up only when the store lacks it at its size. On object storage each checkpoint closes the
    current one (Tracker.seal_events), which then never changes: each file is uploaded once, and a checkpoint
    uploads only the events since the one before, however long the run. The bucket's event files are listed once per
    process (Store.publish_new), not at every checkpoint.
    """
    if not store.uploads:
        return
    store.publish_new(event_files(run_dir) if events is None else events, TENSORBOARD_DIR)
    for name in names:
        if (run_dir / name).exists():
            store.publish(run_dir / name, name)


def restore_run_ids(run_dir: Path, store: Store) -> None:
    """The trackers' run ids from `store` when this node's run directory lacks them (a resume on another node)."""
    target = run_dir / RUN_IDS
    if not target.exists():
        with contextlib.suppress(FileNotFoundError):
            target.write_bytes(store.read_bytes(RUN_IDS))


def prepare_run_dir(path: Path) -> Path:
    """Create the run directory, or fail clearly before any training happens."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"training.checkpoint.dir: cannot create {path}: {exc.strerror}") from None
    # A real write: permissions, read-only mounts and full disks all show up here, before any training.
    probe = path / f".write-test-{os.getpid()}"
    try:
        with probe.open("wb") as file:
            file.write(b"ok")
            os.fsync(file.fileno())
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):  # created, and then no room for its two bytes
            probe.unlink()
        raise SpecError(f"training.checkpoint.dir: {path} is not writable: {exc.strerror}") from None
    return path.resolve()


def remove_created(created: list[Path]) -> None:
    """Undo `prepare_run_dir` when a run fails on bad input: `created` are the folders it made, the run directory
    first, then its parents. All the run directory holds then was written by this start (a built-in dataset);
    a parent that holds something else (the dataset cache, other runs) stays."""
    if created:
        shutil.rmtree(created[0], ignore_errors=True)
    for path in created[1:]:
        with contextlib.suppress(OSError):
            path.rmdir()


def write_report(run_dir: Path, report: dict[str, Any]) -> Path:
    target = run_dir / REPORT
    staging = target.with_name(f".{REPORT}.tmp")
    staging.write_text(json.dumps(finite_or_null(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(staging, target)
    return target


def finite_or_null(value: Any) -> Any:
    """The report's values with null for an infinite or NaN number, which JSON cannot hold (Python would write
    `Infinity`, which other readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_or_null(item) for item in value]
    return value


def export_final(run_dir: Path, model: torch.nn.Module, tokenizer: Any) -> Path:
    """`save_pretrained` model + tokenizer, loadable by transformers' Auto classes as is."""
    target = run_dir / FINAL
    staging = run_dir / f".{FINAL}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    # The tokenizer's limit is the model's (its own default is none): `truncation=True` then fits any text to it.
    if positions := config_positions(model.config):
        tokenizer.model_max_length = positions
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target
