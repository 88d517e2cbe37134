"""The ps message classes: every one survives the wire unchanged, keeps the header keys workers and servers
have always exchanged, and every malformed field is refused with one error naming the message and the field."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.comm.framing import decode, encode
from conveyor.strategies.ps.packing import PACK_BYTES
from conveyor.strategies.ps.protocol import (
    MAX_POSITION_BYTES,
    REQUESTS,
    Commit,
    CommitReply,
    Done,
    Init,
    InitReply,
    LoadState,
    OkReply,
    ParamsReply,
    Ping,
    Position,
    Positions,
    PositionsReply,
    ProtocolError,
    Pull,
    Push,
    Refused,
    Rejoin,
    RejoinReply,
    Restore,
    Save,
    SaveReply,
    State,
    StateReply,
    Stats,
    StatsReply,
    WaitReply,
    read_reply,
    read_request,
)

SECRET = b"ps-protocol-test-secret"
WORKERS = 4

wholes = st.integers(0, 2**40)
ranks = st.integers(0, WORKERS - 1)
keys = st.lists(st.text(min_size=1, max_size=12), max_size=4, unique=True)
positions = st.binary(max_size=64)


def _wire(message):
    """``message`` through the real framing (signed, then decoded) and back into its class."""
    kind, header, tensors = message.encode()
    frames = encode(kind, header, tensors, secret=SECRET, sender="worker:0#00", seq=1)
    received = decode([bytes(f) for f in frames], secret=SECRET, replay_guard=None)
    cls = type(message)
    return cls.from_header(received.header, received.torch_tensors(), num_workers=WORKERS)


def _same(a, b) -> None:
    assert type(a) is type(b) and a.to_header() == b.to_header()
    ta, tb = a.tensors(), b.tensors()
    assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def _values(names):
    return [torch.arange(len(n) + 1, dtype=torch.float32) * 0.5 for n in names]


@st.composite
def messages(draw):
    pieces = draw(keys)
    choices = [
        Init("fp", draw(ranks)),
        Init(draw(st.text(max_size=20)), draw(ranks), '{"spec": 1}', pieces, _values(pieces)),
        Push(draw(ranks), draw(wholes), draw(wholes), pieces, _values(pieces)),
        Commit(draw(ranks), draw(wholes), draw(wholes), draw(st.none() | st.just([{"lr": 0.1}, {}])),
               draw(st.none() | wholes)),
        Pull(draw(ranks), draw(wholes)),
        Stats(draw(st.none() | ranks)), State(draw(st.none() | ranks)), Positions(draw(ranks)), Done(draw(ranks)),
        Ping(),
        LoadState(draw(ranks), {"format": "x"}, dict(zip(pieces, _values(pieces), strict=True))),
        Save(draw(ranks), draw(wholes), draw(st.text(max_size=30))),
        Restore(draw(ranks), draw(wholes), draw(st.text(max_size=30))),
        Position(draw(ranks), draw(positions)),
        Commit(draw(ranks), draw(wholes), draw(wholes), None, None, draw(positions)),
        Rejoin(draw(ranks)), RejoinReply(draw(wholes), draw(st.none() | positions)),
        OkReply(), WaitReply(draw(st.none() | wholes)), InitReply(draw(wholes)),
        CommitReply(draw(wholes), draw(wholes), draw(st.none() | wholes)),
        SaveReply(pieces), ParamsReply(draw(wholes), pieces, _values(pieces)),
        StatsReply("ps:0", "sync", draw(wholes), [1, 2], {"0": 3, "12": 1}, {"pushes": 4}, 0, {"signature": 0}, 2),
        StateReply({"meta": [1]}, dict(zip(pieces, _values(pieces), strict=True))),
        PositionsReply(draw(st.dictionaries(ranks, positions, max_size=WORKERS))),
    ]
    return draw(st.sampled_from(choices))


@settings(max_examples=300, deadline=None)
@given(message=messages())
def test_every_message_survives_the_wire(message) -> None:
    _same(_wire(message), message)


def test_headers_keep_the_keys_workers_and_servers_always_exchanged() -> None:
    g = [torch.ones(2)]
    assert Init("fp", 1).to_header() == {"fingerprint": "fp", "rank": 1}
    assert Init("fp", 0, "{}", ["w[0:2]"], g).to_header() == {"fingerprint": "fp", "rank": 0, "spec": "{}",
                                                              "keys": ["w[0:2]"]}
    assert Push(1, 3, 2, ["w[0:2]"], g).encode() == ("push", {"rank": 1, "step": 3, "read": 2, "keys": ["w[0:2]"]}, g)
    assert Commit(0, 3, 2).encode() == ("commit", {"rank": 0, "step": 3, "read": 2, "hyper": None, "plan": None}, [])
    assert Pull(0, 3).encode() == ("pull", {"rank": 0, "step": 3}, [])
    assert Save(0, 7, "/c").encode() == ("save", {"rank": 0, "step": 7, "root": "/c"}, [])
    assert Restore(0, 7, "/c").encode() == ("restore", {"rank": 0, "step": 7, "root": "/c"}, [])
    assert Stats(0).encode() == ("stats", {"rank": 0}, []) and Ping().encode() == ("ping", {}, [])
    assert LoadState(0, {"m": 1}, {"a": g[0]}).encode() == ("load_state", {"rank": 0, "meta": {"m": 1},
                                                                          "names": ["a"]}, g)
    assert CommitReply(5, 9, None).encode() == ("ok", {"version": 5, "total": 9, "plan": None}, [])
    assert WaitReply().encode() == ("wait", {}, []) and WaitReply(3).encode() == ("wait", {"version": 3}, [])
    assert SaveReply(["ps-0.safetensors"]).encode() == ("ok", {"parts": ["ps-0.safetensors"]}, [])
    kind, header, tensors = PositionsReply({2: b"b", 0: b"a"}).encode()
    assert (kind, header) == ("positions", {"ranks": [0, 2]}) and [t.numpy().tobytes() for t in tensors] == [b"a", b"b"]


def test_a_commit_or_push_without_read_was_read_at_its_own_step() -> None:
    assert Commit.from_header({"rank": 0, "step": 3}).read == 3  # what older tests and tools send
    assert Push.from_header({"rank": 0, "step": 4, "keys": []}).read == 4


# -- refusals ---------------------------------------------------------------------------------------------------------

_VALID = {
    "init": ({"fingerprint": "fp", "rank": 0, "spec": "{}", "keys": ["a", "b"]}, 2),
    "push": ({"rank": 1, "step": 3, "read": 2, "keys": ["a"]}, 1),
    "commit": ({"rank": 1, "step": 3, "read": 2, "hyper": [{"lr": 0.1}], "plan": 10}, 0),
    "pull": ({"rank": 1, "step": 3}, 0),
    "load_state": ({"rank": 0, "meta": {}, "names": ["a"]}, 1),
    "save": ({"rank": 0, "step": 3, "root": "/c"}, 0),
    "restore": ({"rank": 0, "step": 3, "root": "/c"}, 0),
    "positions": ({"rank": 0}, 0),
    "rejoin": ({"rank": 0}, 0),
    "done": ({"rank": 0}, 0),
    "stats": ({"rank": 0}, 0),
    "state": ({"rank": 0}, 0),
}
_REQUIRED = {"init": ["fingerprint", "rank"], "push": ["rank", "step", "keys"], "commit": ["rank", "step"],
             "pull": ["rank", "step"], "load_state": ["rank", "meta", "names"], "save": ["rank", "step", "root"],
             "restore": ["rank", "step", "root"], "positions": ["rank"], "rejoin": ["rank"],
             "done": ["rank"]}
_BAD = {  # a value of the wrong type or range for each field
    "rank": [-1, WORKERS, True, "0", 1.0, [0]], "step": [-1, False, "3", 2.5], "read": [-2, "x", True],
    "plan": [-1, "10", True], "fingerprint": [7, ["fp"]], "spec": [{"a": 1}, 3], "keys": ["a", [1], [None], {}],
    "names": ["a", [3], ["a", "a"]], "meta": [[], "x"], "root": [3, ["/c"]], "hyper": [{"lr": 1}, [1], "x"],
}


def _tensors(n: int) -> list[torch.Tensor]:
    return [torch.zeros(1) for _ in range(n)]


def _refused(kind: str, header, tensors, field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        read_request(kind, header, tensors, num_workers=WORKERS)
    assert caught.value.field == field and kind in str(caught.value) and field in str(caught.value), caught.value


def test_the_valid_requests_are_read() -> None:
    for kind, (header, count) in _VALID.items():
        assert read_request(kind, header, _tensors(count), num_workers=WORKERS).KIND == kind
    position = read_request("position", {"rank": 1}, [torch.tensor([1, 2], dtype=torch.uint8)], num_workers=WORKERS)
    assert position.data == b"\x01\x02"


@pytest.mark.parametrize("kind", sorted(_VALID))
def test_every_malformed_field_is_refused_naming_the_kind_and_the_field(kind: str) -> None:
    header, count = _VALID[kind]
    for name in header:
        for bad in _BAD.get(name, []):
            _refused(kind, header | {name: bad}, _tensors(count), name)
    for name in _REQUIRED.get(kind, []):
        _refused(kind, {k: v for k, v in header.items() if k != name}, _tensors(count), name)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(sorted(_VALID)), data=st.data())
def test_any_value_of_the_wrong_type_is_refused(kind: str, data) -> None:
    header, count = _VALID[kind]
    name = data.draw(st.sampled_from(sorted(header)))
    kinds = {"rank": int, "step": int, "read": int, "plan": int, "fingerprint": str, "spec": str, "root": str,
             "keys": list, "names": list, "meta": dict, "hyper": list}[name]
    junk = st.one_of(st.booleans(), st.floats(), st.text(max_size=5), st.binary(max_size=5),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    bad = data.draw(junk.filter(lambda v: isinstance(v, bool) or not isinstance(v, kinds)))
    _refused(kind, header | {name: bad}, _tensors(count), name)


def test_pieces_and_tensors_must_match() -> None:
    _refused("init", _VALID["init"][0], _tensors(1), "keys")
    _refused("push", _VALID["push"][0], _tensors(3), "keys")
    _refused("load_state", _VALID["load_state"][0], [], "names")
    _refused("pull", _VALID["pull"][0], _tensors(1), "tensors")  # a request that carries none
    byte = torch.zeros(1, dtype=torch.uint8)
    for tensors in ([], [torch.zeros(2)], [torch.zeros((1, 2), dtype=torch.uint8)], [byte, byte]):
        _refused("position", {"rank": 0}, tensors, "tensors")
    with pytest.raises(ProtocolError, match="header is a list"):
        read_request("pull", [1, 2], [])


def test_many_small_pieces_travel_packed_and_come_back_one_per_key() -> None:
    keys = [f"p{i}[0:{i + 1}]" for i in range(65)]
    grads = [torch.arange(i + 1, dtype=torch.float32) for i in range(65)]
    _, header, frames = Push(0, 1, 1, keys, grads).encode()
    assert len(frames) == 1 and header["sizes"] == [g.numel() for g in grads]
    back = _wire(Push(0, 1, 1, keys, grads))
    assert back.keys == keys and all(torch.equal(a, b) for a, b in zip(back.grads, grads, strict=True))
    # another dtype and a piece over PACK_BYTES start frames of their own; a lone piece travels as it is
    big = torch.zeros(PACK_BYTES // 4 + 1)
    values = [torch.ones(2), torch.ones(2), torch.ones(3, dtype=torch.float64), big, torch.ones(1)]
    _, header, frames = ParamsReply(0, list("abcde"), values).encode()
    assert [f.numel() for f in frames] == [4, 3, big.numel(), 1] and torch.equal(frames[3], values[4])
    assert "sizes" not in Push(0, 1, 1, ["w"], [torch.ones(3)]).encode()[1]


def test_packed_pieces_must_fill_their_frames_exactly() -> None:
    header = {"rank": 0, "step": 1, "read": 1, "keys": ["a", "b"]}
    for sizes, frames in (([2, 2], [torch.zeros(3)]), ([2, 1], [torch.zeros(2), torch.zeros(2)]),
                          ([1, 2], [torch.zeros(2), torch.zeros(1)]), ([2, 0], [torch.zeros(2)]),
                          ([1], [torch.zeros(1)]), ([1, 1], [torch.zeros((1, 2))]), ([1, 1], []), ("2", [])):
        _refused("push", header | {"sizes": sizes}, frames, "sizes")


def test_an_unknown_kind_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ProtocolError, match="'fetch'.*not a ps request.*init, push") as caught:
        read_request("fetch", {}, [])
    assert caught.value.field == "kind" and set(REQUESTS) == {
        "init", "push", "commit", "pull", "stats", "state", "load_state", "save", "restore", "position",
        "positions", "rejoin", "meet", "ping", "done"}


def test_a_commit_carrying_a_data_position_over_the_bound_is_refused_naming_it() -> None:
    header = {"rank": 0, "step": 1, "read": 1}
    with pytest.raises(Refused, match="data position of .* bytes, over") as caught:
        read_request("commit", header, [torch.zeros(MAX_POSITION_BYTES + 1, dtype=torch.uint8)])
    assert caught.value.reason == "position_too_large"
    with pytest.raises(ProtocolError, match="tensors are not one 1-d uint8 tensor"):
        read_request("commit", header, [torch.zeros(3)])
    assert read_request("commit", header, [torch.tensor([123, 125], dtype=torch.uint8)]).position == b"{}"


class _Reply:
    def __init__(self, kind, header, tensors=()):
        self.kind, self.header, self._tensors = kind, header, list(tensors)

    def torch_tensors(self):
        return self._tensors


def test_replies_are_checked_and_an_unexpected_kind_is_named() -> None:
    assert read_reply(_Reply("ok", {"version": 2, "total": 5, "plan": None}), CommitReply, what="commit").total == 5
    assert isinstance(read_reply(_Reply("wait", {}), ParamsReply, WaitReply, what="pull"), WaitReply)
    with pytest.raises(RuntimeError, match="unexpected 'stats' reply to a pull request"):
        read_reply(_Reply("stats", {}), ParamsReply, WaitReply, what="pull")
    with pytest.raises(ProtocolError, match="'commit' reply message: total"):
        read_reply(_Reply("ok", {"version": 2, "total": -1}), CommitReply, what="commit")
    with pytest.raises(ProtocolError, match="'params' reply message: keys lists 1 pieces but the message carries 0"):
        read_reply(_Reply("params", {"version": 0, "keys": ["a"]}), ParamsReply, what="pull")
    with pytest.raises(ProtocolError, match="ranks"):
        read_reply(_Reply("positions", {"ranks": [WORKERS]}, [torch.zeros(1, dtype=torch.uint8)]), PositionsReply,
                   what="positions", num_workers=WORKERS)
    with pytest.raises(ProtocolError, match="staleness"):
        StatsReply.from_header(StatsReply("ps:0", "sync", 0, [0], {"x": 1}, {}, 0, {}, 0).to_header())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), [0.9, float("nan")]])
def test_a_commit_with_a_non_finite_hyperparameter_is_refused(bad) -> None:
    """Issue 22, defect 2: `lr = NaN` in a commit would turn every parameter of the server's shard into NaN."""
    with pytest.raises(ProtocolError, match=r"'commit'.*hyper.*group 1: betas = .*expected a finite number"):
        _wire(Commit(0, 3, 3, [{"lr": 0.1}, {"lr": 0.1, "betas": bad}]))  # through the real framing
    with pytest.raises(ProtocolError, match=r"group 0: lr = nan"):
        read_request("commit", {"rank": 0, "step": 3, "hyper": [{"lr": float("nan")}]}, [], num_workers=WORKERS)
    assert _wire(Commit(0, 3, 3, [{"lr": 0.1, "betas": [0.9, 0.99]}])).hyper == [{"lr": 0.1, "betas": [0.9, 0.99]}]
