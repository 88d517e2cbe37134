"""prefetch: order, background production, errors, autotune, resume."""

from __future__ import annotations

import threading
import time

import pytest

from conveyor.data import AUTOTUNE, Dataset
from resume_check import assert_resumes


@pytest.mark.parametrize("size", [0, 1, 3, AUTOTUNE])
def test_prefetch_keeps_order(size):
    assert [int(x) for x in Dataset.range(50).prefetch(size)] == list(range(50))


def test_prefetch_runs_ahead_while_the_consumer_works():
    def slow(x):
        time.sleep(0.02)
        return x

    ds = Dataset.range(10).map(slow).prefetch(10)
    it = iter(ds)
    next(it)
    time.sleep(0.3)  # the producer fills the buffer meanwhile
    t0 = time.perf_counter()
    rest = list(it)
    assert rest == list(range(1, 10))
    assert time.perf_counter() - t0 < 0.1


def test_error_arrives_after_the_elements_before_it():
    def f(x):
        if x == 5:
            raise KeyError("five")
        return x

    it = iter(Dataset.range(10).map(f).prefetch(3))
    got = []
    with pytest.raises(KeyError, match="five"):
        for x in it:
            got.append(int(x))
    assert got == [0, 1, 2, 3, 4]


def test_autotune_grows_the_buffer_when_the_consumer_waits():
    def slow(x):
        time.sleep(0.005)
        return x

    it = iter(Dataset.range(40).map(slow).prefetch(AUTOTUNE))
    list(it)
    stage = next(s for s in it.stats()["stages"] if s["stage"] == "prefetch")
    assert stage["consumer_found_empty"] > 0
    assert stage["buffer_size"] > 2


def test_close_stops_the_thread():
    it = iter(Dataset.range(10**9).prefetch(4))
    next(it)
    it.close()
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name == "conveyor-prefetch"]


@pytest.mark.parametrize("size", [1, 4, AUTOTUNE])
def test_prefetch_resumes(size):
    assert_resumes(lambda: Dataset.range(30).prefetch(size), ks=[0, 1, 10, 29, 30])


def test_bad_buffer_size():
    with pytest.raises(ValueError, match="buffer_size"):
        Dataset.range(3).prefetch(-5)
