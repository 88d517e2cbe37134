"""take(count) and skip(count): docs/tfdata-semantics.md §10."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


def test_vectors():
    assert list(Dataset.range(10).take(3)) == [0, 1, 2]
    assert list(Dataset.range(10).skip(7)) == [7, 8, 9]


def test_take_edge_counts():
    assert list(Dataset.range(4).take(-1)) == [0, 1, 2, 3]
    assert list(Dataset.range(4).take(10)) == [0, 1, 2, 3]
    assert list(Dataset.range(4).take(0)) == []
    assert list(Dataset.range(4).take(-5)) == [0, 1, 2, 3]  # tf.data: any negative means all


def test_skip_edge_counts():
    assert list(Dataset.range(4).skip(0)) == [0, 1, 2, 3]
    assert list(Dataset.range(4).skip(10)) == []
    assert list(Dataset.range(4).skip(-1)) == []
    assert list(Dataset.range(3).repeat().skip(-1)) == []  # never reads the endless input


def test_take_stops_reading_the_input_at_count():
    read = []
    ds = Dataset.range(100).filter(lambda x: read.append(x) is None).take(3)
    assert list(ds) == [0, 1, 2]
    assert read == [0, 1, 2]
    assert list(Dataset.range(3).repeat().take(5)) == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("op", ["take", "skip"])
@pytest.mark.parametrize("count", [1.0, "3", None, True])
def test_bad_count(op, count):
    with pytest.raises(InvalidArgumentError):
        getattr(Dataset.range(3), op)(count)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 12), n=st.integers(-1, 15))
def test_take_plus_skip_is_the_input(size, n):
    ds = Dataset.range(size)
    head, tail = list(ds.take(n)), list(ds.skip(n))
    if n == -1:
        assert head == list(range(size)) and tail == []
    else:
        assert head == list(range(min(n, size)))
        assert head + tail == list(range(size))


def test_resumes():
    assert_resumes(lambda: Dataset.range(10).take(4), ks=[0, 1, 3, 4])
    assert_resumes(lambda: Dataset.range(3).take(5), ks=[0, 2, 3])
    assert_resumes(lambda: Dataset.range(3).repeat().take(7), ks=[0, 3, 7])
    assert_resumes(lambda: Dataset.range(10).skip(4), ks=[0, 1, 5, 6])
    assert_resumes(lambda: Dataset.range(3).skip(5), ks=[0])
    assert_resumes(lambda: Dataset.range(3).skip(-1), ks=[0])
    assert_resumes(lambda: Dataset.range(3).take(0), ks=[0])
