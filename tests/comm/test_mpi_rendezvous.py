"""Agreeing on the rendezvous address through MPI, one rank at a time against a simulated world.

The real thing, with mpirun and mpi4py, is in tests/launch/test_mpi.py; here the other ranks are a
fake communicator (their host names, rank 0's answer), so every branch runs without MPI.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
import pytest

from conveyor.cluster import ClusterConfigError, Discovered, TaskId
from conveyor.comm import mpi_rendezvous
from conveyor.comm.mpi_rendezvous import agree_rendezvous, rank0_address
from conveyor.errors import RendezvousError


class Request:
    def __init__(self, done: bool) -> None:
        self.done = done

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.done


class Comm:
    """This rank's view of COMM_WORLD: the others' host names and, off rank 0, what rank 0 broadcasts."""

    def __init__(self, rank: int, hosts: list[str], answer: dict | None = None, stuck: bool = False) -> None:
        self.rank, self.hosts, self.stuck = rank, hosts, stuck
        self.pending = [] if answer is None else [json.dumps(answer).encode()]

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return len(self.hosts)

    def Iallgather(self, mine: np.ndarray, every: np.ndarray) -> Request:  # noqa: N802
        for row, host in zip(every, self.hosts, strict=True):
            row[:len(host)] = np.frombuffer(host.encode(), dtype=np.uint8)
        return Request(not self.stuck)

    def Ibcast(self, buffer: np.ndarray, root: int = 0) -> Request:  # noqa: N802
        if self.rank != root:
            payload = self.pending[0]
            if buffer.dtype == np.int64:
                buffer[0] = len(payload)
            else:
                buffer[:] = np.frombuffer(payload, dtype=np.uint8)
        return Request(True)


class MPI:
    def __init__(self, comm: Comm) -> None:
        self.COMM_WORLD = comm
        self.finalized = False

    def Get_library_version(self) -> str:  # noqa: N802
        return "Fake MPI 1.0\n"

    def Finalize(self) -> None:  # noqa: N802
        self.finalized = True


def found(rank: int, world_size: int = 2, addr: str | None = None, port: int | None = None) -> Discovered:
    return Discovered(None, TaskId("worker", rank), rank, world_size, rank, world_size, addr, port, "mpi")


def use(monkeypatch, comm: Comm, initialized_here: bool = True) -> MPI:
    mpi = MPI(comm)
    monkeypatch.setattr(mpi_rendezvous, "_import_mpi", lambda found: (mpi, initialized_here))
    return mpi


def test_rank0_on_one_host_listens_on_loopback_and_keeps_the_socket(monkeypatch):
    mpi = use(monkeypatch, Comm(0, ["n1", "n1"]))
    addr, port, listener = agree_rendezvous(found(0), timeout=10)
    try:
        assert addr == "127.0.0.1" and listener is not None
        assert listener.getsockname()[:2] == (addr, port)
        socket.create_connection((addr, port), timeout=5).close()  # listening already: the port is held
    finally:
        listener.close()
    assert mpi.finalized  # initialized for this, so finalized before the pipeline forks workers


def test_other_ranks_take_rank0s_answer_and_a_given_mpi_stays_up(monkeypatch):
    mpi = use(monkeypatch, Comm(1, ["n1", "n2"], answer={"addr": "10.0.0.1", "port": 41234}), initialized_here=False)
    assert agree_rendezvous(found(1), timeout=10) == ("10.0.0.1", 41234, None)
    assert not mpi.finalized  # the script imported mpi4py itself


def test_given_master_variables_are_kept(monkeypatch):
    use(monkeypatch, Comm(0, ["n1", "n2"]))
    assert agree_rendezvous(found(0, addr="10.9.9.9", port=29511), timeout=10) == ("10.9.9.9", 29511, None)


def test_rank0s_failure_reaches_every_rank(monkeypatch):
    use(monkeypatch, Comm(1, ["n1", "n2"], answer={"error": "rank 0 (host n1) cannot pick the rendezvous address: x"}))
    with pytest.raises(RendezvousError, match=r"^rank 0 \(host n1\) cannot pick .*; set MASTER_ADDR to rank 0's"):
        agree_rendezvous(found(1), timeout=10)


def test_rank0_that_cannot_pick_an_address_says_so(monkeypatch):
    use(monkeypatch, Comm(0, ["n1", "n2"]))
    monkeypatch.setattr(mpi_rendezvous, "_resolve", lambda name: ["127.0.1.1"] if name == "n1" else [])
    with pytest.raises(RendezvousError, match=r"host name 'n1' resolves to 127\.0\.1\.1, a loopback address"):
        agree_rendezvous(found(0), timeout=10)


def test_another_mpi_library_than_the_launchers_is_named(monkeypatch):
    use(monkeypatch, Comm(0, ["n1"]))  # a singleton: mpi4py's MPI does not know the launcher's world
    with pytest.raises(ClusterConfigError, match=r"^mpi4py's MPI \(Fake MPI 1\.0\) makes this process rank 0 of 1, "
                                                 r"but the launcher's variables say rank 0 of 2.*--no-binary mpi4py"):
        agree_rendezvous(found(0), timeout=10)


def test_a_rank_that_never_arrives_is_an_error_after_the_timeout(monkeypatch):
    use(monkeypatch, Comm(1, ["n1", "n2"], stuck=True))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"^sharing host names through MPI did not finish within 0\.3 s"):
        agree_rendezvous(found(1), timeout=0.3)
    assert time.monotonic() - start < 5


def test_without_mpi4py_the_error_names_both_fixes(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now raises ImportError
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(ClusterConfigError, match=r"rank 1 of 2 of an MPI job, but MASTER_ADDR and MASTER_PORT are not "
                                                 r"set and mpi4py.*`mpirun -x MASTER_ADDR=<rank 0's host> -x "
                                                 r"MASTER_PORT=29500 \.\.\.`.*pip install 'conveyor\[mpi\]'"):
        agree_rendezvous(found(1), timeout=10)
    with pytest.raises(ClusterConfigError, match=r"but MASTER_PORT is not set"):
        agree_rendezvous(found(1, addr="10.0.0.1"), timeout=10)


def resolver(names: dict[str, list[str]]):
    def resolve(name: str) -> list[str]:
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return names[name]
    return resolve


def test_rank0_address():
    resolve = resolver({"a": ["10.0.0.1", "127.0.0.1"], "b": ["10.0.0.2"], "lo": ["127.0.1.1"], "v6": ["fd00::1"]})
    assert rank0_address(["a"], resolve) == "127.0.0.1"
    assert rank0_address(["a", "a", "a"], resolve) == "127.0.0.1"  # all on rank 0's host
    assert rank0_address(["a", "b"], resolve) == "10.0.0.1"
    assert rank0_address(["v6", "b"], resolve) == "fd00::1"


def test_rank0_address_from_the_route_when_its_name_is_loopback(monkeypatch):
    resolve = resolver({"lo": ["127.0.1.1"], "b": ["10.0.0.2"], "c": ["10.0.0.3"]})
    routes = {"10.0.0.3": "10.0.0.1"}

    def route(address):
        if address not in routes:
            raise OSError("Network is unreachable")
        return routes[address]

    monkeypatch.setattr(mpi_rendezvous, "_route_source", route)
    assert rank0_address(["lo", "b", "c"], resolve) == "10.0.0.1"  # no route to b; c's says
    with pytest.raises(ClusterConfigError, match=r"^rank 0's host name 'x' does not resolve on its machine, and no "
                                                 r"route to the other ranks' hosts \(b\)"):
        rank0_address(["x", "b"], resolve)
