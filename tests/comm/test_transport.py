"""The ZeroMQ transport on 127.0.0.1: requests, pipelining, large tensors, garbage, dead servers, busy ports."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from conveyor.comm.framing import encode, next_seq, sender_id
from conveyor.comm.transport import (
    AddressInUseError,
    Client,
    Deferred,
    RemoteError,
    Server,
    ServerUnavailable,
    _password,
)
from conveyor.launch.ports import free_ports

KEY = b"job-secret-" * 3


def echo(message):
    """Replies with the request's header and tensors, doubled; a few kinds test the error paths."""
    if message.kind == "fail":
        raise RuntimeError("the handler broke")
    if message.kind == "bad-return":
        return 42
    header = {**message.header, "request": message.kind, "n": len(message.tensors)}
    return "echo", header, [t * 2 for t in message.tensors]


@pytest.fixture
def address():
    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.fixture
def server(address):
    with Server(address, KEY, echo, name="ps:0").start() as srv:
        yield srv


@pytest.fixture
def client(server):
    with Client(server.address, KEY, name="ps:0", timeout=5.0, sender="worker:0") as cli:
        yield cli


def wait_for(predicate, timeout=30.0):  # only a machine at a standstill waits this long
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


# ----------------------------------------------------------------------------------------- requests


def test_request_and_reply(server, client):
    tensors = [np.arange(10, dtype=np.float32), np.ones((3, 4), dtype=np.int64), np.zeros((), dtype=np.float16)]
    reply = client.request("push", {"step": 3, "names": ["a", "b"]}, tensors)
    assert reply.kind == "echo" and reply.header == {"step": 3, "names": ["a", "b"], "request": "push", "n": 3}
    for got, sent in zip(reply.tensors, tensors, strict=True):
        np.testing.assert_array_equal(got, sent * 2)
    assert reply.sender.startswith("ps:0#")
    wait_for(lambda: server.stats["replied"] == 1)  # counted just after the reply left: the client may be first
    assert server.stats["received"] == 1 and server.stats["replied"] == 1 and server.stats["dropped"] == 0


def test_torch_tensors_go_through():
    torch = pytest.importorskip("torch")
    port = free_ports(1)[0]
    with Server(f"127.0.0.1:{port}", KEY, lambda m: ("ok", {}, m.torch_tensors()), name="ps:0").start(), \
            Client(f"127.0.0.1:{port}", KEY, name="ps:0", timeout=5) as client:
        sent = [torch.randn(5, 3).to(torch.bfloat16), torch.arange(4)]
        got = client.request("push", {}, sent).torch_tensors()
        assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True)) and got[0].dtype == torch.bfloat16


def test_pipelined_requests_to_several_servers():
    ports = free_ports(2)
    servers = [Server(f"127.0.0.1:{p}", KEY, echo, name=f"ps:{i}").start() for i, p in enumerate(ports)]
    clients = [Client(f"127.0.0.1:{p}", KEY, name=f"ps:{i}", timeout=5) for i, p in enumerate(ports)]
    try:
        ids = [[c.send("push", {"i": i, "j": j}, [np.full(4, j, dtype=np.float32)]) for j in range(3)]
               for i, c in enumerate(clients)]
        assert all(c.in_flight == 3 for c in clients)
        for i, c in reversed(list(enumerate(clients))):  # received in another order than sent
            for j in reversed(range(3)):
                reply = c.receive(ids[i][j])
                assert reply.header["i"] == i and reply.header["j"] == j and reply.tensors[0].tolist() == [2 * j] * 4
        assert all(c.in_flight == 0 for c in clients)
        with pytest.raises(KeyError):
            clients[0].receive(ids[0][0])  # already received
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


def test_large_requests_and_replies_travel_in_parts(address):
    with Server(address, KEY, echo, name="ps:0", part_bytes=1000).start() as server, \
            Client(address, KEY, name="ps:0", timeout=5, part_bytes=1000) as client:
        tensors = [np.full(100 + i, i, dtype=np.float64) for i in range(12)]  # ~850 bytes each: 12 parts
        reply = client.request("push", {"step": 1}, tensors)
        assert reply.header == {"step": 1, "request": "push", "n": 12} and reply.part is None
        for i, got in enumerate(reply.tensors):
            assert got.shape == (100 + i,) and (got == 2 * i).all()
        wait_for(lambda: server.stats["replied"] == 1)  # counted just after the last part left
        assert server.stats["received"] == 12


def test_a_64_mb_tensor_round_trip(server, client):
    big = np.random.default_rng(0).standard_normal(16 * 2**20, dtype=np.float32)  # 64 MB
    reply = client.request("push", {}, [big])
    assert reply.tensors[0].nbytes == big.nbytes
    np.testing.assert_array_equal(reply.tensors[0], big * 2)


def test_handler_errors_become_remote_errors_and_the_server_goes_on(server, client, caplog):
    with caplog.at_level(logging.CRITICAL, logger="conveyor.comm.transport"):
        with pytest.raises(RemoteError, match=r"ps:0 at .* 'fail' request: RuntimeError: the handler broke"):
            client.request("fail")
        with pytest.raises(RemoteError, match="expected \\(kind, header, tensors\\)"):
            client.request("bad-return")
    assert client.request("push", {"ok": True}).header["ok"] is True
    assert server.stats["handler_errors"] == 2


def test_a_handler_that_copies_on_write_while_lending_never_changes_a_reply_on_its_way(address):
    params = np.zeros(4 * 2**20, dtype=np.float32)  # 16 MB, sent without a copy

    def handler(message):
        nonlocal params
        if message.kind == "pull":
            return "params", {}, [params]
        if server.lending:  # the pull's reply may still be on its way: write into new memory
            params = params.copy()
        np.add(params, 1, out=params)  # an update right after a pull: must not reach the pull's reply
        return "ok", {}, []

    with Server(address, KEY, handler, name="ps:0").start() as server, \
            Client(address, KEY, name="ps:0", timeout=5) as client:
        for step in range(3):
            pull, push = client.send("pull"), client.send("push")
            assert (client.receive(pull).tensors[0] == step).all()
            client.receive(push)
        assert server.stats["dropped"] == 0 and client.stats["dropped"] == 0


def test_a_handler_may_answer_later_from_another_call_or_from_the_tick(address):
    held: list[tuple[Deferred, str, float]] = []  # only the serving thread touches it

    def handler(message):
        if message.kind == "hold":
            held.append((Deferred(), message.header["until"], time.monotonic()))
            return held[-1][0]
        for entry in [e for e in held if e[1] == "release"]:
            server.reply(entry[0], ("released", {}, [np.arange(3)]))
            held.remove(entry)
        return "ok", {}, []

    def tick():
        for entry in [e for e in held if e[1] == "tick" and time.monotonic() - e[2] >= 0.2]:
            server.reply(entry[0], ("late", {}, []))
            held.remove(entry)

    with Server(address, KEY, handler, name="ps:0", tick=tick).start() as server, \
            Client(address, KEY, name="ps:0", timeout=10) as client:
        started = time.monotonic()
        by_tick, by_call = client.send("hold", {"until": "tick"}), client.send("hold", {"until": "release"})
        assert client.request("release").kind == "ok"
        reply = client.receive(by_call)
        assert reply.kind == "released" and (reply.tensors[0] == np.arange(3)).all()
        assert client.receive(by_tick).kind == "late" and time.monotonic() - started >= 0.2
        unbound = Deferred()  # no handler returned it: there is nothing to answer
        with pytest.raises(RuntimeError, match="already answered"):
            server.reply(unbound, ("x", {}, []))
        wait_for(lambda: server.stats["replied"] == 3)  # counted just after the send


def test_the_handler_may_close_the_server(address):
    def handler(message):
        server.close()  # takes effect when the loop returns, after this reply
        return "bye", {}, []

    server = Server(address, KEY, handler, name="ps:0").start()
    with Client(address, KEY, name="ps:0", timeout=5) as client:
        assert client.request("shutdown").kind == "bye"
    assert server._done.wait(3)  # the serving thread closed the socket on its way out
    Server(address, KEY, echo, name="ps:0").close()  # and the port is free again


def test_serve_forever_in_the_callers_thread_until_the_handler_stops_it(address):
    def handler(message):
        if message.kind == "shutdown":
            server.stop()
        return "bye", {}, []

    server = Server(address, KEY, handler, name="ps:0")
    with Client(address, KEY, name="ps:0", timeout=5) as client:
        thread = threading.Thread(target=lambda: client.request("shutdown"))
        thread.start()
        server.serve_forever()  # returns once the handler has asked it to
        thread.join(5)
    server.close()


# ----------------------------------------------------------------------------------------- garbage


def raw_socket(kind, address, *, password=None, routing_id=None):
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if password is not None:
        sock.plain_username = b"conveyor"
        sock.plain_password = password
    if routing_id is not None:
        sock.routing_id = routing_id
    sock.connect(f"tcp://{address}")
    return sock


def offer(sock, frames: list[bytes]) -> None:
    """Send from a peer the server refuses, for at most 5 s: once its handshake has failed, a DEALER or REQ has no
    connection to queue on and a plain send would block for ever (seen on a loaded machine)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        sock.sndtimeo = 5000
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            pass  # refused before it could send: what the test wants of the server either way


def test_garbage_and_forgeries_are_dropped_and_counted_and_serving_goes_on(server, client, caplog, monkeypatch):
    address = server.address
    host, port = address.split(":")
    identities = []
    serve_one = server._serve_one
    monkeypatch.setattr(server, "_serve_one", lambda frames: (identities.append(frames[0].bytes), serve_one(frames)))
    assert client.request("push", {"before": True}).header["before"] is True
    generated = int.from_bytes(identities[0][1:], "big")  # ROUTER ids: b"\0" + a counter, the next ones predictable
    caplog.set_level(logging.ERROR, logger="conveyor.comm.transport")

    # Peers that cannot authenticate: plain TCP with random bytes, ZMTP 1.0, a huge ZMTP 1.0 frame,
    # ZeroMQ sockets without the job's password (DEALER, REQ, STREAM), one with another job's password.
    for payload in (os.urandom(64), os.urandom(100_000), b"\x01\x00\x05\x00hell",
                    b"\xff" + (2**62).to_bytes(8, "big") + b"\x00" + os.urandom(100), b""):
        with socket.create_connection((host, int(port))) as tcp:
            tcp.sendall(payload)
    anonymous = [raw_socket(zmq.DEALER, address), raw_socket(zmq.REQ, address), raw_socket(zmq.STREAM, address),
                 raw_socket(zmq.DEALER, address, password=_password(b"another job"))]
    offer(anonymous[0], [b"garbage", os.urandom(50)])
    offer(anonymous[1], [b"garbage"])
    offer(anonymous[3], [b"garbage"])
    # The libzmq routing-id crash: claim the ids the ROUTER generates next; on a clash libzmq aborts the process.
    claimers = [raw_socket(zmq.DEALER, address, routing_id=b"\x00" + (generated + i).to_bytes(4, "big"))
                for i in range(1, 4)]
    for claimer in claimers:
        offer(claimer, [b"claim"])

    # Peers that know the connection password (say, someone who sniffed it) but not the secret.
    insider = raw_socket(zmq.DEALER, address, password=_password(KEY))
    insider.send_multipart([b"garbage", b"frames", os.urandom(40)])
    insider.send_multipart([os.urandom(32)])
    insider.send_multipart(encode("push", {}, [np.ones(3)], secret=b"forged", sender="worker:9#x", seq=1,
                                  recipient="ps:0"))
    # A captured genuine request, sent again: applied once, the copy is dropped.
    genuine = encode("push", {"captured": True}, [np.ones(3)], secret=KEY, sender=sender_id("worker:7"),
                     seq=next_seq(), recipient="ps:0")
    insider.send_multipart(genuine)
    insider.send_multipart(genuine)
    # A genuine request for another ps task.
    insider.send_multipart(encode("push", {}, secret=KEY, sender=sender_id("worker:7"), seq=next_seq(),
                                  recipient="ps:1"))

    def counts():
        return server.stats["dropped_by_reason"]

    wait_for(lambda: counts().get("signature", 0) >= 2 and counts().get("replay", 0) >= 1
             and counts().get("recipient", 0) >= 1 and counts().get("frame_count", 0) >= 1
             and counts().get("handshake", 0) >= 8)
    assert server.stats["replied"] == 2  # the first request and the captured one, once
    assert client.request("push", {"after": True}, [np.ones(2)]).header["after"] is True
    for sock in [*anonymous, *claimers, insider]:
        sock.close(linger=0)
    for _ in range(3):  # new peers get the generated ids that were claimed
        with Client(address, KEY, name="ps:0", timeout=5) as late:
            assert late.request("push", {"late": True}).header["late"] is True


def test_a_client_with_another_secret_is_refused_and_told_why(server):
    with Client(server.address, b"another job", name="ps:0", timeout=1.0) as stranger:
        with pytest.raises(ServerUnavailable, match="job secret"):
            stranger.request("push")
    assert server.stats["dropped_by_reason"].get("handshake", 0) >= 1


# ----------------------------------------------------------------------------------------- failures


def test_a_server_that_never_started_is_unavailable_within_the_timeout():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    with Client(address, KEY, name="ps:3", timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable) as info:
            client.request("pull")
        assert time.monotonic() - start < 1.5
    error = info.value
    assert (error.name, error.address) == ("ps:3", address)
    assert f"ps:3 at {address}" in str(error) and "not running" in str(error) and "cluster spec" in str(error)


def test_a_server_that_dies_is_unavailable_and_the_client_recovers_when_it_is_back(address):
    server = Server(address, KEY, echo, name="ps:1").start()
    with Client(address, KEY, name="ps:1", timeout=0.5) as client:
        assert client.request("push").kind == "echo"
        pending = client.send("push", {"n": 1})
        server.close()
        other = client.send("push", {"n": 2})
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match=f"ps:1 at {address} did not answer"):
            client.receive(other)
        assert time.monotonic() - start < 1.5
        with pytest.raises(ServerUnavailable, match="abandoned"):
            client.receive(pending)  # the reset dropped it: it can never be answered now
        with Server(address, KEY, echo, name="ps:1").start():
            assert client.request("push", {"back": True}, timeout=5).header["back"] is True
        assert client.stats["timeouts"] == 1


def test_a_port_in_use_is_a_clear_error(address):
    with Server(address, KEY, echo, name="ps:0"):
        with pytest.raises(AddressInUseError, match=rf"ps:1 cannot listen on {address}: port \d+ is already in use"):
            Server(address, KEY, echo, name="ps:1")


def test_an_address_of_another_machine_is_a_clear_error():
    with pytest.raises(AddressInUseError, match="not on this machine"):
        Server(f"192.0.2.1:{free_ports(1)[0]}", KEY, echo, name="ps:0")  # TEST-NET-1, never local


def test_the_server_binds_only_its_own_address(address):
    port = int(address.split(":")[1])
    with Server(address, KEY, echo, name="ps:0"):
        with socket.socket() as other:  # the same port on another loopback address is still free
            other.bind(("127.0.0.2", port))


def test_bad_arguments_are_refused_without_echoing_the_secret(address):
    with pytest.raises(ValueError, match="secret must be non-empty bytes") as info:
        Client(address, "text-secret", name="ps:0")  # type: ignore[arg-type]
    assert "text-secret" not in str(info.value)
    with pytest.raises(ValueError, match="address"):
        Server("no-port", KEY, echo, name="ps:0")
    with pytest.raises(ValueError, match="timeout"):
        Client(address, KEY, name="ps:0", timeout=0)
