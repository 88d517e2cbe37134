"""gloo's interface comes from the task's cluster address; a name that resolves to loopback is not trusted."""

from __future__ import annotations

import pytest

from conveyor.cluster import ClusterSpec, TaskId
from conveyor.comm.gloo_interface import interface_for, interface_of


def test_an_address_of_this_machine_names_its_interface():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.7") is None  # TEST-NET-3: no machine's own address


def test_the_task_address_picks_the_interface_and_a_loopback_literal_counts():
    spec = ClusterSpec(worker=("127.0.0.1:7001", "203.0.113.7:7002"))
    assert interface_for(spec, TaskId("worker", 0)) == "lo"  # a job on one machine, as the spec says
    assert interface_for(spec, TaskId("worker", 1)) is None  # behind NAT, say: gloo keeps its default


@pytest.mark.parametrize("name", ["localhost", "no-such-host.invalid"])
def test_a_name_that_resolves_only_to_loopback_or_nowhere_leaves_gloo_alone(name):
    # Debian maps the hostname to 127.0.1.1: telling gloo "lo" there would cut the task off from the others.
    assert interface_for(ClusterSpec(worker=(f"{name}:7001",)), TaskId("worker", 0)) is None
