"""Pod addresses on `lo` (tests/e2e/pod_network.py) without a control plane: added absent, removed once, and
what a killed executor recorded removed by whoever stops it. Needs CAP_NET_ADMIN (root), else skipped."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from pod_network import POD_CIDR, AddressesUnavailable, PodAddresses, machine_addresses, release_recorded

pytestmark = pytest.mark.e2e


@pytest.fixture
def addresses(tmp_path: Path) -> Iterator[PodAddresses]:
    addresses = PodAddresses(tmp_path / "records")
    try:
        addresses.probe()
    except AddressesUnavailable as error:
        pytest.skip(f"pod addresses cannot be added here: {error}")
    yield addresses
    addresses.release_all()
    release_recorded(addresses.record_dir)


def test_addresses_are_new_and_removed_once(addresses: PodAddresses) -> None:
    before = machine_addresses()
    first, second = addresses.allocate(), addresses.allocate()
    assert first != second and {first, second}.isdisjoint(before) and {first, second} <= machine_addresses()
    assert all(ipaddress.ip_address(a) in POD_CIDR for a in (first, second))
    assert sorted(p.name for p in addresses.record_dir.iterdir()) == sorted([first, second])
    addresses.release(first)
    addresses.release(first)
    assert first not in machine_addresses() and second in machine_addresses()
    addresses.release_all()
    assert second not in machine_addresses() and list(addresses.record_dir.iterdir()) == []
    with pytest.raises(AddressesUnavailable, match="stopping"):
        addresses.allocate()


def test_what_a_killed_executor_recorded_is_removed(addresses: PodAddresses) -> None:
    left = addresses.allocate()
    addresses.held.clear()  # as if its process were gone: only the record is left
    assert release_recorded(addresses.record_dir) == [left]
    assert left not in machine_addresses() and release_recorded(addresses.record_dir) == []
