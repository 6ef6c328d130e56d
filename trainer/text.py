"""Reading text datasets (plain text, JSONL, CSV) and getting a tokenizer for them.

Every problem with a data file is a SpecError naming the spec key, the file and,
where it applies, the line: the trainer turns it into one line and exit code 2.
"""

from __future__ import annotations

import csv
import glob
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.spec import SpecError

RECORD_SUFFIXES = {".jsonl", ".json", ".csv"}
EOS = "<|endoftext|>"


def expand_paths(patterns: list[str], key: str) -> list[Path]:
    """Expand globs (and `{stdlib}`) into a sorted list of files; no match is a SpecError."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files: set[Path] = set()
    for pattern in patterns:
        expanded = pattern.replace("{stdlib}", stdlib)
        matches = [Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file()]
        if not matches:
            raise SpecError(f"{key}: no file matches {expanded!r}")
        files.update(matches)
    return sorted(files)


def _open_text(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{key}: {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecError(f"{key}: cannot read {path}: {exc.strerror}") from None


def read_records(path: Path, key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each row of a JSONL or CSV file."""
    text = _open_text(path, key)
    if path.suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        for row in reader:
            yield reader.line_num, row
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{key}: {path}:{number}: invalid JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise SpecError(f"{key}: {path}:{number}: expected a JSON object per line")
        yield number, record


def field(record: dict[str, Any], name: str, where: str, key: str) -> str:
    value = record.get(name)
    if value is None or value == "":
        raise SpecError(f"{key}: {where}: no {name!r} field")
    return str(value)


def read_documents(paths: list[Path], text_field: str, key: str) -> list[str]:
    """causal-lm: a plain text file is one document; JSONL/CSV rows are one each."""
    documents = []
    for path in paths:
        if path.suffix in RECORD_SUFFIXES:
            documents += [field(r, text_field, f"{path}:{n}", key) for n, r in read_records(path, key)]
        else:
            documents.append(_open_text(path, key))
    if not any(doc.strip() for doc in documents):
        raise SpecError(f"{key}: no text in {', '.join(map(str, paths))}")
    return documents


def read_labelled(paths: list[Path], text_field: str, label_field: str, key: str) -> list[tuple[str, str]]:
    """classification: (text, label) rows from JSONL/CSV files."""
    rows = []
    for path in paths:
        if path.suffix not in RECORD_SUFFIXES:
            raise SpecError(f"{key}: {path}: expected a .jsonl or .csv file of {text_field}/{label_field} rows")
        for number, record in read_records(path, key):
            where = f"{path}:{number}"
            rows.append((field(record, text_field, where, key), field(record, label_field, where, key)))
    if not rows:
        raise SpecError(f"{key}: no examples in {', '.join(map(str, paths))}")
    return rows


def find_label(paths: list[Path], label_field: str, label: str, key: str) -> str:
    """`file:line` of the first row labelled `label`, for a message."""
    for path in paths:
        for number, record in read_records(path, key):
            if str(record.get(label_field)) == label:
                return f"{path}:{number}"
    return ", ".join(map(str, paths))


def train_tokenizer(texts: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """A GPT-2-style byte-level BPE trained on `texts`; its one special token is eos = pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def check_pretrained_source(source: str, key: str) -> None:
    """A source that is no existing path must be a hub id: otherwise a directory is missing (and transformers
    would answer with its rules for repo ids)."""
    if Path(source).exists():
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        raise SpecError(f"{key}: {source}: no such directory") from None


def load_tokenizer(source: str, key: str):  # -> PreTrainedTokenizerBase
    """From a directory (or a hub id when the network allows); pad = eos when it has no pad token."""
    from transformers import AutoTokenizer

    check_pretrained_source(source, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"{key}: cannot load a tokenizer from {source!r}: {reason}") from None
    if tokenizer.eos_token is None:
        raise SpecError(f"{key}: the tokenizer in {source!r} has no eos token")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer
