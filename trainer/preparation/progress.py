"""What a preparation shows while it works: a bar on a terminal, a line every 10 s otherwise, the prepare Job's
progress file (its sign of life for the waiting ranks), and the `ddpjob_prepare_*` metrics on their own server."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.names import JOB_NAME_ENV, METRICS_PREFIX

PROGRESS_INTERVAL_S = 10.0  # a progress line this often when stderr is not a terminal


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
