"""Where torch's process-group store listens: only at MASTER_ADDR, never on every interface.

One real process (a group of one hosts the store and joins it at once); psutil reads what this process
listens on. Two-rank jobs are covered by tests/train and tests/strategies.
"""

from __future__ import annotations

import gc
import socket

import psutil
import pytest
import torch.distributed as dist

from conveyor.comm.process_group import AddressInUseError, RendezvousError, init_process_group
from conveyor.launch.ports import free_ports


def free_port() -> int:
    return free_ports(1)[0]  # from this xdist worker's range, if any (tests/conftest.py)


def listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.fixture
def leave_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("master_addr", ["127.0.0.1", "localhost"])
def test_the_store_listens_only_at_master_addr_and_stops_with_the_job(master_addr: str, leave_group) -> None:
    port = free_port()
    store = init_process_group("gloo", master_addr, port, 0, 1, timeout=10)
    assert listening_on(port) == {"127.0.0.1"}  # not "::" or "0.0.0.0": torch alone binds every interface
    store.set("conveyor/probe", "ok")
    assert store.get("conveyor/probe") == b"ok"
    dist.destroy_process_group()
    del store
    gc.collect()
    assert listening_on(port) == set()  # the job is gone: nothing of it still listens


@pytest.mark.timeout(30)
def test_a_master_addr_of_another_machine_cannot_host_the_store(leave_group) -> None:
    port = free_port()
    with pytest.raises(RendezvousError) as info:  # 192.0.2.0/24 is TEST-NET-1: no machine owns it
        init_process_group("gloo", "192.0.2.1", port, 0, 2, timeout=5)
    message = str(info.value)
    assert "192.0.2.1" in message and "not an address of this machine" in message and "MASTER_ADDR" in message
    assert not isinstance(info.value, AddressInUseError)
    assert listening_on(port) == set() and not dist.is_initialized()


@pytest.mark.timeout(30)
def test_a_master_addr_that_does_not_resolve_is_named(leave_group) -> None:
    with pytest.raises(RendezvousError, match="MASTER_ADDR 'no-such-host.invalid' does not resolve"):
        init_process_group("gloo", "no-such-host.invalid", free_port(), 0, 2, timeout=5)


@pytest.mark.timeout(30)
def test_a_timed_out_rendezvous_leaves_nothing_listening(leave_group) -> None:
    port = free_port()
    with pytest.raises(RendezvousError, match="1 of 2 ranks arrived"):
        init_process_group("gloo", "127.0.0.1", port, 0, 2, timeout=1)
    gc.collect()
    assert listening_on(port) == set()
    # and the port can be hosted again at once (the listener was closed exactly once, not leaked)
    store = init_process_group("gloo", "127.0.0.1", port, 0, 1, timeout=10)
    assert listening_on(port) == {"127.0.0.1"}
    dist.destroy_process_group()
    del store


@pytest.mark.timeout(30)
def test_a_port_taken_on_master_addr_is_address_in_use(leave_group) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AddressInUseError, match=f"port {port}.*already in use.*MASTER_PORT"):
            init_process_group("gloo", "127.0.0.1", port, 0, 2, timeout=5)
