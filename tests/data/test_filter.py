"""filter(predicate)."""

from __future__ import annotations

import numpy as np
import pytest

from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes


def test_keeps_matching_elements_in_order():
    assert list(Dataset.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    assert list(Dataset.range(4).filter(lambda x: False)) == []


def test_tuple_elements_are_unpacked():
    ds = Dataset.from_tensor_slices(([1, 2, 3, 4], ["a", "b", "c", "d"]))
    out = list(ds.filter(lambda n, s: n % 2 == 0 and s != "d"))
    assert out == [(2, "b")]


def test_numpy_bools_are_accepted():
    data = np.arange(6)
    ds = Dataset.from_tensor_slices(data)
    assert list(ds.filter(lambda x: x > 3)) == [4, 5]  # np.bool_
    assert list(ds.filter(lambda x: np.asarray(x < 2))) == [0, 1]  # 0-d bool array
    assert list(ds.filter(lambda x: np.array([x, x]).all())) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("result", [1, 0, None, np.array([True]), np.int64(1), "yes"])
def test_non_bool_results_are_refused(result):
    def pred(x):
        return result

    with pytest.raises(TypeError, match="pred must return a scalar bool"):
        list(Dataset.range(3).filter(pred))


def test_predicate_must_be_callable():
    with pytest.raises(TypeError):
        Dataset.range(3).filter(True)


def test_resumes():
    assert_resumes(lambda: Dataset.range(20).filter(lambda x: x % 3 == 1), ks=[0, 1, 3, 6, 7])
    assert_resumes(lambda: Dataset.range(5).filter(lambda x: False), ks=[0])
