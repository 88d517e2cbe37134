"""Where the ranks of an ``mpirun`` job meet, agreed through MPI itself (mpi4py, the ``mpi`` extra).

    addr, port, listener = agree_rendezvous(found, timeout=300.0)   # conveyor.init(), source "mpi"

mpirun tells every process its rank, but not where torch's rendezvous store is. ``MASTER_ADDR`` and
``MASTER_PORT``, when set, say it; whichever is unset is agreed here: every rank shares its host name,
rank 0 picks an address the others reach it at (127.0.0.1 when they all run on its host; else what
its host name resolves to, unless that is a loopback address, as Debian's ``/etc/hosts`` makes it;
then the source address of its route to a peer's host) and a free port there, and broadcasts both.
Rank 0 keeps the port's listening socket and the store serves on it, so nothing can take the port
in between. Without mpi4py the error names both fixes.

Only buffer collectives, so nothing is pickled; each one is non-blocking and polled, so a rank that
never arrives ends in a :class:`RendezvousError` after the job's timeout rather than a hang. When
MPI was initialized here it is finalized at the end, before the input pipeline forks its workers; a
script that uses mpi4py itself imports it before ``conveyor.init()`` and keeps MPI running.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from conveyor.cluster import ClusterConfigError, Discovered
from conveyor.comm.process_group import listen_only_on
from conveyor.errors import RendezvousError

__all__ = ["agree_rendezvous", "rank0_address"]

_NAME_BYTES = 256  # a host name is at most 255 bytes (HOST_NAME_MAX is 64 on Linux; FQDNs reach 253)

Resolve = Callable[[str], list[str]]


def agree_rendezvous(found: Discovered, timeout: float) -> tuple[str, int, socket.socket | None]:
    """``(MASTER_ADDR, MASTER_PORT, listener)`` for a job of ``found.world_size`` started by an MPI launcher.

    ``listener`` is rank 0's socket already listening on the port it picked, for the store to serve
    on (``None`` on other ranks and when ``MASTER_PORT`` was given). Raises :class:`ClusterConfigError`
    when mpi4py is missing or sees another world than the launcher's variables, :class:`RendezvousError`
    when a rank does not arrive within ``timeout`` seconds or rank 0 cannot pick an address.
    """
    mpi, initialized_here = _import_mpi(found)
    agreed = _agree(mpi, found, timeout)
    if initialized_here:  # every rank got here: the fence inside MPI_Finalize does not wait for long
        mpi.Finalize()
    return agreed


def _import_mpi(found: Discovered) -> tuple[Any, bool]:
    already = "mpi4py.MPI" in sys.modules
    try:
        import mpi4py

        if not already:
            # Finalized by hand once the ranks agree. A rank that fails exits without MPI_Finalize, which
            # makes mpirun stop the whole job, rather than wait in the fence of a finalize at exit.
            mpi4py.rc.finalize = False
            mpi4py.rc.thread_level = "single"  # only this thread calls MPI, and only here
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # RuntimeError: mpi4py's wheels found no MPI library to load
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        missing = " and ".join(name for name, value in (("MASTER_ADDR", found.master_addr),
                                                        ("MASTER_PORT", found.master_port)) if value is None)
        raise ClusterConfigError(
            f"this process is rank {found.rank} of {found.world_size} of an MPI job, but {missing} "
            f"{'is' if ' and ' not in missing else 'are'} not set and mpi4py, which would agree on the "
            f"rendezvous address, cannot be imported ({reason}). Set both for every rank, e.g. `mpirun -x "
            f"MASTER_ADDR=<rank 0's host> -x MASTER_PORT=29500 ...` (Hydra's mpiexec: `-genv MASTER_ADDR "
            f"<host> -genv MASTER_PORT 29500`), or pip install 'conveyor[mpi]'") from None
    return MPI, not already


def _agree(mpi: Any, found: Discovered, timeout: float) -> tuple[str, int, socket.socket | None]:
    comm = mpi.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (found.rank, found.world_size):
        library = (mpi.Get_library_version().splitlines() or ["?"])[0].strip()
        raise ClusterConfigError(
            f"mpi4py's MPI ({library}) makes this process rank {comm.Get_rank()} of {comm.Get_size()}, but the "
            f"launcher's variables say rank {found.rank} of {found.world_size}: mpi4py was built for another MPI "
            f"than the mpirun that started the job. Rebuild it against that one (pip install --no-binary mpi4py "
            f"--force-reinstall mpi4py), or set MASTER_ADDR and MASTER_PORT")
    deadline = time.monotonic() + timeout
    hosts = _all_host_names(comm, deadline, timeout)
    listener = None
    if comm.Get_rank() == 0:
        try:
            addr = found.master_addr or rank0_address(hosts)
            if found.master_port is None:
                listener = listen_only_on(addr, 0)
                port = listener.getsockname()[1]
            else:
                port = found.master_port
            answer = {"addr": addr, "port": port}
        except (OSError, ClusterConfigError) as e:
            answer = {"error": f"rank 0 (host {hosts[0]}) cannot pick the rendezvous address: {e}"}
    else:
        answer = {}
    try:
        answer = json.loads(_broadcast(comm, json.dumps(answer).encode(), deadline, timeout))
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    if "error" in answer:
        raise RendezvousError(f"{answer['error']}; set MASTER_ADDR to rank 0's address (and MASTER_PORT to a free "
                              f"port there) for every rank, e.g. mpirun -x MASTER_ADDR=10.0.0.1 -x MASTER_PORT=29500")
    return answer["addr"], int(answer["port"]), listener


def rank0_address(hosts: list[str], resolve: Resolve | None = None) -> str:
    """The address rank 0 (on ``hosts[0]``) is reached at by the ranks on ``hosts`` (host names, rank order).

    ``resolve`` (name → addresses; default: the resolver of this machine) is a parameter for tests.
    Raises :class:`ClusterConfigError` rather than fall back to an address the peers cannot reach.
    """
    resolve = resolve or _resolve
    me = hosts[0]
    peers = list(dict.fromkeys(host for host in hosts if host != me))
    if not peers:
        return "127.0.0.1"
    try:
        own = resolve(me)
    except OSError:
        own = []
    for address in own:
        if not _is_loopback(address):
            return address
    for peer in peers:  # the name says nothing useful: the route to a peer's host gives the source address
        try:
            address = _route_source(resolve(peer)[0])
        except (OSError, IndexError):
            continue
        if not _is_loopback(address):
            return address
    what = f"resolves to {', '.join(own)}, a loopback address" if own else "does not resolve"
    raise ClusterConfigError(f"rank 0's host name {me!r} {what} on its machine, and no route to the other ranks' "
                             f"hosts ({', '.join(peers[:4])}) could be found from there")


def _resolve(name: str) -> list[str]:
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _route_source(address: str) -> str:
    """This machine's address on the route to ``address`` (connecting a UDP socket sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        return str(sock.getsockname()[0])


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _all_host_names(comm: Any, deadline: float, timeout: float) -> list[str]:
    mine = np.zeros(_NAME_BYTES, dtype=np.uint8)
    name = socket.gethostname().encode()[:_NAME_BYTES - 1]
    mine[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    every = np.zeros((comm.Get_size(), _NAME_BYTES), dtype=np.uint8)
    _wait(comm.Iallgather(mine, every), deadline, timeout, "sharing host names")
    return [row.tobytes().rstrip(b"\0").decode(errors="replace") for row in every]


def _broadcast(comm: Any, payload: bytes, deadline: float, timeout: float) -> bytes:
    """Rank 0's ``payload`` on every rank: first its length, then its bytes."""
    length = np.array([len(payload)], dtype=np.int64)
    _wait(comm.Ibcast(length, root=0), deadline, timeout, "broadcasting the rendezvous address")
    data = np.frombuffer(payload, dtype=np.uint8).copy() if comm.Get_rank() == 0 else np.zeros(int(length[0]),
                                                                                               dtype=np.uint8)
    _wait(comm.Ibcast(data, root=0), deadline, timeout, "broadcasting the rendezvous address")
    return data.tobytes()


def _wait(request: Any, deadline: float, timeout: float, what: str) -> None:
    pause = 0.0005
    while not request.Test():
        if time.monotonic() > deadline:
            raise RendezvousError(f"{what} through MPI did not finish within {timeout:g} s: some rank never reached "
                                  f"conveyor.init() (see its output), or the ranks' MPI cannot reach each other")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
