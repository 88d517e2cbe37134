"""shard(num_shards, index): docs/tfdata-semantics.md §3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


@pytest.mark.parametrize("index, expected", [(0, [0, 3, 6, 9]), (1, [1, 4, 7]), (2, [2, 5, 8])])
def test_tfdata_vectors(index, expected):
    assert list(Dataset.range(10).shard(3, index)) == expected


def test_more_shards_than_elements():
    assert list(Dataset.range(2).shard(4, 3)) == []
    assert list(Dataset.range(2).shard(4, 1)) == [1]
    assert list(Dataset.range(5).shard(1, 0)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "num_shards, index", [(0, 0), (-1, 0), (3, 3), (3, -1), (2.0, 0), (2, 0.5), (True, 0)]
)
def test_illegal_arguments(num_shards, index):
    with pytest.raises(InvalidArgumentError):
        Dataset.range(10).shard(num_shards, index)


def test_numpy_integers_are_accepted():
    assert list(Dataset.range(6).shard(np.int64(2), np.int32(1))) == [1, 3, 5]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), num_shards=st.integers(1, 7))
def test_shards_partition_the_input_by_position_modulo(n, num_shards):
    data = [f"e{i}" for i in range(n)] or ["only"]
    shards = [list(Dataset.from_tensor_slices(data).shard(num_shards, i)) for i in range(num_shards)]
    for i, shard in enumerate(shards):
        assert shard == data[i::num_shards]  # each in input order, positions ≡ i (mod num_shards)
    assert sorted(x for s in shards for x in s) == sorted(data)


def test_resumes():
    assert_resumes(lambda: Dataset.range(20).shard(3, 1), ks=[0, 1, 3, 7])
    assert_resumes(lambda: Dataset.range(20).shard(4, 3), ks=[0, 2, 4, 5])
    assert_resumes(lambda: Dataset.range(2).shard(4, 3), ks=[0])
