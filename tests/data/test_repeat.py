"""repeat(count): docs/tfdata-semantics.md §5."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


def test_vectors():
    assert list(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert list(Dataset.range(3).repeat(1)) == [0, 1, 2]
    assert list(Dataset.range(3).repeat(0)) == []
    assert list(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert list(Dataset.range(3).repeat(-1).take(4)) == [0, 1, 2, 0]


def test_forever_over_an_empty_input_stops():
    assert list(Dataset.range(0).repeat()) == []
    assert list(Dataset.range(5).skip(5).repeat(-1)) == []
    assert list(Dataset.range(0).repeat(3)) == []


def test_forever_stops_at_the_first_empty_epoch():
    # epoch 0 keeps everything, epoch 1 keeps nothing: forever ends there, a count runs on
    seen = []

    def keep(x):
        seen.append(x)
        return len(seen) <= 2 or len(seen) > 4

    assert list(Dataset.range(2).filter(keep).repeat()) == [0, 1]
    seen.clear()
    assert list(Dataset.range(2).filter(keep).repeat(3)) == [0, 1, 0, 1]


def test_each_epoch_gets_a_fresh_iterator_and_its_own_shuffle():
    ds = Dataset.range(20).shuffle(20, seed=7).repeat(3)
    out = list(ds)
    epochs = [out[0:20], out[20:40], out[40:60]]
    assert all(sorted(e) == list(range(20)) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    fixed = list(Dataset.range(20).shuffle(20, seed=7, reshuffle_each_iteration=False).repeat(3))
    assert fixed[0:20] == fixed[20:40] == fixed[40:60]


def test_bad_count():
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).repeat(1.5)
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).repeat(True)


def test_stats_do_not_grow_with_epochs():
    it = iter(Dataset.range(2).shard(1, 0).repeat(50))
    assert len(list(it)) == 100
    stages = it.stats()["stages"]
    assert sorted(s["stage"] for s in stages) == ["range", "repeat", "shard"]
    assert [s["elements"] for s in stages] == [100, 100, 100]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 8), k=st.integers(0, 5))
def test_repeat_k_is_k_copies(n, k):
    assert list(Dataset.range(n).repeat(k)) == list(range(n)) * k


def test_resumes():
    assert_resumes(lambda: Dataset.range(4).repeat(3), ks=[0, 1, 3, 4, 5, 8, 11, 12])
    assert_resumes(lambda: Dataset.range(3).repeat(), ks=[0, 2, 3, 7], limit=20)
    assert_resumes(lambda: Dataset.range(0).repeat(), ks=[0])
    assert_resumes(lambda: Dataset.range(3).repeat(0), ks=[0])
    # a shuffle inside: every epoch's order must be rebuilt exactly
    assert_resumes(lambda: Dataset.range(6).shuffle(6, seed=3).repeat(3), ks=[0, 5, 6, 7, 13, 18])


def test_nested_repeat_resumes():
    assert list(Dataset.range(2).repeat(2).repeat(2)) == [0, 1] * 4
    assert_resumes(lambda: Dataset.range(2).repeat(2).repeat(2), ks=[0, 1, 2, 3, 4, 6, 8])
