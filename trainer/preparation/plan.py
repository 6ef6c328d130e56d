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
modification times cannot be trusted, and so does a built-in set (by file name, not path: its run directory may
move).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.location import source_name
from trainer.spec import SpecError, TrainingSpec
from trainer.text import expand_paths

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
CACHE_DIR_NAME = "_datasets"  # next to run directories; `_` is never in a job name (DNS-1035), so no run collides


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
            raise SpecError(f"{key}: cannot read {source_name(path)}: {exc.strerror}") from None
        sources.append(Source(str(path.absolute()), info.st_size, info.st_mtime_ns))
    return sources


@functools.cache  # the resume's data check and the plan ask for the same files, at one start
def content_digest(source: Source) -> str:
    digest = hashlib.sha256()
    with open(source.path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def compared_by_content(spec: TrainingSpec) -> bool:
    """Whether sources are known by their contents, not their modification times: with `fingerprint: content`, and
    for a built-in set, which has new times wherever it is built again (a run directory copied, or its data/ lost)."""
    return spec.data.fingerprint == "content" or bool(spec.data.builtin)


def source_key(spec: TrainingSpec, path: str) -> str:
    """How a source is known from one start to the next: its path; a built-in set's file by its name, which stays
    when the run directory that holds it moves."""
    return Path(path).name if spec.data.builtin else path


def contents(spec: TrainingSpec, sources: dict[str, list[Source]]) -> dict[str, str]:
    """Each source's SHA-256 by source_key (compared_by_content)."""
    return {source_key(spec, s.path): content_digest(s) for group in sources.values() for s in group}


def split_files(spec: TrainingSpec, builtin_files: dict[str, Path] | None) -> dict[str, list[Path]]:
    """The files of each split that has some: train, and val/test where the spec (or the built-in set) names them."""
    if builtin_files is not None:
        return {split: [path] for split, path in builtin_files.items()}
    data = spec.data
    patterns = {"train": data.train, "val": data.val, "test": data.test}
    return {split: expand_paths(globs, f"training.data.{split}") for split, globs in patterns.items() if globs}


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
        """Where the prepare Job leaves its failure's line (trainer.prepare.failure_record) for the waiting ranks."""
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
    """The dataset cache's folder; a `cacheDir` that is (or is under) a file is bad input, found before anything
    is written (it was a traceback of the first write there)."""
    if not spec.data.cache_dir:
        return run_dir.parent / CACHE_DIR_NAME
    folder = Path(spec.data.cache_dir)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise SpecError(f"training.data.cacheDir: {existing} is a file, not a folder")
    return folder


def tokenizer_hash(tokenizer: Any) -> str | None:
    return None if tokenizer is None else hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def make_plan(spec: TrainingSpec, run_dir: Path, tokenizer: Any, builtin_files: dict[str, Path] | None = None) -> Plan:
    cache = cache_dir(spec, run_dir)
    files = split_files(spec, builtin_files)
    sources = {split: stat_sources(paths, f"training.data.{split}") for split, paths in files.items()}
    plan = Plan(spec, files, sources, token_settings(spec), tokenizer_hash(tokenizer), "", Path())
    identity = plan.key
    if compared_by_content(spec):  # instead of the modification times
        identity["sources"] = {
            split: [(source_key(spec, s.path), s.size) for s in group] for split, group in sources.items()
        }
        identity["contents"] = contents(spec, sources)
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return replace(plan, fingerprint=fingerprint, entry=cache / f"{spec.task}-{fingerprint}")


def read_manifest(plan: Plan) -> dict[str, Any] | None:
    try:
        return json.loads(plan.manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
