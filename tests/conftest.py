"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest

from conveyor.testing.hosts import Hosts, unavailable


@pytest.fixture
def make_hosts():
    """``make_hosts(count, rate_mbit=None, names=None, private_hostnames=False) -> Hosts``: hosts as network
    namespaces (conveyor.testing.hosts), removed after the test whatever its outcome; skips where namespaces
    cannot be made (not root)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(count: int, **kwargs) -> Hosts:
        made.append(Hosts(count, **kwargs))
        return made[-1]

    yield make
    for hosts in made:
        hosts.close()
