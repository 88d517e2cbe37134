"""conveyor.errors: one class per idea, reachable from every old import path, every old ``except`` still working."""

from __future__ import annotations

import subprocess
import sys

import pytest

import conveyor.comm.process_group as process_group
import conveyor.comm.transport as transport
import conveyor.launch as launch
import conveyor.launch.rendezvous as rendezvous
import conveyor.launch.supervisor as supervisor
from conveyor import errors
from conveyor.cluster import ClusterConfigError
from conveyor.comm.framing import BadMessage
from conveyor.strategies.ps.protocol import ProtocolError
from conveyor.strategies.ps.server import IdleTimeout
from conveyor.train.checkpoint import CheckpointError
from conveyor.train.resume import ResumeError


@pytest.mark.parametrize("module, name", [
    (process_group, "PeerError"), (process_group, "RendezvousError"), (process_group, "AddressInUseError"),
    (supervisor, "PeerError"), (rendezvous, "RendezvousError"), (launch, "PeerError"), (launch, "RendezvousError"),
    (transport, "AddressInUseError"), (transport, "TransportError"),
])
def test_every_old_path_gives_the_one_class(module, name) -> None:
    assert getattr(module, name) is getattr(errors, name)
    assert name in module.__all__


def test_every_old_except_still_catches() -> None:
    # comm: AddressInUseError was a RendezvousError; launch: RendezvousError was a PeerError;
    # transport: AddressInUseError was a TransportError; all of them RuntimeErrors.
    assert issubclass(errors.AddressInUseError, errors.RendezvousError)
    assert issubclass(errors.RendezvousError, errors.PeerError)
    assert issubclass(errors.AddressInUseError, errors.TransportError)
    assert issubclass(transport.ServerUnavailable, errors.TransportError)
    assert issubclass(transport.RemoteError, errors.TransportError)
    for cls in (errors.PeerError, errors.RendezvousError, errors.AddressInUseError, errors.TransportError,
                CheckpointError, ResumeError, IdleTimeout):
        assert issubclass(cls, RuntimeError) and issubclass(cls, errors.ConveyorError), cls
    for cls in (ClusterConfigError, BadMessage, ProtocolError):
        assert issubclass(cls, ValueError) and issubclass(cls, errors.ConveyorError), cls


def test_peer_error_keeps_its_attributes_and_defaults() -> None:
    bare = errors.PeerError("node 1's launcher is gone")
    assert (bare.peer_rank, bare.peer_task, bare.peer_address, bare.timed_out) == (None, None, None, False)
    named = errors.PeerError("rank 1 died", peer_rank=1, peer_task="worker:1", peer_address="h:1", timed_out=True)
    assert (named.peer_rank, named.peer_task, named.peer_address, named.timed_out) == (1, "worker:1", "h:1", True)
    assert str(named) == "rank 1 died"


def test_the_names_are_distinct_and_documented() -> None:
    names = [n for n in dir(errors) if isinstance(getattr(errors, n), type)
             and issubclass(getattr(errors, n), Exception)]
    assert sorted(names) == sorted(errors.__all__)
    for name in names:
        assert name in errors.__doc__


def test_errors_needs_only_the_standard_library() -> None:
    code = ("import sys, conveyor.errors; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'zmq', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
