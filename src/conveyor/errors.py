"""conveyor's errors, in one hierarchy (standard library only, so that every layer can import it).

    ConveyorError                    the base: `except ConveyorError` catches every error below
    ├── PeerError                    another process of the job died, hung, closed or cannot be reached:
    │   │                            a rank in a collective, or another node's launcher
    │   └── RendezvousError          the processes (ranks, or launchers) could not meet in the first place
    │       └── AddressInUseError    an address to listen on is taken, or not this machine's (also a
    │                                TransportError: a ps task's port)
    ├── TransportError               a parameter-server connection problem (ServerUnavailable and
    │                                RemoteError in :mod:`conveyor.comm.transport`)
    └── ClusterConfigError, CheckpointError (ResumeError), BadMessage, ProtocolError, IdleTimeout,
                                     each in its own module

Every error keeps the builtin base it always had (``RuntimeError``, ``ValueError``), and every old
relation holds (launch's RendezvousError was a PeerError; comm's AddressInUseError a RendezvousError,
transport's a TransportError), so an ``except`` that caught an error before still does. The old paths
re-export these classes: ``conveyor.comm.process_group``, ``conveyor.launch`` (``.supervisor``,
``.rendezvous``) and ``conveyor.comm.transport``. The data layer keeps TensorFlow's names in
:mod:`conveyor.data.errors`, outside this tree (``DataLossError`` is an ``OSError``, as TensorFlow's is).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AddressInUseError", "ConveyorError", "PeerError", "RendezvousError", "TransportError"]


class ConveyorError(Exception):
    """The base of conveyor's own errors; the message names what failed and the fix.

    ``usage_error`` (a class attribute): True for a usage or configuration error, one that a restart of
    the job meets again (the same flags, files and code); ``conveyor run`` does not retry those.
    """

    usage_error: bool = False


class PeerError(ConveyorError, RuntimeError):
    """Another process of the job died, hung, closed its connection, or cannot be reached.

    Raised by ``collective_guard`` when a collective's peer rank is gone or silent, and by the
    launchers when another node's launcher cannot be reached or did not answer in time.
    ``peer_rank``/``peer_task``/``peer_address`` are set when the peer could be identified (``None``
    otherwise; ``peer_task`` is a ``conveyor.cluster.TaskId``); ``timed_out`` tells a silent peer
    (timeout) from one whose connection closed.
    """

    def __init__(self, message: str, *, peer_rank: int | None = None, peer_task: Any = None,
                 peer_address: str | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank
        self.peer_task = peer_task
        self.peer_address = peer_address
        self.timed_out = timed_out


class RendezvousError(PeerError):
    """The processes could not meet: not every rank reached the process group's store, or the launchers
    of a multi-node job could not agree on a cluster. The message names the address and the fix."""


class TransportError(ConveyorError, RuntimeError):
    """A parameter-server connection problem; the message names the task, the address and the fix."""


class AddressInUseError(RendezvousError, TransportError):
    """An address this process must listen on is taken (the port is in use), or its host is not an
    address of this machine: rank 0's rendezvous store, or a parameter server's port."""
