"""Per task: read the data, get the tokenizer, build the model. Everything after is shared.

Data files are read and checked on every rank before anything is written, so bad
data fails fast and identically everywhere. Work that writes (a trained tokenizer,
the token cache, the built-in dataset) is done by rank 0 first, into the run
directory; the other ranks wait at a barrier and read it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.utils.data import Dataset

from trainer import stdlib_docstrings
from trainer.data import (
    CharVocab,
    Collate,
    LabelledExamples,
    PadCollator,
    TokenBlocks,
    check_enough_samples,
    load_char_corpus,
    raise_block_too_long,
)
from trainer.dist import Dist, barrier
from trainer.models import build_causal_lm, build_char_gpt, build_classifier
from trainer.spec import SpecError, TrainingSpec
from trainer.text import expand_paths, find_label, load_tokenizer, read_documents, read_labelled, train_tokenizer

T = TypeVar("T")


@dataclass
class Workload:
    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer, exported with the model
    train: Dataset
    val: Dataset
    test: Dataset | None = None  # classification: the split of the final report (val when None)
    collate: Collate | None = None
    labels: list[str] | None = None
    char_vocab: CharVocab | None = None  # char-gpt: encodes the sample prompt


def main_rank_first(dist: Dist, work: Callable[[], T]) -> T:
    """Rank 0 does `work` first (it may write or download); the others then do it from what it left."""
    if not dist.is_main:
        barrier(dist)
    result = work()
    if dist.is_main:
        barrier(dist)
    return result


def tokenizer_for(spec: TrainingSpec, dist: Dist, run_dir: Path, texts: list[str]) -> Any:
    """The spec's tokenizer (or the pretrained model's), else a byte-level BPE trained on `texts` by rank 0."""
    source = spec.tokenizer.path or spec.model.pretrained
    if source:
        key = "tokenizer.path" if spec.tokenizer.path else "model.pretrained"
        return main_rank_first(dist, lambda: load_tokenizer(source, key))
    trained = run_dir / "tokenizer"

    def train_once() -> Any:
        if dist.is_main and not (trained / "tokenizer.json").exists():
            train_tokenizer(texts, spec.tokenizer.vocab_size).save_pretrained(trained)
        return load_tokenizer(str(trained), "tokenizer")

    return main_rank_first(dist, train_once)


def char_gpt(spec: TrainingSpec, dist: Dist, run_dir: Path) -> Workload:
    corpus = load_char_corpus(spec.data, spec.model.block_size)
    check_enough_samples(len(corpus.train), dist, spec.batch_size, "data.train")
    model = build_char_gpt(spec.model, corpus.vocab.size, corpus.vocab.special_id)
    return Workload(model, corpus.vocab.to_hf_tokenizer(), corpus.train, corpus.val, char_vocab=corpus.vocab)


def tokenize_packed(tokenizer: Any, documents: list[str]) -> torch.Tensor:
    """One stream of token ids, documents separated by eos (GPT-2's packing)."""
    ids: list[int] = []
    for encoded in tokenizer(documents, add_special_tokens=False, verbose=False)["input_ids"]:
        ids += encoded
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


def causal_lm(spec: TrainingSpec, dist: Dist, run_dir: Path) -> Workload:
    data = spec.data
    train_docs = read_documents(expand_paths(data.train, "data.train"), data.text_field, "data.train")
    val_docs = read_documents(expand_paths(data.val, "data.val"), data.text_field, "data.val") if data.val else []
    tokenizer = tokenizer_for(spec, dist, run_dir, train_docs)

    # Tokenize once: rank 0 writes the packed tokens to the run directory, keyed by what they depend on.
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for doc in [*train_docs, "\0val\0", *val_docs]:
        digest.update(doc.encode())
    cache = run_dir / "cache" / f"tokens-{digest.hexdigest()[:16]}.pt"

    def load_tokens() -> dict[str, torch.Tensor]:
        if dist.is_main and not cache.exists():
            tokens = {"train": tokenize_packed(tokenizer, train_docs)}
            tokens["val"] = tokenize_packed(tokenizer, val_docs) if val_docs else tokens["train"][:0]
            cache.parent.mkdir(parents=True, exist_ok=True)
            staging = cache.with_suffix(".tmp")
            torch.save(tokens, staging)
            staging.replace(cache)
        return torch.load(cache)

    tokens = main_rank_first(dist, load_tokens)
    train_ids, val_ids = tokens["train"], tokens["val"]
    if not val_docs:
        cut = int(len(train_ids) * (1 - data.val_fraction))
        train_ids, val_ids = train_ids[:cut], train_ids[cut:]
    block = spec.model.block_size
    train_set, val_set = TokenBlocks(train_ids, block), TokenBlocks(val_ids, block)
    check_enough_samples(len(train_set), dist, spec.batch_size, "data.train")
    if not len(val_set):
        raise_block_too_long(block, len(val_ids), "tokens")
    return Workload(build_causal_lm(spec.model, tokenizer), tokenizer, train_set, val_set)


def classification(spec: TrainingSpec, dist: Dist, run_dir: Path) -> Workload:
    data = spec.data
    if data.builtin:
        built = run_dir / "data" / data.builtin
        files = main_rank_first(
            dist,
            lambda: (
                stdlib_docstrings.build(built)
                if dist.is_main
                else {s: built / f"{s}.jsonl" for s in stdlib_docstrings.SPLITS}
            ),
        )
        splits = {split: [path] for split, path in files.items()}
    else:
        splits = {
            split: expand_paths(patterns, f"data.{split}")
            for split, patterns in (("train", data.train), ("val", data.val), ("test", data.test))
            if patterns
        }

    def rows(split: str) -> list[tuple[str, str]]:
        return read_labelled(splits[split], data.text_field, data.label_field, f"data.{split}")

    train_rows = rows("train")
    if "val" in splits:
        val_rows = rows("val")
    else:  # a seeded shuffle, so a file sorted by label still gives a mixed validation split
        order = list(range(len(train_rows)))
        random.Random(spec.seed).shuffle(order)
        held_out = set(order[: max(1, int(len(order) * data.val_fraction))])
        val_rows = [row for i, row in enumerate(train_rows) if i in held_out]
        train_rows = [row for i, row in enumerate(train_rows) if i not in held_out]
    test_rows = rows("test") if "test" in splits else None

    labels = data.labels or sorted({label for _, label in train_rows})
    known = set(labels)
    for split, split_rows in (("train", train_rows), ("val", val_rows), ("test", test_rows or [])):
        unseen = sorted({label for _, label in split_rows} - known)
        if unseen:
            where = "data.labels" if data.labels else "training data"
            # A validation split held out of train has no files of its own: its rows are in train's.
            row = find_label(splits.get(split, splits["train"]), data.label_field, unseen[0], f"data.{split}")
            raise SpecError(
                f"data.{split}: {row}: label {unseen[0]!r} is not in the {where} ({len(unseen)} such label(s))"
            )
    if len(labels) < 2:
        raise SpecError(f"data.train: one label ({labels[0]!r}); classification needs at least two")

    check_enough_samples(len(train_rows), dist, spec.batch_size, "data.train")

    tokenizer = tokenizer_for(spec, dist, run_dir, [text for text, _ in train_rows])
    label_id = {label: i for i, label in enumerate(labels)}

    def examples(split_rows: list[tuple[str, str]]) -> LabelledExamples:
        encoded = tokenizer(
            [text for text, _ in split_rows], truncation=True, max_length=spec.model.block_size, verbose=False
        )["input_ids"]
        return LabelledExamples(encoded, [label_id[label] for _, label in split_rows])

    train_set = examples(train_rows)
    return Workload(
        model=build_classifier(spec.model, tokenizer, labels),
        tokenizer=tokenizer,
        train=train_set,
        val=examples(val_rows),
        test=examples(test_rows) if test_rows else None,
        collate=PadCollator(tokenizer.pad_token_id),
        labels=labels,
    )


PREPARE = {"char-gpt": char_gpt, "causal-lm": causal_lm, "classification": classification}


def prepare(spec: TrainingSpec, dist: Dist, run_dir: Path) -> Workload:
    return PREPARE[spec.task](spec, dist, run_dir)
