"""What every task's `load` shares: the Workload it returns, its tokenizer, and its prepared data.

Every rank stats the data files and computes the dataset's fingerprint (trainer/prepare.py), so
a missing file fails fast and identically everywhere. When the dataset cache has no prepared
copy, rank 0 prepares it while the others poll the rendezvous store for its outcome: no
collective waits on the tokenizing, so no process-group timeout limits how long it may take.
Smaller work that writes (the built-in dataset, a hub download) is done by rank 0 first behind a
barrier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset

from trainer.checkpoint import CheckpointError
from trainer.data import CharVocab, Collate
from trainer.dist import Dist, barrier
from trainer.location import S3Location, is_s3, source_name
from trainer.metrics import metrics_endpoint
from trainer.names import CHECKPOINT_NAME, METRICS_HOST_ENV, NEW_RUN_DIR, PREPARED_BY_JOB_ENV
from trainer.preparation.plan import (
    CACHE_DIR_NAME,
    MANIFEST,
    Source,
    compared_by_content,
    content_digest,
    contents,
    source_key,
    split_files,
    stat_sources,
    tokenizer_hash,
)
from trainer.preparation.readers import skipped_warning
from trainer.prepare import Builder, Plan, PrepareMetrics, failure_record, make_plan, read_manifest, worker_count
from trainer.spec import SpecError, TrainingSpec
from trainer.storage import S3Store, open_store
from trainer.text import load_tokenizer

T = TypeVar("T")


@dataclass
class Workload:
    """What a task hands the training loop (trainer/tasks adds its own fields)."""

    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer or a CharVocab: its len() and save_pretrained(), with the model
    train: Dataset
    val: Dataset
    data: Plan  # the prepared dataset it reads
    collate: Collate | None = None
    # The final report needs every validation example's prediction: the loop's final evaluation keeps them.
    predict: bool = field(default=False, kw_only=True)


class PreparationFailed(RuntimeError):
    """The data was not prepared for a reason other than the data (a crash, an OOM kill, a lost node, a prepare
    Job that never ran): one line that says so and what to run next. Exit code 1: restarting cannot help."""


def main_rank_first(dist: Dist, work: Callable[[], T]) -> T:
    """Rank 0 does `work` first (it may write or download); the others then do it from what it left."""
    if not dist.is_main:
        barrier(dist)
    result = work()
    if dist.is_main:
        barrier(dist)
    return result


RUN_DATASET = "dataset.json"  # in the run directory: the fingerprint and sources its checkpoints were trained on
WAIT_POLL_S = 1.0  # the prepare Job's files on the shared volume
STORE_POLL_S = 0.1  # rank 0's outcome in the rendezvous store: a local round trip, so the ranks start together
WAIT_LOG_S = 60.0


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def given_tokenizer(spec: TrainingSpec, dist: Dist) -> Any:
    """The spec's tokenizer (or the pretrained model's); None when preparation trains one."""
    source = spec.tokenizer.path or spec.model.pretrained
    if not source:
        return None
    key = "training.tokenizer.path" if spec.tokenizer.path else "training.model.pretrained"
    return main_rank_first(dist, lambda: load_tokenizer(source, key))


def check_same_sources(spec: TrainingSpec, run_dir: Path, sources: Callable[[], dict[str, list[Source]]]) -> None:
    """A run resuming from checkpoints must read the data they were trained on, or the resume is not a resume.

    `sources`: the data files as they are now, stated only when the run resumes.
    """
    if spec.checkpoint.allow_config_change or (before := resumed_dataset(spec, run_dir)) is None:
        return
    # Contents, where modification times say nothing (compared_by_content), when the record has them (one written
    # with `fingerprint: metadata`, or before built-in sets were compared so, has not).
    digests = before.get("contents") if compared_by_content(spec) else None
    for split, now in sources().items():
        old = {source_key(spec, s["path"]): s for s in before["sources"].get(split, [])}
        for source in now:
            previous, name = old.get(source_key(spec, source.path)), source_name(source.path)
            if previous is None:
                raise SpecError(f"training.data.{split}: {name} is new since this run's checkpoints were written")
            if previous["size"] != source.size:
                how = f"size {previous['size']} -> {source.size}"
            elif digests is not None:
                same = digests.get(source_key(spec, source.path)) == content_digest(source)
                how = "" if same else "the same size, other contents"
            elif previous["mtimeNs"] != source.mtime_ns:
                how = f"the same size, modified at {modified(source.mtime_ns)}, not {modified(previous['mtimeNs'])}"
            else:
                how = ""
            if how:
                raise SpecError(
                    f"training.data.{split}: {name} changed since this run's checkpoints were written"
                    f" ({how}); restore it, or start a new run directory ({NEW_RUN_DIR})"
                )
        if gone := sorted(set(old) - {source_key(spec, s.path) for s in now}):
            name = source_name(gone[0])
            raise SpecError(f"training.data.{split}: {name} is gone since this run's checkpoints were written")


def resumed_dataset(spec: TrainingSpec, run_dir: Path) -> dict[str, Any] | None:
    """The dataset record (record_dataset) of a run that resumes from a checkpoint; None when there is nothing to
    resume (no checkpoint yet, no run directory), or when the record is gone and allowConfigChange says go on."""
    store = open_store(spec.checkpoint.dir, run_dir)  # the run directory, or its bucket
    if not any(CHECKPOINT_NAME.fullmatch(name) for name in store.names()):  # by its folders: `latest` may be gone
        return None
    try:
        record = json.loads(store.read_bytes(RUN_DATASET))
        if isinstance(record, dict) and isinstance(record.get("sources"), dict):
            return record
        why = "not the record a run writes"
    except FileNotFoundError:
        if spec.checkpoint.allow_config_change:
            return None
        # Written before the first checkpoint: gone by a hand (or a disk), the data could change unseen.
        raise CheckpointError(
            f"training.checkpoint.dir: {RUN_DATASET} is gone, and the run has checkpoints: the data they were trained"
            " on cannot be checked; restore it, set training.checkpoint.allowConfigChange: true to resume without the"
            f" check, or start a new run directory ({NEW_RUN_DIR})"
        ) from None
    except ValueError as exc:  # not JSON, not UTF-8
        why = f"{type(exc).__name__}: {exc}"
    raise CheckpointError(
        f"training.checkpoint.dir: {RUN_DATASET} is damaged ({why}); restore it, delete it and set"
        " training.checkpoint.allowConfigChange: true to resume without the data check, or start a new run directory"
        f" ({NEW_RUN_DIR})"
    )


def modified(mtime_ns: int) -> str:
    """A file's modification time in a message: UTC, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mtime_ns / 1e9))


def check_resumed_data(spec: TrainingSpec, run_dir: Path) -> None:
    """check_same_sources before anything touches the run directory, so that a refusal leaves it as it was. A
    built-in set is built into the run directory by the task: `prepared` checks it once built."""
    if not spec.data.builtin:
        check_same_sources(spec, run_dir, lambda: spec_sources(spec))


def spec_sources(spec: TrainingSpec) -> dict[str, list[Source]]:
    return {split: stat_sources(paths, f"training.data.{split}") for split, paths in split_files(spec, None).items()}


def prepared(
    spec: TrainingSpec, dist: Dist, run_dir: Path, tokenizer: Any, builtin: dict[str, Path] | None = None
) -> tuple[Plan, dict[str, Any]]:
    """The dataset's plan and manifest: from the cache, else prepared by rank 0 (or the chart's prepare Job)."""
    plan = make_plan(spec, run_dir, tokenizer, builtin)
    if builtin is not None:  # other data was checked before the run directory was touched (check_resumed_data)
        check_same_sources(spec, run_dir, lambda: plan.sources)
    manifest = find_manifest(plan)
    if manifest is None:
        prepares = dist.is_main and not os.environ.get(PREPARED_BY_JOB_ENV)
        manifest = prepare_now(plan, tokenizer, dist.store) if prepares else wait_for(plan, dist)
    else:
        say(f"rank {dist.rank}: prepared data {plan.entry} ({manifest['splits']['train']['tokens']:,} train tokens)")
        if dist.is_main and manifest.get("skipped", {}).get("count"):  # as its preparation warned
            say(skipped_warning(manifest["skipped"]))
    return plan, manifest


def bucket_datasets(plan: Plan) -> S3Store | None:
    """Where a run on object storage shares its prepared datasets with the other nodes and later starts (each node's
    cache is its own): `_datasets/` beside its run directory in the bucket, as on the volume. None otherwise."""
    run_dir = plan.spec.checkpoint.dir
    if plan.spec.data.cache_dir or not is_s3(run_dir):
        return None
    run = S3Location.parse(str(run_dir))
    prefix = f"{run.prefix.rpartition('/')[0]}/{CACHE_DIR_NAME}".lstrip("/")
    return S3Store(S3Location(run.bucket, prefix), plan.entry.parent)


def find_manifest(plan: Plan) -> dict[str, Any] | None:
    """The prepared dataset's manifest from this node's cache, or downloaded there from the bucket (a run on object
    storage) when it is complete there (its manifest is uploaded last)."""
    manifest = read_manifest(plan)
    shared = bucket_datasets(plan)
    if manifest is None and shared is not None and shared.exists(f"{plan.entry.name}/{MANIFEST}"):
        shared.local(plan.entry.name, target=plan.entry)
        manifest = read_manifest(plan)
    return manifest


def outcome_key(plan: Plan) -> str:
    # Per attempt: a restarted group must not read the previous attempt's outcome.
    return f"prepared/{plan.fingerprint}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def prepare_now(plan: Plan, tokenizer: Any, store: Any) -> dict[str, Any]:
    """Rank 0 prepares; the outcome (or the one-line bad-data error) goes to the waiting ranks through the `store`
    (Dist.store; None without torchrun)."""
    workers = worker_count(plan.spec.data)
    say(f"preparing {plan.entry} with {workers} process(es)")
    # Rank 0 is its pod's local rank 0, which serves the pod's metrics: the preparation's until training starts.
    port, directory = metrics_endpoint()
    try:
        with PrepareMetrics.serving(port, os.environ.get(METRICS_HOST_ENV) or "0.0.0.0", directory) as metrics:
            manifest = Builder(plan, tokenizer, workers, say, metrics).build()
        if (shared := bucket_datasets(plan)) is not None:  # before the other nodes hear it is done
            say(f"uploading {plan.entry.name} to {shared.describe()}")
            shared.commit(plan.entry, plan.entry.name, MANIFEST)
    except BaseException as exc:
        if store is not None:
            store.set(outcome_key(plan), failure_record(exc))
        raise
    if store is not None:
        store.set(outcome_key(plan), "ok")
    return manifest


def wait_for(plan: Plan, dist: Dist) -> dict[str, Any]:
    """Poll for rank 0's (or the prepare Job's) outcome: the store's key, the manifest, or the Job's error file.

    Rank 0 failing ends the whole group (torchrun), so its wait needs no bound. The prepare Job is another
    pod: when it has shown no progress (Plan.progress_path) for `training.timeouts.prepareStallSeconds`, it has
    died or never ran, and the rank gives up instead of waiting forever.
    """
    store, key = dist.store, outcome_key(plan)
    job = os.environ.get(PREPARED_BY_JOB_ENV)
    who = f"the prepare Job {job}" if job else "rank 0"
    bound = plan.spec.timeouts.prepare_stall_seconds
    started = logged = time.monotonic()
    started_at = time.time()
    done_at: float | None = None
    say(f"rank {dist.rank}: waiting for {who} to prepare {plan.entry}")
    from_store = store is not None and not job  # rank 0 says when it is done: the volume is read only then
    while True:
        outcome = store.get(key).decode() if from_store and store.check([key]) else None
        if not from_store or outcome == "ok":
            manifest = find_manifest(plan)
            if manifest is not None:
                return manifest
        failure = plan.error_path.read_text(encoding="utf-8") if job and plan.error_path.exists() else None
        if outcome is not None and outcome != "ok":
            failure = outcome
        elif outcome == "ok":
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > WAIT_LOG_S:  # long after rank 0 finished: not the same volume
                failure = (
                    f"error training.data.cacheDir: {plan.entry.parent} must be a volume every node shares:"
                    f" rank 0 prepared {plan.entry.name} there and this node does not see it"
                )
        if failure is not None:
            kind, _, message = failure.partition(" ")
            if kind == "error":
                raise SpecError(message)
            raise PreparationFailed(f"{who} failed to prepare {plan.entry}: {message}")
        progress, last_sign = job_progress(plan, started_at) if job else ("", math.inf)
        if time.time() - last_sign > bound:  # the Job's node's clock may differ a little: the bound is long
            raise PreparationFailed(
                f"{who} has not prepared dataset {plan.fingerprint} ({plan.entry}): no progress from it for {bound} s"
                f" (training.timeouts.prepareStallSeconds), after {time.monotonic() - started:.0f} s of waiting;"
                f" see `kubectl logs job/{job}`, or prepare it with `ctl prepare SPEC`, then start the job again"
            )
        if time.monotonic() - logged >= WAIT_LOG_S:
            logged = time.monotonic()
            say(f"rank {dist.rank}: still waiting for {who} ({logged - started:.0f} s){progress}")
        time.sleep(STORE_POLL_S if from_store else WAIT_POLL_S)


def job_progress(plan: Plan, since: float) -> tuple[str, float]:
    """(`: ` and the prepare Job's latest progress line, or ""; the wall time of its last sign of life, or `since`)."""
    try:
        line = plan.progress_path.read_text(encoding="utf-8").strip()
        return f": {line}", max(since, plan.progress_path.stat().st_mtime)
    except FileNotFoundError:  # not started yet, or between its attempts
        return "", since


def vocabulary_hash(tokenizer: Any) -> str | None:
    """What the model's token ids stand for: a char-gpt's characters, or the tokenizer (one trained during
    preparation is known only once the data is prepared)."""
    if isinstance(tokenizer, CharVocab):
        return hashlib.sha256("".join(tokenizer.chars).encode()).hexdigest()
    return tokenizer_hash(tokenizer)


def check_same_vocabulary(work: Workload, run_dir: Path) -> None:
    """A run resuming from checkpoints must read its tokens as they were trained: another vocabulary (a tokenizer
    trained anew on changed data under allowConfigChange, a pinned tokenizer's files changed, new characters) would
    give the model's embeddings other tokens, silently. Every rank checks it, before anything is resumed."""
    if (record := resumed_dataset(work.data.spec, run_dir)) is None:
        return
    trained = record.get("vocabularySha256")  # None: recorded before the vocabulary was
    if trained is not None and trained != vocabulary_hash(work.tokenizer):
        pinned = "" if isinstance(work.tokenizer, CharVocab) else " (or set training.tokenizer.path to it)"
        raise SpecError(
            "training.data: the vocabulary differs from the one this run's checkpoints were trained on: resumed,"
            f" the model would read its token ids as other tokens; restore the data{pinned}, or start a new run"
            f" directory ({NEW_RUN_DIR})"
        )


def record_dataset(work: Workload, run_dir: Path) -> None:
    """The data checked out: this run reads this dataset, and its vocabulary, from now on (check_same_sources,
    check_same_vocabulary)."""
    plan = work.data
    record = {"fingerprint": plan.fingerprint, "entry": str(plan.entry)} | plan.key
    if compared_by_content(plan.spec):  # what a resume compares then (check_same_sources)
        record["contents"] = contents(plan.spec, plan.sources)
    record["vocabularySha256"] = vocabulary_hash(work.tokenizer)
    text = json.dumps(record, indent=1) + "\n"
    store = open_store(plan.spec.checkpoint.dir, run_dir)
    with contextlib.suppress(FileNotFoundError):
        if store.read_bytes(RUN_DATASET).decode() == text:  # a refused resume writes nothing
            return
    store.write_text(RUN_DATASET, text)
