"""The local kubelet's container logs (tests/e2e/container_logs.py) without a control plane: the CRI records the
executor writes, and the PodLogOptions semantics it serves them with (as k8s.io/cri-client's ReadLogs)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from container_logs import (
    MAX_RECORD_BYTES,
    LogOptions,
    LogOptionsError,
    LogWriter,
    parse_record,
    parse_timestamp,
    stream_log,
    timestamp,
)

pytestmark = pytest.mark.e2e
DONE = threading.Event()
DONE.set()


def write_log(path: Path, outputs: dict[str, bytes]) -> LogWriter:
    """A LogWriter fed `outputs` through real pipes, one per stream, each closed once written."""
    pipes, writers = {}, []
    for stream, data in outputs.items():
        read_end, write_end = os.pipe()
        pipes[stream] = os.fdopen(read_end, "rb")
        writers.append((write_end, data))
    log = LogWriter(path, pipes)
    for write_end, data in writers:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data)
    assert log.wait(10)
    return log


def read(path: Path, options: LogOptions = LogOptions()) -> bytes:  # noqa: B008 (frozen, never changed)
    chunks: list[bytes] = []
    stream_log(path, options, chunks.append, DONE)
    return b"".join(chunks)


def test_records_are_full_lines_or_partial_pieces_of_long_ones(tmp_path: Path) -> None:
    long_line = b"x" * (MAX_RECORD_BYTES + 10) + b"\n"
    write_log(tmp_path / "0.log", {"stdout": b"one\n" + long_line + b"no newline at the end"})
    records = (tmp_path / "0.log").read_bytes().splitlines(keepends=True)
    assert [r.split(b" ", 3)[2] for r in records] == [b"F", b"P", b"F", b"F"]
    assert all(parse_record(r) is not None for r in records)
    assert read(tmp_path / "0.log") == b"one\n" + long_line + b"no newline at the end\n"
    # timestamps prefix lines, not the continuation of a partial record
    stamped = read(tmp_path / "0.log", LogOptions(timestamps=True)).split(b"\n")
    prefix = len(timestamp(0)) + 1
    assert [len(line) for line in stamped[:2]] == [prefix + len(b"one"), prefix + len(long_line) - 1]


def test_stdout_and_stderr_are_both_kept(tmp_path: Path) -> None:
    write_log(tmp_path / "0.log", {"stdout": b"out\n", "stderr": b"err\n"})
    assert sorted(read(tmp_path / "0.log").splitlines()) == [b"err", b"out"]
    assert sorted(r.split(b" ")[1] for r in (tmp_path / "0.log").read_bytes().splitlines()) == [b"stderr", b"stdout"]


def test_tail_limit_and_since(tmp_path: Path) -> None:
    lines = [f"line {i}\n".encode() for i in range(1000)]  # more than a tail block
    write_log(tmp_path / "0.log", {"stdout": b"".join(lines)})
    path = tmp_path / "0.log"
    assert read(path, LogOptions(tail_lines=2)) == b"line 998\nline 999\n"
    assert read(path, LogOptions(tail_lines=0)) == b""
    assert read(path, LogOptions(tail_lines=5000)) == b"".join(lines)
    assert read(path, LogOptions(limit_bytes=10)) == b"line 0\nlin"
    assert len(read(path, LogOptions(limit_bytes=40, timestamps=True))) == 40  # prefixes count
    assert read(path, LogOptions(since_ns=time.time_ns() + 10**9)) == b""
    first = parse_record(path.read_bytes().split(b"\n", 1)[0] + b"\n")
    assert first is not None and read(path, LogOptions(since_ns=first[1])) == b"".join(lines)


def test_follow_ends_when_the_run_has_ended_and_all_is_read(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    log = LogWriter(tmp_path / "0.log", {"stdout": os.fdopen(read_end, "rb")})
    chunks: list[bytes] = []
    follower = threading.Thread(target=stream_log, args=(log.path, LogOptions(follow=True), chunks.append, log.done))
    follower.start()
    with os.fdopen(write_end, "wb", buffering=0) as pipe:
        pipe.write(b"first\n")
        time.sleep(0.3)
        assert follower.is_alive() and chunks == [b"first\n"]
        pipe.write(b"last\n")
    follower.join(5)
    assert not follower.is_alive() and b"".join(chunks) == b"first\nlast\n"


def test_a_follow_stops_when_its_client_is_gone(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    log = LogWriter(tmp_path / "0.log", {"stdout": os.fdopen(read_end, "rb")})
    gone = threading.Event()
    options = LogOptions(follow=True)
    follower = threading.Thread(target=stream_log, args=(log.path, options, lambda _: None, log.done, gone.is_set))
    follower.start()
    gone.set()
    follower.join(5)
    assert not follower.is_alive()
    os.close(write_end)


def test_query_parameters_as_the_kubelet_reads_them() -> None:
    now = time.time_ns()
    options = LogOptions.from_query({"follow": "true", "timestamps": "1", "tailLines": "3", "sinceSeconds": "2"}, now)
    assert options == LogOptions(True, True, 3, None, now - 2 * 10**9)
    assert LogOptions.from_query({"follow": "false", "timestamps": "0", "tail": "all"}, now) == LogOptions()
    assert LogOptions.from_query({"tail": "4"}, now).tail_lines == 4
    assert LogOptions.from_query({"sinceTime": "2024-05-01T12:00:00Z"}, now).since_ns == 1714564800 * 10**9
    for query, status in [
        ({"tailLines": "x"}, 400),
        ({"tailLines": "-1"}, 422),
        ({"limitBytes": "0"}, 422),
        ({"sinceSeconds": "0"}, 422),
        ({"sinceSeconds": "5", "sinceTime": "2024-05-01T12:00:00Z"}, 422),
    ]:
        with pytest.raises(LogOptionsError) as refused:
            LogOptions.from_query(query, now)
        assert refused.value.status == status, query


def test_timestamps_round_trip() -> None:
    ns = 1714564800_123456789
    assert timestamp(ns) == "2024-05-01T12:00:00.123456789Z" and parse_timestamp(timestamp(ns)) == ns
    assert parse_timestamp("2024-05-01T14:00:00.5+02:00") == 1714564800_500000000
