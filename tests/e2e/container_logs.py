"""Container logs as a kubelet keeps and serves them, for the local pod executor (tests/e2e/pod_executor.py).

Writing (`LogWriter`): a container's stdout and stderr are pipes, each drained by a thread into the run's log
file, in the CRI log format that container runtimes write and the kubelet reads (k8s.io/cri-client pkg/logs):

    2024-05-01T12:00:00.123456789Z stdout F a whole line
    2024-05-01T12:00:00.123456790Z stderr P the first 16 KiB of a longer line, continued by the next record

Reading (`stream_log`): a kubelet's /containerLogs answer from such a file, with PodLogOptions' meaning as
cri-client's ReadLogs gives it: tailLines counts records from the end; sinceSeconds/sinceTime skip older records;
timestamps prefixes each line with its record's time and a space; limitBytes cuts the output (prefixes included)
after that many bytes; follow goes on reading new records until the run's output is complete.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

STREAMS = ("stdout", "stderr")
# containerd's longest record: a longer line becomes partial (P) records, then a full (F) one.
MAX_RECORD_BYTES = 16 * 1024
# How often a follow looks for new records (a kubelet is woken by inotify, and checks every second anyway).
FOLLOW_POLL_S = 0.1
TAIL_BLOCK_BYTES = 4096
RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


class LogOptionsError(ValueError):
    """Query parameters a kubelet refuses; `status` is its answer's HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def timestamp(ns: int) -> str:
    """RFC 3339 with nanoseconds, fixed width, in UTC: the kubelet's RFC3339NanoFixed."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    whole = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{fraction:09d}Z"


def parse_timestamp(text: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 time (any fraction of a second, or none)."""
    match = RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    whole, fraction, zone = match.groups()
    seconds = datetime.datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return int(seconds) * 1_000_000_000 + int((fraction or "").ljust(9, "0"))


class LogWriter:
    """One container run's log file, filled by a thread per output stream. `done` is set once every stream is
    drained and the file closed: then the run's output is all there, and a follow of it can end."""

    def __init__(self, path: Path, pipes: dict[str, IO[bytes]]) -> None:
        self.path = path
        self.file = path.open("ab", buffering=0)  # one write per record: readers never see half a buffer
        self.lock = threading.Lock()
        self.open_streams = len(pipes)
        self.done = threading.Event()
        for stream, pipe in pipes.items():
            threading.Thread(target=self.pump, args=(stream, pipe), name=f"log-{stream}", daemon=True).start()
        if not pipes:
            self.close()

    def pump(self, stream: str, pipe: IO[bytes]) -> None:
        try:
            with pipe:
                while chunk := pipe.readline(MAX_RECORD_BYTES):
                    self.write(stream, chunk)
        finally:
            with self.lock:
                self.open_streams -= 1
                last = self.open_streams == 0
            if last:
                self.close()

    def write(self, stream: str, chunk: bytes) -> None:
        """A record for `chunk`: full when it ends a line; partial when it is the first MAX_RECORD_BYTES of a
        longer one; a last line without a newline is full, with the newline added (as containerd does)."""
        partial = not chunk.endswith(b"\n") and len(chunk) == MAX_RECORD_BYTES
        content = chunk if chunk.endswith(b"\n") else chunk + b"\n"
        record = f"{timestamp(time.time_ns())} {stream} {'P' if partial else 'F'} ".encode() + content
        with self.lock:
            self.file.write(record)

    def close(self) -> None:
        self.file.close()
        self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether the output is all in the file within `timeout_s` (it is not while some process that
        inherited the pipes still runs)."""
        return self.done.wait(timeout_s)


@dataclass(frozen=True)
class LogOptions:
    """PodLogOptions as a kubelet applies them to one log file (`previous` chooses the file, elsewhere)."""

    follow: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since_ns: int = 0

    @classmethod
    def from_query(cls, query: dict[str, str], now_ns: int) -> LogOptions:
        """From /containerLogs' query parameters (each one's first value), refused as a kubelet refuses them:
        400 for what does not parse, 422 for what fails PodLogOptions' validation."""
        value = dict(query)
        if value.get("tail"):  # the kubelet's backwards compatibility: `tail` for tailLines, "all" for none
            value.pop("tailLines", None)
            if value["tail"] != "all":
                value["tailLines"] = value["tail"]
        try:
            tail_lines, limit_bytes, since_seconds = (
                int(value[name]) if name in value else None for name in ("tailLines", "limitBytes", "sinceSeconds")
            )
            since_time = parse_timestamp(value["sinceTime"]) if "sinceTime" in value else None
        except ValueError:
            raise LogOptionsError(400, '{"message": "Unable to decode query."}') from None
        if (
            (tail_lines is not None and tail_lines < 0)
            or (limit_bytes is not None and limit_bytes < 1)
            or (since_seconds is not None and (since_seconds < 1 or since_time is not None))
        ):
            raise LogOptionsError(422, '{"message": "Invalid request."}')
        since_ns = max(now_ns - since_seconds * 1_000_000_000 if since_seconds else 0, since_time or 0)
        return cls(flag(value, "follow"), flag(value, "timestamps"), tail_lines, limit_bytes, since_ns)


def flag(query: dict[str, str], name: str) -> bool:
    """A boolean query parameter as the API machinery reads it: absent, "0" or "false" is false."""
    return name in query and query[name].lower() not in ("0", "false")


def stream_log(
    path: Path,
    options: LogOptions,
    write: Callable[[bytes], None],
    done: threading.Event,
    gone: Callable[[], bool] = lambda: False,
) -> None:
    """Write the log at `path` through `write`, as `options` say. A follow waits for new records until `done` is
    set (the run's output is complete) and all is read, or until `gone()` (the client went away)."""
    with path.open("rb") as file:
        file.seek(tail_start(file, options.tail_lines))
        records_left = options.tail_lines if not options.follow else None
        bytes_left = options.limit_bytes
        new_line = True  # a partial record's continuation gets no timestamp prefix
        while records_left != 0:
            finished = done.is_set()  # checked before reading: what the run wrote before it ended is read below
            record = file.readline()
            if not record.endswith(b"\n"):
                if options.follow and not finished and not gone():
                    file.seek(-len(record), os.SEEK_CUR)  # read again once complete
                    done.wait(FOLLOW_POLL_S)
                    continue
                if not record:
                    return
            parsed = parse_record(record)
            if parsed is None:  # the kubelet skips what it cannot parse
                continue
            stamp, ns, content = parsed
            if ns >= options.since_ns:
                line = f"{stamp} ".encode() + content if options.timestamps and new_line else content
                if bytes_left is not None:
                    line, bytes_left = line[:bytes_left], bytes_left - min(len(line), bytes_left)
                write(line)
                if bytes_left == 0:
                    return
            if records_left is not None:
                records_left -= 1
            new_line = content.endswith(b"\n") or not content


def tail_start(file: IO[bytes], lines: int | None) -> int:
    """Where the last `lines` records begin; the start with None (cri-client's findTailLineStartIndex: an
    incomplete last record is not counted)."""
    if lines is None:
        return 0
    position = file.seek(0, os.SEEK_END)
    count, block = 0, b""
    while position > 0 and count <= lines:
        size = min(TAIL_BLOCK_BYTES, position)
        position -= size
        file.seek(position)
        block = file.read(size)
        count += block.count(b"\n")
    for _ in range(count - lines):  # more record ends than asked for: the surplus is all in the last block read
        skip = block.index(b"\n") + 1
        block, position = block[skip:], position + skip
    return position


def parse_record(record: bytes) -> tuple[str, int, bytes] | None:
    """(timestamp, its nanoseconds, content) of a CRI log record; a partial record's content without the
    record's newline. None for what is not a record."""
    fields = record.split(b" ", 3)
    if len(fields) != 4 or fields[1].decode(errors="replace") not in STREAMS:
        return None
    stamp, _, tag, content = fields
    try:
        ns = parse_timestamp(stamp.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if tag.split(b":")[0] == b"P":
        content = content.removesuffix(b"\n")
    return stamp.decode(), ns, content


def plain_text(paths: Iterable[Path]) -> str:
    """The output kept in these log files, without the records' timestamps and streams (for messages in tests)."""
    done = threading.Event()
    done.set()
    chunks: list[bytes] = []
    for path in paths:
        stream_log(path, LogOptions(), chunks.append, done)
    return b"".join(chunks).decode(errors="replace")
