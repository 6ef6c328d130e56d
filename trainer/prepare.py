"""Prepared data: text in, flat token files and a manifest out, in a dataset cache keyed by a fingerprint.

A prepared dataset is a directory `<cacheDir>/<task>-<fingerprint>/`:

    manifest.json        written last: dtype, counts, tokenizer hash, sources (size, mtime), settings
    train.bin            token ids of every document, one after the other (uint16, or uint32 for large vocabularies)
    train.idx            classification: int64 end offset of each document in train.bin
    train.labels         classification: int32 label id of each document
    val.*, test.*        the same for the other splits that have files
    tokenizer/           the BPE trained on the training text, when the spec names no tokenizer

It is built under a temporary name and renamed into place once complete, so a directory that
exists is whole; a failed or killed preparation leaves nothing that a later run would trust.

The fingerprint hashes file metadata (path, size, modification time), the tokenizer and the
settings that change tokens: a restart stats the sources and maps the files, it never reads the
corpus again. `data.fingerprint: content` hashes file contents instead, for filesystems whose
modification times cannot be trusted.

Preparation streams: documents are read one file (JSONL/CSV/Parquet: one row) at a time,
tokenized in chunks by a pool of processes (every core by default) and appended in order, with
at most `data.prepareBufferMiB` of text in flight. Torch-free: `ctl prepare` and the pool's
processes import it without torch.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes.util
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import socket
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainer.names import JOB_NAME_ENV, METRICS_HOST_ENV, METRICS_PORT_ENV, METRICS_PREFIX
from trainer.spec import DataSpec, SpecError, TrainingSpec, load_training_spec
from trainer.text import RECORD_SUFFIXES, expand_paths, load_tokenizer, train_tokenizer

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
CACHE_DIR_NAME = "_datasets"  # next to run directories; `_` is never in a job name (DNS-1035), so no run collides
PARQUET_SUFFIX = ".parquet"
SKIPPED_SHOWN = 5  # names of skipped files a log line shows
PROGRESS_INTERVAL_S = 10.0  # a progress line this often when stderr is not a terminal
# Text per chunk a pool process tokenizes at most (one round trip to the pool): small enough that the processes
# finish the last chunks of a split close together, large next to a round trip's cost (~1 ms).
CHUNK_BYTES = 2**20
# Text per call of the Rust tokenizer within a chunk: it takes over 100 bytes per byte of text while it encodes
# (alignments, offsets, token strings, masks), so a whole 4 MiB chunk at once held ~200 MB per process, and one
# 4 MB document alone ~500 MB. A longer document is encoded in pieces of about this size where that leaves its
# ids unchanged (Encoder.cut).
ENCODE_BATCH_BYTES = 256 * 2**10


@dataclass(frozen=True)
class Source:
    path: str
    size: int
    mtime_ns: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mtimeNs": self.mtime_ns}


def stat_sources(paths: list[Path], key: str) -> list[Source]:
    sources = []
    for path in paths:
        try:
            info = path.stat()
        except OSError as exc:
            raise SpecError(f"{key}: cannot read {path}: {exc.strerror}") from None
        sources.append(Source(str(path.absolute()), info.st_size, info.st_mtime_ns))
    return sources


def content_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_files(spec: TrainingSpec, builtin_files: dict[str, Path] | None) -> dict[str, list[Path]]:
    """The files of each split that has some: train, and val/test where the spec (or the built-in set) names them."""
    if builtin_files is not None:
        return {split: [path] for split, path in builtin_files.items()}
    data = spec.data
    patterns = {"train": data.train, "val": data.val, "test": data.test}
    return {split: expand_paths(globs, f"data.{split}") for split, globs in patterns.items() if globs}


def token_settings(spec: TrainingSpec) -> dict[str, Any]:
    """Every setting that changes the prepared tokens (and nothing that does not, such as valFraction)."""
    data = spec.data
    settings: dict[str, Any] = {"task": spec.task, "textField": data.text_field, "onBadFile": data.on_bad_file}
    if spec.task == "classification":
        settings |= {"labelField": data.label_field, "labels": data.labels, "maxLength": spec.model.block_size}
    if spec.task != "char-gpt" and not (spec.tokenizer.path or spec.model.pretrained):
        settings["trainedVocabSize"] = spec.tokenizer.vocab_size
    return settings


@dataclass(frozen=True)
class Plan:
    """What to prepare and where it lives: computed by every rank from metadata alone."""

    spec: TrainingSpec
    files: dict[str, list[Path]]
    sources: dict[str, list[Source]]
    settings: dict[str, Any]
    tokenizer_hash: str | None  # None: char-gpt, or a BPE trained during preparation
    fingerprint: str
    entry: Path

    @property
    def manifest_path(self) -> Path:
        return self.entry / MANIFEST

    @property
    def error_path(self) -> Path:
        """Where the prepare Job leaves its failure's line (failure_record) for the ranks waiting on it."""
        return self.entry.with_name(f".{self.entry.name}.error")

    @property
    def progress_path(self) -> Path:
        """The prepare Job's latest progress line, rewritten every PROGRESS_INTERVAL_S: its sign of life."""
        return self.entry.with_name(f".{self.entry.name}.progress")

    @property
    def key(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "settings": self.settings,
            "tokenizerSha256": self.tokenizer_hash,
            "sources": {split: [s.to_json() for s in sources] for split, sources in self.sources.items()},
        }


def cache_dir(spec: TrainingSpec, run_dir: Path) -> Path:
    return Path(spec.data.cache_dir) if spec.data.cache_dir else run_dir.parent / CACHE_DIR_NAME


def tokenizer_hash(tokenizer: Any) -> str | None:
    return None if tokenizer is None else hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def make_plan(spec: TrainingSpec, run_dir: Path, tokenizer: Any, builtin_files: dict[str, Path] | None = None) -> Plan:
    files = split_files(spec, builtin_files)
    sources = {split: stat_sources(paths, f"data.{split}") for split, paths in files.items()}
    plan = Plan(spec, files, sources, token_settings(spec), tokenizer_hash(tokenizer), "", Path())
    identity = plan.key
    if spec.data.fingerprint == "content":
        identity["contents"] = {s.path: content_digest(s.path) for group in sources.values() for s in group}
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return replace(plan, fingerprint=fingerprint, entry=cache_dir(spec, run_dir) / f"{spec.task}-{fingerprint}")


def read_manifest(plan: Plan) -> dict[str, Any] | None:
    try:
        return json.loads(plan.manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


# --- Reading documents as a stream -------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    text: str
    label: str | None
    size: int  # bytes of input it stands for, for progress


def _text_file(path: Path, key: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{key}: {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{key}: cannot read {path}: {exc.strerror}") from None


def _value(record: dict[str, Any], name: str, where: str, key: str) -> str:
    value = record.get(name)
    if value is None or value == "":
        raise SpecError(f"{key}: {where}: no {name!r} field")
    return str(value)


def _lines(path: Path, key: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file, read incrementally; an undecodable line names its number."""
    try:
        with path.open("rb") as file:
            for number, raw in enumerate(file, start=1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SpecError(f"{key}: {path}:{number}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{key}: cannot read {path}: {exc.strerror}") from None


def _records(path: Path, fields: list[str], key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each row of a JSONL, CSV or Parquet file, one row in memory at a time."""
    if path.suffix == PARQUET_SUFFIX:
        yield from _parquet_records(path, fields, key)
    elif path.suffix == ".csv":
        lines = (line for _, line in _lines(path, key))
        reader = csv.DictReader(lines)
        try:
            for row in reader:
                yield f"{path}:{reader.line_num}", row
        except csv.Error as exc:
            raise SpecError(f"{key}: {path}:{reader.line_num}: invalid CSV: {exc}") from None
    else:
        for number, line in _lines(path, key):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecError(f"{key}: {path}:{number}: invalid JSON: {exc.msg}") from None
            if not isinstance(record, dict):
                raise SpecError(f"{key}: {path}:{number}: expected a JSON object per line")
            yield f"{path}:{number}", record


def _parquet_records(path: Path, fields: list[str], key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow
    import pyarrow.parquet

    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except (OSError, pyarrow.ArrowException) as exc:
        raise SpecError(f"{key}: {path}: not a readable Parquet file: {str(exc).splitlines()[0]}") from None
    missing = [name for name in fields if name not in parquet.schema_arrow.names]
    if missing:
        raise SpecError(f"{key}: {path}: no {missing[0]!r} column (columns: {', '.join(parquet.schema_arrow.names)})")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024, columns=fields):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", record
    except (OSError, pyarrow.ArrowException) as exc:
        raise SpecError(f"{key}: {path}: row {row + 1}: unreadable: {str(exc).splitlines()[0]}") from None


def find_label(paths: list[Path], label_field: str, label: str, key: str) -> str:
    """Where the first row labelled `label` is (`file:line`, `file: row N`), for a message: read only then."""
    for path in paths:
        for where, record in _records(path, [label_field], key):
            if str(record.get(label_field)) == label:
                return where
    return ", ".join(map(str, paths))


def _file_documents(path: Path, data: DataSpec, labelled: bool, key: str) -> Iterator[Document]:
    if path.suffix not in (*RECORD_SUFFIXES, PARQUET_SUFFIX):
        if labelled:
            raise SpecError(f"{key}: {path}: expected a .jsonl, .csv or .parquet file of text/label rows")
        text = _text_file(path, key)
        yield Document(text, None, len(text))
        return
    fields = [data.text_field, data.label_field] if labelled else [data.text_field]
    for where, record in _records(path, fields, key):
        text = _value(record, data.text_field, where, key)
        label = _value(record, data.label_field, where, key) if labelled else None
        yield Document(text, label, len(text))


@dataclass
class Skipped:
    """Files left out under `data.onBadFile: skip`, with the first reasons."""

    files: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def summary(self) -> str:
        shown = ", ".join(self.files[:SKIPPED_SHOWN]) + (", ..." if len(self.files) > SKIPPED_SHOWN else "")
        return f"skipped {len(self.files)} bad file(s) (data.onBadFile: skip): {shown}; first: {self.reasons[0]}"


def documents(paths: list[Path], data: DataSpec, labelled: bool, key: str, skipped: Skipped) -> Iterator[Document]:
    """Every document of `paths`, in order. With onBadFile skip, a file that fails is left out whole:
    a text file is read once (it is one document); a row file is checked in a first pass."""
    for path in paths:
        if data.on_bad_file == "skip":
            try:
                if path.suffix in (*RECORD_SUFFIXES, PARQUET_SUFFIX):
                    for _ in _file_documents(path, data, labelled, key):
                        pass
                else:
                    yield from list(_file_documents(path, data, labelled, key))
                    continue
            except SpecError as exc:
                if str(path) not in skipped.files:  # each pass over the data meets it again
                    skipped.files.append(str(path))
                    skipped.reasons.append(str(exc))
                continue
        yield from _file_documents(path, data, labelled, key)


def read_texts(paths: list[Path], text_field: str, key: str) -> Iterator[str]:
    """The text of every document of `paths` (a plain text file is one; each JSONL/CSV/Parquet row is one)."""
    # The spec models take their camelCase keys only (as a job spec spells them).
    data = DataSpec.model_validate({"train": [str(p) for p in paths], "textField": text_field})
    return (doc.text for doc in documents(paths, data, False, key, Skipped()))


# --- Tokenizing in a pool ----------------------------------------------------------------------


@dataclass(frozen=True)
class Encoder:
    """How a chunk of documents becomes tokens; picklable, so the pool's processes get it once."""

    dtype: str
    tokenizer_json: str | None = None  # a BPE's backend (tokenizers' JSON)
    chars: str | None = None  # char-gpt: the sorted vocabulary; a chunk's documents are joined by "\n"
    eos_id: int | None = None  # appended after every document (causal-lm packing)
    max_length: int | None = None  # classification: truncation
    cut: int | None = None  # pieces of about this many characters for long documents (see cuts_within_documents)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, per-document lengths) of a chunk."""
        if self.chars is not None:
            points = np.frombuffer("\n".join(texts).encode("utf-32-le"), dtype=np.uint32)
            tokens = np.searchsorted(_codepoints(self.chars), points).astype(self.dtype)
            return tokens, np.array([len(t) for t in texts], dtype=np.int64)
        backend = _backend(self.tokenizer_json)
        special = self.max_length is not None
        pieces = [(doc, piece) for doc, text in enumerate(texts) for piece in pieces_of(text, self.cut)]
        ids_of: list[list[np.ndarray]] = [[] for _ in texts]
        for batch in text_batches(pieces, ENCODE_BATCH_BYTES):
            # encode_batch_fast: the same ids without the offsets, which take a third of the tokenizer's memory.
            encodings = backend.encode_batch_fast([piece for _, piece in batch], add_special_tokens=special)
            for (doc, _), encoding in zip(batch, encodings, strict=True):
                ids_of[doc].append(np.array(encoding.ids, dtype=self.dtype))
        parts = []
        for pieces_ids in ids_of:
            ids = np.concatenate(pieces_ids)[: self.max_length]
            parts.append(ids if self.eos_id is None else np.append(ids, np.array(self.eos_id, dtype=self.dtype)))
        lengths = np.array([len(part) for part in parts], dtype=np.int64)
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)
        return flat, lengths


# Where a long document may be cut (cuts_within_documents): before a newline or a space that follows a printable
# ASCII character (a line of code or prose ends so; words of minified text are spaced so).
CUT = re.compile(r"(?<=[!-~])[\n ]")


def cuts_within_documents(tokenizer_json: str) -> bool:
    r"""Whether cutting a text at a CUT leaves its ids unchanged.

    So for GPT-2's byte-level BPE (and the one preparation trains): no normalizer, and the ByteLevel
    pre-tokenizer's regex without a prefix space. No regex match runs from a printable ASCII character into
    the whitespace after it, so a match starts there (` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` or a
    whitespace run); none looks behind, BPE merges stay within a match, and no added token holds a newline
    or a space or takes the whitespace around it. Other tokenizers are never cut.
    """
    config = json.loads(tokenizer_json)
    pre = config.get("pre_tokenizer") or {}
    added = config.get("added_tokens") or []
    return (
        config.get("normalizer") is None
        and (config.get("model") or {}).get("type") == "BPE"
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and not any(
            "\n" in token["content"] or " " in token["content"] or token.get("lstrip") or token.get("rstrip")
            for token in added
        )
    )


def pieces_of(text: str, size: int | None) -> list[str]:
    """`text` in pieces of at least `size` characters, each cut at a CUT; the whole text when `size` is None or
    no cut exists (a document without a newline or a space after a printable ASCII character)."""
    if size is None:
        return [text]
    pieces, start = [], 0
    while (cut := CUT.search(text, start + size)) is not None:
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


_BACKENDS: dict[str, Any] = {}
_CODEPOINTS: dict[str, np.ndarray] = {}
_POOL_ENCODER: list[Encoder] = []  # set in each pool process by its initializer


def _backend(tokenizer_json: str | None) -> Any:
    if tokenizer_json not in _BACKENDS:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer_json)
        backend.no_truncation()  # transformers' call also turns any saved truncation/padding off
        backend.no_padding()
        _BACKENDS[tokenizer_json] = backend
    return _BACKENDS[tokenizer_json]


def _codepoints(chars: str) -> np.ndarray:
    if chars not in _CODEPOINTS:
        _CODEPOINTS[chars] = np.array([ord(c) for c in chars], dtype=np.uint32)
    return _CODEPOINTS[chars]


def _init_pool(encoder: Encoder) -> None:
    # One process per core already: the tokenizer's own threads would only compete with them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _POOL_ENCODER.append(encoder)


def _encode_in_pool(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _POOL_ENCODER[0].encode(texts)


def text_batches(pieces: list[tuple[int, str]], batch_bytes: int) -> Iterator[list[tuple[int, str]]]:
    """(document, text) pieces in consecutive runs of about `batch_bytes` characters (a longer piece: alone)."""
    start = size = 0
    for end, (_, text) in enumerate(pieces, start=1):
        size += len(text)
        if size >= batch_bytes:
            yield pieces[start:end]
            start, size = end, 0
    if start < len(pieces):
        yield pieces[start:]


def chunks(docs: Iterable[Document], chunk_bytes: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += doc.size
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """Start processes that do not import the parent's `__main__` first.

    A spawned process runs the parent's main module before anything else: for a trainer rank that
    is `trainer.__main__` (torch, transformers: seconds and hundreds of MB per process) when the
    pool's processes need only this module.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def fast_malloc() -> str | None:
    """jemalloc's shared library where the system has it (the image installs it), for the tokenizing processes.

    The Rust tokenizer allocates a few small strings and vectors per token and spends about 40% of its time in
    glibc's malloc and free; with jemalloc it encodes 15-20% faster (docs/data.md).
    """
    return ctypes.util.find_library("jemalloc")


@contextlib.contextmanager
def preloading(library: str | None) -> Iterator[None]:
    """Processes started meanwhile load `library` before any other (LD_PRELOAD); this one is unchanged."""
    before = os.environ.get("LD_PRELOAD")
    if library is not None:
        os.environ["LD_PRELOAD"] = f"{library}:{before}" if before else library
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


@contextlib.contextmanager
def encoding_pool(encoder: Encoder, workers: int, allocator: str | None = None) -> Iterator[Any]:
    """The processes that tokenize, started once for every split of a preparation, with `allocator` preloaded;
    None: tokenize in this one."""
    if workers == 1:
        yield None
        return
    # spawn: the parent may hold threads (a process group, the tokenizer's pool) that fork would copy half-alive.
    with without_main(), preloading(allocator):
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_pool, (encoder,))
    with pool:
        yield pool


def encoded(
    encoder: Encoder, docs: Iterable[Document], pool: Any, workers: int, buffer_bytes: int
) -> Iterator[tuple[list[Document], np.ndarray, np.ndarray]]:
    """(chunk, tokens, lengths) in document order; at most `buffer_bytes` of text in flight."""
    if pool is None:
        for chunk in chunks(docs, min(CHUNK_BYTES, buffer_bytes)):
            yield (chunk, *encoder.encode([d.text for d in chunk]))
        return
    in_flight = 4 * workers  # a few chunks queued per process: it never waits for the parent, busy as it may be
    pending: deque = deque()
    for chunk in chunks(docs, max(1, min(CHUNK_BYTES, buffer_bytes // in_flight))):
        pending.append((chunk, pool.apply_async(_encode_in_pool, ([d.text for d in chunk],))))
        if len(pending) >= in_flight:
            done, result = pending.popleft()
            yield (done, *result.get())
    while pending:
        done, result = pending.popleft()
        yield (done, *result.get())


# --- Progress -----------------------------------------------------------------------------------


class Progress:
    """Bytes of input done out of a known total: a bar on a terminal, a line every 10 s otherwise, and metrics."""

    def __init__(
        self,
        label: str,
        total_bytes: int,
        stream: Any = None,
        metrics: PrepareMetrics | None = None,
        heartbeat: Path | None = None,
    ) -> None:
        self.label, self.total = label, max(1, total_bytes)
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.metrics = metrics
        self.heartbeat = heartbeat  # a file that gets the latest line (for waiting trainers), when given
        self.done_bytes = self.documents = self.tokens = 0
        self.started = self.shown = self.beaten = time.monotonic()
        if metrics:
            metrics.start(label, total_bytes)
        self.beat(f"{label}: started")

    def advance(self, size: int, documents: int, tokens: int) -> None:
        self.done_bytes += size
        self.documents += documents
        self.tokens += tokens
        now = time.monotonic()
        rate = self.done_bytes / max(now - self.started, 1e-9)
        eta = (self.total - self.done_bytes) / rate if rate else math.inf
        if self.metrics:
            self.metrics.advance(size, documents, tokens, eta)
        if now - self.shown >= (0.2 if self.tty else PROGRESS_INTERVAL_S):
            self.shown = now
            self.show(rate, eta)

    def beat(self, text: str) -> None:
        if self.heartbeat is not None:
            self.beaten = time.monotonic()
            self.heartbeat.write_text(text + "\n", encoding="utf-8")

    def show(self, rate: float, eta: float, end: str = "") -> None:
        share = min(1.0, self.done_bytes / self.total)
        text = (
            f"{self.label}: {share:6.1%} {self.done_bytes / 2**20:,.1f}/{self.total / 2**20:,.1f} MiB"
            f" | {rate / 2**20:.1f} MiB/s | {self.documents:,} docs, {self.tokens:,} tokens"
            f" | ETA {eta:,.0f} s"
        )
        if time.monotonic() - self.beaten >= PROGRESS_INTERVAL_S or end:
            self.beat(text)
        if self.tty:
            bar = "#" * int(share * 20)
            self.stream.write(f"\r[{bar:<20}] {text}{end}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        elapsed = time.monotonic() - self.started
        self.done_bytes = self.total
        self.show(self.done_bytes / max(elapsed, 1e-9), 0.0, end="\n")
        if self.metrics:
            self.metrics.finish()


class PrepareMetrics:
    """`ddpjob_prepare_*`: what the dashboard shows while a dataset is prepared (trainer/metrics.py's conventions)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        job = os.environ.get(JOB_NAME_ENV, "")
        name = METRICS_PREFIX + "prepare_"

        def gauge(metric: str, documentation: str, *labels: str) -> Any:
            return Gauge(name + metric, documentation, ["job_name", *labels], registry=self.registry)

        def counter(metric: str, documentation: str) -> Any:
            return Counter(name + metric, documentation, ["job_name"], registry=self.registry)

        self.input = gauge("input_bytes", "Bytes of input the current pass reads.", "stage")
        self.read = counter("read_bytes", "Bytes of input read so far (all passes).")
        self.docs = counter("documents", "Documents read so far (all passes).")
        self.tokens = counter("tokens", "Tokens written to the prepared files.")
        self.eta = gauge("eta_seconds", "Estimated seconds left in the current pass.")
        self.finished = gauge("finished_timestamp_seconds", "Unix time the last pass finished.")
        self.job = job
        self.stage = ""

    @classmethod
    @contextlib.contextmanager
    def serving(cls, port: int, host: str, directory: str | None = None) -> Iterator[PrepareMetrics | None]:
        """Metrics served on `port` while the preparation runs (none when `port` is 0); the port is free after.

        `directory`: prometheus_client's multiprocess directory (a trainer pod's), created if missing.
        """
        if not port:
            yield None
            return
        from prometheus_client import start_http_server

        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        metrics = cls()
        try:
            server, _ = start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as exc:
            raise RuntimeError(f"metrics: cannot serve on {host}:{port}: {exc}") from exc
        try:
            yield metrics
        finally:
            stop_server(server)

    def start(self, stage: str, total: int) -> None:
        self.stage = stage
        self.input.labels(self.job, stage).set(total)

    def advance(self, size: int, documents: int, tokens: int, eta: float) -> None:
        self.read.labels(self.job).inc(size)
        self.docs.labels(self.job).inc(documents)
        self.tokens.labels(self.job).inc(tokens)
        if math.isfinite(eta):
            self.eta.labels(self.job).set(eta)

    def finish(self) -> None:
        self.eta.labels(self.job).set(0)
        self.finished.labels(self.job).set(time.time())


def stop_server(server: Any) -> None:
    """Shut a socketserver down and free its port, at once: serve_forever looks for a shutdown only between
    polls of 0.5 s, so connections wake it until it has seen it (a trainer rank serves its own metrics next)."""
    stopping = threading.Thread(target=server.shutdown, daemon=True)
    stopping.start()
    host, port = server.server_address[:2]
    wake = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    while stopping.is_alive():
        with contextlib.suppress(OSError):
            socket.create_connection((wake, port), timeout=0.1).close()
        stopping.join(0.01)
    server.server_close()


# --- Building a prepared dataset ----------------------------------------------------------------


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
        return documents(self.plan.files[split], self.data, self.labelled, f"data.{split}", self.skipped)

    def input_bytes(self, splits: list[str]) -> int:
        return sum(s.size for split in splits for s in self.plan.sources[split])

    def pass_over(self, label: str, splits: list[str]) -> Iterator[Document]:
        """The documents of `splits` with a progress display of their own."""
        progress = Progress(label, self.input_bytes(splits), metrics=self.metrics, heartbeat=self.heartbeat)
        for split in splits:
            for doc in self.docs(split):
                progress.advance(doc.size, 1, 0)
                yield doc
        progress.finish()

    def build(self) -> dict[str, Any]:
        plan = self.plan
        cache = plan.entry.parent
        created = [p for p in (cache, *cache.parents) if not p.exists()]
        staging = cache / f".{plan.entry.name}.tmp-{os.getpid()}"
        started = time.monotonic()
        try:
            staging.mkdir(parents=True)
            manifest = self.write(staging)
            manifest["seconds"] = round(time.monotonic() - started, 3)
            self.check_unchanged()
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            with contextlib.suppress(FileExistsError, OSError):
                os.rename(staging, plan.entry)  # a concurrent preparation of the same fingerprint may have won
            if not plan.manifest_path.exists():
                raise OSError(f"cannot move {staging} to {plan.entry}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            for path in created:  # nothing left behind on bad data
                with contextlib.suppress(OSError):
                    path.rmdir()
        if self.skipped.files:
            self.log(self.skipped.summary())
        return manifest

    def write(self, staging: Path) -> dict[str, Any]:
        spec, splits = self.plan.spec, list(self.plan.files)
        manifest: dict[str, Any] = self.plan.key | {"task": spec.task, "fingerprint": self.plan.fingerprint}
        if spec.task == "char-gpt":
            chars: set[str] = set()
            for doc in self.pass_over("reading the character vocabulary", splits):
                chars.update(doc.text)
            joined = "".join(sorted(chars | {"\n"}))  # "\n" joins the documents
            vocab_size = len(joined) + 1
            encoder = Encoder(dtype_for(vocab_size), chars=joined)
            manifest["chars"] = joined
        else:
            tokenizer = self.tokenizer
            if tokenizer is None:
                texts = (doc.text for doc in self.pass_over("training the tokenizer", ["train"]))
                train_tokenizer(texts, spec.tokenizer.vocab_size).save_pretrained(staging / TOKENIZER_DIR)
                tokenizer = load_tokenizer(str(staging / TOKENIZER_DIR), "tokenizer")
                manifest["tokenizerSha256"] = tokenizer_hash(tokenizer)
            vocab_size = len(tokenizer)
            tokenizer_json = tokenizer.backend_tokenizer.to_str()
            encoder = Encoder(
                dtype_for(vocab_size),
                tokenizer_json=tokenizer_json,
                eos_id=None if self.labelled else tokenizer.eos_token_id,
                max_length=spec.model.block_size if self.labelled else None,
                # Pieces would each get the special tokens that classification adds.
                cut=ENCODE_BATCH_BYTES if not self.labelled and cuts_within_documents(tokenizer_json) else None,
            )
        manifest |= {"dtype": encoder.dtype, "vocabSize": vocab_size, "splits": {}}
        label_ids: dict[str, int] = {label: i for i, label in enumerate(self.data.labels or [])}
        seen: dict[str, set[str]] = {}
        with encoding_pool(encoder, self.workers, fast_malloc()) as pool:
            for split in splits:
                seen[split] = set()
                manifest["splits"][split] = self.write_split(staging, split, encoder, pool, label_ids, seen[split])
        if self.labelled:
            manifest["labels"] = self.finish_labels(staging, label_ids, seen)
        manifest["skipped"] = {"count": len(self.skipped.files), "files": self.skipped.files[:SKIPPED_SHOWN]}
        return manifest

    def write_split(
        self, staging: Path, split: str, encoder: Encoder, pool: Any, label_ids: dict[str, int], seen: set[str]
    ) -> dict[str, int]:
        """One split's files; `label_ids` gets each new label an id in order of appearance, `seen` the split's."""
        writer = SplitWriter(staging, split, self.labelled)
        progress = Progress(
            f"tokenizing {split}", self.input_bytes([split]), metrics=self.metrics, heartbeat=self.heartbeat
        )
        separator = None if encoder.chars is None else np.array([encoder.chars.index("\n")], dtype=encoder.dtype)
        for chunk, tokens, lengths in encoded(encoder, self.docs(split), pool, self.workers, self.buffer_bytes):
            progress.advance(sum(d.size for d in chunk), len(chunk), len(tokens))
            ids = None
            if self.labelled:
                ids = [label_ids.setdefault(d.label, len(label_ids)) for d in chunk]
                seen.update(d.label for d in chunk)
            if separator is not None and writer.tokens:
                writer.write(separator, np.zeros(0, np.int64), None)
            writer.has_text = writer.has_text or any(d.text.strip() for d in chunk)
            writer.write(tokens, lengths, ids)
        counts = writer.close()
        progress.finish()
        if not writer.documents or not writer.has_text:
            what = "examples" if self.labelled and not writer.documents else "text"
            raise SpecError(f"data.{split}: no {what} in {', '.join(map(str, self.plan.files[split]))}")
        return counts

    @property
    def buffer_bytes(self) -> int:
        return self.data.prepare_buffer_mib * 2**20

    def finish_labels(self, staging: Path, label_ids: dict[str, int], seen: dict[str, set[str]]) -> list[str]:
        """The label set (the spec's, else the training labels sorted) and the files' ids rewritten to it."""
        labels = self.data.labels or sorted(seen["train"])
        known = set(labels)
        for split, split_labels in seen.items():
            unseen = sorted(split_labels - known)
            if unseen:
                where = "data.labels" if self.data.labels else "training data"
                more = f"{len(unseen)} such label(s)"
                row = find_label(self.plan.files[split], self.data.label_field, unseen[0], f"data.{split}")
                raise SpecError(f"data.{split}: {row}: label {unseen[0]!r} is not in the {where} ({more})")
        if len(labels) < 2:
            raise SpecError(f"data.train: one label ({labels[0]!r}); classification needs at least two")
        final = {label: i for i, label in enumerate(labels)}
        remap = np.zeros(max(len(label_ids), 1), dtype=np.int32)
        for label, first_seen in label_ids.items():
            remap[first_seen] = final[label]
        for split in seen:
            path = staging / f"{split}.labels"
            ids = np.fromfile(path, dtype=np.int32)
            remap[ids].tofile(path)  # one int32 per document: small next to the tokens
        return labels

    def check_unchanged(self) -> None:
        """A source written to while it was read would leave tokens matching neither version."""
        for split, paths in self.plan.files.items():
            for path, before in zip(paths, self.plan.sources[split], strict=True):
                now = stat_sources([path], f"data.{split}")[0]
                if (now.size, now.mtime_ns) != (before.size, before.mtime_ns):
                    raise SpecError(f"data.{split}: {path} changed while it was being prepared; prepare again")


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def worker_count(data: DataSpec) -> int:
    """`data.prepareWorkers`, else every core this process may run on."""
    if data.prepare_workers:
        return data.prepare_workers
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare_spec(spec: TrainingSpec, run_dir: Path, log: Callable[[str], None], for_job: bool = False) -> Plan:
    """`ctl prepare` and the chart's prepare Job: the spec's dataset in its cache, prepared unless already there.

    `for_job`: the prepare Job's, which training pods wait for: its progress (Plan.progress_path) shows them it is
    alive, and its failure's line (Plan.error_path) is what they exit with: 2 for bad data, else 1.
    """
    builtin = None
    if spec.data.builtin:
        from trainer import stdlib_docstrings

        builtin = stdlib_docstrings.build(run_dir / "data" / spec.data.builtin)
    source = spec.tokenizer.path or spec.model.pretrained
    key = "tokenizer.path" if spec.tokenizer.path else "model.pretrained"
    tokenizer = load_tokenizer(source, key) if source else None
    plan = make_plan(spec, run_dir, tokenizer, builtin)
    manifest = read_manifest(plan)
    if manifest is not None:
        log(f"already prepared: {plan.entry}")
        return plan
    workers = worker_count(spec.data)
    log(f"preparing {plan.entry} with {workers} process(es)")
    port = int(os.environ.get(METRICS_PORT_ENV) or 0)
    heartbeat = plan.progress_path if for_job else None
    if heartbeat is not None:
        heartbeat.parent.mkdir(parents=True, exist_ok=True)
    plan.error_path.unlink(missing_ok=True)  # a previous attempt's: this one's outcome is not known yet
    try:
        with PrepareMetrics.serving(port, os.environ.get(METRICS_HOST_ENV) or "0.0.0.0") as metrics:
            manifest = Builder(plan, tokenizer, workers, log, metrics, heartbeat).build()
    except Exception as exc:
        if for_job:  # the waiting ranks fail at once with this line instead of waiting for progress that never comes
            plan.error_path.write_text(failure_record(exc), encoding="utf-8")
        raise
    finally:
        if heartbeat is not None:
            heartbeat.unlink(missing_ok=True)
    splits = manifest["splits"].items()
    counts = ", ".join(f"{split} {c['tokens']:,} tokens / {c['documents']:,} docs" for split, c in splits)
    log(f"prepared {plan.entry} in {manifest['seconds']:.1f} s: {counts} ({manifest['dtype']})")
    return plan


def failure_record(exc: Exception) -> str:
    """The prepare Job's outcome as trainer.workloads.wait_for reads it: `error <line>` for bad data, else
    `failed <exception>: <its first line>`."""
    if isinstance(exc, SpecError):
        return f"error {exc}"
    lines = str(exc).splitlines()
    return f"failed {type(exc).__name__}: {lines[0]}" if lines else f"failed {type(exc).__name__}"


def main(argv: list[str] | None = None) -> None:
    """The chart's prepare Job: `python -m trainer.prepare --config /etc/ddpjob/training.yaml`."""
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=prepare_spec.__doc__)
    parser.add_argument("--config", required=True, type=Path, help="training.yaml (the spec's training: section)")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        spec = load_training_spec(args.config)
        run_dir = Path(spec.checkpoint.dir or Path("runs") / spec.task).absolute()
        prepare_spec(spec, run_dir, log, for_job=True)
    except SpecError as exc:
        log(f"error: {exc}")
        sys.exit(2)


if __name__ == "__main__":
    # As `python -m trainer.prepare` this file is `__main__`, which the pool's processes do not import (without_main):
    # its functions would not reach them. The importable module's do.
    from trainer.prepare import main as importable_main

    importable_main()
