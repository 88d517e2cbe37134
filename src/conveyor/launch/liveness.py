"""Whether the other machines' launchers are still there: heartbeats through the rendezvous store.

    heart = Heartbeat(twin, hosts=["host0 (10.0.0.1)", "host1 (10.0.0.2)"], timeout=300.0)
    heart.start()          # after the rendezvous; twin: a StorePeers on a connection of its own
    heart.stop()           # before leaving the job

Every launcher but node 0's writes a signed, growing beat count to the store every ``interval`` seconds,
from a thread of its own on a connection of its own: the run loop may be busy stopping tasks or pausing
between attempts. Node 0's thread reads the beats; a node that has not beaten for ``timeout`` seconds,
and has not left, is lost (its machine died, or is cut off): node 0 writes the job's abort record naming
it, and every launcher stops its tasks and fails (a job of fixed size cannot go on without one of its
machines; an elastic job's coordinator reads the beats itself and goes on: ``launch/elastic.py``). A
lost node 0 takes the store with it, which every other launcher's next call to it reports. Why:
docs/launcher.md, "Process groups and rendezvous".

An elastic job adds a *lifeline* (:class:`Lifelines`, :func:`lifeline`): each member launcher keeps one TCP
connection to node 0 open for its whole life, introduced by a line signed with the job secret. When the
launcher's process dies (killed, crashed, its pod deleted) its kernel closes the connection, and node 0 knows
at once instead of after the node timeout; a launcher that leaves says ``bye`` first. A machine that loses power
or its link closes nothing: the heartbeat still finds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from conveyor.errors import PeerError

__all__ = ["BYE", "Heartbeat", "Lifelines", "beat_interval", "lifeline"]

BYE = b"bye\n"  # a member leaving on purpose: its closed lifeline is no loss
_HELLO_BYTES = 200
_HELLO_SECONDS = 5.0


class BeatStore(Protocol):
    """What the heartbeat needs of the store (``rendezvous.StorePeers`` on its own connection)."""

    node_rank: int
    nnodes: int

    def beat(self, count: int) -> None: ...

    def beat_of(self, node: int) -> int | None: ...

    def has_left(self, node: int) -> bool: ...

    def abort(self, description: str) -> None: ...

    def release(self) -> None: ...


def beat_interval(timeout: float) -> float:
    """Seconds between beats: a tenth of the time a silent node has before it counts as lost, at most 1 s."""
    return max(0.05, min(1.0, timeout / 10))


class Heartbeat:
    """The heartbeat thread of one launcher; see the module docstring. ``hosts[r]`` names node ``r``."""

    def __init__(self, store: BeatStore, *, hosts: Sequence[str], timeout: float) -> None:
        self._store = store
        self._hosts = list(hosts)
        self.timeout = timeout
        self.interval = beat_interval(timeout)
        self.lost: set[int] = set()  # nodes node 0 declared lost: nobody waits for them to leave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread and close its connection (before the store itself goes: see StorePeers.close)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5.0)
        self._store.release()

    def _run(self) -> None:
        try:
            if self._store.node_rank == 0:
                self._watch()
            else:
                count = 0
                while True:
                    self._store.beat(count)
                    count += 1
                    if self._stop.wait(self.interval):
                        return
        except PeerError:
            return  # the store is gone: the run loop's own next call says so

    def _watch(self) -> None:
        others = range(1, self._store.nnodes)
        now = time.monotonic()
        last = {r: -1 for r in others}
        heard = {r: now for r in others}  # the rendezvous just ended: every node was there
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for r in others:
                beat = self._store.beat_of(r)
                if beat is not None and beat > last[r]:  # a replayed older beat proves nothing
                    last[r], heard[r] = beat, now
            silent = [r for r in others if now - heard[r] > self.timeout and not self._store.has_left(r)]
            if silent:
                self.lost.update(silent)
                self._store.abort(self._describe(silent, now - min(heard[r] for r in silent)))
                return

    def _describe(self, silent: list[int], seconds: float) -> str:
        nodes = ", ".join(f"node {r} ({self._hosts[r]})" for r in silent)
        return (f"lost {nodes}: no heartbeat from its launcher for {seconds:.0f} s (--timeout {self.timeout:g}); "
                f"the machine is down or cut off from the rendezvous host, and the job cannot go on without it, so "
                f"every node stops. Start the job again on every node once the machine is back")


def _hello(secret: bytes, run: str, member: int) -> bytes:
    mac = hmac.new(secret, f"conveyor lifeline\0{run}\0{member}".encode(), hashlib.sha256).hexdigest()
    return f"{member} {mac}\n".encode()


def lifeline(address: str, port: int, *, secret: bytes, run: str, member: int, timeout: float) -> socket.socket | None:
    """A member's end: connected and introduced, kept open until the launcher leaves (then ``BYE``, close).
    None when node 0 cannot be reached this way: the heartbeat alone then finds this node's loss."""
    try:
        conn = socket.create_connection((address, port), timeout=timeout)
        conn.sendall(_hello(secret, run, member))
    except OSError:
        return None
    return conn


def farewell(conn: socket.socket | None) -> None:
    """Leave on purpose: node 0 reads ``BYE`` before the close and counts no loss."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.sendall(BYE)
        conn.close()


class Lifelines:
    """Node 0's end of the members' lifelines (module docstring), polled from the coordinator's thread.

    :meth:`poll` accepts new connections, reads their introductions (a member id signed with the job secret;
    the first one per id counts, anything else is dropped) and returns the members whose connection closed
    without ``BYE`` since the last call. Nothing blocks: every socket is non-blocking.
    """

    def __init__(self, address: str, *, secret: bytes, run: str) -> None:
        self._secret, self._run = secret, run
        self._server = socket.create_server((address, 0))
        self._server.setblocking(False)
        self.port: int = self._server.getsockname()[1]
        self._new: dict[socket.socket, tuple[bytes, float]] = {}  # not introduced yet: what came, and until when
        self._members: dict[socket.socket, tuple[int, bytes]] = {}  # introduced: its id, what it said since
        self._known: set[int] = set()

    def poll(self) -> set[int]:
        self._accept()
        ready = self._readable([*self._new, *self._members])
        gone: set[int] = set()
        for conn in ready:
            data = self._recv(conn)
            if data is None:
                continue
            if conn in self._new:
                self._introduce(conn, data)
            elif data:
                member, said = self._members[conn]
                self._members[conn] = (member, (said + data)[-len(BYE):])
            else:  # closed: by the member's kernel (its launcher died) unless it said bye first
                member, said = self._members.pop(conn)
                conn.close()
                if not said.endswith(BYE):
                    gone.add(member)
        now = time.monotonic()
        for conn in [c for c, (_, until) in self._new.items() if now > until]:
            del self._new[conn]  # never introduced itself
            conn.close()
        return gone

    def close(self) -> None:
        for conn in [self._server, *self._new, *self._members]:
            conn.close()
        self._new.clear()
        self._members.clear()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # none waiting (BlockingIOError), or the socket closed
                return
            conn.setblocking(False)
            self._new[conn] = (b"", time.monotonic() + _HELLO_SECONDS)

    @staticmethod
    def _readable(conns: list[socket.socket]) -> list[socket.socket]:
        if not conns:
            return []
        try:
            return select.select(conns, [], [], 0)[0]
        except (OSError, ValueError):
            return []

    @staticmethod
    def _recv(conn: socket.socket) -> bytes | None:
        try:
            return conn.recv(_HELLO_BYTES)
        except (BlockingIOError, InterruptedError):
            return None  # nothing after all
        except OSError:
            return b""  # reset: as closed

    def _introduce(self, conn: socket.socket, data: bytes) -> None:
        got, until = self._new.pop(conn)
        got += data
        line, newline, rest = got.partition(b"\n")
        if not data or len(line) > _HELLO_BYTES:
            conn.close()
            return
        if not newline:
            self._new[conn] = (got, until)
            return
        member_text = line.split(b" ", 1)[0].decode("ascii", "replace")
        member = int(member_text) if member_text.isdigit() else -1
        expected = _hello(self._secret, self._run, member)
        if member < 1 or member in self._known or not hmac.compare_digest(line + b"\n", expected):
            conn.close()  # unsigned, another job's, or a second introduction of one member (a replay)
            return
        self._known.add(member)
        self._members[conn] = (member, rest[-len(BYE):])  # (a bye may come with the introduction)
