"""conveyor's errors, in one hierarchy (stdlib only, so that every layer can import it).

    try:
        job = conveyor.init()
    except conveyor.errors.RendezvousError as e:     # the processes could not meet; the message says why
        ...

::

    ConveyorError                       every error below; ``except ConveyorError`` catches conveyor's own
    ├── PeerError                       another process of the job died, hung, closed its connection or
    │   │                               cannot be reached: a rank in a collective, or another node's launcher
    │   └── RendezvousError             the processes (ranks, or launchers) could not meet in the first place
    │       └── AddressInUseError       the address to meet at or serve on is taken, or not this machine's
    ├── TransportError                  a parameter-server connection problem (:mod:`conveyor.comm.transport`)
    │   ├── AddressInUseError           (the same class: a ps task's port is taken)
    │   ├── ServerUnavailable, RemoteError           (in :mod:`conveyor.comm.transport`)
    ├── ClusterConfigError (ValueError) a cluster description or task identity that cannot work
    ├── CheckpointError (RuntimeError)  a checkpoint that cannot be written or read (``conveyor.train``)
    └── ...                             the ps protocol's ``ProtocolError``, ``BadMessage``, ``IdleTimeout``

Every error keeps the builtin base it always had (``RuntimeError``, ``ValueError``), so an ``except``
that caught it before still does. ``RendezvousError`` is a ``PeerError`` because the launchers' peer
checks always treated "could not meet the other nodes" as a peer failure; ``AddressInUseError`` is both
a ``RendezvousError`` (rank 0's store port) and a ``TransportError`` (a ps task's port).

The data layer keeps its own errors (:mod:`conveyor.data.errors`, TensorFlow's names: ``DataLossError``
is an ``OSError`` as TensorFlow's is), outside this tree.

Old import paths still work and give these same classes: ``conveyor.comm.process_group.PeerError``,
``.RendezvousError``, ``.AddressInUseError``; ``conveyor.launch.PeerError``, ``.RendezvousError``
(and ``conveyor.launch.supervisor.PeerError``, ``conveyor.launch.rendezvous.RendezvousError``);
``conveyor.comm.transport.AddressInUseError``, ``.TransportError``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AddressInUseError", "ConveyorError", "PeerError", "RendezvousError", "TransportError"]


class ConveyorError(Exception):
    """The base of conveyor's own errors; the message names what failed and the fix."""


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
