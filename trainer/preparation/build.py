"""Building a prepared dataset: every split's token files written in a staging directory, the manifest last,
then renamed into place."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.cpus import usable_cpus
from trainer.location import source_name
from trainer.owned import OWNER, remove, remove_if_abandoned
from trainer.preparation.encode import (
    ENCODE_BATCH_BYTES,
    Encoder,
    cuts_within_documents,
    encoded,
    encoding_pool,
    fast_malloc,
)
from trainer.preparation.plan import MANIFEST, TOKENIZER_DIR, Plan, stat_sources, tokenizer_hash
from trainer.preparation.progress import PrepareMetrics, Progress
from trainer.preparation.readers import Document, Skipped, documents, find_label, skipped_warning
from trainer.spec import DataSpec, SpecError
from trainer.text import load_tokenizer, train_tokenizer


class SplitWriter:
    """Appends one split's tokens (and, for classification, document ends and label ids) to its files."""

    def __init__(self, directory: Path, split: str, labelled: bool) -> None:
        self.tokens_file = (directory / f"{split}.bin").open("wb")
        self.ends_file = (directory / f"{split}.idx").open("wb") if labelled else None
        self.labels_file = (directory / f"{split}.labels").open("wb") if labelled else None
        self.tokens = self.documents = 0
        self.has_text = False

    def write(self, tokens: np.ndarray, lengths: np.ndarray, label_ids: list[int] | None) -> None:
        self.tokens_file.write(tokens.tobytes())
        if self.ends_file is not None:
            self.ends_file.write((self.tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
            self.labels_file.write(np.array(label_ids, dtype=np.int32).tobytes())
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def close(self) -> dict[str, int]:
        for file in (self.tokens_file, self.ends_file, self.labels_file):
            if file is not None:
                file.flush()
                os.fsync(file.fileno())
                file.close()
        return {"tokens": self.tokens, "documents": self.documents}


def label_order(labels: Iterable[str]) -> list[str]:
    """Sorted by value when every label is a number, else as text: rows labelled 0..n-1 (a Hugging Face ClassLabel
    exported) keep each label's id equal to it in the model's id2label ("10" after "9", not after "1")."""
    numbers = {label: as_number(label) for label in labels}
    if None in numbers.values():
        return sorted(numbers)
    return sorted(numbers, key=lambda label: (numbers[label], label))  # "1" before "1.0": the same on every run


def as_number(label: str) -> float | None:
    """The number a label writes, if any. "nan" is none: NaN orders before and after nothing, so labels sorted with
    it came out in the order of the set's hashing, which differs from one process to the next."""
    try:
        number = float(label)
    except ValueError:
        return None
    return None if math.isnan(number) else number


def meant(label: str) -> float | str:
    """What a label means: its number ("1" and "1.0" are one), else its text without blanks at its ends (" pos", a
    CSV's `neg, pos`, is "pos")."""
    number = as_number(label)
    return label.strip() if number is None else number


def written_as(twin: float | str) -> str:
    return "number" if isinstance(twin, float) else "label but for blanks at an end,"


def same_label(label: str, labels: list[str]) -> str | None:
    """The first of `labels` that is `label` written another way ("1" for "1.0", "pos" for " pos"), if any: files
    exported by different tools (an integer column, a float column with gaps) write the same class so."""
    return next((other for other in labels if other != label and meant(other) == meant(label)), None)


@dataclass
class Labels:
    """Classification's labels while the splits are written: an id for each new label in order of appearance, the
    labels each split has; `finish` settles the label set and rewrites the files' ids to it."""

    data: DataSpec
    files: dict[str, list[Path]]  # the plan's, to name a row with an unknown label
    ids: dict[str, int] = field(init=False)
    seen: dict[str, set[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ids = {label: i for i, label in enumerate(self.data.labels or [])}

    def add(self, split: str, chunk: list[Document]) -> list[int]:
        """The documents' label ids, in the order of appearance."""
        self.seen.setdefault(split, set()).update(d.label for d in chunk)
        return [self.ids.setdefault(d.label, len(self.ids)) for d in chunk]

    def finish(self, staging: Path) -> list[str]:
        """The label set (the spec's, else the training labels sorted) and the files' ids rewritten to it."""
        labels = self.data.labels or label_order(self.seen["train"])
        if not self.data.labels:
            self.refuse_a_label_written_two_ways(labels)
        known = set(labels)
        for split, split_labels in self.seen.items():
            unseen = sorted(split_labels - known)
            if unseen:
                where = "training.data.labels" if self.data.labels else "training data"
                more = f"{len(unseen)} such label(s)"
                if twin := same_label(unseen[0], labels):
                    what = written_as(meant(twin))
                    more += f"; it has {twin!r}, the same {what} written another way: write each label one way"
                row = find_label(self.files[split], self.data.label_field, unseen[0], f"training.data.{split}")
                raise SpecError(f"training.data.{split}: {row}: label {unseen[0]!r} is not in the {where} ({more})")
        if len(labels) < 2:
            raise SpecError(f"training.data.train: one label ({labels[0]!r}); classification needs at least two")
        final = {label: i for i, label in enumerate(labels)}
        remap = np.zeros(max(len(self.ids), 1), dtype=np.int32)
        for label, first_seen in self.ids.items():
            remap[first_seen] = final[label]
        for split in self.seen:
            path = staging / f"{split}.labels"
            ids = np.fromfile(path, dtype=np.int32)
            remap[ids].tofile(path)  # one int32 per document: small next to the tokens
        return labels

    def refuse_a_label_written_two_ways(self, labels: list[str]) -> None:
        """Two training labels that mean one ("1" and "1.0", "pos" and " pos") would be two classes, silently."""
        first: dict[float | str, str] = {}
        for label in labels:
            if (key := meant(label)) in first:
                twins = (first[key], label)
                rows = [find_label(self.files["train"], self.data.label_field, x, "training.data.train") for x in twins]
                raise SpecError(
                    f"training.data.train: labels {twins[0]!r} ({rows[0]}) and {twins[1]!r} ({rows[1]}) are the same"
                    f" {written_as(key)} written two ways, which would be two classes: write each label one way (or,"
                    " if they are two classes, list them in training.data.labels)"
                )
            first[key] = label


OWNER_TOUCH_SECONDS = 10.0  # how often the process writing a staging directory touches its owner file (locked too)
# Unlocked and untouched this long: its owner is gone. Well above the touch interval plus NFS's attribute cache (up
# to 60 s), so a live owner on another node is kept where locks are only per node (NFS `nolock`, FUSE mounts).
ABANDONED_SECONDS = 180.0


def staging_dir(entry: Path) -> Path:
    """This process's staging directory for `entry`: one per process and pod, since pods sharing a volume prepare the
    same dataset concurrently. One of this name already there was left by a killed process whose pid this one
    reuses: no live one owns it."""
    return entry.parent / f".{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}"


class Owner:
    """This process's claim on its staging directory: a lock the kernel releases however the process ends (SIGKILL,
    out of memory; NFS's server when the node is gone, at its lease's end), and a file touched while it lives."""

    def __init__(self, staging: Path) -> None:
        self.file = (staging / OWNER).open("w")
        with contextlib.suppress(OSError):  # a filesystem without locks: its age alone tells
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.stopped = threading.Event()
        self.toucher = threading.Thread(target=self.touch_while_alive, name="ddpjob-staging-owner", daemon=True)
        self.toucher.start()

    def touch_while_alive(self) -> None:
        while not self.stopped.wait(OWNER_TOUCH_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.file.fileno())

    def now(self) -> float:
        """The volume's time now (its server's clock on NFS): the mtime of this file, touched."""
        os.utime(self.file.fileno())
        return os.fstat(self.file.fileno()).st_mtime

    def close(self) -> None:
        self.stopped.set()
        self.toucher.join()
        self.file.close()  # releases the lock


def remove_abandoned(entry: Path, now: float) -> list[Path]:
    """Removes the staging directories for `entry` whose owner is gone: their lock is free and their owner file was
    last touched more than ABANDONED_SECONDS before `now` (the volume's time). One without an owner file is being
    created, and is left."""
    own = staging_dir(entry)

    def untouched(owner: int) -> bool:
        return now - os.fstat(owner).st_mtime > ABANDONED_SECONDS

    # Not our own: on NFS, whose locks are per process, closing a file of ours would release ours.
    stagings = entry.parent.glob(f".{glob.escape(entry.name)}.tmp-*")
    return [staging for staging in stagings if staging != own and remove_if_abandoned(staging, untouched)]


@contextlib.contextmanager
def staged(entry: Path, log: Callable[[str], None]) -> Iterator[Path]:
    """A staging directory beside `entry`, renamed to it once the body has written it (its manifest last). Nothing
    else is left behind, whatever happens: neither the staging directory nor the folders made for it. Staging
    directories that killed preparations of the same dataset left are removed, before and after: a killed Job's
    retry starts within seconds, before they count as abandoned."""
    cache = entry.parent
    created = [p for p in (cache, *cache.parents) if not p.exists()]
    staging = staging_dir(entry)

    def remove_abandoned_now() -> None:
        with contextlib.suppress(OSError):  # tidying: never a reason for this preparation to fail
            for path in remove_abandoned(entry, owner.now()):
                log(f"removed {path}, left by a preparation that was killed")

    try:
        remove(staging)
        staging.mkdir(parents=True)
        owner = Owner(staging)
        try:
            remove_abandoned_now()
            yield staging
            remove_abandoned_now()
            (staging / OWNER).unlink()  # not part of the dataset; the lock stays held until the file is closed
            with contextlib.suppress(FileExistsError, OSError):
                os.rename(staging, entry)  # a concurrent preparation of the same fingerprint may have won
        finally:
            owner.close()
        if not (entry / MANIFEST).exists():
            raise OSError(f"cannot move {staging} to {entry}")
    finally:
        remove(staging)  # what stays keeps its owner file: a later preparation's sweep removes it
        for path in created:  # nothing left behind on bad data
            with contextlib.suppress(OSError):
                path.rmdir()


def check_unchanged(plan: Plan) -> None:
    """A source written to while it was read would leave tokens matching neither version."""
    for split, paths in plan.files.items():
        for path, before in zip(paths, plan.sources[split], strict=True):
            now = stat_sources([path], f"training.data.{split}")[0]
            if (now.size, now.mtime_ns) != (before.size, before.mtime_ns):
                changed = source_name(path)
                raise SpecError(f"training.data.{split}: {changed} changed while it was being prepared; prepare again")


@dataclass
class Builder:
    """Prepares `plan` into a staging directory, then renames it into place (the manifest inside, written last)."""

    plan: Plan
    tokenizer: Any  # the spec's tokenizer; None: char-gpt, or train one here
    workers: int
    log: Callable[[str], None]
    metrics: PrepareMetrics | None = None
    heartbeat: Path | None = None  # the prepare Job's: Plan.progress_path
    skipped: Skipped = field(default_factory=Skipped)

    @property
    def data(self) -> DataSpec:
        return self.plan.spec.data

    @property
    def labelled(self) -> bool:
        return self.plan.spec.task == "classification"

    def docs(self, split: str) -> Iterator[Document]:
        return documents(self.plan.files[split], self.data, self.labelled, f"training.data.{split}", self.skipped)

    def progress(self, label: str, splits: list[str]) -> Progress:
        """A progress display over the input bytes of `splits`."""
        size = sum(s.size for split in splits for s in self.plan.sources[split])
        return Progress(label, size, metrics=self.metrics, heartbeat=self.heartbeat)

    def pass_over(self, label: str, splits: list[str]) -> Iterator[Document]:
        """The documents of `splits` with a progress display of their own."""
        progress = self.progress(label, splits)
        for split in splits:
            for doc in self.docs(split):
                progress.advance(doc.size, 1, 0)
                yield doc
        progress.finish()

    def build(self) -> dict[str, Any]:
        started = time.monotonic()
        # Looked up before anything is staged: where jemalloc is missing, find_library runs gcc on a temporary file,
        # which a stop (Ctrl-C, SIGTERM) amid it can leave behind; that window is then the start's first moment.
        library = fast_malloc()
        with staged(self.plan.entry, self.log) as staging:
            manifest = self.write(staging, library)
            manifest["seconds"] = round(time.monotonic() - started, 3)
            check_unchanged(self.plan)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        self.plan.error_path.unlink(missing_ok=True)  # a failure recorded for this dataset (trainer.prepare) is over
        if self.skipped.files:
            self.log(skipped_warning(manifest["skipped"]))
        return manifest

    def write(self, staging: Path, library: str | None) -> dict[str, Any]:
        """Every split's files in `staging`, tokenized by processes that preload `library`; the manifest's content."""
        spec, splits = self.plan.spec, list(self.plan.files)
        manifest: dict[str, Any] = self.plan.key | {"task": spec.task, "fingerprint": self.plan.fingerprint}
        char = spec.task == "char-gpt"
        encoder, vocab_size, known = self.char_encoder(splits) if char else self.token_encoder(staging)
        manifest |= known | {"dtype": encoder.dtype, "vocabSize": vocab_size, "splits": {}}
        labels = Labels(self.data, self.plan.files) if self.labelled else None
        with encoding_pool(encoder, self.workers, library) as pool:
            for split in splits:
                manifest["splits"][split] = self.write_split(staging, split, encoder, pool, labels)
        if labels is not None:
            manifest["labels"] = labels.finish(staging)
        manifest["skipped"] = self.skipped.record()
        return manifest

    def char_encoder(self, splits: list[str]) -> tuple[Encoder, int, dict[str, Any]]:
        """char-gpt's: every character of the data (a pass of its own, recorded in the manifest); the vocabulary
        size."""
        chars: set[str] = set()
        for doc in self.pass_over("reading the character vocabulary", splits):
            chars.update(doc.text)
        joined = "".join(sorted(chars | {"\n"}))  # "\n" joins the documents
        vocab_size = len(joined) + 1
        return Encoder(dtype_for(vocab_size), chars=joined), vocab_size, {"chars": joined}

    def token_encoder(self, staging: Path) -> tuple[Encoder, int, dict[str, Any]]:
        """The spec's tokenizer, else one trained here on the training split (saved with the data, its hash in the
        manifest); its vocabulary size."""
        tokenizer, known = self.tokenizer, {}
        if tokenizer is None:
            texts = (doc.text for doc in self.pass_over("training the tokenizer", ["train"]))
            train_tokenizer(texts, self.plan.spec.tokenizer.vocab_size).save_pretrained(staging / TOKENIZER_DIR)
            tokenizer = load_tokenizer(str(staging / TOKENIZER_DIR), "tokenizer")
            known = {"tokenizerSha256": tokenizer_hash(tokenizer)}
        vocab_size = len(tokenizer)
        tokenizer_json = tokenizer.backend_tokenizer.to_str()
        encoder = Encoder(
            dtype_for(vocab_size),
            tokenizer_json=tokenizer_json,
            eos_id=None if self.labelled else tokenizer.eos_token_id,
            max_length=self.plan.spec.model.block_size if self.labelled else None,
            # Pieces would each get the special tokens that classification adds.
            cut=ENCODE_BATCH_BYTES if not self.labelled and cuts_within_documents(tokenizer_json) else None,
        )
        return encoder, vocab_size, known

    def write_split(
        self, staging: Path, split: str, encoder: Encoder, pool: Any, labels: Labels | None
    ) -> dict[str, int]:
        """One split's files; its token and document counts."""
        writer = SplitWriter(staging, split, self.labelled)
        progress = self.progress(f"tokenizing {split}", [split])
        separator = None if encoder.chars is None else np.array([encoder.chars.index("\n")], dtype=encoder.dtype)
        for chunk, tokens, lengths in encoded(encoder, self.docs(split), pool, self.workers, self.buffer_bytes):
            progress.advance(sum(d.size for d in chunk), len(chunk), len(tokens))
            if separator is not None and writer.tokens:
                writer.write(separator, np.zeros(0, np.int64), None)
            writer.has_text = writer.has_text or any(d.text.strip() for d in chunk)
            writer.write(tokens, lengths, None if labels is None else labels.add(split, chunk))
        counts = writer.close()
        progress.finish()
        if not writer.documents or not writer.has_text:
            what = "examples" if self.labelled and not writer.documents else "text"
            files = [source_name(path) for path in self.plan.files[split]]
            if not writer.documents and set(files) <= set(self.skipped.files):
                raise SpecError(
                    f"training.data.{split}: every file was skipped as bad (training.data.onBadFile: skip), so it"
                    f" has no {what}; first: {self.skipped.reasons[0]}"
                )
            raise SpecError(f"training.data.{split}: no {what} in {', '.join(files)}")
        return counts

    @property
    def buffer_bytes(self) -> int:
        return self.data.prepare_buffer_mib * 2**20


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def worker_count(data: DataSpec) -> int:
    """`data.prepareWorkers`, else a process for each CPU this one may use (a prepare pod's: its CPU limit)."""
    return data.prepare_workers or usable_cpus()
