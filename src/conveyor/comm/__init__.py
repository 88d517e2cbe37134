"""Communication between tasks.

- :mod:`.process_group` - torch.distributed setup (rendezvous through a ``TCPStore`` hosted by rank 0),
  ``RendezvousError`` / ``AddressInUseError``, and ``PeerError`` with ``collective_guard``, which turns
  a gloo "connection closed" or timeout into an error naming the peer task and the fix.

Import the submodules directly (``from conveyor.comm.process_group import PeerError``): this package
imports nothing itself, so that modules here which do not need PyTorch (message framing, the
parameter-server transport) stay free of it.
"""
