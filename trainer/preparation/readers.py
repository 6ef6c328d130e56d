"""Reading documents as a stream: plain text files, JSONL (or a JSON array), CSV, TSV, Parquet and Arrow rows, one
row in memory at a time, from files compressed with gzip, bzip2, xz or zstd too (C4's `.json.gz`, The Pile's
`.jsonl.zst`); bad input is one SpecError naming the key, the file and the row."""

from __future__ import annotations

import bz2
import codecs
import contextlib
import csv
import gzip
import io
import json
import lzma
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from trainer.failures import first_line
from trainer.location import source_name
from trainer.spec import DataSpec, SpecError

# Files of columns, read with pyarrow, by their suffix: the format's name.
COLUMNAR = {".parquet": "Parquet", ".arrow": "Arrow"}
RECORD_SUFFIXES = {".jsonl", ".json", ".csv", ".tsv", *COLUMNAR}  # a file of rows; any other is one document
ROWS_AT_ONCE = 1024  # rows of a columnar file made Python objects at a time
ARROW_FILE_MAGIC = b"ARROW1"  # how an Arrow IPC file of the file format begins; one of the stream format does not
# The csv module's reading of each table format. A TSV has no quoting (IANA's text/tab-separated-values, GLUE's
# files): a quote is text, where CSV quoting would join the rows up to the next quote into one field.
# Strict: a quote left open read the rest of the file into one field (a missing label at its end, or rows joined
# into one document up to the next stray quote), and text after a closing quote was kept.
TABLES: dict[str, dict[str, Any]] = {
    ".csv": {"strict": True},
    ".tsv": {"delimiter": "\t", "quoting": csv.QUOTE_NONE, "strict": True},
}
# A row with more fields than the header would be read as a document cut short, its label from the wrong field.
SPLIT_FIELD = {
    ".csv": 'a comma in a field that is not in quotes? quote the field ("a, b")',
    ".tsv": "a tab in a field? a TSV has no quoting: save the rows as .csv",
}


def _zstd(raw: IO[bytes]) -> IO[bytes]:
    # The standard library reads zstd from Python 3.14 on; Parquet's library (a dependency already) does meanwhile.
    import pyarrow

    return io.BufferedReader(pyarrow.CompressedInputStream(raw, "zstd"))  # its stream reads no lines by itself


# A compressed file is read through its decompressor, its format named by the suffix before.
DECOMPRESSORS: dict[str, Callable[[IO[bytes]], IO[bytes]]] = {
    ".gz": lambda raw: gzip.GzipFile(fileobj=raw),
    ".bz2": bz2.BZ2File,
    ".xz": lzma.LZMAFile,
    ".zst": _zstd,
}
# What reading a file may raise: the system's errors, and a compressed stream that is damaged or cut short.
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
SKIPPED_SHOWN = 5  # names of skipped files a log line shows
FIELDS_SHOWN = 10  # names of a row's fields a message shows
CSV_FIELD_LIMIT = 2**31 - 1  # characters: the most the csv module takes on every platform (a C long)
JSON_CHUNK = 1 << 20  # bytes a JSON array file is read by at least
NOT_BLANK = re.compile(r"\S")
JSON_KINDS = {list: "a list", dict: "an object"}  # what a row's field may be instead of a string or a number
# Half of a UTF-16 surrogate pair: JSON's `\ud800` escape alone decodes to it, and no UTF-8 tokenizer, file or
# report can hold it (the run failed with exit 1 in the tokenizer, or at the end in the report, for a label).
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Document:
    text: str
    label: str | None
    size: int  # bytes of the file it stands for (compressed, where the file is), for progress


def data_format(path: Path) -> str:
    """A data file's format, its suffix in lower case under any compression suffix: `c4-00001.JSON.gz` -> `.json`."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if suffixes and suffixes[-1] in DECOMPRESSORS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _unreadable(path: Path, key: str, exc: BaseException) -> SpecError:
    if isinstance(exc, OSError) and exc.strerror:
        return SpecError(f"{key}: cannot read {path}: {exc.strerror}")
    return SpecError(f"{key}: {path}: not a readable {path.suffix} file: {exc}")  # a damaged compressed stream


@contextlib.contextmanager
def _opened(path: Path, key: str) -> Iterator[tuple[IO[bytes], Callable[[], int]]]:
    """The file's bytes, decompressed when its name says so, and how many bytes of the file itself are read so far;
    an error while reading is one SpecError."""
    try:
        with path.open("rb") as raw:
            decompress = DECOMPRESSORS.get(path.suffix.lower())
            yield (decompress(raw) if decompress else raw), raw.tell
    except READ_ERRORS as exc:
        raise _unreadable(path, key, exc) from None


def _text_file(path: Path, key: str) -> tuple[str, int]:
    """The file's text, and its size."""
    with _opened(path, key) as (file, consumed):
        data = file.read()
        size = consumed()
    try:
        return data.decode("utf-8-sig"), size
    except UnicodeDecodeError as exc:
        raise SpecError(f"{key}: {path} is not UTF-8 text (byte {exc.start})") from None


def _value(record: dict[str, Any], name: str, where: str, key: str) -> str:
    """A field as text: a string, a number as written, a boolean as JSON writes it. A list or an object (a multi-label
    row) is not one label."""
    value = record.get(name)
    if name not in record:  # with the fields it has: the name to set, or rows held in one field (`{"data": [...]}`)
        names = [str(field) for field in record]
        shown = ", ".join(names[:FIELDS_SHOWN]) + (", ..." if len(names) > FIELDS_SHOWN else "")
        raise SpecError(f"{key}: {where}: no {name!r} field (fields: {shown or 'none'})")
    # JSON's null, Parquet's missing value, a CSV's empty or absent cell, pandas' missing number (NaN)
    if value is None or value == "" or value != value:
        raise SpecError(f"{key}: {where}: {name!r} is empty")
    if isinstance(value, bool):  # JSON's and Parquet's booleans, spelled as JSON (and a CSV) has them
        return "true" if value else "false"
    if not isinstance(value, str | int | float):
        kind = JSON_KINDS.get(type(value), type(value).__name__)
        raise SpecError(f"{key}: {where}: {name!r} is {kind}, not a string or a number")
    # isascii() first: it reads a flag of the string, so only text with other characters is searched.
    if isinstance(value, str) and not value.isascii() and (half := LONE_SURROGATE.search(value)):
        escape = f"\\u{ord(half.group()):04x}"
        raise SpecError(
            f"{key}: {where}: {name!r} holds {escape} at character {half.start()}, half of a UTF-16 surrogate pair"
            " without its other half: not Unicode text"
        )
    return str(value)


def _lines(path: Path, key: str) -> Iterator[tuple[int, str, int]]:
    """(line number, line, bytes of the file read) of a UTF-8 file, read incrementally; an undecodable line names its
    number. A byte order mark (Excel's "CSV UTF-8", Notepad) is not part of the first line: it would be in the first
    column's name."""
    with _opened(path, key) as (file, consumed):
        for number, raw in enumerate(file, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8"), consumed()
            except UnicodeDecodeError as exc:
                raise SpecError(f"{key}: {path}:{number}: not UTF-8 text (byte {exc.start})") from None


def _records(path: Path, fields: list[str], key: str) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(where, record, bytes of the file read) for each row of a JSONL, JSON, CSV, TSV, Parquet or Arrow file, one
    row in memory at a time."""
    kind = data_format(path)
    if kind in COLUMNAR:
        yield from _columnar_records(path, fields, key)
    elif kind in TABLES:
        # A field may be a whole document: the csv module's default bound (128 KiB) would refuse a long one.
        csv.field_size_limit(CSV_FIELD_LIMIT)
        read = 0
        lines = _lines(path, key)

        def text() -> Iterator[str]:
            nonlocal read
            for _, line, read in lines:  # noqa: B007 (`read`: how far the rows yielded have come)
                yield line

        reader = csv.DictReader(text(), **TABLES[kind])
        if reader.fieldnames is not None:  # None: an empty file
            _check_columns(path, fields, reader.fieldnames, key)
        first = reader.line_num + 1  # the line the next row starts on
        try:
            for row in reader:
                where, first = f"{path}:{reader.line_num}", reader.line_num + 1
                if any(row.get(None) or ()):  # the fields past the header's (empty ones: trailing delimiters)
                    count = len(reader.fieldnames or ()) + len(row[None])
                    raise SpecError(
                        f"{key}: {where}: {count} fields, the header has {len(reader.fieldnames or ())}:"
                        f" {SPLIT_FIELD[kind]}"
                    )
                if kind == ".tsv":
                    _refuse_csv_quotes(row, fields, where, key)
                yield where, row, read
        except csv.Error as exc:  # the csv module's line count lags here: the line the row starts on
            why = str(exc)
            if why == "unexpected end of data":  # the row's quote was never closed
                why = f"a quote opened in the row that starts here is never closed (the file ends inside it): {why}"
            raise SpecError(f"{key}: {path}:{first}: invalid {kind[1:].upper()}: {why}") from None
    elif kind == ".json" and _first_character(path, key) == "[":
        yield from _json_array(path, key)
    else:
        for number, line, read in _lines(path, key):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                # Also a pretty-printed object (SQuAD's `{"data": [...]}` indented): its first line is all of it read.
                ends = exc.pos >= len(line.rstrip())
                why = "the object does not end on its line (JSON Lines: one object per line)" if ends else None
                why = why or json_problem(exc.msg, exc.colno)
                raise SpecError(f"{key}: {path}:{number}: invalid JSON: {why}") from None
            if not isinstance(record, dict):
                raise SpecError(f"{key}: {path}:{number}: expected a JSON object per line")
            yield f"{path}:{number}", record, read


def _refuse_csv_quotes(row: dict[str, Any], fields: list[str], where: str, key: str) -> None:
    """A TSV field in CSV quotes, its own quotes doubled, as pandas' `to_csv(sep="\t")` writes a field that holds a
    quote: read as text, the document would keep them all."""
    for name in fields:
        value = row.get(name) or ""
        inner = value[1:-1]
        if len(value) > 2 and value[0] == value[-1] == '"' and '""' in inner and '"' not in inner.replace('""', ""):
            raise SpecError(
                f"{key}: {where}: {name!r} is in CSV quotes, its own quotes doubled (it begins {value[:20]!r}): a TSV's"
                " quotes are text, as in GLUE's files; save the rows as .csv"
            )


def _first_character(path: Path, key: str) -> str:
    """The first character of a file that is not blank (nor a byte order mark); "" for a blank file."""
    with _opened(path, key) as (file, _):
        head = file.read(len(codecs.BOM_UTF8)).removeprefix(codecs.BOM_UTF8).lstrip()
        while not head and (chunk := file.read(JSON_CHUNK)):
            head = chunk.lstrip()
    return chr(head[0]) if head else ""


def _json_array(path: Path, key: str) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(file:line, object, bytes of the file read) for each element of a `.json` file that is one JSON array of
    objects, as `json.dump(rows)` writes it (HF datasets reads such files too), read a chunk at a time: an element is
    decoded once the text read holds all of it, so memory is bounded by the largest element, not by the file."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    parser = json.JSONDecoder()
    buffer, start, line, offset = "", 0, 1, 0  # offset: bytes read; line: the line of buffer[start]
    column = 1  # of buffer[0], in its line

    def more() -> bool:
        """Read on (at least as much as is unread, so a long element costs a few decodes, not one per chunk)."""
        nonlocal buffer, start, offset, column
        raw = file.read(max(JSON_CHUNK, len(buffer) - start))
        try:
            text = decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            byte = offset - len(decoder.getstate()[0]) + exc.start
            raise SpecError(f"{key}: {path} is not UTF-8 text (byte {byte})") from None
        if not raw:  # the end: what was read stays as it is, for a message's line
            return False
        offset += len(raw)
        newline = buffer.rfind("\n", 0, start)
        column = start - newline if newline >= 0 else column + start
        buffer, start = buffer[start:] + text, 0
        return True

    def next_character() -> str:
        """The next character that is not blank ("" at the end of the file); `start` and `line` move to it."""
        nonlocal start, line
        while True:
            if found := NOT_BLANK.search(buffer, start):
                line += buffer.count("\n", start, found.start())
                start = found.start()
                return buffer[start]
            line += buffer.count("\n", start)
            start = len(buffer)
            if not more():
                return ""

    def invalid(message: str, position: int) -> SpecError:
        where = line + buffer.count("\n", start, position)
        newline = buffer.rfind("\n", 0, position)  # none: the line began before the buffer, at buffer[0]'s column
        at = position - newline if newline >= 0 else column + position
        return SpecError(f"{key}: {path}:{where}: invalid JSON: {json_problem(message, at)}")

    with _opened(path, key) as (file, consumed):
        next_character()  # the array's "[", as _first_character found
        start += 1
        if next_character() == "]":
            start += 1
        else:
            while True:
                next_character()
                while True:  # decode the element, reading on while the text read ends inside it
                    try:
                        element, end = parser.raw_decode(buffer, start)
                    except json.JSONDecodeError as exc:
                        if more():
                            continue
                        raise invalid(exc.msg, exc.pos) from None
                    if end < len(buffer) or not more():  # a number at the end of the text read may go on
                        break
                if not isinstance(element, dict):
                    raise SpecError(f"{key}: {path}:{line}: expected a JSON object per element of the array")
                yield f"{path}:{line}", element, consumed()
                line += buffer.count("\n", start, end)
                start = end
                separator = next_character()
                start += 1
                if separator == "]":
                    break
                if separator != ",":
                    raise invalid("Expecting ',' delimiter", start - 1)
        if next_character():
            raise invalid("Extra data", start)


def json_problem(message: str, column: int) -> str:
    """json's message with its column: some end in "at" ("Unterminated string starting at"), for the position that
    json's own text of the error adds."""
    return f"{message} column {column}" if message.endswith(" at") else f"{message} at column {column}"


def _check_columns(path: Path, fields: list[str], columns: Sequence[str], key: str) -> None:
    """A table without a column the spec names, or with two of that name (a CSV row kept the last one's field):
    said once for the file, with the columns it has."""
    missing = [name for name in fields if name not in columns]
    if missing:
        raise SpecError(f"{key}: {path}: no {missing[0]!r} column (columns: {', '.join(columns)})")
    if repeated := [name for name in fields if list(columns).count(name) > 1]:
        name, count = repeated[0], list(columns).count(repeated[0])
        raise SpecError(
            f"{key}: {path}: {count} columns are named {name!r} (columns: {', '.join(columns)}); rename all but the"
            " one to read"
        )


def _columnar_records(path: Path, fields: list[str], key: str) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Parquet and Arrow files: the spec's columns only, a slice of rows at a time."""
    import pyarrow

    kind = COLUMNAR[data_format(path)]
    try:
        columns, batches = (_parquet_batches if kind == "Parquet" else _arrow_batches)(path, fields)
    except (OSError, pyarrow.ArrowException) as exc:
        raise SpecError(f"{key}: {path}: not a readable {kind} file: {first_line(exc)}") from None
    _check_columns(path, fields, columns, key)
    row = 0
    try:
        for batch, read in batches:
            # A file may be one batch of all its rows: Python objects for a slice of them at a time.
            for start in range(0, batch.num_rows, ROWS_AT_ONCE):
                for record in batch.slice(start, ROWS_AT_ONCE).to_pylist():
                    row += 1
                    yield f"{path}: row {row}", record, read
    except (OSError, pyarrow.ArrowException) as exc:
        raise SpecError(f"{key}: {path}: row {row + 1}: unreadable: {first_line(exc)}") from None


Batches = Iterator[tuple[Any, int]]  # (a pyarrow RecordBatch of the spec's columns, bytes of the file read with it)


def _parquet_batches(path: Path, fields: list[str]) -> tuple[list[str], Batches]:
    import pyarrow.parquet

    size = path.stat().st_size
    parquet = pyarrow.parquet.ParquetFile(path)
    rows = max(1, parquet.metadata.num_rows)

    def batches() -> Batches:
        done = 0
        for batch in parquet.iter_batches(batch_size=ROWS_AT_ONCE, columns=fields):
            done += batch.num_rows
            yield batch, size * done // rows  # the file's bytes in proportion to its rows

    return parquet.schema_arrow.names, batches()


def _arrow_batches(path: Path, fields: list[str]) -> tuple[list[str], Batches]:
    """An Arrow IPC file: the stream format (what Hugging Face datasets' `save_to_disk` and cache write) or the file
    format (Feather 2, `pyarrow.ipc.new_file`), memory-mapped."""
    import pyarrow.ipc

    source = pyarrow.memory_map(str(path))
    if source.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
        reader = pyarrow.ipc.open_file(source)
        count = reader.num_record_batches

        def batches() -> Batches:
            for index in range(count):
                yield reader.get_batch(index).select(fields), source.size() * (index + 1) // count

    else:
        source.seek(0)
        reader = pyarrow.ipc.open_stream(source)

        def batches() -> Batches:
            # Where each batch ends, the last at the file's end (after the stream's end marker).
            held: tuple[Any, int] | None = None
            for batch in reader:
                if held:
                    yield held
                held = batch.select(fields), source.tell()
            if held:
                yield held[0], source.size()

    return reader.schema.names, batches()


def find_label(paths: list[Path], label_field: str, label: str, key: str) -> str:
    """Where the first row labelled `label` is (`file:line`, `file: row N`), for a message: read only then."""
    for path in paths:
        for where, record, _ in _records(path, [label_field], key):
            if str(record.get(label_field)) == label:
                return where.replace(str(path), source_name(path), 1)
    return ", ".join(map(source_name, paths))


def _file_documents(path: Path, data: DataSpec, labelled: bool, key: str) -> Iterator[Document]:
    """The documents of one file; a problem names it as the spec did (an object of a bucket by its URI, not by this
    node's copy of it)."""
    try:
        yield from _documents_of(path, data, labelled, key)
    except SpecError as exc:
        raise SpecError(str(exc).replace(str(path), source_name(path), 1)) from None


def _documents_of(path: Path, data: DataSpec, labelled: bool, key: str) -> Iterator[Document]:
    if data_format(path) not in RECORD_SUFFIXES:
        if labelled:
            raise SpecError(
                f"{key}: {path}: expected a .jsonl, .json, .csv, .tsv, .parquet or .arrow file of text/label rows"
            )
        text, size = _text_file(path, key)
        yield Document(text, None, size)
        return
    fields = [data.text_field, data.label_field] if labelled else [data.text_field]
    done = 0
    for where, record, read in _records(path, fields, key):
        text = _value(record, data.text_field, where, key)
        label = _value(record, data.label_field, where, key) if labelled else None
        yield Document(text, label, read - done)
        done = read


@dataclass
class Skipped:
    """Files left out under `data.onBadFile: skip`, with the first reasons."""

    files: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """What the manifest keeps of them: a run that maps the dataset later warns of them too."""
        first = self.reasons[0] if self.reasons else None
        return {"count": len(self.files), "files": self.files[:SKIPPED_SHOWN], "first": first}


def skipped_warning(record: dict[str, Any]) -> str:
    """The warning line of a manifest's skipped files (Skipped.record); a terminal shows it (ctl run: a warning)."""
    shown = ", ".join(record["files"]) + (", ..." if record["count"] > len(record["files"]) else "")
    first = f"; first: {record['first']}" if record.get("first") else ""  # a manifest of before it kept the reason
    return f"warning: skipped {record['count']} bad file(s) (training.data.onBadFile: skip): {shown}{first}"


def documents(paths: list[Path], data: DataSpec, labelled: bool, key: str, skipped: Skipped) -> Iterator[Document]:
    """Every document of `paths`, in order. With onBadFile skip, a file that fails is left out whole:
    a text file is read once (it is one document); a row file is checked in a first pass."""
    for path in paths:
        if data.on_bad_file == "skip":
            try:
                if data_format(path) in RECORD_SUFFIXES:
                    for _ in _file_documents(path, data, labelled, key):
                        pass
                else:
                    yield from list(_file_documents(path, data, labelled, key))
                    continue
            except SpecError as exc:
                if source_name(path) not in skipped.files:  # each pass over the data meets it again
                    skipped.files.append(source_name(path))
                    skipped.reasons.append(str(exc))
                continue
        yield from _file_documents(path, data, labelled, key)


def read_texts(paths: list[Path], text_field: str, key: str) -> Iterator[str]:
    """The text of every document of `paths` (a plain text file is one; each row of a file of rows is one)."""
    # The spec models take their camelCase keys only (as a job spec spells them).
    data = DataSpec.model_validate({"train": [str(p) for p in paths], "textField": text_field})
    return (doc.text for doc in documents(paths, data, False, key, Skipped()))
