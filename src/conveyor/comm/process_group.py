"""torch.distributed process-group setup, and errors that say which task failed and what to do.

    store = init_process_group("gloo", "10.0.0.1", 29500, rank, world_size, timeout=300.0)
    with collective_guard(job, "all_gather_bytes"):
        dist.all_gather(...)            # a dead peer raises PeerError naming it, not a bare gloo error

Promises: a rendezvous that times out raises :class:`RendezvousError` saying how many ranks arrived,
a port taken on rank 0 raises :class:`AddressInUseError` at once; the store rank 0 hosts listens on
``MASTER_ADDR`` only (:func:`listen_only_on`, :func:`serve_store`), never on every interface; under
torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` every rank is a client of the agent's store.
:func:`collective_guard` re-raises gloo's "connection closed" and "timed out" errors as
:class:`PeerError`, naming the peer when it can be known, and lets every other error through untouched.
What gloo says and how the peer is found: docs/launcher.md, "Process groups and rendezvous".
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from conveyor.cluster.spec import ClusterConfigError, ClusterSpec, TaskId, join_address, split_address
from conveyor.errors import AddressInUseError, PeerError, RendezvousError  # re-exported: their old home

__all__ = [
    "AddressInUseError",
    "GroupInfo",
    "PeerError",
    "RendezvousError",
    "collective_guard",
    "init_process_group",
    "is_peer_failure",
    "listen_only_on",
    "peer_error",
    "serve_store",
]

_ARRIVED_KEY = "conveyor/arrived"  # every rank adds 1 once connected, so a failed init can say how many came

# Substrings of errors that mean "the other side of a collective is gone or silent". Matched on the
# message, because gloo raises plain RuntimeErrors; torch's own Dist*Error types are caught by type.
_PEER_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Application timeout caused pair closure",
    "Timed out waiting",
    "gloo/transport",
    "NCCL communicator was aborted",
    "PeerError: ",
)
_TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout", "timed out", "Timeout")
_GLOO_PEER_RE = re.compile(r"\[([^\]\s]+)\]:(\d+)")
_CLIENTS_RE = re.compile(r"(\d+)/(\d+) clients joined")


# PeerErrors raised inside DDP comm hooks reach the caller of backward() only as text (autograd re-wraps
# them); the most recent ones are kept by message so that a guard can raise the original object again.
_RECENT: OrderedDict[str, PeerError] = OrderedDict()
_RECENT_LOCK = threading.Lock()


@dataclass(frozen=True)
class GroupInfo:
    """What :func:`collective_guard` needs to name a peer: this rank, the group size, the cluster, the timeout."""

    rank: int
    world_size: int
    spec: ClusterSpec | None = None
    timeout: float | None = None


# -- setup -----------------------------------------------------------------------------------------


def init_process_group(
    backend: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout: float,
    *,
    host_store: bool | None = None,
    store_prefix: str | None = None,
    listener: socket.socket | None = None,
) -> dist.Store:
    """Join (rank 0: host) the rendezvous store at ``master_addr:master_port`` and create the default group.

    ``timeout`` (seconds) bounds the rendezvous and every later collective of the group. ``host_store``
    defaults to ``rank == 0``; pass ``False`` when a launcher already hosts the store (torchrun's agent).
    ``store_prefix`` namespaces the keys in a store that outlives one attempt (an agent store across
    restarts). ``listener``: a socket already listening at ``master_addr:master_port``, for the hosting
    rank's store to serve on (the store then owns it): a port picked earlier cannot be taken in between.
    Returns the store. Raises :class:`AddressInUseError`, :class:`RendezvousError`, or ``ValueError`` for
    arguments that cannot work.
    """
    _check_args(backend, master_addr, master_port, rank, world_size, timeout)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; call "
                           "job.shutdown() (or torch.distributed.destroy_process_group()) before joining another")
    hosts = (rank == 0) if host_store is None else host_store
    where = join_address(master_addr, master_port)
    delta = timedelta(seconds=timeout)
    # wait_for_workers on every rank: a client is counted only when it sets it too (it then just checks in).
    if hosts:
        store: dist.Store = _host_store(master_addr, master_port, rank, world_size, timeout, listener)
    else:
        try:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=delta,
                                  wait_for_workers=True)
        except RuntimeError as e:  # torch's DistError family subclasses RuntimeError
            raise _store_error(e, where, master_port, rank, world_size, timeout, False) from e
    if store_prefix:
        store = dist.PrefixStore(store_prefix, store)
    try:
        store.add(_ARRIVED_KEY, 1)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
    except RuntimeError as e:
        arrived = _arrived(store)
        count = f"{arrived} of {world_size} ranks reached the store; " if arrived is not None else ""
        raise RendezvousError(
            f"rank {rank} could not form the {backend} process group of {world_size} through the store at {where} "
            f"within {timeout:g} s: {count}{_first_line(e)}. {_RDZV_FIX.format(host=master_addr, port=master_port)}"
        ) from e
    return store


def _host_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: float,
                listener: socket.socket | None = None) -> dist.TCPStore:
    """The store, hosted here and listening at ``master_addr:master_port`` only."""
    where = join_address(master_addr, master_port)
    try:
        listener = listener or listen_only_on(master_addr, master_port)
    except socket.gaierror as e:
        raise RendezvousError(f"rank {rank} cannot host the rendezvous store: MASTER_ADDR {master_addr!r} does not "
                              f"resolve on this machine ({e.strerror}); set MASTER_ADDR to rank 0's address, e.g. "
                              f"10.0.0.1 (127.0.0.1 for a job on one machine)") from None
    except OSError as e:
        raise _bind_error(e, master_addr, master_port, rank) from None
    bound = listener.getsockname()[0]
    _warn_if_unreachable(master_addr, bound)
    try:
        # The host's own client connects to the bound address: the name might resolve to another one first.
        return serve_store(listener, world_size=world_size, timeout=timedelta(seconds=timeout),
                           wait_for_workers=True)
    except RuntimeError as e:
        raise _store_error(e, where, master_port, rank, world_size, timeout, True, bound) from e


def listen_only_on(host: str, port: int) -> socket.socket:
    """A TCP socket listening at ``host:port`` and nowhere else, for a ``TCPStore`` to serve on.

    A name is resolved once; the first of its addresses that is this machine's is bound. Raises
    ``socket.gaierror`` (no such name), ``OSError`` with ``EADDRNOTAVAIL`` naming what ``host`` resolves to
    (none of it is this machine's: the store cannot be hosted here), or the bind's own ``OSError``
    (``EADDRINUSE``...).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for family, _, _, _, sockaddr in infos:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: a quick restart reuses it
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRNOTAVAIL:
                continue
            raise
        return sock
    addresses = ", ".join(dict.fromkeys(str(info[4][0]) for info in infos))
    raise OSError(errno.EADDRNOTAVAIL, f"{host} is {addresses}, not an address of this machine")


def serve_store(listener: socket.socket, **kwargs: Any) -> dist.TCPStore:
    """A hosting ``TCPStore`` serving on ``listener`` (see :func:`listen_only_on`), which it owns from now on.

    torch closes the descriptor when the store goes, and also when it fails to start (a rendezvous that
    times out); it is closed here only if torch did not, found by its inode, never by its number alone:
    that number may already belong to another file.
    """
    host, port = listener.getsockname()[:2]
    identity = _identity(listener.fileno())
    fd = listener.detach()
    try:
        return dist.TCPStore(host, port, is_master=True, master_listen_fd=fd, use_libuv=True, **kwargs)
    except BaseException:
        if _identity(fd) == identity:
            os.close(fd)
        raise


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _bind_error(e: OSError, master_addr: str, port: int, rank: int) -> RendezvousError:
    where = join_address(master_addr, port)
    if e.errno == errno.EADDRINUSE:
        return AddressInUseError(
            f"rank {rank} cannot host the rendezvous store on port {port} ({where}): the port is already in use, "
            f"by another job or a previous run that is still alive. Stop that process, or pick a free port "
            f"(MASTER_PORT, or `conveyor run --rdzv HOST:PORT`)")
    if e.errno == errno.EADDRNOTAVAIL:
        return RendezvousError(
            f"rank {rank} cannot host the rendezvous store at {where}: MASTER_ADDR {e.strerror}, so the other ranks "
            f"would look for the store elsewhere. Run rank {rank} on the machine MASTER_ADDR names, or set "
            f"MASTER_ADDR to this machine's address (127.0.0.1 for a job on one machine)")
    return RendezvousError(f"rank {rank} cannot host the rendezvous store at {where}: {e.strerror or e}; set "
                           f"MASTER_ADDR to an address of this machine and MASTER_PORT to a free port")


def _warn_if_unreachable(master_addr: str, bound: str) -> None:
    # A machine's own name often resolves to 127.0.1.1 in its /etc/hosts (Debian, Ubuntu) while the other
    # machines resolve it through DNS: they would then look for the store at an address it does not serve.
    if master_addr == bound or master_addr == "localhost" or not ipaddress.ip_address(bound.split("%")[0]).is_loopback:
        return
    print(f"[conveyor] MASTER_ADDR {master_addr!r} is {bound} on this machine, a loopback address: the rendezvous "
          f"store listens there only, so ranks on other machines cannot reach it. For a job on several machines "
          f"set MASTER_ADDR to this machine's network address", file=sys.stderr, flush=True)


_RDZV_FIX = ("Check that every task was started and none crashed before conveyor.init() (see their logs), that "
             "{host} is reachable from every task's machine, and that port {port} is free there and not blocked by "
             "a firewall")


def _check_args(backend: str, master_addr: str, master_port: int, rank: int, world_size: int, timeout: float) -> None:
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend = {backend!r}; expected 'gloo' (CPU) or 'nccl' (CUDA)")
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ValueError(f"master_addr = {master_addr!r}; expected rank 0's host, e.g. '10.0.0.1' (MASTER_ADDR)")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port = {master_port!r}; expected a port 1-65535 that is free on rank 0 (MASTER_PORT)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size = {world_size!r}; expected the number of training processes, at least 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank!r}; expected 0..{world_size - 1} for world_size {world_size}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout = {timeout!r}; expected a number of seconds > 0")


def _store_error(e: RuntimeError, where: str, port: int, rank: int, world_size: int, timeout: float,
                 hosts: bool, bound: str | None = None) -> RendezvousError:
    text = str(e)
    host = where.rsplit(":", 1)[0].strip("[]")
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return _bind_error(OSError(errno.EADDRINUSE, text), host, port, rank)
    if hosts:
        m = _CLIENTS_RE.search(text)
        arrived = f"{m.group(1)} of {world_size} ranks arrived (counting this one). " if m else ""
        listens = ""
        if bound is not None and bound != host:
            listens = f" (it listens at {join_address(bound, port)} only: what {host} is here)"
        return RendezvousError(
            f"rendezvous at {where} timed out after {timeout:g} s: {arrived}Rank {rank} hosts the store{listens} and "
            f"waited for all {world_size}. {_RDZV_FIX.format(host=host, port=port)}")
    return RendezvousError(
        f"rank {rank} could not reach the rendezvous store at {where} (hosted by rank 0) within {timeout:g} s: "
        f"{_first_line(e)}. Check that rank 0 was started and is alive, that {host} is reachable from this "
        f"machine (MASTER_ADDR), and that port {port} is open there (MASTER_PORT)")


def _arrived(store: dist.Store) -> int | None:
    try:
        return int(store.add(_ARRIVED_KEY, 0))
    except Exception:  # the store itself is gone (rank 0 died): the count is unknown, not an error of its own
        return None


# -- collectives -----------------------------------------------------------------------------------


def is_peer_failure(error: BaseException) -> bool:
    """True when ``error`` says a collective's peer is gone or silent (gloo/NCCL/store), not a user error."""
    if isinstance(error, PeerError):
        return True
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError, dist.DistBackendError)):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _PEER_MARKERS)


@contextmanager
def collective_guard(job_or_spec: Any = None, operation: str = "a collective") -> Iterator[None]:
    """Re-raise a peer failure inside the block as :class:`PeerError` naming the peer and the fix.

    ``job_or_spec`` says who is who: a ``Job`` (or anything with ``rank``, ``world_size`` and
    ``cluster``/``spec``), a :class:`GroupInfo`, a ``ClusterSpec`` (rank from torch.distributed), or
    ``None`` (everything from torch.distributed). ``operation`` names what failed in the message.

    DDP runs comm hooks inside autograd and turns an exception raised there into a plain RuntimeError
    whose text holds ``"PeerError: <message>"``; a guard around ``loss.backward()`` recognises that text
    and raises the PeerError again, so a training loop wrapped in one guard sees one error type.
    """
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        raise peer_error(e, job_or_spec, operation) from e


def peer_error(error: BaseException, job_or_spec: Any = None, operation: str = "a collective") -> PeerError:
    """The :class:`PeerError` for a collective that failed with ``error`` (see :func:`collective_guard`)."""
    text = str(error)
    if "PeerError: " in text:  # already explained inside a DDP comm hook; unwrap autograd's wrapping
        inner = text.split("PeerError: ", 1)[1].split("\n\nAt:", 1)[0].strip()
        with _RECENT_LOCK:
            original = _RECENT.get(inner)
        return original or PeerError(inner, timed_out=any(m in inner for m in _TIMEOUT_MARKERS))
    group = _group_of(job_or_spec)
    timed_out = any(m in text for m in _TIMEOUT_MARKERS)
    peer_rank, candidates = _identify_peer(text, group)
    me = f"rank {group.rank}" if group is not None else "this rank"
    task = _task_of(group, peer_rank)
    address = _address_of(group, task)
    if peer_rank is not None:
        who = _describe(peer_rank, task, address)
    elif candidates:
        who = "one of " + ", ".join(_describe(r, _task_of(group, r), _address_of(group, _task_of(group, r)))
                                    for r in candidates)
    else:
        who = "a peer rank"
    log = f" (under `conveyor run`: logs/{task.type}-{task.index}.log in the output folder)" if task else ""
    if timed_out:
        limit = f"the {group.timeout:g} s timeout" if group is not None and group.timeout else "the timeout"
        why = (f"{who} did not take part within {limit}: it died, hung, or is doing something else (a longer "
               f"evaluation or checkpoint, a different number of steps). Check its log{log}; if it is only slow, "
               f"raise the timeout (conveyor.init(timeout=...) or CONVEYOR_TIMEOUT)")
    else:
        why = (f"{who} closed its connection: it most likely crashed or was killed; its log{log} says why. "
               f"Restart the job (`conveyor run --max-restarts N` resumes from the last checkpoint)")
    made = PeerError(f"{operation} failed on {me}: {why}. [{_first_line(error)}]", peer_rank=peer_rank,
                     peer_task=task, peer_address=address, timed_out=timed_out)
    with _RECENT_LOCK:
        _RECENT[str(made)] = made
        while len(_RECENT) > 8:
            _RECENT.popitem(last=False)
    return made


def _group_of(obj: Any) -> GroupInfo | None:
    if isinstance(obj, GroupInfo):
        return obj
    if obj is not None and hasattr(obj, "rank") and hasattr(obj, "world_size") and obj.rank is not None:
        spec = getattr(obj, "cluster", None) or getattr(obj, "spec", None)
        return GroupInfo(obj.rank, obj.world_size, spec if isinstance(spec, ClusterSpec) else None,
                         getattr(obj, "timeout", None))
    if dist.is_available() and dist.is_initialized():
        return GroupInfo(dist.get_rank(), dist.get_world_size(), obj if isinstance(obj, ClusterSpec) else None)
    return None


def _identify_peer(text: str, group: GroupInfo | None) -> tuple[int | None, list[int]]:
    """(the peer's rank if certain, else the ranks it could be) from the error text and the cluster."""
    if group is None:
        return None, []
    others = [r for r in range(group.world_size) if r != group.rank]
    if len(others) == 1:
        return others[0], []
    m = _GLOO_PEER_RE.search(text)
    if m is None or group.spec is None:
        return None, []
    peer_ip = m.group(1)
    matches = [r for r in others if _same_host(_host_of(group, r), peer_ip)]
    if len(matches) == 1:
        return matches[0], []
    return None, matches


def _host_of(group: GroupInfo, rank: int) -> str | None:
    address = _address_of(group, _task_of(group, rank))
    return split_address(address)[0] if address else None


def _same_host(host: str | None, ip: str) -> bool:
    if host is None:
        return False
    if host == ip:
        return True
    try:  # error path only; a name in the spec is compared with the IP gloo reported
        return ip in {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False


def _task_of(group: GroupInfo | None, rank: int | None) -> TaskId | None:
    if group is None or group.spec is None or rank is None:
        return None
    tasks = group.spec.training_tasks
    return tasks[rank] if 0 <= rank < len(tasks) else None


def _address_of(group: GroupInfo | None, task: TaskId | None) -> str | None:
    if group is None or group.spec is None or task is None:
        return None
    try:
        return group.spec.task_address(task.type, task.index)
    except ClusterConfigError:
        return None


def _describe(rank: int, task: TaskId | None, address: str | None) -> str:
    if task is None:
        return f"rank {rank}"
    return f"rank {rank} ({task} at {address})" if address else f"rank {rank} ({task})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
