"""Communication between tasks.

- :mod:`.process_group` - torch.distributed setup (rendezvous through a ``TCPStore`` hosted by rank 0),
  ``RendezvousError`` / ``AddressInUseError``, and ``PeerError`` with ``collective_guard``, which turns
  a gloo "connection closed" or timeout into an error naming the peer task and the fix;
- :mod:`.mpi_rendezvous` - for a job started by ``mpirun`` without ``MASTER_ADDR``/``MASTER_PORT``: the
  ranks agree on them through MPI (mpi4py, imported only then).

Import the submodules directly (``from conveyor.comm.process_group import PeerError``): this package
imports nothing itself, so that modules here which do not need PyTorch (message framing, the
parameter-server transport) stay free of it.
"""
