"""The parameter-server transport: a ZeroMQ ROUTER server and DEALER clients exchanging signed messages.

    def handle(message):                      # runs in the server's thread, one message at a time
        return "ok", {"step": 3}, [params]    # kind, header, tensors of the reply

    server = Server("10.0.0.5:2222", secret, handle, name="ps:0").start()
    client = Client("10.0.0.5:2222", secret, name="ps:0", timeout=30.0, sender="worker:1")
    reply = client.request("pull", {"step": 3})          # ServerUnavailable if ps:0 does not answer
    ids = [c.send("push", {}, grads) for c, grads in zip(clients, shards)]   # in flight at once
    replies = [c.receive(i) for c, i in zip(clients, ids)]

Messages are :mod:`conveyor.comm.framing` frames. What it promises: the server binds exactly the
cluster spec's address; connections must pass a gate keyed by the job secret, and messages that do not
decode are dropped and counted (``server.stats["dropped_by_reason"]``), never answered; a handler that
raises becomes a :class:`RemoteError` at the client; payloads over ``part_bytes`` travel in separately
signed parts (incomplete ones abandoned after ``PART_TIMEOUT`` and within ``MAX_ASSEMBLY_BYTES``);
every request has a timeout, after which :class:`ServerUnavailable` says what the connection looked
like. Tensors travel without copies, so keep those given to :meth:`Client.send` unchanged until
:meth:`Client.receive` returns. A socket belongs to one thread. The reasons and the measurements:
``docs/ps.md``, "The parameter-server transport".
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from conveyor.cluster.spec import join_address, split_address
from conveyor.comm.framing import (
    BadMessage,
    Message,
    ReplayGuard,
    Wire,
    as_wire,
    check_secret,
    decode,
    encode,
    next_seq,
    sender_id,
    sender_role,
)
from conveyor.errors import AddressInUseError, TransportError  # re-exported: their old home

__all__ = [
    "AddressInUseError",
    "Client",
    "Deferred",
    "RemoteError",
    "Server",
    "ServerUnavailable",
    "TransportError",
]

log = logging.getLogger(__name__)

Handler = Callable[[Message], Any]

_POLL_MS = 50  # how often the serving loop looks at its stop event
_BATCH = 64  # messages handled before the loop polls again (lets monitor events and stop requests in)
_TRACK_BYTES = 1 << 16  # pyzmq's copy_threshold: smaller frames are copied, larger ones are tracked
PART_BYTES = 8 << 20  # a request or reply larger than this travels as several messages (see _send)
_MAX_ASSEMBLIES = 4096  # split messages being put together at once, per server or client
MAX_ASSEMBLY_BYTES = 4 << 30  # tensor bytes of split messages being put together at once (see _Assembly)
#: what all connections not yet authenticated may hold together (each, up to ``max_frame_bytes``)
MAX_UNAUTHENTICATED_BYTES = 1 << 30
PART_TIMEOUT = 60.0  # seconds a split message may wait for its next part before it is abandoned
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_SERVER_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
                  | zmq.EVENT_CLOSED)
_PLAIN_USER = b"conveyor"


class ServerUnavailable(TransportError):
    """A server did not answer within the timeout (or the connection was reset after an earlier one)."""

    def __init__(self, message: str, *, name: str, address: str) -> None:
        super().__init__(message)
        self.name = name
        self.address = address


class RemoteError(TransportError):
    """The server's handler raised while handling this request; the text is the server's exception."""


class Deferred:
    """What a handler returns to answer later: the server keeps the request's return address in it, and
    :meth:`Server.reply` answers it from the serving thread (a later handler call, or the ``tick``).

    The client's timeout still bounds the wait, so a handler that defers must answer well within it.
    """

    def __init__(self) -> None:
        self._to: tuple[Any, Message] | None = None
        self.answered = False

    def bind(self, identity: Any, message: Message) -> None:
        self._to = (identity, message)

    @property
    def identity(self) -> Any:
        """The connection to answer on (None until the handler returned)."""
        return None if self._to is None else self._to[0]

    def take(self) -> tuple[Any, Message]:
        if self._to is None or self.answered:
            raise RuntimeError("Server.reply: this request was already answered, or its handler has not returned yet")
        self.answered = True
        return self._to


# --------------------------------------------------------------------------------------------- gate


def _password(secret: bytes) -> bytes:
    """The PLAIN password for a job: derived from its secret, so seeing it on the wire reveals no secret."""
    return hmac.new(secret, b"conveyor/comm/transport/zap/v1", hashlib.sha256).hexdigest().encode()


class _Gate:
    """This process's ZAP handler (ZeroMQ's hook for authenticating connections), shared by its servers.

    ZeroMQ asks ``inproc://zeromq.zap.01`` of the socket's context about each PLAIN handshake; one handler
    per context may bind it, so servers register ``zap_domain -> password`` here and one daemon thread
    answers for all of them. It restarts if the process's context changes (after ``fork``, or a ``term``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passwords: dict[bytes, bytes] = {}
        self._context: zmq.Context | None = None

    def register(self, context: zmq.Context, domain: bytes, password: bytes) -> None:
        with self._lock:
            if self._context is not context or context.closed:
                rep = context.socket(zmq.REP)
                rep.linger = 0
                rep.bind("inproc://zeromq.zap.01")
                self._context = context
                threading.Thread(target=self._serve, args=(rep,), name="conveyor-zap", daemon=True).start()
            self._passwords[domain] = password

    def unregister(self, domain: bytes) -> None:
        with self._lock:
            self._passwords.pop(domain, None)

    def _serve(self, rep: zmq.Socket) -> None:
        try:
            while True:
                if not rep.poll(1000):
                    if self._context is not rep.context:  # superseded by a handler on a newer context
                        break
                    continue
                request = rep.recv_multipart()
                rep.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        finally:
            rep.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        version, request_id, domain, _address, _identity, mechanism, *credentials = (*request, *[b""] * 6)[:8]
        expected = self._passwords.get(domain)
        ok = (expected is not None and mechanism == b"PLAIN" and len(credentials) == 2
              and credentials[0] == _PLAIN_USER and hmac.compare_digest(credentials[1], expected))
        status = (b"200", b"OK") if ok else (b"400", b"refused")
        return [b"1.0", request_id, *status, _PLAIN_USER if ok else b"", b""]


_GATE = _Gate()


# --------------------------------------------------------------------------------------------- helpers


def _resolve_bind(host: str, port: int, name: str, address: str) -> tuple[str, bool]:
    """``(endpoint host for tcp://, is IPv6)``: a literal address of this host, preferring IPv4.

    ZeroMQ does not look host names up for ``bind``, so the name from the cluster spec is resolved here,
    the same way (IPv4 first) a client's ``connect`` resolves it.
    """
    if host == "*":
        return "*", False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise AddressInUseError(
            f"{name} cannot listen on {address}: host {host!r} does not resolve ({exc.strerror}). The cluster "
            f"spec must give this task an address of its own machine (a resolvable name or an IP)") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, ip = infos[0][0], infos[0][4][0]
    if ip.startswith("127.") and host != "localhost" and not host.startswith("127."):
        log.warning("%s: host %r resolves to the loopback address %s; tasks on other machines cannot reach "
                    "it (fix /etc/hosts or give an IP in the cluster spec)", name, host, ip)
    return ip, family == socket.AF_INET6


def _tcp(host: str, port: int) -> str:
    return f"tcp://{join_address(host, port)}" if host != "*" else f"tcp://*:{port}"


def _drain_monitor(monitor: zmq.Socket | None) -> list[tuple[int, int]]:
    """``(event, value)`` pairs waiting on a monitor socket, without blocking."""
    events = []
    while monitor is not None:
        try:
            event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
        except zmq.Again:
            break
        events.append((int(event["event"]), int(event["value"])))
    return events


def _groups(tensors: Sequence[Wire], part_bytes: int) -> list[list[Wire]]:
    """Consecutive tensors grouped into parts of about ``part_bytes`` (a tensor is never cut)."""
    groups: list[list[Wire]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _send(sock: zmq.Socket, envelope: list[Any], kind: str, header: dict[str, Any] | None, tensors: Sequence[Any],
          *, secret: bytes, sender: str, recipient: str, reply_to: int | None, part_bytes: int,
          track: bool) -> tuple[int, list[zmq.MessageTracker]]:
    """Sign and send one request or reply; returns ``(its id = seq of its first message, trackers)``.

    Large payloads go as several messages of about ``part_bytes``, each signed on its own: ZeroMQ starts
    writing a multipart message only once its last frame is queued, so one big message would serialise
    hash → send → verify. In parts, hashing part k+1 here overlaps sending part k and verifying it there.
    Every tensor is converted first, so a bad one fails before anything is sent.
    """
    wires = [as_wire(t) for t in tensors]
    groups = _groups(wires, part_bytes)
    first = next_seq()
    trackers = []
    for index, group in enumerate(groups):
        seq = first if index == 0 else next_seq()
        frames = encode(kind, header if index == 0 else None, group, secret=secret, sender=sender, seq=seq,
                        recipient=recipient, reply_to=reply_to,
                        part=(index, len(groups), first) if len(groups) > 1 else None)
        parts: list[Any] = [*envelope, frames[0]]
        for view in frames[1:-1]:
            if track and view.nbytes >= _TRACK_BYTES:
                frame = zmq.Frame(view, copy=False, track=True)
                trackers.append(frame.tracker)
                view = frame
            parts.append(view)
        parts.append(frames[-1])
        sock.send_multipart(parts, copy=False)
    return first, trackers


class _Assembly:
    """Puts split messages back together: the first part's kind and header, every part's tensors.

    Bounded (docs/ps.md, "Large payloads travel in parts"): at most ``limit`` assemblies and ``max_bytes``
    of their tensors at once (beyond either, the oldest are abandoned: their requests time out at the
    sender), and one whose next part has not come within ``timeout`` seconds of the previous one is
    abandoned (:meth:`expire`, and on every part). Abandoned assemblies are ``"part"`` drops.
    """

    def __init__(self, limit: int = _MAX_ASSEMBLIES, *, max_bytes: int = MAX_ASSEMBLY_BYTES,
                 timeout: float = PART_TIMEOUT, on_drop: Callable[[str], None] | None = None) -> None:
        self._open: OrderedDict[tuple[str, int], tuple[list[Message], float]] = OrderedDict()  # by last part
        self._limit = limit
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.nbytes = 0  # tensor bytes held in incomplete assemblies
        self._on_drop = on_drop

    def add(self, message: Message) -> Message | None:
        """The whole message once its last part is in, else ``None``; ``BadMessage("part")`` if out of order
        or too large for the bound alone."""
        assert message.part is not None
        index, count, first = message.part
        key = (message.sender, first)
        now = time.monotonic()
        self.expire(now)
        if index == 0:
            self._abandon(key, None)
            parts: list[Message] | None = []
        else:
            parts = self._open.pop(key, (None, 0.0))[0]
            if parts is None or len(parts) != index or parts[0].part[1] != count:  # type: ignore[index]
                self._forget(parts)
                raise BadMessage("part", f"part {index}/{count} of message {first} from {message.sender} came out of "
                                         f"order or without its first part (or after its assembly was abandoned)")
        parts.append(message)
        size = sum(t.nbytes for t in message.tensors)
        self.nbytes += size
        if index == count - 1:
            self._forget(parts)
            return replace(parts[0], tensors=[t for p in parts for t in p.tensors],
                           dtypes=[d for p in parts for d in p.dtypes], part=None)
        self._open[key] = (parts, now)
        while len(self._open) > self._limit or (self.nbytes > self.max_bytes and len(self._open) > 1):
            self._abandon(next(iter(self._open)), "the bound on split messages being assembled was reached")
        if self.nbytes > self.max_bytes:
            self._abandon(key, None)
            raise BadMessage("part", f"message {first} from {message.sender} is larger than the {self.max_bytes} "
                                     f"bytes a split message may hold while it is assembled")
        return None

    def expire(self, now: float) -> None:
        """Abandon the assemblies whose last part came more than ``timeout`` seconds before ``now``."""
        while self._open:
            key, (_, last) = next(iter(self._open.items()))
            if now - last <= self.timeout:
                break
            self._abandon(key, f"no part came for {self.timeout:g} s")

    def _abandon(self, key: tuple[str, int], why: str | None) -> None:
        parts = self._open.pop(key, (None, 0.0))[0]
        self._forget(parts)
        if parts is not None and why is not None and self._on_drop is not None:
            self._on_drop(f"abandoned split message {key[1]} from {key[0]} after {len(parts)} parts: {why}")

    def _forget(self, parts: list[Message] | None) -> None:
        self.nbytes -= sum(t.nbytes for p in parts or () for t in p.tensors)


class _Inbox:
    """What a server does to each incoming message (the frames after the routing id) before its handler
    sees it: authenticate and check it (:func:`decode`), then put split requests back together."""

    def __init__(self, secret: bytes, recipient: str, guard: ReplayGuard, assembly: _Assembly) -> None:
        self._secret = secret
        self._recipient = recipient
        self._guard = guard
        self.assembly = assembly
        #: ``(time.time(), sender role)`` of the last authenticated message, ``None`` before the first
        self.heard: tuple[float, str] | None = None

    def accept(self, body: Sequence[Any]) -> Message | None:
        """The whole request once its last part is in, ``None`` while parts are missing; raises
        :class:`BadMessage` for anything to drop (its ``reason`` is what the server counts)."""
        message = decode(body, secret=self._secret, replay_guard=self._guard, recipient=self._recipient)
        self.heard = (time.time(), sender_role(message.sender))
        return self.assembly.add(message) if message.part is not None else message


def _reply_parts(result: Any) -> tuple[str, dict, Sequence[Any]]:
    """A handler's return value → ``(kind, header, tensors)``; ``None`` means ``("ok", {}, ())``."""
    if result is None:
        return "ok", {}, ()
    if isinstance(result, tuple) and len(result) in (2, 3):
        kind, header, tensors = (*result, ())[:3]
        if isinstance(kind, str) and (header is None or isinstance(header, dict)):
            return kind, header or {}, tensors
    raise TypeError(f"the handler returned {type(result).__name__}; expected (kind, header, tensors), "
                    f"(kind, header) or None")


def _bind_error(exc: zmq.ZMQError, name: str, address: str, ip: str, port: int) -> AddressInUseError:
    where = f"{name} cannot listen on {address}" + (f" ({ip})" if ip != split_address(address)[0] else "")
    if exc.errno == errno.EADDRINUSE:
        return AddressInUseError(
            f"{where}: port {port} is already in use (another job, or an earlier run of this one that is "
            f"still alive). Stop the process holding it (`ss -ltnp 'sport = :{port}'` shows it) or give "
            f"this task a free port in the cluster spec (`conveyor run` picks free ports itself)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return AddressInUseError(
            f"{where}: that address is not on this machine. The cluster spec must give each ps task an "
            f"address of the machine it runs on")
    return AddressInUseError(f"{where}: {exc.strerror}")


def _router(ip: str, ipv6: bool, port: int, domain: bytes, max_frame_bytes: int | None,
            handshake_timeout: float) -> tuple[zmq.Socket, zmq.Socket]:
    """A ROUTER socket behind the gate (``domain`` registered with :data:`_GATE`) and its monitor, before
    binding; the caller binds it."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    sock.ipv6 = ipv6
    sock.plain_server = True
    sock.zap_domain = domain
    sock.router_mandatory = 1  # a reply to a vanished client raises instead of vanishing silently
    sock.sndtimeo = 0  # a client whose queue is full (it stopped reading) loses the reply; the server goes on
    if max_frame_bytes is not None:
        sock.maxmsgsize = int(max_frame_bytes)
    sock.handshake_ivl = max(1, int(handshake_timeout * 1000))
    return sock, sock.get_monitor_socket(_SERVER_EVENTS)


def _handshake_limit(max_frame_bytes: int | None) -> int | None:
    """How many connections may handshake at once: :data:`MAX_UNAUTHENTICATED_BYTES` over what each may
    hold (its frame and ZeroMQ's 8 KiB read buffer), and at least 64 (a job's workers connecting at once);
    None (no limit) without a frame limit, where one connection alone is unbounded."""
    if max_frame_bytes is None:
        return None
    return max(64, MAX_UNAUTHENTICATED_BYTES // (int(max_frame_bytes) + (8 << 10)))


def _bound_router(ip: str, ipv6: bool, port: int, domain: bytes, max_frame_bytes: int | None,
                  handshake_timeout: float, *, name: str, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """:func:`_router`, bound to ``ip:port``; on failure everything is closed, ``domain`` unregistered, and
    :class:`AddressInUseError` says why."""
    sock, monitor = _router(ip, ipv6, port, domain, max_frame_bytes, handshake_timeout)
    try:
        sock.bind(_tcp(ip, port))
    except zmq.ZMQError as exc:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        _GATE.unregister(domain)
        raise _bind_error(exc, name, address, ip, port) from None
    return sock, monitor


def _close_router(sock: zmq.Socket, monitor: zmq.Socket, endpoint: str) -> None:
    """Close a server's socket with the port free on return (a restarted server can bind it at once).

    ZeroMQ closes sockets in its I/O thread, after zmq_close returns; so unbind first and wait for the
    listener's CLOSED event.
    """
    try:
        sock.unbind(endpoint)
        deadline = time.monotonic() + 2.0
        while (remaining := deadline - time.monotonic()) > 0 and monitor.poll(int(remaining * 1000) + 1):
            if any(event & zmq.EVENT_CLOSED for event, _ in _drain_monitor(monitor)):
                break
    except zmq.ZMQError:
        pass
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)


class _Drops:
    """What a server dropped, counted by reason and logged sparingly (thread-safe: counted from the serving
    thread, read by ``stats`` from any)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._dropped: Counter[str] = Counter()  # grows a key per reason

    def add(self, reason: str, detail: str, identity: Any) -> None:
        with self._lock:
            self._dropped[reason] += 1
            count = self._dropped[reason]
        if count == 1 or count % 1000 == 0:  # the first of each kind, then a reminder: logs cannot be flooded
            peer = identity.get("Peer-Address") if isinstance(identity, zmq.Frame) else None
            log.warning("%s: dropped a %s%s (%s: %s); %d dropped for this reason so far", self._name,
                        "connection" if reason == "handshake" else "message", f" from {peer}" if peer else "",
                        reason, detail, count)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)


class _Handshakes:
    """Counts connections that fail the gate as ``"handshake"`` drops, from the socket's monitor events.

    ZeroMQ reports a refused password or a wrong mechanism as an event, but a peer that sends
    something that is not a ZMTP 3 greeting (random bytes) just gets disconnected. So connections are
    followed by file descriptor from ``ACCEPTED`` to ``DISCONNECTED``; the handshake events carry no
    descriptor and are matched to the oldest connection still handshaking, which is exact unless
    several peers handshake at the same moment (then only which connection is blamed may be off).

    At most ``limit`` connections may be handshaking at once (each may hold a frame before it is
    authenticated): beyond it, the newest are shut down (``shutdown(2)`` on their descriptor, which ZeroMQ
    sees as the peer leaving and cleans up itself) and counted as ``"unauthenticated"`` drops.
    """

    def __init__(self, drops: _Drops, limit: int | None = None) -> None:
        self._drops = drops
        self._limit = limit
        self._pending: OrderedDict[int, None] = OrderedDict()  # fds accepted, handshake not settled
        self._shut: set[int] = set()  # fds shut down here: their disconnect is not a drop again
        self._shut_failing = 0  # handshake failures still to come from them (one each, before the disconnect)

    def follow(self, events: list[tuple[int, int]]) -> None:
        for event, value in events:
            if event & zmq.EVENT_ACCEPTED:
                self._pending[value] = None
                self._shut.discard(value)  # a new connection on a reused descriptor
            elif event & (zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED):
                if event & _HANDSHAKE_FAILED and self._shut_failing:
                    self._shut_failing -= 1  # a connection shut down here failing its handshake: counted already
                    continue
                if self._pending:
                    self._pending.popitem(last=False)  # settled: its disconnect is not counted again
                if event & _HANDSHAKE_FAILED:
                    why = ("a wrong password (another job's secret?)" if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH
                           else "no or another security mechanism (not a conveyor client)")
                    self._drops.add("handshake", f"a connection failed the handshake: {why}", None)
            elif event & zmq.EVENT_DISCONNECTED and value in self._shut:
                self._shut.discard(value)
            elif event & zmq.EVENT_DISCONNECTED and value in self._pending:
                del self._pending[value]
                self._drops.add("handshake", "a connection closed before completing the ZeroMQ handshake (random "
                                             "bytes, a port scanner, or a ZMTP 1.0 peer)", None)
        while self._limit is not None and len(self._pending) > self._limit:
            fd, _ = self._pending.popitem(last=True)  # the newest: connections already handshaking go on
            self._drops.add("unauthenticated", f"over {self._limit} connections were handshaking at once (the "
                                               f"bound on memory before authentication); the newest was closed", None)
            self._shut.add(fd)
            self._shut_failing += 1
            _shut_down(fd)


def _shut_down(fd: int) -> None:
    """Shut down the connection on descriptor ``fd`` without closing it: ZeroMQ, which owns the descriptor,
    reads end-of-file, disconnects and closes it itself."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return  # already closed
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


# --------------------------------------------------------------------------------------------- server


class _Outbox:
    """How a server answers: check, sign and send a handler's result, and follow the replies whose tensors
    ZeroMQ still reads (sent without copies), per peer, without ever waiting for them."""

    def __init__(self, name: str, secret: bytes, sender: str, stats: Counter[str]) -> None:
        self._name = name
        self._secret = secret
        self._sender = sender
        self._stats = stats
        self._lent: list[tuple[bytes, list[zmq.MessageTracker], int]] = []  # (peer, trackers, bytes) per reply

    def failed(self, message: Message, exc: Exception) -> tuple[str, dict[str, Any], list[Any]]:
        """The ``error`` reply for a handler that raised ``exc`` (counted and logged)."""
        self._stats["handler_errors"] += 1
        log.error("%s: handler failed on %r from %s", self._name, message.kind, message.sender, exc_info=exc)
        return "error", {"error": f"{type(exc).__name__}: {exc}"[:4000], "request_kind": message.kind}, []

    def send(self, sock: zmq.Socket, identity: Any, message: Message, result: Any, part_bytes: int) -> None:
        """Answer ``message`` (from the peer ``identity``) with a handler's ``result``; never blocks."""
        try:
            kind, header, tensors = _reply_parts(result)
            tensors = [as_wire(t) for t in tensors]
            encode(kind, header, secret=self._secret, sender=self._sender, seq=0)  # a bad header fails here, too
        except Exception as exc:
            kind, header, tensors = self.failed(message, exc)
        try:
            _, trackers = _send(sock, [identity], kind, header, tensors, secret=self._secret, sender=self._sender,
                                recipient=message.sender, reply_to=message.seq, part_bytes=part_bytes, track=True)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client left; EAGAIN: its queue is full (not reading)
            self._stats["reply_failed"] += 1
            log.warning("%s: could not reply to %s (%s)", self._name, message.sender, exc.strerror)
            return
        self._stats["replied"] += 1
        if trackers:
            self._lent.append((bytes(identity), trackers, sum(t.nbytes for t in tensors)))

    def lending(self) -> bool:
        """Whether ZeroMQ may still read the tensors of an earlier reply (forgets those it let go of)."""
        if self._lent:
            self._lent = [entry for entry in self._lent if not all(t.done for t in entry[1])]
        return bool(self._lent)

    def unsent_bytes(self, identity: Any) -> int:
        """The tensor bytes of replies to the peer ``identity`` that ZeroMQ has not let go of yet."""
        peer = bytes(identity)
        return sum(n for who, _, n in self._lent if who == peer) if self.lending() else 0


class Server:
    """A ROUTER socket bound to ``bind_address`` that answers signed requests with ``handler``.

    ``handler(message) -> (kind, header, tensors)`` runs in the serving thread, one message at a time; it
    may return a :class:`Deferred` instead and answer later with :meth:`reply`. Replies never block the
    server: their tensors leave without copies, so a handler that changes tensors it returned earlier
    writes into new ones while :attr:`lending` (copy on write), and can bound what a peer that does not
    read holds with :meth:`unsent_bytes` (a reply to a peer whose queue is full is dropped and counted).
    ``tick()``, if given, runs in the serving thread after every batch of messages and at least every
    50 ms (for deadlines).
    ``name`` is the task (``"ps:0"``): requests must be signed for it, replies are signed by it.
    ``max_skew`` is the clock difference tolerated (seconds); ``max_frame_bytes`` makes ZeroMQ disconnect
    a peer that sends a larger frame (``None``: no limit; set it to bound the memory a peer can make the
    server allocate).

    Memory before authentication: ZeroMQ reads a frame's size from its header and allocates that much
    before the frame (even the PLAIN handshake's HELLO) is complete, so without ``max_frame_bytes`` one
    unauthenticated connection can make the server hold as many bytes as it cares to send. With it, a
    connection holds at most ``max_frame_bytes`` plus ZeroMQ's 8 KiB read buffer, and only for
    ``handshake_timeout`` seconds (ZMQ_HANDSHAKE_IVL): a connection that has not passed the gate by then
    is closed.
    """

    def __init__(self, bind_address: str, secret: bytes, handler: Handler, *, name: str, max_skew: float = 300.0,
                 max_frame_bytes: int | None = None, handshake_timeout: float = 10.0, part_bytes: int = PART_BYTES,
                 tick: Callable[[], None] | None = None, max_assembly_bytes: int = MAX_ASSEMBLY_BYTES,
                 part_timeout: float = PART_TIMEOUT) -> None:
        host, port = split_address(bind_address, field=f"{name} address")
        check_secret(secret)
        if not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be a positive number of seconds; got {handshake_timeout!r}")
        self.name = name
        self.address = bind_address
        self.sender = sender_id(name)
        self.handler = handler
        self.tick = tick
        self.part_bytes = part_bytes
        self._secret = bytes(secret)
        self._stats: Counter[str] = Counter(dict.fromkeys(
            ("received", "replied", "handler_errors", "reply_failed", "internal_errors"), 0))  # fixed keys
        self._drops = _Drops(name)
        #: split requests being put together (a handler learning how large they can be may raise ``max_bytes``)
        self.assembly = _Assembly(max_bytes=max_assembly_bytes, timeout=part_timeout,
                                  on_drop=lambda why: self._drops.add("part", why, None))
        self._inbox = _Inbox(self._secret, name, ReplayGuard(max_skew=max_skew), self.assembly)
        self._outbox = _Outbox(name, self._secret, self.sender, self._stats)
        self._stop = threading.Event()
        self._serving: threading.Thread | None = None  # the thread that owns the socket while serving
        self._done = threading.Event()  # set when serving ends
        self._done.set()
        self._lock = threading.Lock()
        self._close_on_exit = False
        self._closed = False
        self._handshakes = _Handshakes(self._drops, _handshake_limit(max_frame_bytes))
        self._active = time.monotonic()  # when serving began or an authenticated message was last handled
        self._peer: Any = None  # the connection whose message the handler is handling
        ip, ipv6 = _resolve_bind(host, port, name, bind_address)
        self._domain = f"conveyor/{name}/{secrets.token_hex(8)}".encode()
        _GATE.register(zmq.Context.instance(), self._domain, _password(self._secret))
        self._sock, self._monitor = _bound_router(ip, ipv6, port, self._domain, max_frame_bytes, handshake_timeout,
                                                  name=name, address=bind_address)
        self._endpoint = self._sock.last_endpoint

    # ---- serving

    def start(self) -> Server:
        """Serve in a background (daemon) thread; returns ``self``."""
        thread = threading.Thread(target=self._serve, args=(None, (None, None)), name=f"conveyor-{self.name}-server",
                                  daemon=True)
        self._claim(thread)
        thread.start()
        return self

    def stop(self) -> None:
        """Ask the serving loop to return (safe from any thread, including the handler)."""
        self._stop.set()

    def serve_forever(self, stop_event: threading.Event | None = None, *, idle_timeout: float | None = None,
                      first_contact_timeout: float | None = None) -> bool:
        """Receive, check, handle and answer messages in this thread until :meth:`stop` (or ``stop_event``).

        With ``idle_timeout``, also return once that many seconds passed without an authenticated message
        (``first_contact_timeout``, default the same, until the first one): then the result is False.
        Time spent in the handler never counts as idle, and neither does a queue of unread messages.
        """
        self._claim(threading.current_thread())
        return self._serve(stop_event, (idle_timeout, first_contact_timeout or idle_timeout))

    def _claim(self, thread: threading.Thread) -> None:
        with self._lock:
            if self._serving is not None or self._closed:
                raise RuntimeError(f"{self.name}: already serving, or closed (one thread owns the socket)")
            self._serving = thread
            self._done.clear()

    def _serve(self, stop_event: threading.Event | None, idle: tuple[float | None, float | None]) -> bool:
        try:
            return self._loop(stop_event, idle)
        finally:
            with self._lock:
                self._serving = None
                close = self._close_on_exit
            if close:
                self._release()
            self._done.set()  # after the release: close() returns with the port free

    def _loop(self, stop_event: threading.Event | None, idle: tuple[float | None, float | None]) -> bool:
        """True when stopped, False when ``idle`` = ``(timeout, first-contact timeout)`` ran out."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        self._active = time.monotonic()
        while not (self._stop.is_set() or (stop_event is not None and stop_event.is_set())):
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ContextTerminated:
                return True
            if self._monitor in ready:
                self._handshakes.follow(_drain_monitor(self._monitor))
            self.assembly.expire(time.monotonic())
            self._tick()
            if self._sock not in ready:
                limit = idle[0] if self.last_heard is not None else idle[1]
                if limit is not None and time.monotonic() - self._active > limit:
                    return False
                continue
            for _ in range(_BATCH):
                if self._stop.is_set():
                    break
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ContextTerminated:
                    return True
                try:
                    self._serve_one(frames)
                except Exception:  # a bug here must not take the parameter server down
                    self._stats["internal_errors"] += 1
                    log.exception("%s: failed to serve a message; continuing", self.name)
        return True

    def _tick(self) -> None:
        if self.tick is None:
            return
        try:
            self.tick()
        except Exception:  # a bug here must not take the parameter server down
            self._stats["internal_errors"] += 1
            log.exception("%s: the tick failed; continuing", self.name)

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        self._stats["received"] += 1
        identity, body = frames[0], frames[1:]
        try:
            message = self._inbox.accept(body)
        except BadMessage as bad:
            self._drops.add(bad.reason, bad.detail, identity)
            return
        self._active = time.monotonic()
        if message is None:  # more parts to come
            return
        try:
            self._answer(identity, message)
        finally:
            self._active = time.monotonic()  # the handler's time is not idle time

    @property
    def last_heard(self) -> tuple[float, str] | None:
        """``(time.time(), sender role)`` of the last authenticated message; ``None`` before the first."""
        return self._inbox.heard

    def _answer(self, identity: Any, message: Message) -> None:
        self._peer = identity
        try:
            result = self.handler(message)
        except Exception as exc:
            result = self._outbox.failed(message, exc)
        finally:
            self._peer = None
        if isinstance(result, Deferred):
            result.bind(identity, message)
        else:
            self._outbox.send(self._sock, identity, message, result, self.part_bytes)

    def reply(self, deferred: Deferred, result: Any) -> None:
        """Answer the request whose handler returned ``deferred`` (from the serving thread: a handler or the tick).

        The tensors of ``result`` follow the handler's rule (see :attr:`lending`).
        """
        identity, message = deferred.take()
        self._outbox.send(self._sock, identity, message, result, self.part_bytes)

    @property
    def lending(self) -> bool:
        """Whether ZeroMQ may still read tensors of earlier replies: change them only by writing new ones."""
        return self._outbox.lending()

    @property
    def peer(self) -> bytes | None:
        """The connection whose message the handler is handling (None outside a handler): a key per peer."""
        return None if self._peer is None else bytes(self._peer)

    def unsent_bytes(self, peer: Deferred | None = None) -> int:
        """Tensor bytes of replies not yet sent to a peer: the one whose request the handler is handling
        (``None``), or the one ``peer`` (a :class:`Deferred` the handler returned) is to be answered to."""
        identity = self._peer if peer is None else peer.identity
        return 0 if identity is None else self._outbox.unsent_bytes(identity)

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot: ``received``, ``replied``, ``dropped``, ``dropped_by_reason``, ``handler_errors``,
        ``reply_failed``, ``internal_errors``."""
        dropped = self._drops.snapshot()
        return {"received": self._stats["received"], "replied": self._stats["replied"],
                "dropped": sum(dropped.values()), "dropped_by_reason": dropped,
                "handler_errors": self._stats["handler_errors"], "reply_failed": self._stats["reply_failed"],
                "internal_errors": self._stats["internal_errors"]}

    # ---- lifetime

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket (idempotent). From the handler, closes once the loop returns."""
        if self._closed:
            return
        self.stop()
        with self._lock:
            serving = self._serving
            self._close_on_exit = serving is not None  # whoever serves closes the socket on its way out
        if serving is None:
            self._release()
        elif serving is not threading.current_thread() and not self._done.wait(timeout):
            # A handler is stuck: the socket stays with its thread, which closes it when it returns.
            log.warning("%s: the serving thread did not stop within %.0f s", self.name, timeout)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        _close_router(self._sock, self._monitor, self._endpoint)
        _GATE.unregister(self._domain)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Server(name={self.name!r}, address={self.address!r})"


# --------------------------------------------------------------------------------------------- client

_LINK_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED
                | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)


class Client:
    """A DEALER connection to one server task, with timeouts and pipelining.

    ``name`` is the server's task (``"ps:1"``): requests are signed for it, and replies must come from it.
    ``sender`` is this task's role (``"worker:0"``); a random per-process nonce is appended to it.
    ``timeout`` (seconds) bounds every request unless :meth:`receive`/:meth:`request` get their own.
    """

    def __init__(self, address: str, secret: bytes, *, name: str, timeout: float = 30.0, sender: str = "client",
                 max_skew: float = 300.0, part_bytes: int = PART_BYTES) -> None:
        self._host, self._port = split_address(address, field=f"{name} address")
        check_secret(secret)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self.name = name
        self.address = address
        self.timeout = float(timeout)
        self.sender = sender_id(sender)
        self.part_bytes = part_bytes
        self._secret = bytes(secret)
        self._guard = ReplayGuard(max_skew=max_skew)
        self._assembly = _Assembly()
        self._pending: dict[int, str] = {}  # request id -> kind, awaiting a reply
        self._ready: dict[int, Message] = {}  # replies that arrived while waiting for another request
        self._lost: dict[int, str] = {}  # request id -> why it can no longer be answered
        self._stats: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._link = "not connected yet"
        self._refused = False
        self._closed = False
        self._open()

    def _open(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        sock.ipv6 = ":" in self._host
        sock.plain_username = _PLAIN_USER
        sock.plain_password = _password(self._secret)
        sock.sndtimeo = int(self.timeout * 1000)
        self._monitor = sock.get_monitor_socket(_LINK_EVENTS)
        sock.connect(_tcp(self._host, self._port))
        self._sock = sock
        self._link = "not connected yet"
        self._refused = False

    def _shut(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _update_link(self) -> None:
        for event, _ in _drain_monitor(self._monitor):
            if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link = "connected"
                self._refused = False
            elif event & _HANDSHAKE_FAILED:
                self._link = "handshake failed"
                self._refused = True  # sticky: ZeroMQ disconnects and retries, which says less
            elif event & zmq.EVENT_DISCONNECTED:
                self._link = "disconnected"
            elif event & zmq.EVENT_CONNECTED:
                self._link = "handshake pending"
            elif event & zmq.EVENT_CONNECT_RETRIED and self._link in ("not connected yet", "handshake pending"):
                self._link = "refused"

    def _unavailable(self, what: str, waited: float) -> ServerUnavailable:
        self._update_link()
        why = {
            "connected": f"the connection is up but {self.name} did not answer: it is hung or overloaded, or it "
                         f"drops this task's messages (clocks more than the allowed skew apart, or a damaged "
                         f"message; its log counts the drops). Check {self.name}'s log, or raise the timeout",
            "refused": f"nothing accepts connections there: {self.name} is not running (it died, or has not "
                       f"started yet) or the address is wrong. Check {self.name}'s log and the cluster spec",
            "not connected yet": f"no connection could be made: {self.name} is not running (it died, or has not "
                                 f"started yet) or the address is unreachable. Check {self.name}'s log and the "
                                 f"cluster spec",
            "handshake pending": "a TCP connection is open but the ZeroMQ handshake never completed: what "
                                 "listens there is probably not a conveyor parameter server; check the cluster "
                                 "spec's ps addresses",
            "handshake failed": f"{self.name} refused the connection: this task's job secret differs from the "
                                f"server's (every task must get the same CONVEYOR_JOB_SECRET from one launch), or "
                                f"what listens there is not a conveyor parameter server (check the cluster spec)",
            "disconnected": f"the connection dropped: {self.name} died or restarted. Check {self.name}'s log",
        }["handshake failed" if self._refused else self._link]
        return ServerUnavailable(f"{self.name} at {self.address} did not answer {what} within {waited:.3g} s: {why}.",
                                 name=self.name, address=self.address)

    def _reset(self, why: str) -> None:
        """Drop the socket and every request on it: a late server must not apply what already failed."""
        for rid in self._pending:
            self._lost[rid] = why
        self._pending.clear()
        self._assembly = _Assembly()
        self._shut()

    # ---- requests

    def send(self, kind: str, header: dict[str, Any] | None = None, tensors: Sequence[Any] = ()) -> int:
        """Queue a request and return its id for :meth:`receive`. Keep ``tensors`` unchanged until then."""
        if self._closed:
            raise RuntimeError(f"client of {self.name} is closed")
        if self._sock is None:
            self._open()
        assert self._sock is not None
        self._update_link()
        try:
            seq, _ = _send(self._sock, [], kind, header, tensors, secret=self._secret, sender=self.sender,
                           recipient=self.name, reply_to=None, part_bytes=self.part_bytes, track=False)
        except zmq.Again:
            error = self._unavailable(f"(could not even queue the {kind!r} request)", self.timeout)
            self._reset(str(error))
            raise error from None
        self._pending[seq] = kind
        self._stats["sent"] += 1
        return seq

    def receive(self, request_id: int, timeout: float | None = None) -> Message:
        """The reply to ``request_id``; raises :class:`ServerUnavailable` after ``timeout`` seconds
        (default: the client's) and :class:`RemoteError` when the server's handler failed."""
        if request_id in self._ready:
            return self._finish(self._ready.pop(request_id))
        if request_id in self._lost:
            raise ServerUnavailable(f"request {request_id} to {self.name} at {self.address} was abandoned: "
                                    f"{self._lost.pop(request_id)}", name=self.name, address=self.address)
        kind = self._pending.get(request_id)
        if kind is None:
            raise KeyError(f"request id {request_id} was not sent by this client of {self.name}, or was received")
        timeout = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + timeout
        assert self._sock is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                if time.monotonic() < deadline:
                    continue
                self._stats["timeouts"] += 1
                error = self._unavailable(f"a {kind!r} request", time.monotonic() - start)
                self._reset(f"the connection was reset after an earlier timeout ({error})")
                raise error
            frames = self._sock.recv_multipart(copy=False)
            try:
                message = decode(frames, secret=self._secret, replay_guard=self._guard, recipient=self.sender)
            except BadMessage as bad:
                self._dropped[bad.reason] += 1
                log.warning("client of %s: dropped a reply (%s: %s)", self.name, bad.reason, bad.detail)
                continue
            rid = message.reply_to
            if sender_role(message.sender) != self.name or rid not in self._pending:
                self._dropped["unexpected"] += 1
                continue
            if message.part is not None:
                try:
                    message = self._assembly.add(message)
                except BadMessage as bad:
                    self._dropped[bad.reason] += 1
                    continue
                if message is None:
                    continue
            del self._pending[rid]
            self._stats["received"] += 1
            if rid == request_id:
                return self._finish(message)
            self._ready[rid] = message

    def _finish(self, message: Message) -> Message:
        if message.kind == "error":
            raise RemoteError(f"{self.name} at {self.address} failed to handle a "
                              f"{message.header.get('request_kind', '?')!r} request: {message.header.get('error')}")
        return message

    def request(self, kind: str, header: dict[str, Any] | None = None, tensors: Sequence[Any] = (), *,
                timeout: float | None = None) -> Message:
        """:meth:`send` then :meth:`receive`."""
        return self.receive(self.send(kind, header, tensors), timeout)

    @property
    def stats(self) -> dict[str, Any]:
        """A snapshot: ``sent``, ``received``, ``timeouts``, ``dropped``, ``dropped_by_reason``."""
        dropped = dict(self._dropped)
        return {"sent": self._stats["sent"], "received": self._stats["received"], "timeouts": self._stats["timeouts"],
                "dropped": sum(dropped.values()), "dropped_by_reason": dropped}

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet received."""
        return len(self._pending) + len(self._ready)

    def close(self) -> None:
        """Close the socket (idempotent); unanswered requests are abandoned."""
        if not self._closed:
            self._closed = True
            self._shut()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(name={self.name!r}, address={self.address!r})"
