"""Parameter placement over ps tasks: exact coverage, balance, the huge-embedding split, JSON and the table.

    pytest tests/strategies/test_ps_sharding.py --durations=5
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conveyor.strategies.ps.sharding import (
    DEFAULT_CHUNK_BYTES,
    Piece,
    Placement,
    parse_piece_key,
    piece_key,
    place,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

shapes = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)
param_lists = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12).map(
    lambda items: [(f"layer{i}.w", shape, dtype) for i, (shape, dtype) in enumerate(items)])


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bert_base() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """BERT-base's parameter shapes (110 M parameters, 440 MB), without allocating them."""
    f = torch.float32
    params = [("embeddings.word", (30522, 768), f), ("embeddings.position", (512, 768), f),
              ("embeddings.type", (2, 768), f), ("embeddings.ln.w", (768,), f), ("embeddings.ln.b", (768,), f)]
    for i in range(12):
        for name in ("q", "k", "v", "o"):
            params += [(f"layer{i}.{name}.w", (768, 768), f), (f"layer{i}.{name}.b", (768,), f)]
        params += [(f"layer{i}.up.w", (3072, 768), f), (f"layer{i}.up.b", (3072,), f),
                   (f"layer{i}.down.w", (768, 3072), f), (f"layer{i}.down.b", (768,), f)]
        params += [(f"layer{i}.ln{j}.{k}", (768,), f) for j in (1, 2) for k in "wb"]
    return params + [("pooler.w", (768, 768), f), ("pooler.b", (768,), f)]


# -- invariants, for any list of parameters ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(params=param_lists, servers=st.integers(1, 6), chunk=st.integers(1, 600))
def test_every_element_in_exactly_one_piece(params, servers, chunk):
    placement = place(params, servers, chunk_bytes=chunk)
    for name, shape, _ in params:
        covered = torch.zeros(numel(shape), dtype=torch.int64)
        for piece in placement.pieces_of(name):
            covered[piece.start:piece.stop] += 1
            assert 0 <= piece.server < servers
        assert torch.all(covered == 1)
    assert sum(placement.bytes_per_server()) == sum(numel(s) * d.itemsize for _, s, d in params)
    assert sorted(placement.pieces, key=lambda p: p.server) == sorted(
        (p for s in range(servers) for p in placement.pieces_for(s)), key=lambda p: p.server)


@settings(max_examples=150, deadline=None)
@given(params=param_lists, servers=st.integers(1, 6), chunk=st.integers(1, 600))
def test_pieces_are_at_most_a_chunk_and_imbalance_at_most_the_largest_piece(params, servers, chunk):
    placement = place(params, servers, chunk_bytes=chunk)
    largest_item = max(d.itemsize for _, _, d in params)
    sizes = [placement.nbytes(p) for p in placement.pieces]
    assert max(sizes) <= max(chunk, largest_item)
    loads = placement.bytes_per_server()
    assert max(loads) - min(loads) <= max(sizes)  # the bound the module docstring guarantees


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40), servers=st.integers(1, 8),
       chunk=st.integers(64, 4096))
def test_ratio_bound_when_every_server_holds_five_pieces_worth(sizes, servers, chunk):
    params = [(f"p{i}", (n,), torch.float32) for i, n in enumerate(sizes)]
    placement = place(params, servers, chunk_bytes=chunk)
    largest = max(placement.nbytes(p) for p in placement.pieces)
    loads = placement.bytes_per_server()
    assume(sum(loads) / servers >= 5 * largest)  # true in most draws
    assert max(loads) / min(loads) <= 1.25


@settings(max_examples=80, deadline=None)
@given(params=param_lists, servers=st.integers(1, 5), chunk=st.integers(1, 300), data=st.data())
def test_split_join_round_trip(params, servers, chunk, data):
    placement = place(params, servers, chunk_bytes=chunk)
    name, shape, dtype = data.draw(st.sampled_from(params))
    tensor = torch.arange(numel(shape)).to(dtype).reshape(shape)
    parts = placement.split(name, tensor)
    assert [p for p, _ in parts] == placement.pieces_of(name)
    for piece, view in parts:
        assert view.numel() == piece.numel
        if view.numel():
            assert view.data_ptr() == tensor.data_ptr() + piece.start * tensor.element_size()  # a view, no copy
    as_list = placement.join(name, [(piece, view.clone()) for piece, view in reversed(parts)])
    as_dict = placement.join(name, {piece.key: view for piece, view in parts})
    assert torch.equal(as_list, tensor.reshape(-1)) and torch.equal(as_dict, tensor.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(params=param_lists, servers=st.integers(1, 5), chunk=st.integers(1, 300), seed=st.integers(0, 99))
def test_assignment_does_not_depend_on_list_order(params, servers, chunk, seed):
    shuffled = list(params)
    random.Random(seed).shuffle(shuffled)
    assert set(place(params, servers, chunk).pieces) == set(place(shuffled, servers, chunk).pieces)
    assert place(params, servers, chunk) == place(list(params), servers, chunk)  # and repeatable


# -- the cases the issue names ------------------------------------------------------------------------------------


def test_a_huge_embedding_is_spread_evenly_over_every_server():
    params = [("embed", (1_000_000, 64), torch.float32), ("head.w", (64, 1000), torch.float32),
              ("head.b", (1000,), torch.float32)]
    placement = place(params, 4)  # default 4 MiB chunks; the embedding is 256 MB
    pieces = placement.pieces_of("embed")
    assert {p.server for p in pieces} == {0, 1, 2, 3}
    assert all(placement.nbytes(p) <= DEFAULT_CHUNK_BYTES for p in pieces)
    share = [sum(placement.nbytes(p) for p in pieces if p.server == s) for s in range(4)]
    assert max(share) - min(share) <= 4  # equal shares, to within one element
    loads = placement.bytes_per_server()
    assert max(loads) / min(loads) <= 1.01


def test_an_embedding_just_over_one_chunk_still_reaches_every_server():
    placement = place([("embed", (DEFAULT_CHUNK_BYTES // 4 + 1,), torch.float32)], 3)
    assert {p.server for p in placement.pieces} == {0, 1, 2}


def test_bert_base_over_four_servers_is_balanced():
    placement = place(bert_base(), 4)
    loads = placement.bytes_per_server()
    assert max(loads) / min(loads) <= 1.25
    assert max(loads) - min(loads) <= DEFAULT_CHUNK_BYTES
    assert {p.server for p in placement.pieces_of("embeddings.word")} == {0, 1, 2, 3}
    assert all(len(placement.pieces_of(name)) == 1 for name, shape, _ in bert_base() if numel(shape) * 4 <= 2**22)


def test_small_parameters_go_whole_largest_first_to_the_least_loaded_server():
    params = [("c", (10,), torch.float32), ("a", (30,), torch.float32), ("b", (30,), torch.float32),
              ("d", (5,), torch.float32)]
    placement = place(params, 2, chunk_bytes=1000)
    # a (120 B) -> 0, b (120 B, tie with a broken by name) -> 1, c (40 B) -> 0 (tie: lowest index), d -> 1
    assert [(p.param, p.server) for p in placement.pieces] == [("c", 0), ("a", 0), ("b", 1), ("d", 1)]
    assert [p.numel for p in placement.pieces] == [10, 30, 30, 5]


def test_zero_element_and_scalar_parameters():
    placement = place([("empty", (0, 5), torch.float32), ("scalar", (), torch.float32)], 2)
    assert [p.key for p in placement.pieces] == ["empty[0:0]", "scalar[0:1]"]
    assert torch.equal(placement.join("scalar", placement.split("scalar", torch.tensor(3.0))), torch.tensor([3.0]))
    assert placement.join("empty", placement.split("empty", torch.zeros(0, 5))).shape == (0,)


def test_more_servers_than_pieces_leaves_some_idle_and_says_so():
    placement = place([("w", (3,), torch.float32)], 3)
    assert placement.bytes_per_server() == [12, 0, 0]
    assert placement.pieces_for(1) == []
    assert "ps:1, ps:2 hold(s) nothing" in placement.describe()


# -- JSON, fingerprint, text --------------------------------------------------------------------------------------


def test_json_round_trip_and_fingerprint():
    placement = place(bert_base(), 3)
    text = placement.to_json()
    again = Placement.from_json(text)
    assert again == placement and again.fingerprint == placement.fingerprint
    assert Placement.from_json(json.loads(text)) == placement
    assert len(placement.fingerprint) == 16
    assert place(bert_base(), 2).fingerprint != placement.fingerprint
    assert place(bert_base(), 3, chunk_bytes=2**21).fingerprint != placement.fingerprint
    placement.verify(again.fingerprint)
    with pytest.raises(ValueError, match="would update different elements"):
        placement.verify(place(bert_base(), 2).fingerprint, peer="ps:1")


def test_altered_json_is_refused():
    obj = place([("a", (100,), torch.float32), ("b", (7,), torch.float32)], 2, chunk_bytes=64).to_dict()
    moved = json.loads(json.dumps(obj))
    moved["pieces"][0][3] = 1 - moved["pieces"][0][3]
    with pytest.raises(ValueError, match="does not match its contents"):
        Placement.from_json(moved)
    gap = json.loads(json.dumps(obj))
    gap["pieces"][1][1] += 1
    with pytest.raises(ValueError, match="do not tile"):
        Placement.from_json(gap)
    with pytest.raises(ValueError, match="version"):
        Placement.from_json({**obj, "version": 99})


def test_describe_is_a_table_of_servers():
    placement = place([("embed", (1000, 64), torch.float32), ("fc.w", (64, 10), torch.float32),
                       ("fc.b", (10,), torch.float32)], 3, chunk_bytes=4096)
    text = placement.describe()
    lines = text.splitlines()
    assert lines[0].startswith(f"parameter placement {placement.fingerprint}: 3 parameters")
    assert f"in {len(placement.pieces)} pieces over 3 server(s), chunk 4.00 KiB" in lines[0]
    assert lines[1].split() == ["server", "pieces", "MiB", "largest", "piece"]
    for server in range(3):
        row = lines[2 + server].split()
        assert row[0] == f"ps:{server}" and int(row[1]) == len(placement.pieces_for(server))
        assert float(row[2]) == pytest.approx(placement.bytes_per_server()[server] / 2**20, abs=0.006)
        assert row[3].startswith("embed[")
    assert lines[-1].startswith("balance: max/min = 1.0")


# -- errors -------------------------------------------------------------------------------------------------------


def test_piece_keys():
    assert piece_key("enc.layers.0.w", 0, 4096) == "enc.layers.0.w[0:4096]"
    assert parse_piece_key("odd[name][3:7]") == ("odd[name]", 3, 7)
    assert Piece("w", 2, 5, 1).key == "w[2:5]" and Piece("w", 2, 5, 1).numel == 3
    with pytest.raises(ValueError, match="not a piece key"):
        parse_piece_key("w[3]")


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="listed twice"):
        place([("w", (2,), torch.float32), ("w", (3,), torch.float32)], 2)
    with pytest.raises(ValueError, match="num_servers = 0"):
        place([("w", (2,), torch.float32)], 0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        place([("w", (2,), torch.float32)], 1, chunk_bytes=0)
    with pytest.raises(ValueError, match="not a torch dtype"):
        place([("w", (2,), "float33")], 1)
    placement = place([("w", (6,), torch.float32), ("v", (2,), torch.float32)], 2, chunk_bytes=8)
    with pytest.raises(ValueError, match="the placement has shape"):
        placement.split("w", torch.zeros(5))
    with pytest.raises(KeyError, match="not a parameter"):
        placement.split("u", torch.zeros(5))
    parts = placement.split("w", torch.zeros(6))
    with pytest.raises(ValueError, match="missing piece"):
        placement.join("w", parts[1:])
    with pytest.raises(ValueError, match="given twice"):
        placement.join("w", parts + parts[:1])
    with pytest.raises(ValueError, match="is not a piece of 'w'"):
        placement.join("w", parts + placement.split("v", torch.zeros(2)))
