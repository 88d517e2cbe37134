"""batch(batch_size, drop_remainder): docs/tfdata-semantics.md §8."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.ops.batch import BatchNode
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


def test_tfdata_vectors():
    out = list(Dataset.range(8).batch(3))
    assert [b.tolist() for b in out] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert all(b.dtype == np.int64 for b in out)
    dropped = list(Dataset.range(8).batch(3, drop_remainder=True))
    assert [b.tolist() for b in dropped] == [[0, 1, 2], [3, 4, 5]]


def test_exact_multiple_and_empty_input():
    assert [b.tolist() for b in Dataset.range(6).batch(3, drop_remainder=True)] == [[0, 1, 2], [3, 4, 5]]
    assert list(Dataset.range(0).batch(3)) == []
    assert list(Dataset.range(2).batch(3, drop_remainder=True)) == []


def test_keeps_tuple_and_dict_structure():
    imgs = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    ds = Dataset.from_tensor_slices((imgs, {"label": [1, 2, 3, 4], "id": [b"a", b"b", b"c", b"d"]}))
    first, second = list(ds.batch(3))
    x, d = first
    assert type(first) is tuple and list(d) == ["label", "id"]
    assert x.shape == (3, 2, 3) and x.dtype == np.float32
    np.testing.assert_array_equal(x, imgs[:3])
    assert d["label"].tolist() == [1, 2, 3]
    assert d["id"].dtype == object and d["id"].tolist() == [b"a", b"b", b"c"]
    assert second[0].shape == (1, 2, 3) and second[1]["id"].tolist() == [b"d"]


def test_strings_become_object_arrays():
    (b,) = list(Dataset.from_tensor_slices(["x", "yz"]).batch(2))
    assert b.dtype == object and b.tolist() == ["x", "yz"]


def test_different_shapes_or_structures_are_refused():
    shapes = Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros(3)]))
    with pytest.raises(ValueError, match="different shapes"):
        list(shapes.batch(2))
    structures = Dataset.from_generator(lambda: iter([(1, 2), 3]))
    with pytest.raises(ValueError, match="different structure"):
        list(structures.batch(2))


@pytest.mark.parametrize("size", [0, -1, 2.0, True, None])
def test_bad_batch_size(size):
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).batch(size)


def test_attributes_read_by_the_optimizer():
    node = BatchNode(Dataset.range(3)._node, np.int64(4), 1)
    assert node.batch_size == 4 and type(node.batch_size) is int and node.drop_remainder is True
    assert node.params() == {"batch_size": 4, "drop_remainder": True}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), size=st.integers(1, 9), drop=st.booleans())
def test_batches_concatenate_to_the_input(n, size, drop):
    batches = [b.tolist() for b in Dataset.range(n).batch(size, drop_remainder=drop)]
    assert all(len(b) == size for b in batches[:-1])
    expected = list(range(n))
    if drop:
        assert all(len(b) == size for b in batches)
        expected = expected[: n - n % size]
    elif batches:
        assert len(batches[-1]) == (n % size or size)
    assert [x for b in batches for x in b] == expected


def test_resumes():
    assert_resumes(lambda: Dataset.range(10).batch(3), ks=[0, 1, 3, 4])
    assert_resumes(lambda: Dataset.range(10).batch(3, drop_remainder=True), ks=[0, 2, 3])
    data = (np.arange(10.0), [str(i) for i in range(10)])
    assert_resumes(lambda: Dataset.from_tensor_slices(data).batch(4), ks=[0, 1, 2, 3])
