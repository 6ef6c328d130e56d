"""The rendezvous host's name, looked up before torchrun starts, until it has an address.

A pod can start before the pod it meets at has an address. A TrainJob's JobSet starts every node's pod at once,
and the master's DNS record appears only when its pod has an IP (later still when its claim or image is slow).
torch looks the name up in its store's connect loop and warns at every failed lookup, so a worker's log would
open with lines such as `The IPv6 network addresses of (<master>, 29500) cannot be retrieved (gai error: -3 ...)`.
The training operator gives a PyTorchJob's workers an init container that waits for the name instead
(docs/operations.md); this wait is the same for every kind, and quiet. It ends at the rendezvous' own timeout, as
torch's connect would have, with one line naming the host and the lookup's error.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 1.0


def unresolved(
    host: str,
    port: int,
    timeout: float,
    resolve: Callable[..., Any] = socket.getaddrinfo,
    poll_seconds: float = POLL_SECONDS,
) -> str | None:
    """None once `host` resolves (at once for an address or a local name); else, after `timeout` seconds of lookups,
    the last lookup's error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resolve(host, port, type=socket.SOCK_STREAM)
            return None
        except socket.gaierror as error:
            if time.monotonic() >= deadline:
                return error.strerror or str(error)
        time.sleep(poll_seconds)
