"""Element codecs: the JSON form (iterator state) and the binary form (between processes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conveyor.data import elements

leaves = st.one_of(
    st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=5),
    st.binary(max_size=8),
    hnp.arrays(st.sampled_from([np.float32, np.int64, np.uint8, np.bool_]), hnp.array_shapes(min_dims=0, max_dims=3)),
)
structures = st.recursive(
    leaves, lambda kids: st.one_of(st.tuples(kids, kids), st.lists(kids, max_size=3),
                                   st.dictionaries(st.text(min_size=1, max_size=3), kids, max_size=3)),
    max_leaves=8)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        return (type(a) is type(b) and a.dtype == b.dtype and np.shape(a) == np.shape(b)
                and np.array_equal(a, b, equal_nan=True))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None)
@given(structures)
def test_json_round_trip(x):
    assert same(elements.from_json(json.loads(json.dumps(elements.to_json(x)))), x)


@settings(max_examples=60, deadline=None)
@given(structures)
def test_binary_round_trip(x):
    assert same(elements.unpack(elements.pack_bytes(x)), x)


def test_numpy_scalars_stay_scalars():
    for x in (np.int64(3), np.float32(1.5)):
        assert same(elements.unpack(elements.pack_bytes(x)), x)
        assert same(elements.from_json(elements.to_json(x)), x)


def test_stack_keeps_structure_and_makes_string_columns():
    batch = elements.stack([{"a": np.ones(2) * i, "s": b"x%d" % i, "n": i} for i in range(3)])
    assert batch["a"].shape == (3, 2) and batch["n"].dtype == np.int64
    assert batch["s"].dtype == object and list(batch["s"]) == [b"x0", b"x1", b"x2"]
    assert [canon["n"] for canon in elements.unstack(batch)] == [0, 1, 2]


def test_stack_refuses_ragged_and_mixed_structures():
    with pytest.raises(ValueError, match="different shapes"):
        elements.stack([np.ones(2), np.ones(3)])
    with pytest.raises(ValueError, match="different structure"):
        elements.stack([(1, 2), (1, 2, 3)])


def test_unsupported_types_are_named():
    with pytest.raises(TypeError, match="set"):
        elements.to_json({1, 2})
