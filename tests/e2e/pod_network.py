"""Pod addresses for the local pod executor: each pod gets an address of its own from 10.244.0.0/16, added to
`lo`, as a cluster's pod network gives each pod one.

Why not share 127.0.0.1: the API server's pods/proxy connects to a pod's status.podIP and refuses any address
that is not global unicast (pkg/registry/core/pod/strategy.go ResourceLocation), which loopback is not. And with
an address each, every pod can listen on the port its spec declares, as in a cluster.

Adding addresses needs CAP_NET_ADMIN (root here) and iproute2's `ip`; `PodAddresses.probe` says whether this
machine allows it, and the executor falls back to shared loopback when not.

Several control planes may run on one machine at once (the test tier and a user's `controlplane.py up`): an
address is chosen only when no interface has it, and the kernel refuses to add one that `lo` already has (another
executor's, added meanwhile), which means "taken, try another". Each address added is recorded as a file in the
record directory until it is removed, so that whoever stops an executor that could not clean up after itself
(SIGKILL) removes what it left (`release_recorded`).
"""

from __future__ import annotations

import ipaddress
import json
import random
import subprocess
import threading
from pathlib import Path

POD_CIDR = ipaddress.ip_network("10.244.0.0/16")
DEVICE = "lo"
ALLOCATION_TRIES = 50
# What iproute2 says when the address is on the device already (older versions: the kernel's "File exists").
TAKEN_MESSAGES = ("File exists", "already assigned")
ABSENT_MESSAGES = ("Cannot assign requested address", "not found")


class AddressesUnavailable(RuntimeError):
    """Pod addresses cannot be added here (not root, no CAP_NET_ADMIN, no `ip` command); the message says why."""


def ip(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise AddressesUnavailable("no `ip` command (iproute2) on PATH") from None


def machine_addresses() -> set[str]:
    """Every address of every interface of this machine (network namespace)."""
    result = ip("-j", "addr", "show")
    if result.returncode != 0:
        raise AddressesUnavailable(f"ip -j addr show: {result.stderr.strip()}")
    return {info["local"] for link in json.loads(result.stdout) for info in link.get("addr_info", [])}


def remove_address(address: str) -> None:
    """Removes `address` from `lo`; an address already gone is fine."""
    result = ip("addr", "del", f"{address}/32", "dev", DEVICE)
    if result.returncode != 0 and not any(m in result.stderr for m in ABSENT_MESSAGES):
        raise AddressesUnavailable(f"ip addr del {address}/32 dev {DEVICE}: {result.stderr.strip()}")


class PodAddresses:
    """The addresses this executor added to `lo`, one per pod, recorded in `record_dir` while they are there.
    Adding and removing happen under one lock, so `release_all` (the executor's last act before it exits) neither
    misses an address being added nor ends the process while another thread is removing one."""

    def __init__(self, record_dir: Path) -> None:
        self.record_dir = record_dir
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.held: set[str] = set()
        self.closed = False

    def probe(self) -> None:
        """Adds and removes one address; raises AddressesUnavailable, with the reason, when that fails."""
        self.release(self.allocate())

    def allocate(self) -> str:
        """A new address on `lo`, present nowhere on this machine before."""
        for _ in range(ALLOCATION_TRIES):
            candidate = str(POD_CIDR.network_address + random.randrange(1, POD_CIDR.num_addresses - 1))
            if candidate in machine_addresses():
                continue
            with self.lock:
                if self.closed:
                    raise AddressesUnavailable("the executor is stopping")
                result = ip("addr", "add", f"{candidate}/32", "dev", DEVICE)
                if result.returncode == 0:
                    self.held.add(candidate)
                    (self.record_dir / candidate).touch()
                    return candidate
            if not any(m in result.stderr for m in TAKEN_MESSAGES):
                raise AddressesUnavailable(f"ip addr add {candidate}/32 dev {DEVICE}: {result.stderr.strip()}")
        raise AddressesUnavailable(f"no free address in {POD_CIDR} after {ALLOCATION_TRIES} tries")

    def release(self, address: str) -> None:
        """Removes an address this executor added (once; later calls do nothing)."""
        with self.lock:
            if address in self.held:
                self.remove(address)

    def release_all(self) -> None:
        """Removes every address, and adds none after."""
        with self.lock:
            self.closed = True
            for address in sorted(self.held):
                self.remove(address)

    def remove(self, address: str) -> None:  # with the lock held
        remove_address(address)
        self.held.discard(address)
        (self.record_dir / address).unlink(missing_ok=True)


def release_recorded(record_dir: Path) -> list[str]:
    """Removes the addresses an executor recorded and did not remove (it was killed); returns them."""
    left = sorted(path.name for path in record_dir.glob("*")) if record_dir.is_dir() else []
    for address in left:
        remove_address(address)
        (record_dir / address).unlink()
    return left
