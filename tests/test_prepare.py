"""Prepared data: token files equal a plain single-process tokenization, whatever the number of preparing
processes; bad inputs are one line naming key, file and row with nothing trusted left behind; `ctl prepare`
prepares once and runs map what it wrote."""

from __future__ import annotations

import bz2
import csv
import errno
import fcntl
import gzip
import itertools
import json
import lzma
import multiprocessing.util
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.ipc
import pyarrow.parquet
import pytest
import torch
import yaml
from conftest import processes_with_marker, rank_log, run_ctl, sigterm_as_pid_1, start_ctl, tiny_spec
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from trainer.data import CharVocab
from trainer.dist import Dist
from trainer.names import EXIT_PREEMPTED, METRICS_HOST_ENV, METRICS_PORT_ENV, PREPARED_BY_JOB_ENV
from trainer.preparation import build, encode, readers
from trainer.prepare import (
    MANIFEST,
    Builder,
    Plan,
    PrepareMetrics,
    Stopped,
    make_plan,
    prepare_spec,
    read_texts,
    stop,
)
from trainer.spec import DataSpec, SpecError, TrainingSpec
from trainer.text import expand_paths, train_tokenizer
from trainer.workloads import PreparationFailed, prepare_now, wait_for

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = sorted((STDLIB / "email").glob("*.py"))  # ~600 KB of real text in ~30 files, some empty


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([p.read_text() for p in SOURCES[:5]], vocab_size=400).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> tuple[list[Path], list[str]]:
    """The same kind of documents as plain text files, JSONL, CSV and Parquet; and the documents, in order."""
    root = tmp_path_factory.mktemp("inputs")
    texts = [p.read_text(encoding="utf-8") for p in SOURCES]
    groups = [texts[:10], texts[10:16], texts[16:22], texts[22:]]
    files = []
    for i, text in enumerate(groups[0]):
        files.append(root / f"a{i:02d}.txt")
        files[-1].write_text(text, encoding="utf-8")
    files.append(root / "b.jsonl")
    files[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in groups[1]), encoding="utf-8")
    files.append(root / "c.csv")
    with files[-1].open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, ["text"])
        writer.writeheader()
        writer.writerows({"text": t} for t in groups[2])
    files.append(root / "d.parquet")
    pyarrow.parquet.write_table(pyarrow.table({"text": groups[3]}), files[-1], row_group_size=2)
    return files, [t for group in groups for t in group]


def training(task: str, train: list[str], tmp_path: Path, tokenizer: dict | None = None, **data) -> TrainingSpec:
    return TrainingSpec.model_validate(
        {
            "task": task,
            "model": {"blockSize": 64},
            "tokenizer": tokenizer or {},
            "data": {"train": train, "cacheDir": str(tmp_path / "cache")} | data,
        }
    )


def tokens(entry: Path, split: str = "train") -> np.ndarray:
    manifest = json.loads((entry / MANIFEST).read_text())
    return np.fromfile(entry / f"{split}.bin", dtype=manifest["dtype"])


@pytest.mark.parametrize("workers", [1, 3])
def test_causal_lm_tokens_equal_a_single_process_tokenization(
    tmp_path, tokenizer_dir, mixed_inputs, workers, monkeypatch
) -> None:
    files, documents = mixed_inputs
    # Long documents are encoded in pieces (the tokenizer's memory): here every document of over 2,000 characters.
    for module in (encode, build):  # the batches a process encodes; the pieces the builder asks for
        monkeypatch.setattr(module, "ENCODE_BATCH_BYTES", 2000)
    assert sum(len(encode.pieces_of(text, 2000)) > 1 for text in documents) > len(documents) // 2
    backend = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer
    assert encode.cuts_within_documents(backend.to_str())
    # A whitespace run is one token (" \n\n", "   "): a cut inside one would split it, so none is made there. A
    # document of one line (minified text) is cut before spaces.
    for tricky in ("x = 1 \n\n y = 2\n" * 300, "x = f(1)    'y'\t z9 = [2,   3]; " * 300):
        whole = encode.Encoder("uint16", train_tokenizer([tricky], 300).backend_tokenizer.to_str())  # merges runs
        cut = replace(whole, cut=50)
        assert len(encode.pieces_of(tricky, 50)) > 1
        assert np.array_equal(cut.encode([tricky])[0], whole.encode([tricky])[0])
    assert encode.pieces_of("a" * 500 + "   b", 50) == ["a" * 500, "   b"], "cut before a run, not inside"
    spaced = AutoTokenizer.from_pretrained(tokenizer_dir)
    spaced.add_tokens(["end of text"])  # an added token with a space: a cut could fall inside it
    assert not encode.cuts_within_documents(spaced.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # "\n..." would become " \n..."
    assert not encode.cuts_within_documents(backend.to_str())
    spec = training(
        "causal-lm",
        [str(f) for f in files],
        tmp_path,
        tokenizer={"path": str(tokenizer_dir)},
        prepareWorkers=workers,
        prepareBufferMiB=1,  # many small chunks: the pool's results must come back in order
    )
    entry = prepare_spec(spec, tmp_path / "run", print).entry

    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    encoded = reference(documents, add_special_tokens=False)["input_ids"]
    expected = [token for ids in encoded for token in [*ids, reference.eos_token_id]]
    prepared = tokens(entry)
    assert prepared.dtype == np.uint16
    assert np.array_equal(prepared, np.array(expected, dtype=np.uint16))
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["splits"]["train"] == {"tokens": len(expected), "documents": len(documents)}
    assert [s["path"] for s in manifest["sources"]["train"]] == [str(f) for f in files]
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")], "no staging left behind"


def test_read_texts_reads_every_document_from_the_text_field_it_is_given(tmp_path, mixed_inputs) -> None:
    """The benches' reader: the same documents as preparation reads, in order, from the field named."""
    files, documents = mixed_inputs
    assert list(read_texts(files, "text", "training.data.train")) == documents
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": t, "text": ""}) + "\n" for t in documents[:3]), encoding="utf-8")
    assert list(read_texts([body], "body", "training.data.train")) == documents[:3]


def test_a_byte_order_mark_is_not_part_of_the_text(tmp_path) -> None:
    """Excel's "CSV UTF-8" and Notepad begin a file with one: it is neither text nor in the first column's name."""
    (tmp_path / "a.txt").write_text("a text file", encoding="utf-8-sig")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "a JSONL row"}) + "\n", encoding="utf-8-sig")
    with (tmp_path / "c.csv").open("w", newline="", encoding="utf-8-sig") as out:
        csv.writer(out).writerows([["text", "label"], ["a CSV row", "x"]])
    files = [tmp_path / name for name in ("a.txt", "b.jsonl", "c.csv")]
    assert list(read_texts(files, "text", "training.data.train")) == ["a text file", "a JSONL row", "a CSV row"]


def test_a_boolean_field_is_spelled_as_json_writes_it(tmp_path) -> None:
    """JSON's and Parquet's true and false are the labels "true" and "false", as a CSV has them, not Python's."""
    (tmp_path / "a.jsonl").write_text('{"label": true}\n{"label": false}\n')
    parquet({"label": [True, False]})(tmp_path / "b.parquet")
    (tmp_path / "c.csv").write_text("label\ntrue\nfalse\n")
    files = [tmp_path / name for name in ("a.jsonl", "b.parquet", "c.csv")]
    assert list(read_texts(files, "label", "training.data.train")) == ["true", "false"] * 3


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_json_file_may_be_one_array_of_rows(tmp_path, monkeypatch, chunk) -> None:
    """As `json.dump(rows)` writes it, indented or not: the same rows as json.load reads, read a few bytes at a time
    too (characters of several bytes, numbers and strings cut by a read); a bad row names its line."""
    monkeypatch.setattr(readers, "JSON_CHUNK", chunk)
    rows = [
        {"text": f'row {i} caf\u00e9 \u4e2d\u6587 \U0001f600 \\ "q"', "n": 10**i, "x": [1.5, {}]} for i in range(12)
    ]
    for name, text in (
        ("indented.json", json.dumps(rows, indent=2)),
        ("flat.json", json.dumps(rows, ensure_ascii=False)),
    ):
        (tmp_path / name).write_text("\ufeff \n" + text + "\n", encoding="utf-8")
        assert list(read_texts([tmp_path / name], "text", "training.data.train")) == [row["text"] for row in rows]
        assert [int(n) for n in read_texts([tmp_path / name], "n", "training.data.train")] == [10**i for i in range(12)]
    (tmp_path / "empty.json").write_text(" [ ] ")
    assert list(read_texts([tmp_path / "empty.json"], "text", "training.data.train")) == []
    lines = json.dumps([{"text": "a"}, {"body": "b"}], indent=1).splitlines()  # the second row opens on line 5
    assert lines[4] == " {"
    (tmp_path / "bad.json").write_text("\n".join(lines))
    with pytest.raises(
        SpecError, match=f"^training.data.train: {tmp_path / 'bad.json'}:5: no 'text' field \\(fields: body\\)$"
    ):
        list(read_texts([tmp_path / "bad.json"], "text", "training.data.train"))


def zstd_frames(data: bytes) -> bytes:
    """`data` as two zstd frames, one after the other: what `zstd` writes of files joined (The Pile's shards are
    `.jsonl.zst`)."""
    codec = pyarrow.Codec("zstd")
    half = len(data) // 2
    return codec.compress(data[:half], asbytes=True) + codec.compress(data[half:], asbytes=True)


COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": zstd_frames,
}


@pytest.mark.parametrize("compression", list(COMPRESS))
def test_compressed_files_are_read_as_the_files_they_hold(tmp_path, mixed_inputs, compression) -> None:
    """C4 ships as `.json.gz` JSON Lines: a compressed file is the file its name has under the compression suffix
    (in any case), read as a stream; a document's size is the compressed bytes it took, so progress ends at the
    files' sizes on disk."""
    files, documents_in_order = mixed_inputs
    compressed = []
    for index, path in enumerate(files):
        if path.suffix == ".parquet":  # compressed inside
            compressed.append(path)
            continue
        target = tmp_path / f"{index:02d}{path.suffix.upper() if index % 2 else path.suffix}.{compression}"
        target.write_bytes(COMPRESS[compression](path.read_bytes()))
        compressed.append(target)
    assert list(read_texts(compressed, "text", "training.data.train")) == documents_in_order
    data = DataSpec.model_validate({"train": [str(p) for p in compressed]})

    def sizes(paths: list[Path]) -> dict[Path, list[int]]:
        return {
            path: [d.size for d in readers.documents([path], data, False, "k", readers.Skipped())] for path in paths
        }

    plain = {path: sum(docs) for path, docs in sizes(files).items() if docs}  # (a file may hold no document)
    assert plain == {path: path.stat().st_size for path in plain}  # every byte of a file, once
    packed = {path: sum(docs) for path, docs in sizes(compressed).items() if docs}
    assert len(packed) == len(plain) and all(0 < size <= path.stat().st_size for path, size in packed.items())


def test_arrow_files_and_datasets_saved_to_disk_are_read_as_their_rows(tmp_path) -> None:
    """Hugging Face datasets' own format: Arrow IPC files (the stream format of `save_to_disk` and its cache; the file
    format of Feather 2 too), memory-mapped, a slice of rows at a time. A folder `save_to_disk` wrote is its data files
    in order, not its metadata; a saved DatasetDict names its splits' folders, a folder of the datasets cache its
    splits' files."""
    import datasets

    rows = {"text": [f"document {i}" for i in range(3000)], "label": [f"class {i % 3}" for i in range(3000)]}
    dataset = datasets.Dataset.from_dict(rows)
    dataset.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    shards = expand_paths([str(tmp_path / "saved")], "training.data.train")
    assert [path.name for path in shards] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    data = DataSpec.model_validate({"train": [str(tmp_path / "saved")]})
    read = [doc for path in shards for doc in readers.documents([path], data, True, "k", readers.Skipped())]
    assert [(doc.text, doc.label) for doc in read] == list(zip(rows["text"], rows["label"], strict=True))
    assert sum(doc.size for doc in read) == sum(path.stat().st_size for path in shards)  # progress ends at the sizes

    table = pyarrow.table(rows)
    with pyarrow.ipc.new_file(tmp_path / "feather.arrow", table.schema) as out:  # several batches
        out.write_table(table, max_chunksize=700)
    with pyarrow.ipc.new_stream(tmp_path / "one-batch.arrow", table.schema) as out:  # all rows in one
        out.write_table(table)
    for name in ("feather.arrow", "one-batch.arrow"):
        assert list(read_texts([tmp_path / name], "label", "training.data.train")) == rows["label"], name

    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(5))}).save_to_disk(str(tmp_path / "splits"))
    splits = f"{tmp_path / 'splits' / 'train'}, {tmp_path / 'splits' / 'test'}"
    dataset_dict = (
        f"training.data.train: {tmp_path / 'splits'} is a saved DatasetDict: name one split's folder ({splits})"
    )
    with pytest.raises(SpecError, match=f"^{re.escape(dataset_dict)}$"):
        expand_paths([str(tmp_path / "splits")], "training.data.train")
    test_split = expand_paths([str(tmp_path / "splits" / "test")], "training.data.train")
    assert list(read_texts(test_split, "text", "training.data.train")) == rows["text"][:5]
    # The datasets cache of `load_dataset`: every split's Arrow files and dataset_info.json side by side.
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in rows["text"]))
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "another split"}) + "\n")
    files = {"train": str(tmp_path / "rows.jsonl"), "train_extra": str(tmp_path / "more.jsonl")}
    loaded = datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path / "cache"))
    cache = Path(loaded["train"].cache_files[0]["filename"]).parent
    splits = f"{cache}/json-train.arrow, {cache}/json-train_extra.arrow"  # each split's own file, no other
    refused = f"training.data.train: {cache} is a Hugging Face datasets cache: name one split's files ({splits})"
    with pytest.raises(SpecError, match=f"^{re.escape(refused)}$"):
        expand_paths([str(cache)], "training.data.train")
    train_split = expand_paths([f"{cache}/json-train.arrow"], "training.data.train")
    assert list(read_texts(train_split, "text", "training.data.train")) == rows["text"]
    # Written by 2 processes, a split of 2 files is 2 shards. In a fresh interpreter: its pool forks, and a fork of
    # this one (threads of earlier tests still running) can hang on a lock a thread held.
    files["train"] = [str(tmp_path / "rows.jsonl"), str(tmp_path / "more.jsonl")]
    load = (
        "import datasets, json, pathlib, sys\n"
        "files, cache = json.loads(sys.argv[1]), sys.argv[2]\n"
        "loaded = datasets.load_dataset('json', data_files=files, cache_dir=cache, num_proc=2)\n"
        "print(pathlib.Path(loaded['train'].cache_files[0]['filename']).parent)"
    )
    sharded = [sys.executable, "-c", load, json.dumps(files), str(tmp_path / "sharded")]
    cache = Path(subprocess.run(sharded, capture_output=True, text=True, check=True, timeout=300).stdout.strip())
    with pytest.raises(SpecError, match=re.escape(f"({cache}/json-train-*-of-*.arrow, {cache}/json-train_extra")):
        expand_paths([str(cache)], "training.data.train")
    train_split = expand_paths([f"{cache}/json-train-*-of-*.arrow"], "training.data.train")
    assert list(read_texts(train_split, "text", "training.data.train")) == [*rows["text"], "another split"]
    # Any other folder with a state.json is a folder of files, that one included.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "state.json").write_text('{"step": 3}')
    assert expand_paths([str(tmp_path / "notes")], "training.data.train") == [tmp_path / "notes" / "state.json"]
    (tmp_path / "notes" / "state.json").unlink()
    (tmp_path / "notes" / "dataset_info.json").write_text("[1, 2]")  # and a dataset_info.json that is not HF's
    assert expand_paths([str(tmp_path / "notes")], "training.data.train") == [tmp_path / "notes" / "dataset_info.json"]


def test_a_tsv_file_has_rows_without_quoting(tmp_path) -> None:
    """GLUE's train.tsv: tab-separated, a quote is text (read as CSV quoting, a field opening with one took in the
    rows up to the next quote, silently)."""
    rows = [("sentence", "label"), ('"a film" about nothing', "0"), ("it's 5' 11\" tall", "1"), ('plain "quoted', "1")]
    rows += [('"a" or "b"', "0"), ('""', "1"), ('"""', "0")]  # quotes at both ends, none doubled inside: text
    (tmp_path / "train.tsv").write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
    assert list(read_texts([tmp_path / "train.tsv"], "sentence", "training.data.train")) == [row[0] for row in rows[1:]]
    assert list(read_texts([tmp_path / "train.tsv"], "label", "training.data.train")) == ["0", "1", "1", "0", "1", "0"]
    (tmp_path / "trailing.tsv").write_text("sentence\tlabel\na film\t0\t\t\n")  # empty fields past the header's
    assert list(read_texts([tmp_path / "trailing.tsv"], "label", "training.data.train")) == ["0"]
    (tmp_path / "short.tsv").write_text("sentence\tlabel\nno label here\n")
    with pytest.raises(SpecError, match=r"short\.tsv:2: 'label' is empty$"):
        list(
            readers.documents(
                [tmp_path / "short.tsv"],
                DataSpec.model_validate({"train": ["x"], "textField": "sentence"}),
                True,
                "training.data.train",
                readers.Skipped(),
            )
        )


def test_a_directory_names_the_files_under_it(tmp_path) -> None:
    """As an S3 prefix names its objects: every file below it, in order, hidden ones (.git, .DS_Store) left out."""
    corpus = tmp_path / "corpus [v2]"  # glob's special characters in the name are the name's
    for relative in ("b.txt", "a/c.txt", "a/d/e.jsonl", ".git/HEAD", "a/.DS_Store"):
        (corpus / relative).parent.mkdir(parents=True, exist_ok=True)
        (corpus / relative).write_text("x")
    assert expand_paths([str(corpus)], "training.data.train") == [
        corpus / "a/c.txt",
        corpus / "a/d/e.jsonl",
        corpus / "b.txt",
    ]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=f"^training.data.val: no file in the directory '{tmp_path / 'empty'}'$"):
        expand_paths([str(tmp_path / "empty")], "training.data.val")


def test_a_csv_field_may_be_a_long_document(tmp_path) -> None:
    """Longer than the csv module's default bound on a field (128 KiB)."""
    document = "a long document. " * 20_000
    with (tmp_path / "long.csv").open("w", newline="", encoding="utf-8") as out:
        csv.writer(out).writerows([["text"], [document], ["a short one"]])
    assert list(read_texts([tmp_path / "long.csv"], "text", "training.data.train")) == [document, "a short one"]


def test_the_tokenizing_processes_preload_the_allocator_they_are_given(monkeypatch) -> None:
    """jemalloc where installed (encode.fast_malloc); the mechanism with a library no worker loads by itself."""
    monkeypatch.delenv("LD_PRELOAD", raising=False)  # whatever the environment preloads stays out of the comparison
    encoder = encode.Encoder("uint16", chars="\nab")
    libraries = {}
    for allocator in (None, "libresolv.so.2"):
        with encode.encoding_pool(encoder, 2, allocator) as pool:
            libraries[allocator] = pool.apply(Path.read_text, (Path("/proc/self/maps"),))
            assert pool.apply(encode._encode_in_pool, (["ab", "ba"],))[0].tolist() == [1, 2, 0, 2, 1]
    assert "libresolv" not in libraries[None] and "libresolv" in libraries["libresolv.so.2"]
    assert "LD_PRELOAD" not in os.environ, "this process's environment is left as it was"


def test_a_sigterm_while_the_tokenizing_pool_starts_ends_the_pool_whole(monkeypatch, capfd) -> None:
    """trainer.prepare's SIGTERM raises in the main thread. Arriving while the pool started its processes (here the
    second one spawned, its start-up data not yet written), it left the first running and the second failing with
    EOFError after the Job's last line. Now it is raised once the pool is whole, which then ends both."""
    spawn = multiprocessing.util.spawnv_passfds
    workers: list[int] = []

    def spawned_then_signalled(path: str, args: list[bytes], passfds: tuple[int, ...]) -> int:
        pid = spawn(path, args, passfds)
        if any(b"spawn_main" in os.fsencode(arg) for arg in args):  # not the resource tracker's
            workers.append(pid)
            if len(workers) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return pid

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawned_then_signalled)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped), encode.encoding_pool(encode.Encoder("uint16", chars="\nab"), 2):
            pytest.fail("a stopped start yields no pool")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(workers) == 2
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()] == [], "every worker ended"
    assert "Error" not in capfd.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_classification_and_char_tokens_equal_a_single_process_tokenization(tmp_path, workers) -> None:
    rows = [{"text": p.read_text()[:3000], "label": "big" if p.stat().st_size > 20000 else "small"} for p in SOURCES]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = training("classification", [str(data)], tmp_path, tokenizer={"vocabSize": 300}, prepareWorkers=workers)
    entry = prepare_spec(spec, tmp_path / "run", print).entry
    manifest = json.loads((entry / MANIFEST).read_text())
    tokenizer = AutoTokenizer.from_pretrained(entry / "tokenizer")  # trained on the training text while preparing
    expected = tokenizer([r["text"] for r in rows], truncation=True, max_length=64)["input_ids"]
    ends = np.fromfile(entry / "train.idx", dtype=np.int64)
    flat = tokens(entry)
    assert [flat[s:e].tolist() for s, e in zip([0, *ends[:-1]], ends, strict=True)] == expected
    assert manifest["labels"] == ["big", "small"]
    assert np.fromfile(entry / "train.labels", dtype=np.int32).tolist() == [
        manifest["labels"].index(r["label"]) for r in rows
    ]

    char_entry = prepare_spec(
        training("char-gpt", [str(p) for p in SOURCES], tmp_path, prepareWorkers=workers), tmp_path / "run", print
    ).entry
    text = "\n".join(p.read_text() for p in SOURCES)
    vocab = CharVocab(list(json.loads((char_entry / MANIFEST).read_text())["chars"]))
    assert np.array_equal(tokens(char_entry), vocab.encode(text).numpy())


def test_labels_one_number_written_two_ways_are_two_classes_only_when_the_spec_lists_both(tmp_path) -> None:
    """`1` and `1.0` in the rows are refused as two classes (tests/test_bad_data.py), unless data.labels lists both."""
    rows = [{"text": f"row {i}", "label": [1, 1.0][i % 2]} for i in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = training("classification", [str(data)], tmp_path, tokenizer={"vocabSize": 300}, prepareWorkers=1)
    with pytest.raises(SpecError, match=r"labels '1' \(.*rows\.jsonl:1\) and '1\.0' \(.*rows\.jsonl:2\) are the same"):
        prepare_spec(spec, tmp_path / "run", print)
    listed = training("classification", [str(data)], tmp_path, tokenizer={"vocabSize": 300}, labels=["1.0", "1"])
    entry = prepare_spec(listed, tmp_path / "run", print).entry
    assert np.fromfile(entry / "train.labels", dtype=np.int32).tolist() == [1, 0] * 4


def test_the_label_order_does_not_depend_on_the_order_the_labels_come_in() -> None:
    """Numbers by value, else (a label that is no number, "nan" too: NaN orders against nothing) as text. The
    training labels come as a set, whose order changes with each process's hashing: two preparations of the same
    rows must give every class the same id."""
    for labels, order in [
        (["10", "2", "1.0", "1", "-3"], ["-3", "1", "1.0", "2", "10"]),
        (["10", "2", "nan", "1"], ["1", "10", "2", "nan"]),
        (["b", "10", "a"], ["10", "a", "b"]),
    ]:
        assert {tuple(build.label_order(arrival)) for arrival in itertools.permutations(labels)} == {tuple(order)}


def test_each_file_is_read_once_however_named_and_a_name_with_glob_characters_is_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file named relative and absolute, through `..` or a link, was read (and trained on) once per name; a folder
    linking to itself, 41 times (`**` follows it to the system's limit), and two such links were 2^40 paths: a hang;
    so were folders linking to each other (n! paths). `b[1].txt`, given as it is, was refused as "not a regular
    file": its name was read as a glob only."""
    from trainer.text import expand_paths

    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.txt", "b[1].txt", "b1.txt"):
        (data / name).write_text(name)
    (data / "link.txt").symlink_to(data / "a.txt")
    siblings = [data / f"s{i}" for i in range(12)]
    for folder in [data / "sub", *siblings]:
        folder.mkdir()
        (folder / f"{folder.name}.txt").write_text(folder.name)
    for link, folder in (("loop", data), ("loop2", data), ("sub/up", data), ("sub/.hidden", data)):
        (data / link).symlink_to(folder)
    for one, other in itertools.permutations(siblings, 2):
        (one / other.name).symlink_to(other)
    monkeypatch.chdir(tmp_path)
    names = ["data/a.txt", str(data / "a.txt"), f"{data}/../data/a.txt", str(data / "link.txt")]
    assert expand_paths(names, "k") == [Path("data/a.txt")]
    plain = [data / name for name in ("a.txt", "b1.txt", "b[1].txt")]
    assert expand_paths([str(data)], "k") == sorted([*plain, *(f / f"{f.name}.txt" for f in [data / "sub", *siblings])])
    assert expand_paths(["data/**/sub.txt", "**/a.txt", "data/sub/*"], "k") == [
        Path("data/a.txt"),
        Path("data/sub/sub.txt"),
    ]
    # What names a folder itself after a `**` (`.`, `..`, an empty part) is no link to follow.
    assert expand_paths(["data/**//a.txt", "data/**/./b1.txt"], "k") == [Path("data/a.txt"), Path("data/b1.txt")]
    assert [path.resolve() for path in expand_paths(["data/**/../sub/*.txt"], "k")] == [data / "sub" / "sub.txt"]
    assert expand_paths([str(data / "b[1].txt")], "k") == [data / "b[1].txt"]
    assert expand_paths([str(data / "b[1]*")], "k") == [data / "b1.txt"]  # a glob still, when no file has the name


def parquet(rows: dict[str, list]) -> Callable[[Path], None]:
    return lambda path: pyarrow.parquet.write_table(pyarrow.table(rows), path)


BAD = {
    "missing": ("absent.txt", None, "training.data.train: no file matches"),
    "link-to-nothing": ("link.txt", lambda p: p.symlink_to(p.with_name("gone.txt")), "link.txt' is a link to '"),
    "fifo": ("pipe.txt", os.mkfifo, "pipe.txt' is not a regular file (a FIFO, a socket or a device)"),
    "empty": ("empty.txt", lambda p: p.write_text("  \n"), "training.data.train: no text in"),
    "undecodable": ("latin1.txt", lambda p: p.write_bytes("caf\xe9".encode("latin-1")), "latin1.txt is not UTF-8 text"),
    "jsonl-row": (
        "rows.jsonl",
        lambda p: p.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n'),
        "rows.jsonl:3: no 'text' field (fields: body)",
    ),
    "jsonl-row-of-many-fields": (
        "rows.jsonl",
        lambda p: p.write_text(json.dumps({f"f{i}": i for i in range(12)}) + "\n"),
        "rows.jsonl:1: no 'text' field (fields: f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, ...)",
    ),
    # One object holding the rows in a field (SQuAD's), on one line or indented: what the file is, not valid JSON
    "json-object-of-rows": (
        "rows.json",
        lambda p: p.write_text(json.dumps({"version": 1, "data": [{"text": "a"}]})),
        "rows.json:1: no 'text' field (fields: version, data)",
    ),
    "json-object-indented": (
        "rows.json",
        lambda p: p.write_text(json.dumps({"version": 1, "data": [{"text": "a"}]}, indent=2)),
        "rows.json:1: invalid JSON: the object does not end on its line (JSON Lines: one object per line)",
    ),
    "jsonl-bad-value": (
        "rows.jsonl",
        lambda p: p.write_text('{"text": "a"}\n{"text": tru}\n'),
        "rows.jsonl:2: invalid JSON: Expecting value at column 10",
    ),
    "csv-row": ("rows.csv", lambda p: p.write_text("text,n\na,1\n,2\n"), "rows.csv:3: 'text' is empty"),
    "csv-column": ("rows.csv", lambda p: p.write_text("body,n\na,1\n"), "rows.csv: no 'text' column (columns: body"),
    # A row kept the last column's field: the first one's text was dropped without a word.
    "csv-column-twice": (
        "rows.csv",
        lambda p: p.write_text("text,n,text\na,1,b\n"),
        "rows.csv: 2 columns are named 'text' (columns: text, n, text); rename all but the one to read",
    ),
    "parquet-column": ("rows.parquet", parquet({"body": ["a"]}), "rows.parquet: no 'text' column"),
    "parquet-row": ("rows.parquet", parquet({"text": ["a", "b", None]}), "rows.parquet: row 3: 'text' is empty"),
    # pandas' missing number, as json.dumps writes it
    "jsonl-nan": (
        "rows.jsonl",
        lambda p: p.write_text('{"text": "a"}\n{"text": NaN}\n'),
        "rows.jsonl:2: 'text' is empty",
    ),
    "jsonl-list": (
        "rows.jsonl",
        lambda p: p.write_text('{"text": "a"}\n{"text": ["b", "c"]}\n'),
        "rows.jsonl:2: 'text' is a list, not a string or a number",
    ),
    # A .json file that is one array (json.dump(rows)): the line of the problem, as json.load would name it
    "json-array-trailing-comma": (
        "rows.json",
        lambda p: p.write_text('[\n {"text": "a"},\n {"text": "b"},\n]\n'),
        "rows.json:4: invalid JSON: Expecting value at column 1",
    ),
    # json's message ends in "starting at" for the position its own text adds: the line was cut off there
    "json-array-cut-in-a-string": (
        "rows.json",
        lambda p: p.write_text('[\n {"text": "a"},\n {"text": "b'),
        "rows.json:3: invalid JSON: Unterminated string starting at column 11",
    ),
    "json-array-no-comma": (
        "rows.json",
        lambda p: p.write_text('[\n {"text": "a"}\n {"text": "b"}\n]'),
        "rows.json:3: invalid JSON: Expecting ',' delimiter",
    ),
    "json-array-not-closed": (
        "rows.json",
        lambda p: p.write_text('[{"text": "a"}, {"text": "b"'),
        "rows.json:1: invalid JSON: Expecting ',' delimiter at column 29",
    ),
    # All on one line, as json.dump writes it: the column, also past the first chunk read (1 MiB).
    "json-array-on-one-line": (
        "rows.json",
        lambda p: p.write_text('[{"text": "a"}, {"text": tru}]'),
        "rows.json:1: invalid JSON: Expecting value at column 26",
    ),
    "json-array-on-one-line-past-a-chunk": (
        "rows.json",
        lambda p: p.write_text(f'[{{"text": "a"}}, {{"text": "{"x" * (1 << 20)}"}}, {{"text": tru}}]'),
        f"rows.json:1: invalid JSON: Expecting value at column {(1 << 20) + 40}",
    ),
    "json-array-extra": (
        "rows.json",
        lambda p: p.write_text('[{"text": "a"}]\n[]'),
        "rows.json:2: invalid JSON: Extra",
    ),
    "json-array-of-strings": (
        "rows.json",
        lambda p: p.write_text('[\n{"text": "a"},\n"b"]'),
        "rows.json:3: expected a JSON object per element of the array",
    ),
    "json-array-not-utf-8": (
        "rows.json",
        lambda p: p.write_bytes('[{"text": "caf\xe9"}]'.encode("latin-1")),
        "rows.json is not UTF-8 text (byte 14)",
    ),
    "gzip-cut-short": (
        "rows.jsonl.gz",
        lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30]),
        "rows.jsonl.gz: not a readable .gz file: Compressed file ended before the end-of-stream marker was reached",
    ),
    "not-gzip": ("rows.jsonl.gz", lambda p: p.write_text('{"text": "a"}\n'), "rows.jsonl.gz: not a readable .gz file"),
    "zstd-cut-short": (
        "rows.jsonl.zst",
        lambda p: p.write_bytes(zstd_frames(b'{"text": "a"}\n' * 1000)[:-10]),
        "rows.jsonl.zst: not a readable .zst file: ",
    ),
    "not-zstd": (
        "rows.jsonl.zst",
        lambda p: p.write_text('{"text": "a"}\n'),
        "rows.jsonl.zst: not a readable .zst file",
    ),
    # More fields than the header: the text cut short at the separator, the rest read as other fields or dropped.
    "csv-unquoted-comma": (
        "rows.csv",
        lambda p: p.write_text("text,source\nhello,a\nhello, world,b\n"),
        "rows.csv:3: 3 fields, the header has 2: a comma in a field that is not in quotes? quote the field",
    ),
    # Not strict, the csv module read the rest of the file into the open quote's field, and kept text after a quote.
    "csv-quote-never-closed": (
        "rows.csv",
        lambda p: p.write_text('text\nfine\n"never closed\nmore\nrows\n'),
        "rows.csv:3: invalid CSV: a quote opened in the row that starts here is never closed (the file ends inside it)",
    ),
    "csv-text-after-a-quote": (
        "rows.csv",
        lambda p: p.write_text('text\n"quoted" and not\n'),
        "rows.csv:2: invalid CSV: ',' expected after '\"'",
    ),
    "tsv-tab-in-field": (
        "rows.tsv",
        lambda p: p.write_text("text\nhello\tworld\n"),
        "rows.tsv:2: 2 fields, the header has 1: a tab in a field? a TSV has no quoting: save the rows as .csv",
    ),
    # pandas' to_csv(sep="\t") quotes a field that holds a quote: read as a TSV, the text would keep every quote.
    "tsv-in-csv-quotes": (
        "rows.tsv",
        lambda p: p.write_text('text\n"he said ""hi"" twice"\n'),
        'rows.tsv:2: \'text\' is in CSV quotes, its own quotes doubled (it begins \'"he said ""hi"" twic\'):',
    ),
    "not-arrow": ("rows.arrow", lambda p: p.write_text("text\n"), "rows.arrow: not a readable Arrow file"),
    "not-parquet": ("rows.parquet", lambda p: p.write_text("text\n"), "rows.parquet: not a readable Parquet file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_name_key_file_and_row_and_leave_nothing(tmp_path, case) -> None:
    name, make, message = BAD[case]
    good = tmp_path / "good.txt"
    good.write_text("some good text\n" * 50)
    if make:
        make(tmp_path / name)
    # Empty files are fine among others (a package's empty __init__.py); a corpus without text is not.
    files = [str(tmp_path / name)] if case == "empty" else [str(good), str(tmp_path / name)]
    spec = training("char-gpt", files, tmp_path, prepareWorkers=1)
    with pytest.raises(SpecError) as failure:
        prepare_spec(spec, tmp_path / "run", print)
    assert message in str(failure.value) and "\n" not in str(failure.value)
    assert not (tmp_path / "cache").exists(), "no dataset, no staging: nothing a later run would trust"

    skipping = training("char-gpt", [str(good), str(tmp_path / name)], tmp_path, onBadFile="skip", prepareWorkers=1)
    if case in ("missing", "link-to-nothing", "fifo", "empty"):  # a mistake in the spec, or no text at all
        return
    logged: list[str] = []
    entry = prepare_spec(skipping, tmp_path / "run", logged.append).entry
    warning = f"warning: skipped 1 bad file(s) (training.data.onBadFile: skip): {tmp_path / name}; first: "
    assert any(line.startswith(warning) and message in line for line in logged), logged
    skipped = json.loads((entry / MANIFEST).read_text())["skipped"]
    assert skipped["count"] == 1 and skipped["files"] == [str(tmp_path / name)] and message in skipped["first"]
    assert len(tokens(entry)) == len("some good text\n" * 50)
    # Every file bad: not "no text in" them, which they may well have.
    only_bad = training("char-gpt", [str(tmp_path / name)], tmp_path, onBadFile="skip", prepareWorkers=1)
    with pytest.raises(SpecError) as failure:
        prepare_spec(only_bad, tmp_path / "run", print)
    every = "training.data.train: every file was skipped as bad (training.data.onBadFile: skip), so it has no text;"
    assert str(failure.value).startswith(every) and message in str(failure.value)


def test_ctl_prepare_once_then_runs_map_it_and_a_changed_source_stops_a_resume(tmp_path, corpus_file) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_file.read_text())
    spec = tiny_spec(corpus, checkpoint={"every": 1}, maxSteps=2, sample={"maxNewTokens": 0})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    prepared = run_ctl("prepare", "spec.yaml", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    entry = Path(prepared.stdout.strip())
    assert entry.parent == tmp_path / "runs" / "_datasets" and (entry / MANIFEST).exists()
    assert "tokenizing train" in prepared.stderr
    again = run_ctl("prepare", "spec.yaml", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == prepared.stdout and "already prepared" in again.stderr

    # prepare.enabled: ctl run prepares first (here: finds it done), then its ranks take the prepare Job's path.
    run = run_ctl("run", "spec.yaml", "--set", "prepare.enabled=true", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "already prepared" in run.stderr
    rank_0 = rank_log(tmp_path / "runs" / "tiny", 0, 0)
    assert f"rank 0: prepared data {entry}" in rank_0.read_text() and "preparing" not in run.stdout

    corpus.write_text(corpus.read_text() + "\nmore text\n")  # the resume would train on other data
    # The same settings: changed ones would be refused first, before the data is looked at.
    resumed = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    (failure,) = resumed.stderr.splitlines()
    assert failure.startswith(f"error: training.data.train: {corpus} changed since this run's checkpoints"), failure


def test_the_prepare_jobs_command_prepares_with_several_processes(tmp_path) -> None:
    """The chart's prepare Job runs `python -m trainer.prepare`: its pool's processes get the module's functions even
    though the module is `__main__` there (they failed to unpickle them, so no prepare Job ever finished)."""
    config = tmp_path / "training.yaml"
    data = {"train": [str(p) for p in SOURCES[:3]], "prepareWorkers": 2, "cacheDir": str(tmp_path / "cache")}
    config.write_text(yaml.safe_dump({"task": "char-gpt", "data": data, "checkpoint": {"dir": str(tmp_path / "run")}}))
    command = [sys.executable, "-m", "trainer.prepare", "--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "with 2 process(es)" in done.stderr
    (entry,) = (tmp_path / "cache").iterdir()
    assert json.loads((entry / MANIFEST).read_text())["splits"]["train"]["documents"] == 3


def test_the_prepare_jobs_command_as_pid_1_stops_at_sigterm_and_leaves_nothing(tmp_path, tokenizer_dir) -> None:
    """The prepare Job's pod deleted or evicted while it tokenizes: its command, here a container's PID 1, stops at the
    kubelet's SIGTERM (a process without a handler would never get it, held until SIGKILL) with one line and exit
    143, which the Job retries; no staging directory, dataset or progress file is left, and no failure recorded."""
    cache = tmp_path / "cache"
    # About 27 MB of text: 5-10 s of tokenizing, where the signal comes within 50 ms of its start.
    data = {"train": [str(STDLIB / "*.py"), str(STDLIB / "*" / "*.py")], "prepareWorkers": 2, "cacheDir": str(cache)}
    section = {"task": "causal-lm", "tokenizer": {"path": str(tokenizer_dir)}, "data": data}
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump(section | {"checkpoint": {"dir": str(tmp_path / "run")}}))
    command = [sys.executable, "-m", "trainer.prepare", "--config", str(config)]
    code, stderr = sigterm_as_pid_1(command, tmp_path, lambda: any(cache.glob(".*.tmp-*")))  # tokenizing
    assert code == EXIT_PREEMPTED, stderr
    assert stderr.splitlines()[-1] == (
        "trainer.prepare: stopped by SIGTERM, nothing kept; the next start prepares again (exit 143)"
    ), stderr
    assert [path.name for path in cache.rglob("*")] == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_ctl_prepare_stopped_by_a_signal_says_so_and_leaves_nothing(
    tmp_path, temporary, tokenizer_dir, marked_env, sig
) -> None:
    """SIGTERM ended `ctl prepare` at once: its pool's BrokenPipeError tracebacks (about 50 lines), a half-written
    dataset (50 MB) and its pods' config folder were left. Ctrl-C cleaned up, and said nothing."""
    env, marker = marked_env
    cache = tmp_path / "cache"
    data = {"train": [str(STDLIB / "*.py"), str(STDLIB / "*" / "*.py")], "prepareWorkers": 2, "cacheDir": str(cache)}
    training = {"task": "causal-lm", "tokenizer": {"path": str(tokenizer_dir)}, "data": data}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"name": "tiny", "training": training}))
    ctl = start_ctl("prepare", "spec.yaml", cwd=tmp_path, env=env | {"TMPDIR": str(temporary)}, merge_stderr=False)
    deadline = time.monotonic() + 60
    while not any(cache.glob(".*.tmp-*/*")):  # tokenizing, its pool started
        assert ctl.poll() is None and time.monotonic() < deadline, ctl.communicate()
        time.sleep(0.02)
    ctl.send_signal(sig)
    out, err = ctl.communicate(timeout=60)
    how = "interrupted (SIGINT)" if sig == signal.SIGINT else "terminated (SIGTERM)"
    line = f"ctl: {how}: the preparation stopped, nothing kept; the same command prepares again"
    assert (ctl.returncode, out, err.splitlines()[-1]) == (128 + sig, "", line), err
    assert "Traceback" not in err and "leaked" not in err, err
    assert [path.name for path in cache.rglob("*")] == [] and list(temporary.iterdir()) == []
    assert processes_with_marker(marker) == []


def test_a_staging_directory_left_by_a_killed_process_of_the_same_pod_and_pid_is_replaced(tmp_path) -> None:
    """A killed preparation's (SIGKILL, out of memory) staging directory under this process's name, whose pid the
    killed one had (pids repeat), is no live process's. It made the next preparation fail (FileExistsError), and
    the ranks waiting for it with it."""
    spec = training("char-gpt", [str(p) for p in SOURCES[:3]], tmp_path, prepareWorkers=1)
    plan = make_plan(spec, tmp_path / "run", None)
    stale = build.staging_dir(plan.entry)
    stale.mkdir(parents=True)
    (stale / "train.bin").write_bytes(b"half written")
    with PrepareMetrics.serving(0, "127.0.0.1") as metrics:  # no endpoint
        manifest = Builder(plan, None, 1, print, metrics).build()
    assert manifest["splits"]["train"]["documents"] == 3
    assert sorted(path.name for path in plan.entry.parent.iterdir()) == [plan.entry.name]


def killed_preparation(entry: Path) -> Path:
    """The staging directory of a preparation of `entry` killed outright (SIGKILL, out of memory), after it had
    written some tokens."""
    owner = (
        "import sys, time; from pathlib import Path; from trainer.preparation.build import staged\n"
        "with staged(Path(sys.argv[1]), print) as staging:\n"
        "    (staging / 'train.bin').write_bytes(b'half written'); print(staging, flush=True); time.sleep(120)\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", owner, str(entry)], stdout=subprocess.PIPE, text=True)
    line = killed.stdout.readline().strip()
    killed.kill()
    killed.wait(timeout=30)
    assert line, "the preparation to kill never made its staging directory"
    return Path(line)


def age(staging: Path, seconds: float) -> None:
    """Makes `staging`'s owner file look last touched `seconds` ago."""
    then = time.time() - seconds
    os.utime(staging / build.OWNER, (then, then))


def test_staging_directories_of_killed_preparations_are_removed_and_live_ones_kept(tmp_path, capsys) -> None:
    """A preparation killed in another pod (or in this pod's earlier container: with a shared process namespace its
    pids do not repeat) leaves its staging directory, which filled the volume at every OOM kill until removed by
    hand. The next preparation of that dataset removes those whose owner's lock is free and that nobody touched for
    ABANDONED_SECONDS; a locked one, a recently touched one and one without an owner file yet stay."""
    spec = training("char-gpt", [str(p) for p in SOURCES[:3]], tmp_path, prepareWorkers=1)
    plan = make_plan(spec, tmp_path / "run", None)
    abandoned, recent = killed_preparation(plan.entry), killed_preparation(plan.entry)
    age(abandoned, build.ABANDONED_SECONDS + 5)
    live = abandoned.with_name(f".{plan.entry.name}.tmp-another-pod-7")
    live.mkdir()
    (live / build.OWNER).touch()
    age(live, 10 * build.ABANDONED_SECONDS)  # its owner frozen, say: its lock alone keeps it
    creating = abandoned.with_name(f".{plan.entry.name}.tmp-another-pod-8")  # no owner file yet: just made
    creating.mkdir()
    with (live / build.OWNER).open("r+") as lock:  # another open file: held against this process's attempts too
        fcntl.flock(lock, fcntl.LOCK_EX)
        with PrepareMetrics.serving(0, "127.0.0.1") as metrics:  # no endpoint
            manifest = Builder(plan, None, 1, print, metrics).build()
    assert manifest["splits"]["train"]["documents"] == 3
    assert f"removed {abandoned}, left by a preparation that was killed" in capsys.readouterr().out
    left = sorted(path.name for path in plan.entry.parent.iterdir())
    assert left == sorted([plan.entry.name, recent.name, live.name, creating.name])
    assert not (plan.entry / build.OWNER).exists()


def test_a_staging_directory_abandoned_while_a_preparation_runs_is_removed_after_it(tmp_path, monkeypatch) -> None:
    """A Job killed out of memory is retried within seconds, before its staging directory counts as abandoned: the
    retry removes it when it has finished. Meanwhile the retry's own owner file is kept fresh."""
    monkeypatch.setattr(build, "OWNER_TOUCH_SECONDS", 0.05)
    entry = tmp_path / "cache" / "char-gpt-0123"
    killed = killed_preparation(entry)
    logged: list[str] = []
    with build.staged(entry, logged.append) as staging:
        assert killed.exists()
        age(killed, build.ABANDONED_SECONDS + 5)
        age(staging, build.ABANDONED_SECONDS + 5)
        time.sleep(0.5)
        assert time.time() - (staging / build.OWNER).stat().st_mtime < 0.5
        (staging / MANIFEST).write_text("{}")
    assert logged == [f"removed {killed}, left by a preparation that was killed"]
    assert sorted(path.name for path in entry.parent.iterdir()) == [entry.name]
    assert sorted(path.name for path in entry.iterdir()) == [MANIFEST]


def test_without_file_locks_a_staging_directory_untouched_long_enough_is_abandoned(tmp_path, monkeypatch) -> None:
    """A volume whose filesystem has no locks (flock fails with ENOLCK): the owner file's age alone tells."""

    def no_locks(fd: object, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    entry = tmp_path / "cache" / "char-gpt-0123"
    abandoned, recent = killed_preparation(entry), killed_preparation(entry)
    age(abandoned, build.ABANDONED_SECONDS + 5)
    monkeypatch.setattr(build.fcntl, "flock", no_locks)
    logged: list[str] = []
    with build.staged(entry, logged.append) as staging:
        (staging / MANIFEST).write_text("{}")
    assert logged == [f"removed {abandoned}, left by a preparation that was killed"]
    assert sorted(path.name for path in entry.parent.iterdir()) == sorted([entry.name, recent.name])


def test_preparation_progress_is_exported_as_metrics(tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("words and more words\n" * 2000)
    spec = training("char-gpt", [str(corpus)], tmp_path, prepareWorkers=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with PrepareMetrics.serving(port, "127.0.0.1") as metrics:
        Builder(make_plan(spec, tmp_path / "run", None), None, 1, print, metrics).build()
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in scraped.splitlines() if line[0] != "#"}
    assert values["ddpjob_prepare_tokens_total"] == 2000 * len("words and more words\n")
    assert values["ddpjob_prepare_read_bytes_total"] == 2 * corpus.stat().st_size  # the vocabulary pass, then tokens
    assert values["ddpjob_prepare_eta_seconds"] == 0 and values["ddpjob_prepare_finished_timestamp_seconds"] > 0
    with pytest.raises(OSError):  # the port is free again for the training metrics
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_ranks_waiting_for_the_prepare_job_exit_with_its_bad_data_line(tmp_path, monkeypatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n")
    plan = make_plan(training("char-gpt", [str(corpus)], tmp_path), tmp_path / "run", None)
    plan.error_path.parent.mkdir(parents=True)
    plan.error_path.write_text(f"error training.data.train: {corpus}:1: something wrong")
    monkeypatch.setenv(PREPARED_BY_JOB_ENV, "1")
    with pytest.raises(SpecError, match=f"^training.data.train: {corpus}:1: something wrong$"):
        wait_for(plan, Dist(rank=0, local_rank=0, world_size=2, device=torch.device("cpu")))


def waiting_rank() -> Dist:
    return Dist(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"))


def with_wait_bound(spec: TrainingSpec, seconds: int) -> TrainingSpec:
    """`spec` with `training.timeouts.prepareStallSeconds` below what the model allows (10 s): a short test."""
    return spec.model_copy(update={"timeouts": spec.timeouts.model_copy(update={"prepare_stall_seconds": seconds})})


def test_ranks_waiting_for_a_prepare_job_that_never_prepares_give_up_naming_the_dataset(tmp_path, monkeypatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text\n")
    plan = make_plan(with_wait_bound(training("char-gpt", [str(corpus)], tmp_path), 1), tmp_path / "run", None)
    monkeypatch.setenv(PREPARED_BY_JOB_ENV, "news-prepare")
    failures: list[BaseException] = []

    def wait() -> None:
        try:
            wait_for(plan, waiting_rank())
        except BaseException as exc:
            failures.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=120)
    assert not waiter.is_alive(), "the rank waits forever"
    (failure,) = failures
    assert isinstance(failure, PreparationFailed), failure
    (line,) = str(failure).splitlines()
    assert line.startswith(f"the prepare Job news-prepare has not prepared dataset {plan.fingerprint} ({plan.entry})")
    assert "no progress from it for 1 s (training.timeouts.prepareStallSeconds)" in line
    assert "`kubectl logs job/news-prepare`" in line and "`ctl prepare SPEC`" in line
    assert not plan.entry.exists()


def test_a_prepare_job_showing_progress_is_waited_for_past_the_bound(tmp_path, monkeypatch) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to prepare\n" * 100)
    spec = with_wait_bound(training("char-gpt", [str(corpus)], tmp_path, prepareWorkers=1), 2)
    plan = make_plan(spec, tmp_path / "run", None)
    monkeypatch.setenv(PREPARED_BY_JOB_ENV, "news-prepare")

    def slow_job() -> None:
        plan.progress_path.parent.mkdir(parents=True)
        for _ in range(20):  # 5 s of progress lines, over twice the bound
            plan.progress_path.write_text("tokenizing train: 50.0%\n")
            time.sleep(0.25)
        prepare_spec(spec, tmp_path / "run", print, for_job=True)

    job = threading.Thread(target=slow_job)
    job.start()
    try:
        manifest = wait_for(plan, waiting_rank())
    finally:
        job.join()
    assert manifest == json.loads(plan.manifest_path.read_text())
    assert not plan.progress_path.exists() and not plan.error_path.exists()


def test_ranks_waiting_for_a_prepare_job_that_crashes_exit_at_once_with_its_cause(tmp_path, monkeypatch) -> None:
    """The prepare Job's command fails for a reason that is not the data (its metrics port is taken): the waiting
    rank fails with that line at once, not after `prepareStallSeconds` without progress."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to prepare\n" * 100)
    # Without the record, the rank would give up after this bound with another line.
    plan = make_plan(with_wait_bound(training("char-gpt", [str(corpus)], tmp_path), 30), tmp_path / "run", None)
    config = tmp_path / "training.yaml"
    data = {"train": [str(corpus)], "prepareWorkers": 1, "cacheDir": str(tmp_path / "cache")}
    config.write_text(yaml.safe_dump({"task": "char-gpt", "data": data, "checkpoint": {"dir": str(tmp_path / "run")}}))
    monkeypatch.setenv(PREPARED_BY_JOB_ENV, "news-prepare")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = os.environ | {METRICS_PORT_ENV: str(port), METRICS_HOST_ENV: "127.0.0.1"}
        command = [sys.executable, "-m", "trainer.prepare", "--config", str(config)]
        job = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        with pytest.raises(PreparationFailed) as failed:
            wait_for(plan, waiting_rank())
        assert job.wait(timeout=60) == 1, job.stderr.read()
    (line,) = str(failed.value).splitlines()
    assert line == (
        f"the prepare Job news-prepare failed to prepare {plan.entry}: RuntimeError: metrics: cannot serve on"
        f" 127.0.0.1:{port}: [Errno 98] Address already in use"
    )
    assert not plan.entry.exists() and not plan.progress_path.exists()


def prepare_job(config: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The chart's prepare Job: its command, on `config` (the mounted training.yaml)."""
    command = [sys.executable, "-m", "trainer.prepare", "--config", str(config)]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def prepare_job_config(tmp_path: Path, corpus: Path) -> Path:
    config = tmp_path / "training.yaml"
    data = {"train": [str(corpus)], "prepareWorkers": 1, "cacheDir": str(tmp_path / "cache")}
    config.write_text(yaml.safe_dump({"task": "char-gpt", "data": data, "checkpoint": {"dir": str(tmp_path / "run")}}))
    return config


def test_a_resubmission_after_fixing_the_data_waits_for_its_own_prepare_job(tmp_path, monkeypatch) -> None:
    """The prepare Job's failure on bad data stays on the volume (the cache's `.<entry>.error`); the data fixed, the
    next submission's ranks, up before its prepare Job, wait for that Job instead of failing with the old line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n \n")
    config = prepare_job_config(tmp_path, corpus)
    failed = prepare_job(config, tmp_path)
    assert failed.returncode == 2 and f"error: training.data.train: no text in {corpus}" in failed.stderr, failed.stderr
    spec = with_wait_bound(training("char-gpt", [str(corpus)], tmp_path, prepareWorkers=1), 30)
    assert make_plan(spec, tmp_path / "run", None).error_path.exists()

    corpus.write_text("some text to prepare\n" * 100)
    plan = make_plan(spec, tmp_path / "run", None)  # the resubmission's ranks
    monkeypatch.setenv(PREPARED_BY_JOB_ENV, "news-prepare")
    outcome: list[object] = []
    waiter = threading.Thread(target=lambda: outcome.append(wait_or_failure(plan)), daemon=True)
    waiter.start()
    waiter.join(timeout=3)  # several polls of the volume, before the resubmission's prepare Job has started
    assert waiter.is_alive() and not outcome, outcome
    assert prepare_job(config, tmp_path).returncode == 0
    waiter.join(timeout=60)
    assert outcome == [json.loads(plan.manifest_path.read_text())]


def wait_or_failure(plan: Plan) -> object:
    try:
        return wait_for(plan, waiting_rank())
    except Exception as exc:
        return exc


def test_a_prepared_dataset_clears_the_failure_recorded_for_it(tmp_path, monkeypatch) -> None:
    """A prepare Job's failure that is not the data's (its metrics port taken) stays on the volume under the same
    fingerprint; once the dataset is prepared (by rank 0 here, or found prepared by the next prepare Job), it is gone:
    emptying the cache (`rm -rf cache/*` keeps dot files) cannot bring it back to fail the next submission."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to prepare\n" * 100)
    config = prepare_job_config(tmp_path, corpus)
    plan = make_plan(training("char-gpt", [str(corpus)], tmp_path, prepareWorkers=1), tmp_path / "run", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = os.environ | {METRICS_PORT_ENV: str(taken.getsockname()[1]), METRICS_HOST_ENV: "127.0.0.1"}
        assert prepare_job(config, tmp_path, env).returncode == 1
    record = plan.error_path.read_text()
    assert record.startswith("failed RuntimeError: metrics: cannot serve on"), record

    monkeypatch.setenv(METRICS_PORT_ENV, "0")  # rank 0 prepares, without a prepare Job
    prepare_now(plan, None, None)
    assert plan.manifest_path.exists() and not plan.error_path.exists()

    plan.error_path.write_text(record)  # as an attempt that failed beside a successful one would leave it
    done = prepare_job(config, tmp_path)
    assert done.returncode == 0 and "already prepared" in done.stderr, done.stderr
    assert not plan.error_path.exists()


@pytest.mark.parametrize("under", ["", "/datasets"], ids=["the-file", "under-the-file"])
def test_a_dataset_cache_that_is_a_file_is_bad_input_and_nothing_is_created(tmp_path, corpus_file, under) -> None:
    """It was a traceback of the first write there (`ctl prepare`), or a rank's exit 1 with a run directory left."""
    (tmp_path / "datasets.txt").write_text("not a folder\n")
    spec = tiny_spec(corpus_file, data={"train": str(corpus_file), "cacheDir": f"datasets.txt{under}"})
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    for command in (["prepare"], ["run"], ["run", "--set", "prepare.enabled=true"]):
        result = run_ctl(command[0], "spec.yaml", *command[1:], cwd=tmp_path)
        assert result.returncode == 2 and result.stdout == "", (command, result.stdout, result.stderr)
        assert result.stderr.splitlines() == ["error: training.data.cacheDir: datasets.txt is a file, not a folder"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["datasets.txt", "spec.yaml"], command


def test_a_prepared_file_cut_short_is_named_with_what_to_do(tmp_path, corpus_file) -> None:
    """It was numpy's `mmap length is greater than file size`, naming neither the file nor the dataset."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tiny_spec(corpus_file, sample={"maxNewTokens": 0})))
    prepared = run_ctl("prepare", "spec.yaml", cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    entry = Path(prepared.stdout.strip())
    tokens = json.loads((entry / MANIFEST).read_text())["splits"]["train"]["tokens"]
    os.truncate(entry / "train.bin", 1000)
    run = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert run.returncode == 1
    cause = (
        f"DamagedDataset: {entry / 'train.bin'} holds 1,000 bytes where its manifest says {tokens * 2:,}: the prepared"
        f" dataset is damaged; delete {entry} to prepare it again"
    )
    assert cause in run.stderr.splitlines()[-1], run.stderr
