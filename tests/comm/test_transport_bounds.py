"""Split messages that never complete: a server abandons them after a timeout and within a total bound.

(The bound on connections before authentication is tested with a ps task: tests/strategies/test_ps_hardening.py.)

A peer with the job secret sends the first part of a split request and never the rest; without a bound
the server keeps every such part forever. Driven with a raw DEALER on 127.0.0.1 and a patched clock
(no long sleeps).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from conveyor.comm import transport
from conveyor.comm.framing import encode, next_seq, sender_id
from conveyor.comm.transport import Server, _password
from conveyor.launch.ports import free_ports

KEY = b"job-secret-" * 3


def _first_part(sock: zmq.Socket, nbytes: int, count: int = 2) -> None:
    """Part 0 of a ``count``-part request carrying ``nbytes`` of tensor; the other parts never follow."""
    seq = next_seq()
    frames = encode("push", {}, [np.zeros(nbytes, np.uint8)], secret=KEY, sender=sender_id("worker:0"), seq=seq,
                    recipient="ps:0", part=(0, count, seq))
    sock.send_multipart([bytes(memoryview(f)) for f in frames])


@pytest.fixture
def attacker_and_server():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = Server(address, KEY, lambda m: ("ok", {}, []), name="ps:0", max_assembly_bytes=3 << 20,
                    part_timeout=30.0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.plain_username, sock.plain_password = b"conveyor", _password(KEY)
    sock.connect(f"tcp://{address}")
    yield sock, server
    sock.close(linger=0)
    server.close()


def _received(server: Server, sock: zmq.Socket, n: int) -> None:
    """Serve exactly ``n`` messages from the raw socket in this thread (no serving thread: no races)."""
    for _ in range(n):
        assert server._sock.poll(30_000), "the server received nothing within 30 s"
        server._serve_one(server._sock.recv_multipart(copy=False))


@pytest.mark.timeout(60)
def test_an_incomplete_split_message_is_abandoned_after_the_part_timeout(attacker_and_server, monkeypatch) -> None:
    sock, server = attacker_and_server
    _first_part(sock, 1 << 20)
    _received(server, sock, 1)
    assembly = server.assembly
    assert assembly.nbytes == 1 << 20  # held while the rest may still come
    now = time.monotonic()
    monkeypatch.setattr(transport.time, "monotonic", lambda: now + 31.0)
    assembly.expire(transport.time.monotonic())  # what the serving loop does on every poll
    assert assembly.nbytes == 0 and server.stats["dropped_by_reason"] == {"part": 1}


@pytest.mark.timeout(60)
def test_incomplete_split_messages_are_bounded_in_total_bytes(attacker_and_server) -> None:
    sock, server = attacker_and_server
    for _ in range(10):  # 10 MiB of first parts against a 3 MiB bound
        _first_part(sock, 1 << 20)
    _received(server, sock, 10)
    assembly = server.assembly
    assert assembly.nbytes <= 3 << 20
    assert server.stats["dropped_by_reason"]["part"] >= 7  # the oldest were abandoned, and counted
    _first_part(sock, 4 << 20)  # one alone over the bound: refused, not kept
    _received(server, sock, 1)
    assert assembly.nbytes <= 3 << 20

