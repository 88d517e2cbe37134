"""unbatch(): split batches back into elements."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


def test_inverts_batch():
    out = list(Dataset.range(5).batch(2).unbatch())
    assert out == [0, 1, 2, 3, 4] and all(isinstance(x, np.int64) for x in out)


def test_keeps_structure_and_strings():
    imgs = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    batch = (imgs, {"id": np.array([b"a", b"b", b"c"], dtype=object), "y": np.array([1.0, 2.0, 3.0])})
    out = list(Dataset.from_generator(lambda: iter([batch])).unbatch())
    assert len(out) == 3
    x, d = out[2]
    np.testing.assert_array_equal(x, imgs[2])
    assert type(out[2]) is tuple and list(d) == ["id", "y"]
    assert d["id"] == b"c" and type(d["id"]) is bytes and d["y"] == 3.0


def test_empty_batches_contribute_nothing():
    batches = [np.zeros((0, 2)), np.ones((2, 2)), np.zeros((0, 2))]
    out = list(Dataset.from_generator(lambda: iter(batches)).unbatch())
    assert [r.tolist() for r in out] == [[1.0, 1.0], [1.0, 1.0]]


def test_refuses_components_of_different_length():
    bad = Dataset.from_generator(lambda: iter([(np.zeros(2), np.zeros(3))]))
    with pytest.raises(ValueError, match=r"unbatch.*\(2,\), \(3,\)"):
        list(bad.unbatch())
    scalar = Dataset.from_generator(lambda: iter([5]))
    with pytest.raises(ValueError, match="unbatch needs every component to have a leading"):
        list(scalar.unbatch())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 20), size=st.integers(1, 6))
def test_batch_then_unbatch_is_identity(n, size):
    data = (np.arange(n * 2).reshape(n, 2), [f"s{i}" for i in range(n)]) if n else (np.zeros((0, 2)), [])
    ds = Dataset.from_tensor_slices(data) if n else Dataset.range(0)
    out = list(ds.batch(size).unbatch())
    assert len(out) == n
    for i, (row, s) in enumerate(out):
        assert row.tolist() == [2 * i, 2 * i + 1] and s == f"s{i}"


def test_resumes_inside_a_batch():
    assert_resumes(lambda: Dataset.range(10).batch(4).unbatch(), ks=[0, 1, 3, 4, 5, 9, 10])
    data = {"x": np.arange(14.0).reshape(7, 2), "name": [f"n{i}".encode() for i in range(7)]}
    assert_resumes(lambda: Dataset.from_tensor_slices(data).batch(3).unbatch(), ks=[0, 1, 2, 3, 5, 7])
