"""Training progress in a TrainJob's status: Kubeflow Trainer v2.3's TrainJobStatus feature (KEP-2779).

With the feature gate on, Trainer v2 gives the trainer containers the URL of their job's status endpoint,
its CA certificate and a projected service-account token (trainer.names.PROGRESS_*_ENV). Rank 0 POSTs
`{"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics, lastUpdatedTime}}` there at log
steps, and the controller applies it to `.status.trainerStatus`.

Reporting must never cost training anything: a background thread sends, one request at a time with a
short timeout, at most one every few seconds; an update made while one is in flight replaces any that
waits, so only the newest goes out. A slow, refusing or absent server gets one warning line, then silence.
Without the environment nothing happens. Torch-free.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from trainer.names import PROGRESS_CA_CERT_ENV, PROGRESS_TOKEN_ENV, PROGRESS_URL_ENV, WARNING_PREFIX

# One request's bound; the controller's own server gives up on a request after 10 s.
REQUEST_TIMEOUT = 5.0
# Each update is a status write on the API server: at most one every MIN_INTERVAL seconds (the final one goes
# out at once). transformers' KubeflowCallback uses the same interval.
MIN_INTERVAL = 5.0


def trainer_status(
    step: int, max_steps: int, remaining_seconds: float | None, metrics: Mapping[str, float | int]
) -> dict[str, Any]:
    """The request body Trainer v2.3's status server decodes (UpdateTrainJobStatusRequest)."""
    status: dict[str, Any] = {
        # Integers 0..100 and >= 0 (int32 in the API); the CRD's rule requires lastUpdatedTime.
        "progressPercentage": min(100, max(0, 100 * step // max(max_steps, 1))),
        # Metric values are strings of at most 64 characters.
        "metrics": [{"name": name, "value": format_value(value)} for name, value in metrics.items()],
        "lastUpdatedTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if remaining_seconds is not None:
        status["estimatedRemainingSeconds"] = max(0, round(remaining_seconds))
    return {"trainerStatus": status}


def format_value(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class ProgressReporter:
    """Sends rank 0's progress to the TrainJob status server in the background; a context manager.

    `report` only hands the update over; leaving the context normally gives the last update up to one request
    timeout to go out (none when the server has been failing), so that the job's status ends at 100%.
    """

    def __init__(
        self,
        url: str | None,
        ca_file: str | None = None,
        token_file: str | None = None,
        warn: Callable[[str], None] | None = None,
        min_interval: float = MIN_INTERVAL,
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.url, self.ca_file, self.token_file = url, ca_file, token_file
        self.warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
        self.min_interval, self.timeout = min_interval, timeout
        self.first: tuple[float, int] | None = None  # (time, step) of the first report, for the estimate
        self.pending: bytes | None = None  # the newest update not yet taken by the sender
        self.sending = False
        self.closed = False
        self.healthy = True  # the last request succeeded (or none was made)
        self.warned = False
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ProgressReporter:
        """From what Trainer v2 injects; without a URL the reporter does nothing."""
        return cls(environ.get(PROGRESS_URL_ENV), environ.get(PROGRESS_CA_CERT_ENV), environ.get(PROGRESS_TOKEN_ENV))

    def report(self, step: int, max_steps: int, metrics: Mapping[str, float | int]) -> None:
        """Queue the progress at `step` of `max_steps`; the estimate is the pace since the first report."""
        if self.url is None:
            return
        now = time.monotonic()
        remaining = None
        if self.first is None:
            self.first = (now, step)
        elif step > self.first[1]:
            remaining = (now - self.first[0]) / (step - self.first[1]) * (max_steps - step)
        body = json.dumps(trainer_status(step, max_steps, remaining, metrics)).encode()
        with self.changed:
            self.pending = body
            self.changed.notify_all()
        if self.thread is None:
            self.thread = threading.Thread(target=self.send_loop, name="trainjob-progress", daemon=True)
            self.thread.start()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
            if kind is None and self.healthy:  # a failing trainer does not wait: its peers learn of it by its exit
                self.changed.wait_for(lambda: self.pending is None and not self.sending, timeout=self.timeout)

    def send_loop(self) -> None:
        next_send = 0.0  # monotonic time at which the next request may start
        while True:
            with self.changed:
                # The newest update goes when the interval is over, or at once when closing.
                while self.pending is None or not (self.closed or time.monotonic() >= next_send):
                    if self.closed and self.pending is None:
                        return
                    self.changed.wait(None if self.pending is None else next_send - time.monotonic())
                body, self.pending, self.sending = self.pending, None, True
            ok = self.send(body)
            next_send = time.monotonic() + self.min_interval
            with self.changed:
                self.sending, self.healthy = False, ok
                self.changed.notify_all()

    def send(self, body: bytes) -> bool:
        """POST one update; a failure is one warning line the first time, silence after."""
        headers = {"Content-Type": "application/json"}
        try:
            if self.token_file:
                # Re-read each time: the kubelet rotates the projected token (it expires after an hour).
                with open(self.token_file, encoding="utf-8") as token:
                    headers["Authorization"] = f"Bearer {token.read().strip()}"
            context = ssl.create_default_context(cafile=self.ca_file)
            request = urllib.request.Request(self.url or "", data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=self.timeout, context=context):
                return True
        except urllib.error.HTTPError as error:
            self.warn_once(f"HTTP {error.code}: {server_message(error)}")
        except (OSError, ValueError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", None) or error
            self.warn_once(str(reason) or type(error).__name__)
        return False

    def warn_once(self, reason: str) -> None:
        if not self.warned:
            self.warned = True
            self.warn(
                f"{WARNING_PREFIX}cannot report progress to the TrainJob status at {self.url}: {reason};"
                " training goes on (further failures are not logged)"
            )


def server_message(error: urllib.error.HTTPError) -> str:
    """The `message` of the Kubernetes Status the status server answers errors with, else the HTTP reason."""
    try:
        return str(json.loads(error.read())["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(error.reason)
