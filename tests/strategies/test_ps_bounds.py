"""A ps task against a peer that holds the job secret but not the protocol: what it may make the server keep.

The server is driven directly (``handle`` with decoded messages, ``_answer_held`` as the tick), so the
bounds are checked by counts, not timings: pushes for steps or pieces that would never be applied,
commits that would poison a worker's clock, pushes naming more pieces than the server holds, and held
pulls (indexed by step: a tick touches only what it answers).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from conveyor.comm.framing import Message
from conveyor.comm.transport import Deferred
from conveyor.launch.ports import free_ports
from conveyor.strategies.ps import server as server_module
from conveyor.strategies.ps.optim import OptimizerSpec
from conveyor.strategies.ps.server import ParameterServer
from conveyor.strategies.ps.sharding import place

SECRET = b"ps-bounds-secret"


def _message(kind: str, header: dict, tensors=(), sender: str = "worker:0") -> Message:
    arrays = [t.numpy() for t in tensors]
    return Message(kind, header, arrays, sender, seq=1, ts=time.time(), dtypes=[str(a.dtype) for a in arrays])


@pytest.fixture
def make_server():
    made = []

    def make(mode: str, workers: int = 2, staleness: int = 0) -> tuple[ParameterServer, list[str]]:
        server = ParameterServer(f"127.0.0.1:{free_ports(1)[0]}", SECRET, index=0, num_workers=workers, mode=mode,
                                 staleness=staleness)
        made.append(server)
        model = nn.Linear(3, 2)
        placement = place([(n, p.shape, p.dtype) for n, p in model.named_parameters()], 1)
        spec = OptimizerSpec.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        keys = [p.key for p in placement.pieces]
        flat = {n: p.detach().reshape(-1) for n, p in model.named_parameters()}
        values = [flat[p.param][p.start:p.stop].clone() for p in placement.pieces]
        kind, _, _ = server.handle(_message("init", {"fingerprint": placement.fingerprint, "rank": 0,
                                                     "spec": spec.to_json(), "keys": keys}, values))
        assert kind == "ok"
        return server, keys

    yield make
    for server in made:
        server.close()


def _push(server: ParameterServer, keys: list[str], *, rank: int = 0, step: int = 0, numel: int | None = None):
    grads = [torch.ones(numel or server.opt.params.get(k, torch.ones(1)).numel()) for k in keys]
    return server.handle(_message("push", {"rank": rank, "step": step, "read": 0, "keys": keys}, grads,
                                  sender=f"worker:{rank}"))


def _commit(server: ParameterServer, *, rank: int = 0, step: int = 0):
    return server.handle(_message("commit", {"rank": rank, "step": step, "read": 0}, sender=f"worker:{rank}"))


# -- 1. pushes that would never be applied -------------------------------------------------------------------------


def test_a_push_for_a_step_far_ahead_is_refused_counted_and_not_kept(make_server) -> None:
    server, keys = make_server("sync")
    kind, header, _ = _push(server, keys, step=10**9)
    assert kind == "error" and "step" in header["error"] and "window" in header["error"]
    assert server.counters["refused_step_out_of_window"] == 1
    assert server.rule._grads == {}  # nothing kept for a step the sync rule would never reach
    assert _push(server, keys, step=0)[0] == "ok"  # the worker's next step is accepted


def test_a_push_for_a_step_already_committed_is_refused(make_server) -> None:
    server, keys = make_server("sync")
    assert _push(server, keys, step=0)[0] == "ok" and _commit(server, step=0)[0] == "ok"
    kind, header, _ = _push(server, keys, step=0)  # worker 0 committed step 0; step 0 is not applied yet
    assert kind == "error" and "window 1..2" in header["error"]
    assert server.counters["refused_step_out_of_window"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_push_naming_a_piece_the_server_does_not_hold_is_refused_and_counted(make_server, mode) -> None:
    server, keys = make_server(mode)
    kind, header, _ = _push(server, [keys[0], "no-such-piece[0:4]"], numel=1)
    assert kind == "error" and "does not hold" in header["error"] and "no-such-piece" in header["error"]
    kind, header, _ = _push(server, [keys[0], keys[0]])
    assert kind == "error" and "twice" in header["error"]
    assert server.counters["refused_unknown_pieces"] == 2 and server.counters["pushes"] == 0
    if mode == "sync":
        assert server.rule._grads == {}


# -- 3. a push naming more pieces than the server holds -------------------------------------------------------------


def test_a_push_naming_more_pieces_than_the_server_holds_is_refused_before_it_is_read(make_server,
                                                                                      monkeypatch) -> None:
    server, keys = make_server("async")
    unpacked = []
    monkeypatch.setattr("conveyor.strategies.ps.protocol.unpack", lambda *a: unpacked.append(a))
    many = [f"k{i}" for i in range(100_000)]
    header = {"rank": 0, "step": 0, "read": 0, "keys": many, "sizes": [1] * len(many)}
    kind, reply, _ = server.handle(_message("push", header, [torch.zeros(len(many))]))
    assert kind == "error" and "100000 pieces" in reply["error"] and f"holds {len(keys)}" in reply["error"]
    assert server.counters["refused_too_many_pieces"] == 1
    assert unpacked == []  # refused on the count alone: nothing was cut, copied or applied


# -- 4. commits that would poison a worker's clock ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_commit_outside_the_workers_window_is_refused_and_the_clock_is_unchanged(make_server, mode) -> None:
    server, _ = make_server(mode, staleness=1)
    for step in (2**64 - 1, 2):  # far ahead, and just past the window (clock 0, STEP_AHEAD 1)
        kind, header, _ = _commit(server, step=step)
        assert kind == "error" and f"is {step}, outside worker 0's window 0..1" in header["error"]
    assert server.clock == [0, 0] and server.version == 0
    assert _commit(server, step=0)[0] == "ok" and server.clock == [1, 0]
    kind, header, _ = _commit(server, step=0)  # again: already committed
    assert kind == "error" and "window 1..2" in header["error"]
    assert server.counters["refused_step_out_of_window"] == 3
    if mode == "sync":
        assert set(server.rule._commits) == {0}  # no slot kept for the refused steps


# -- 5. held pulls: indexed by step, bounded per peer ---------------------------------------------------------------


def _hold(server: ParameterServer, step: int, peer: bytes, hold: int = 2000):
    server.server._peer = peer  # what the transport sets while the handler runs
    try:
        result = server.handle(_message("pull", {"rank": 0, "step": step, "hold": hold}))
    finally:
        server.server._peer = None
    if isinstance(result, Deferred):
        result.bind(peer, _message("pull", {}))
    return result


def test_a_tick_with_many_held_pulls_none_ready_touches_one(make_server, monkeypatch) -> None:
    server, _ = make_server("sync", workers=1)
    monkeypatch.setattr(server_module, "MAX_HOLD_MS", 600_000)  # a slow machine cannot expire them
    if hasattr(server._held, "per_peer"):
        server._held.per_peer = server._held.total = 10_000
    answered = []
    monkeypatch.setattr(server.server, "reply", lambda deferred, result: answered.append(result[0]))
    asked = []
    ready = server.rule.ready
    monkeypatch.setattr(server.rule, "ready", lambda step: asked.append(step) or ready(step))
    for i in range(1000):
        assert isinstance(_hold(server, 5 + i % 50, b"peer-%d" % i, hold=600_000), Deferred)
    asked.clear()
    server._answer_held()  # the tick: nothing is ready (version 0), nothing expired
    assert len(asked) <= 1 and answered == []
    for step in range(4):  # version 4: still none ready (they wait for steps 5..54)
        _commit(server, step=step)
    assert answered == [] and len(server._held) == 1000
    asked.clear()
    _commit(server, step=4)  # version 5: the 20 pulls for step 5 are answered, the rest untouched
    assert answered == ["params"] * 20 and len(server._held) == 980 and len(asked) <= 2


def test_held_pulls_are_bounded_per_peer_and_in_total(make_server, monkeypatch) -> None:
    server, _ = make_server("sync", workers=1)
    per_peer, total = server._held.per_peer, server._held.total
    assert per_peer == server_module.MAX_HELD_PER_PEER and total == per_peer * 2
    monkeypatch.setattr(server.server, "reply", lambda deferred, result: None)
    held = [_hold(server, 3, b"one") for _ in range(per_peer + 1)]
    assert all(isinstance(h, Deferred) for h in held[:per_peer])
    assert held[-1][0] == "wait" and server.counters["pull_hold_refused"] == 1  # answered now: asks again
    others = [_hold(server, 3, b"peer-%d" % i) for i in range(total)]
    assert sum(isinstance(h, Deferred) for h in others) == total - per_peer
    assert len(server._held) == total


def test_held_pulls_that_run_out_of_time_are_answered_wait(make_server, monkeypatch) -> None:
    server, _ = make_server("sync", workers=1)
    answered = []
    monkeypatch.setattr(server.server, "reply", lambda deferred, result: answered.append(result[0]))
    _hold(server, 3, b"one", hold=1)
    _hold(server, 3, b"two", hold=60_000)
    now = time.monotonic()
    monkeypatch.setattr(server_module.time, "monotonic", lambda: now + 0.5)
    server._answer_held()
    assert answered == ["wait"] and len(server._held) == 1
    monkeypatch.setattr(server_module.time, "monotonic", lambda: now + 2.5)  # MAX_HOLD_MS caps any hold
    server._answer_held()
    assert answered == ["wait", "wait"] and len(server._held) == 0
