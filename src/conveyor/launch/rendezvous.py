"""Multi-node rendezvous: the launchers of a job find each other and agree on one cluster.

    # on node 0 (10.0.0.1), then on node 1, each with the same (private) secret file
    conveyor run -n 2 --nnodes 2 --node-rank 0 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py
    conveyor run -n 2 --nnodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --job-secret-file job.secret train.py

Node 0's launcher hosts a ``torch.distributed.TCPStore`` at the ``--rdzv`` address; each launcher claims
its node rank, publishes its address, task counts, ports and settings, and waits for every node.

Promises: every launcher derives the same ``ClusterSpec`` (the :class:`~conveyor.launch.plan.NodeInfo`
list in node-rank order), or fails naming the rendezvous address and the missing nodes, a duplicate node
rank, or settings that disagree; every record is signed with the job secret (which never enters the
store) and the job's run id, so records from another secret or an earlier job are refused; the store
listens on the ``--rdzv`` address only and stays up for the whole job, as the supervisor's
:class:`~conveyor.launch.supervisor.Peers` (:class:`StorePeers`), through which the launchers' heartbeats
end the job naming a lost node (``launch/liveness.py``); on node 0 an ``--rdzv`` name that resolves to
loopback is refused. torch is imported here only, lazily.
The records, and what the unauthenticated store still exposes: docs/launcher.md, "Process groups
and rendezvous".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from conveyor.cluster import split_address
from conveyor.errors import PeerError, RendezvousError  # RendezvousError re-exported: its old home
from conveyor.launch.liveness import Heartbeat
from conveyor.launch.plan import NodeInfo
from conveyor.launch.ports import free_ports

__all__ = ["Rendezvous", "RendezvousError", "StorePeers", "join", "local_address"]

_P = "conveyor/"
_POLL = 0.1


@dataclass(frozen=True)
class Rendezvous:
    """What every node agreed on, plus the link to the others for the rest of the job."""

    nodes: tuple[NodeInfo, ...]
    node_rank: int
    master_addr: str
    master_port: int
    secret: bytes = field(repr=False)
    peers: StorePeers = field(repr=False)
    names: tuple[str, ...] = ()  # "<hostname> at <address>" of each node, for messages
    dispatcher_port: int | None = None  # node 0's port for the data service's dispatcher (when a node has data workers)


def _seal(secret: bytes, key: str, record: Mapping[str, Any]) -> str:
    """``record`` as JSON, then a line with the HMAC-SHA256 of the key and that JSON under the job secret."""
    body = json.dumps(record, sort_keys=True)
    return body + "\n" + _mac(secret, key, body)


def _unseal(secret: bytes, key: str, value: bytes, endpoint: str) -> dict:
    body, _, mac = value.decode("utf-8", "replace").rpartition("\n")
    # As bytes: compare_digest refuses a str with non-ASCII characters, which a forged value may hold.
    if not hmac.compare_digest(mac.encode(), _mac(secret, key, body).encode()):
        raise RendezvousError(f"rendezvous at {endpoint}: {key} was not written with this node's job secret: the "
                              f"nodes have different secrets (or another program wrote it); give every node the "
                              f"same --job-secret-file (or CONVEYOR_JOB_SECRET)")
    try:
        record = json.loads(body)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise RendezvousError(f"rendezvous at {endpoint}: {key} is malformed; is another conveyor version using "
                              f"this address?")
    return record


def _mac(secret: bytes, key: str, body: str) -> str:
    return hmac.new(secret, f"conveyor rendezvous\0{key}\0{body}".encode(), hashlib.sha256).hexdigest()


def local_address(host: str, port: int) -> str:
    """This machine's address on the route towards ``host``: the one the other nodes can reach it at.

    Connecting a UDP socket sends nothing; it only makes the kernel choose the route and source address.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise RendezvousError(f"--rdzv host {host!r} does not resolve here ({e.strerror}); give node 0's address, "
                              f"e.g. --rdzv 10.0.0.1:{port}, or a name every node resolves to it (DNS, /etc/hosts)"
                              ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
        except OSError as e:
            raise RendezvousError(f"no route from this machine to the rendezvous host {host} ({e.strerror})") from None
        return sock.getsockname()[0]


def _check_not_loopback(host: str, port: int, endpoint: str) -> None:
    """Node 0 refuses a *name* that resolves to loopback here: the others, elsewhere, could never reach the
    store there. (A loopback literal or ``localhost`` asks for launchers all on this machine, and gets it.)"""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if host == "localhost":
        return
    # The address the store would listen on (listen_only_on binds the first of this machine's addresses).
    address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        raise RendezvousError(
            f"--rdzv {endpoint}: {host!r} resolves to {address} on this machine (node 0), a loopback address, "
            f"so the rendezvous would listen where no other machine can reach it; give node 0's network address "
            f"(--rdzv 10.0.0.1:{port}), or make {host} resolve to it here (a '127.0.1.1 {host}' line in "
            f"/etc/hosts, Debian's default, is the usual cause); launchers that all run on this machine can use "
            f"--rdzv 127.0.0.1:PORT")


def join(
    endpoint: str,
    *,
    nnodes: int,
    node_rank: int,
    workers: int,
    ps: int,
    settings: Mapping[str, Any],
    secret: bytes,
    timeout: float,
    data_workers: int = 0,
) -> Rendezvous:
    """Join (node 0: host) the rendezvous at ``endpoint`` and return what all ``nnodes`` nodes agreed on.

    ``settings`` (JSON-able) must be equal on every node. ``secret`` is the job secret, the same on every
    node, brought from out of band: it never goes into the store.
    """
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 2:
        raise ValueError(f"--nnodes {nnodes!r}: a rendezvous joins 2 or more nodes")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank!r}: expected 0..{nnodes - 1} for --nnodes {nnodes}")
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("a job on several machines needs the job secret (16 bytes or more) on every node: give "
                         "each node the same --job-secret-file or CONVEYOR_JOB_SECRET")
    host, port = split_address(endpoint, "--rdzv")
    address = local_address(host, port)
    if node_rank == 0:
        _check_not_loopback(host, port, endpoint)
    # node 0 also picks torch's store port and the dispatcher's (used if any node has data workers)
    ports = free_ports(workers + ps + data_workers + (2 if node_rank == 0 else 0), address)
    store = _connect(host, port, endpoint, node_rank, timeout)
    peers = StorePeers(store, nnodes=nnodes, node_rank=node_rank, endpoint=endpoint, timeout=timeout, secret=secret)
    try:
        rdzv = _agree(store, peers, endpoint, nnodes, node_rank, address, (workers, ps, data_workers), ports,
                      dict(settings), secret, timeout)
        twin = StorePeers(_client(host, port, endpoint, node_rank, timeout), nnodes=nnodes, node_rank=node_rank,
                          endpoint=endpoint, timeout=timeout, secret=secret)
        twin.run = peers.run
        peers.start_heartbeat(twin, rdzv.names)
        return rdzv
    except BaseException:
        # Node 0 hosts the store: the others may still be reading why (a record that fails their check).
        peers.close(wait=True, linger=min(5.0, timeout))
        raise


def _agree(store: Any, peers: StorePeers, endpoint: str, nnodes: int, node_rank: int, address: str,
           counts: tuple[int, int, int], ports: list[int], settings: dict, secret: bytes, timeout: float) -> Rendezvous:
    workers, ps, data_workers = counts
    deadline = time.monotonic() + timeout

    def left() -> float:  # every store call ends by the rendezvous' deadline (a second's grace for the last one)
        return max(1.0, deadline - time.monotonic())

    if _call(store.add, endpoint, f"{_P}claim/{node_rank}", 1, timeout=left()) > 1:
        raise RendezvousError(f"node rank {node_rank} is taken at the rendezvous {endpoint}: another launcher "
                              f"joined with --node-rank {node_rank}; give each node its own rank 0..{nnodes - 1} "
                              f"(a job whose node was lost cannot take it back: start the job again on every node)")
    peers.joined = True
    settings = {"nnodes": nnodes, **settings}
    tasks = workers + ps + data_workers
    mine = {"host": address, "workers": workers, "ps": ps, "data_workers": data_workers, "ports": ports[:tasks],
            "settings": settings, "hostname": socket.gethostname()}
    if node_rank == 0:
        job = {"master_port": ports[tasks], "dispatcher_port": ports[tasks + 1], "run": secrets.token_hex(16)}
        _call(store.set, endpoint, f"{_P}job", _seal(secret, f"{_P}job", job), timeout=left())
    _call(store.set, endpoint, f"{_P}node/{node_rank}", _seal(secret, f"{_P}node/{node_rank}", mine), timeout=left())
    print(f"[conveyor] node {node_rank} of {nnodes} ({address}) joined the rendezvous at {endpoint}; waiting at most "
          f"{timeout:g} s for the other nodes", file=sys.stderr, flush=True)

    keys = [f"{_P}job"] + [f"{_P}node/{r}" for r in range(nnodes)]
    while not _call(store.check, endpoint, keys, timeout=left()):
        if time.monotonic() > deadline:
            missing = [str(r) for r in range(nnodes)
                       if not _call(store.check, endpoint, [f"{_P}node/{r}"], timeout=left())]
            raise RendezvousError(f"rendezvous at {endpoint}: node(s) {', '.join(missing)} of {nnodes} did not join "
                                  f"within {timeout:g} s; start `conveyor run --nnodes {nnodes} --node-rank I "
                                  f"--rdzv {endpoint} ...` on every node (or raise --timeout)")
        time.sleep(_POLL)
    job, *published = [_unseal(secret, key, _call(store.get, endpoint, key, timeout=left()), endpoint) for key in keys]
    try:
        nodes = tuple(NodeInfo(str(n["host"]), int(n["workers"]), int(n["ps"]), tuple(int(p) for p in n["ports"]),
                               int(n.get("data_workers", 0))) for n in published)
        master_port = int(job["master_port"])
        dispatcher_port = int(job["dispatcher_port"]) if any(n.data_workers for n in nodes) else None
        peers.run = str(job["run"])
        peers.training_nodes = tuple(r for r, n in enumerate(nodes) if n.workers)
        names = tuple(f"{n.get('hostname') or '?'} at {node.host}" for n, node in zip(published, nodes, strict=True))
        _check_settings(endpoint, [n["settings"] for n in published])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RendezvousError(f"rendezvous at {endpoint}: a published record is malformed ({type(e).__name__}: {e}); "
                              f"is another conveyor version using this address?") from None
    return Rendezvous(nodes=nodes, node_rank=node_rank, master_addr=nodes[0].host, master_port=master_port,
                      secret=secret, peers=peers, names=names, dispatcher_port=dispatcher_port)


#: Agreed settings that are no flag, by what a refusal calls them.
_NOT_FLAGS = {"script": "the training script", "script_args": "the script's arguments (sha256)"}


def _check_settings(endpoint: str, settings: list[dict]) -> None:
    for r, node in enumerate(settings[1:], start=1):
        difference = settings_difference(endpoint, f"node {r}", settings[0], node)
        if difference is not None:
            raise RendezvousError(difference)


def settings_difference(endpoint: str, who: str, first: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """Why ``who``'s settings ``node`` cannot join node 0's ``first`` (naming the flag, or the script), else None."""
    for key in sorted(set(first) | set(node)):
        if first.get(key) == node.get(key):
            continue
        if key in _NOT_FLAGS:
            return (f"rendezvous at {endpoint}: {who} runs {_NOT_FLAGS[key]} {node.get(key)!r} but node 0 runs "
                    f"{first.get(key)!r}; start every node with the same script and arguments")
        flag = "--" + key.replace("_", "-")
        return (f"rendezvous at {endpoint}: {who} has {flag} = {node.get(key)!r} but node 0 has {first.get(key)!r}; "
                f"start every node with the same {flag}")
    return None


def _connect(host: str, port: int, endpoint: str, node_rank: int, timeout: float) -> Any:
    # torch's C++ side logs every connection retry with a stack trace; the errors below say it better.
    # Only this (launcher) process is affected: the tasks' environment was captured before.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from conveyor.comm.process_group import serve_store  # lazily: imports torch, the only torch in launch/

    unreachable = (f"node {node_rank} could not reach the rendezvous at {endpoint} within {timeout:g} s: {{}}; start "
                   f"node 0's launcher there (conveyor run --node-rank 0 --rdzv {endpoint} ...) and check that the "
                   f"port is open")
    wait = timedelta(seconds=timeout)
    try:
        if node_rank == 0:
            return serve_store(_listen(host, port, endpoint), wait_for_workers=False, timeout=wait)
        error = _wait_until_listening(host, port, timeout)
        if error is not None:
            raise RendezvousError(unreachable.format(error))
        return _client(host, port, endpoint, node_rank, timeout)
    except RuntimeError as e:  # torch's DistNetworkError / DistStoreError
        if isinstance(e, RendezvousError):
            raise
        if node_rank == 0:
            raise RendezvousError(f"node 0 cannot host the rendezvous at {endpoint}: {_first_line(e)}; --rdzv must "
                                  f"be an address of node 0 with a free port (is another job using it?)") from None
        raise RendezvousError(unreachable.format(_first_line(e))) from None


def _client(host: str, port: int, endpoint: str, node_rank: int, timeout: float) -> Any:
    """A client connection to the store, which listens already (node 0's own heartbeat connects to it too)."""
    from torch.distributed import TCPStore

    def connect() -> Any:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))

    try:  # its handshake, too, waits without end on a store that accepts and never answers
        return _call(connect, endpoint, timeout=timeout + 1.0)
    except (RuntimeError, PeerError) as e:
        raise RendezvousError(f"node {node_rank} could not connect to the rendezvous at {endpoint}: "
                              f"{_first_line(e)}") from None


def _listen(host: str, port: int, endpoint: str) -> socket.socket:
    """A socket listening on the ``--rdzv`` address only, for node 0's store to serve on.

    Left to itself, ``TCPStore`` binds the wildcard address (``::``: every interface) whatever host it is
    given; a socket handed over as ``master_listen_fd`` is served as it is.
    """
    from conveyor.comm.process_group import listen_only_on

    try:
        return listen_only_on(host, port)
    except socket.gaierror as e:
        raise RendezvousError(f"--rdzv host {host!r} does not resolve ({e.strerror})") from None
    except OSError as e:
        raise RendezvousError(f"node 0 cannot host the rendezvous at {endpoint}: {e.strerror}; --rdzv must be an "
                              f"address of node 0 with a free port (is another job using it?)") from None


def _wait_until_listening(host: str, port: int, timeout: float) -> str | None:
    """Poll until node 0's store accepts connections; the last error when ``timeout`` passes first.

    Nodes usually start within seconds of each other, node 0 not necessarily first; TCPStore's own retry
    backs off for a second or more after a refused connection, a plain connect every 0.1 s does not.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return None
        except OSError as e:
            if time.monotonic() + _POLL > deadline:
                return e.strerror or type(e).__name__
            time.sleep(_POLL)


def _call(method: Any, endpoint: str, *args: Any, timeout: float) -> Any:
    """``method(*args)`` on the store, given up after ``timeout`` s: torch's client blocks without end on a store
    that accepts and never answers (a link cut after the connection was made), whatever its own timeout says.
    The call runs in a daemon thread, so that one left blocked does not keep the launcher from ending."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = method(*args)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, name="conveyor-rendezvous-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise PeerError(f"node 0's rendezvous store at {endpoint} did not answer within {timeout:g} s (--timeout): "
                        f"its machine is down or cut off from this one, and the job cannot go on without it; check "
                        f"that this node reaches {endpoint} (network link, firewall), then start the job again")
    error = box.get("error")
    if isinstance(error, RuntimeError):
        raise PeerError(f"lost node 0, whose launcher hosts the rendezvous at {endpoint}: {_first_line(error)}; its "
                        f"machine is down or cut off, or its launcher was killed, and the job cannot go on without "
                        f"it") from None
    if error is not None:
        raise error
    return box["value"]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class StorePeers:
    """The supervisor's :class:`~conveyor.launch.supervisor.Peers`, over the rendezvous store.

    Keys: ``failed/<attempt>`` (the first failure's description wins: it is the cause, later ones are
    usually peers whose collectives broke because of it), ``abort`` (an interrupted launcher, or a node
    lost), and one record per node for ``done/<attempt>/<node>``, ``trained/<attempt>/<node>``,
    ``stopped/<attempt>/<node>``, ``alive/<node>`` (its heartbeat, ``launch/liveness.py``) and
    ``left/<node>`` (node 0 waits for the others to leave before it shuts the store down, so nobody loses
    the store while reading the outcome). Every value is signed like the rendezvous records, over the key
    and this job's run id: whoever reaches the port without the secret cannot write a record that stops,
    restarts or ends the job (deleting a heartbeat only makes the job end, after ``timeout``, as a lost
    machine would). Counters could not carry a signature, hence a record per node. A value that fails
    the check is ignored, and said once.
    """

    def __init__(self, store: Any, *, nnodes: int, node_rank: int, endpoint: str, timeout: float,
                 secret: bytes) -> None:
        self._store = store
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.endpoint = endpoint
        self._timeout = timeout
        self._secret = secret
        self.run = ""  # node 0's run id, from the rendezvous; binds every record to this job
        self.training_nodes: tuple[int, ...] = tuple(range(nnodes))  # the nodes with training tasks
        self._valid: dict[str, dict] = {}
        self._forged: set[str] = set()
        self._closed = False
        self._heart: Heartbeat | None = None
        self.beat_key = f"{_P}alive/{node_rank}"  # an elastic member beats under its member id instead
        self.left_prefix = f"{_P}left"  # an elastic round's ranks leave under the round's own prefix
        self.joined = False  # claimed its node rank: only then does it say when it leaves

    @property
    def timeout(self) -> float:
        return self._timeout

    def _sealed(self, key: str, record: Mapping[str, Any]) -> str:
        return _seal(self._secret, f"{key}\0{self.run}", record)

    def _check(self, key: str, value: bytes) -> dict | None:
        """The record in ``value`` if this job signed it under ``key``; else None, said once per key."""
        try:
            return _unseal(self._secret, f"{key}\0{self.run}", value, self.endpoint)
        except RendezvousError:
            if key not in self._forged:
                self._forged.add(key)
                print(f"[conveyor] ignoring {key} in the rendezvous store at {self.endpoint}: it is not signed with "
                      f"this job's secret (a program without it wrote it, or a copy from an earlier job); anyone who "
                      f"reaches that port can write there: keep it on a private network", file=sys.stderr, flush=True)
            return None

    def _read(self, key: str) -> dict | None:
        if key not in self._valid and _call(self._store.check, self.endpoint, [key], timeout=self._timeout):
            record = self._check(key, _call(self._store.get, self.endpoint, key, timeout=self._timeout))
            if record is not None:
                self._valid[key] = record  # a record, once valid, stays: the store may be overwritten later
        return self._valid.get(key)

    def _first(self, key: str, description: str) -> None:
        """Set ``key`` unless a valid record holds it already (the first one wins); a forgery is replaced."""
        mine = self._sealed(key, {"description": description})
        expected = ""
        for _ in range(3):  # a writer without the secret may race; it can delay the record, not replace it
            current = _call(self._store.compare_set, self.endpoint, key, expected, mine, timeout=self._timeout)
            if current == mine.encode() or self._check(key, current) is not None:
                return
            expected = current

    def _description(self, key: str) -> str | None:
        record = self._read(key)
        return None if record is None else str(record.get("description"))

    def _mark(self, key: str) -> None:
        _call(self._store.set, self.endpoint, key, self._sealed(key, {"node": self.node_rank}), timeout=self._timeout)

    def _everyone(self, prefix: str, nodes: Sequence[int] | None = None) -> bool:
        return all(self._read(f"{prefix}/{r}") is not None for r in (range(self.nnodes) if nodes is None else nodes))

    def failure(self, attempt: int) -> str | None:
        return self._description(f"{_P}failed/{attempt}")

    def aborted(self) -> str | None:
        return self._description(f"{_P}abort")

    def report_failure(self, attempt: int, description: str) -> None:
        self._first(f"{_P}failed/{attempt}", description)

    def abort(self, description: str) -> None:
        self._first(f"{_P}abort", description)

    def report_done(self, attempt: int) -> None:
        self._mark(f"{_P}done/{attempt}/{self.node_rank}")

    def all_done(self, attempt: int) -> bool:
        return self._everyone(f"{_P}done/{attempt}")

    def report_succeeded(self, attempt: int) -> None:
        self._mark(f"{_P}succeeded/{attempt}")

    def report_trained(self, attempt: int) -> None:
        self._mark(f"{_P}trained/{attempt}/{self.node_rank}")

    def succeeded(self, attempt: int) -> bool:
        return (self._read(f"{_P}succeeded/{attempt}") is not None
                or self._everyone(f"{_P}trained/{attempt}", self.training_nodes))

    # -- heartbeats (launch/liveness.py) ------------------------------------------------------------

    def start_heartbeat(self, twin: StorePeers, names: Sequence[str]) -> None:
        """Beat (node 0: watch the others' beats) from a thread, through ``twin``: this job's peers on a
        connection of their own."""
        self._heart = Heartbeat(twin, hosts=names, timeout=self._timeout)
        self._heart.start()

    def beat(self, count: int) -> None:
        key = self.beat_key
        _call(self._store.set, self.endpoint, key, self._sealed(key, {"beat": count}), timeout=self._timeout)

    def beat_of(self, node: int) -> int | None:
        """Node ``node``'s latest beat count, if a valid one is there (never cached: it grows)."""
        return self.beat_at(f"{_P}alive/{node}")

    def beat_at(self, key: str) -> int | None:
        """The latest beat count under ``key``, if a valid one is there."""
        if not _call(self._store.check, self.endpoint, [key], timeout=self._timeout):
            return None
        record = self._check(key, _call(self._store.get, self.endpoint, key, timeout=self._timeout))
        beat = None if record is None else record.get("beat")
        return beat if isinstance(beat, int) and not isinstance(beat, bool) else None

    def has_left(self, node: int) -> bool:
        return self._read(f"{self.left_prefix}/{node}") is not None

    def release(self) -> None:
        """Drop the connection (the heartbeat's twin, once its thread is done with it)."""
        self._store = None

    def report_stopped(self, attempt: int) -> None:
        self._mark(f"{_P}stopped/{attempt}/{self.node_rank}")

    def all_stopped(self, attempt: int) -> bool:
        return self._everyone(f"{_P}stopped/{attempt}")

    def close(self, *, wait: bool = True, linger: float = 15.0) -> None:
        """Leave the job. Node 0 hosts the store, so it waits (at most ``linger`` s) for the others to leave
        first: they may still be reading how the job ended."""
        if self._closed:
            return
        self._closed = True
        lost = set()
        if self._heart is not None:
            # Its own connection goes first, while the store is surely up: node 0's store, shut down with a
            # client of its own process still connected, never finishes (nor does the process's exit).
            self._heart.stop()
            lost = self._heart.lost
        try:
            if self.node_rank != 0:
                if self.joined:  # a launcher refused its rank must not speak for the node that holds it
                    # first: node 0 must not count a node that left as lost
                    self._mark(f"{self.left_prefix}/{self.node_rank}")
            elif wait:
                deadline = time.monotonic() + linger
                while not self._everyone(self.left_prefix, [r for r in range(1, self.nnodes) if r not in lost]):
                    if time.monotonic() > deadline:
                        break
                    time.sleep(_POLL)
        except PeerError:
            pass  # the others are gone already
        finally:
            self._store = None
