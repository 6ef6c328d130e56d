"""A real S3 server for the object-storage tests: versitygw over a temporary POSIX directory.

The binary is built from its Go module once and cached by version (tests/e2e/cluster_binaries.py, part of
`make e2e-binaries`); the server listens on a free port of `address` with test credentials, and a bucket is a
directory under its root, so a test makes its buckets with mkdir before it starts.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from certs import Tls
from e2e.cluster_binaries import build_versitygw

from ctl.processes import LOCAL_ADDRESS, free_port
from trainer.location import S3_ACCESS_KEY_ENV, S3_ENDPOINT_ENV, S3_REGION_ENV, S3_SECRET_KEY_ENV

ACCESS_KEY = "ddpjob-test"
SECRET_KEY = "ddpjob-test-secret"
REGION = "us-east-1"
START_TIMEOUT_S = 30


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    root: Path  # the POSIX directory behind it: root/<bucket>/<key>

    def env(self, secret: str = SECRET_KEY) -> dict[str, str]:
        """The standard AWS variables a client of this server needs (with another `secret`: refused ones)."""
        return {
            S3_ENDPOINT_ENV: self.endpoint,
            S3_ACCESS_KEY_ENV: ACCESS_KEY,
            S3_SECRET_KEY_ENV: secret,
            S3_REGION_ENV: REGION,
        }

    def bucket(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path


def listening(address: str, port: int) -> bool:
    """Whether a server accepts connections on address:port."""
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
        return True
    return False


def wait_for_port(address: str, port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"versitygw exited with {server.returncode}:\n{log.read_text()}")
        if listening(address, port):
            return
        time.sleep(0.1)
    raise RuntimeError(f"versitygw did not listen on {address}:{port} within {START_TIMEOUT_S} s:\n{log.read_text()}")


@contextlib.contextmanager
def s3_server(work_dir: Path, address: str = LOCAL_ADDRESS, tls: Tls | None = None) -> Iterator[S3Server]:
    """versitygw serving `work_dir`/root on a free port of `address` (over HTTPS with `tls`'s server certificate);
    stopped afterwards."""
    root = work_dir / "root"
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = work_dir / "versitygw.log"
    command = [str(build_versitygw()), "--access", ACCESS_KEY, "--secret", SECRET_KEY, "--region", REGION]
    if tls:
        command += ["--cert", str(tls.cert_file), "--key", str(tls.key_file)]
    with log.open("w") as output:
        server = subprocess.Popen(
            [*command, "--port", f"{address}:{port}", "posix", str(root)], stdout=output, stderr=subprocess.STDOUT
        )
    try:
        wait_for_port(address, port, server, log)
        yield S3Server(f"{'https' if tls else 'http'}://{address}:{port}", root)
    finally:
        server.terminate()
        server.wait(timeout=30)
