"""cache(filename): docs/tfdata-semantics.md §11."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conveyor.data.errors import StateMismatchError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes, take_all


class Reads:
    """A filter predicate that keeps everything and counts how often the input is read."""

    def __init__(self):
        self.seen: list = []

    def __call__(self, *x):
        self.seen.append(x[0] if len(x) == 1 else x)
        return True


# ---------------------------------------------------------------------------------------- memory


def test_memory_cache_replays_after_one_complete_pass():
    reads = Reads()
    ds = Dataset.range(5).filter(reads).cache()
    assert list(ds) == [0, 1, 2, 3, 4]
    assert list(ds) == [0, 1, 2, 3, 4]
    assert reads.seen == [0, 1, 2, 3, 4]


def test_memory_cache_serves_later_epochs_of_repeat():
    reads = Reads()
    assert list(Dataset.range(3).filter(reads).cache().repeat(3)) == [0, 1, 2] * 3
    assert reads.seen == [0, 1, 2]


def test_a_partial_pass_does_not_finalize():
    reads = Reads()
    ds = Dataset.range(5).filter(reads).cache()
    it = iter(ds)
    assert [next(it), next(it)] == [0, 1]
    it.close()
    assert list(ds.take(5)) == [0, 1, 2, 3, 4]  # take(5) stops before the input ends: still partial
    assert list(ds) == [0, 1, 2, 3, 4]
    assert list(ds) == [0, 1, 2, 3, 4]
    assert reads.seen == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_cache_then_shuffle_reshuffles_the_same_elements():
    ds = Dataset.range(10).shuffle(10, seed=1).cache()
    first, second = list(ds), list(ds)
    assert first == second and sorted(first) == list(range(10))
    reshuffled = list(ds.shuffle(10, seed=2).repeat(2))
    assert sorted(reshuffled[:10]) == sorted(reshuffled[10:]) == list(range(10))


def test_recorded_arrays_are_read_only():
    ds = Dataset.from_tensor_slices(np.zeros((2, 3))).cache()
    for row in ds:
        with pytest.raises(ValueError, match="read-only"):
            row += 1
    assert all(r.sum() == 0 for r in ds)


def test_recording_is_shared_with_rewritten_copies_of_the_node():
    reads = Reads()
    ds = Dataset.range(3).filter(reads).cache()
    copy = Dataset(ds._node.with_inputs(ds._node.inputs))
    assert list(copy) == [0, 1, 2]
    assert list(ds) == [0, 1, 2]
    assert reads.seen == [0, 1, 2]


def test_empty_input():
    ds = Dataset.range(0).cache()
    assert list(ds) == [] and list(ds) == []


def test_memory_cache_resumes():
    assert_resumes(lambda: Dataset.range(5).cache(), ks=[0, 1, 4, 5])
    assert_resumes(lambda: Dataset.range(4).cache().repeat(3), ks=[0, 2, 4, 5, 8, 11, 12])


def test_memory_replay_resumed_in_a_new_pipeline_rebuilds_the_recording():
    # The recorded pass is shuffled; after a restart the recording is gone and must be rebuilt from
    # the same seeds, iteration and epoch, not from the epoch that is being replayed.
    def make():
        return Dataset.range(8).shuffle(8, seed=5).cache().repeat(4)

    assert_resumes(make, ks=[0, 3, 8, 9, 20, 31, 32])
    it = iter(make())
    head = take_all(it, 19)
    state = json.loads(json.dumps(it.state_dict()))
    rest = take_all(it)
    fresh = make()
    resumed = iter(fresh)
    resumed.load_state_dict(state)
    assert take_all(resumed) == rest
    assert [int(x) for x in head[:8]] == [int(x) for x in head[8:16]]
    assert sorted(take_all(iter(fresh))[:8]) == sorted(head[:8])  # the rebuilt recording is reused


def test_memory_replay_rebuilt_from_a_changed_input_is_refused():
    keep = {"all": True}
    make = lambda: Dataset.range(6).filter(lambda x: keep["all"] or x < 2).cache().repeat(2)
    it = iter(make())
    take_all(it, 10)
    state = json.loads(json.dumps(it.state_dict()))
    keep["all"] = False
    resumed = iter(make())
    resumed.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="not deterministic"):
        next(resumed)


# ---------------------------------------------------------------------------------------- files


def _leftovers(directory):
    return sorted(os.listdir(directory))


def test_file_cache_persists_and_replays_without_the_input(tmp_path):
    prefix = str(tmp_path / "sub" / "c")
    reads = Reads()
    data = (np.arange(6, dtype=np.float32).reshape(3, 2), [b"a", b"b", b"c"], ["x", "y", "z"])
    ds = Dataset.from_tensor_slices(data).filter(reads).cache(prefix)
    first = take_all(ds)
    assert _leftovers(tmp_path / "sub") == ["c.cache"]
    other = Dataset.from_tensor_slices(data).filter(reads).cache(prefix)  # a new run
    assert take_all(other) == first
    assert take_all(other.repeat(2)) == first * 2
    assert len(reads.seen) == 3


def test_file_cache_ignores_upstream_changes_until_removed(tmp_path):
    prefix = str(tmp_path / "c")
    assert list(Dataset.range(3).cache(prefix)) == [0, 1, 2]
    assert list(Dataset.range(7).cache(prefix)) == [0, 1, 2]  # tf.data behaves the same
    os.unlink(prefix + ".cache")
    assert list(Dataset.range(7).cache(prefix)) == list(range(7))


def test_a_partial_file_pass_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "c")
    ds = Dataset.range(5).cache(prefix)
    it = iter(ds)
    next(it)
    next(it)
    it.close()
    assert _leftovers(tmp_path) == []
    assert list(ds.take(3)) == [0, 1, 2]
    assert _leftovers(tmp_path) == []
    assert list(ds) == [0, 1, 2, 3, 4]
    assert _leftovers(tmp_path) == ["c.cache"]


def test_the_first_complete_file_pass_wins(tmp_path):
    prefix = str(tmp_path / "c")
    a, b = iter(Dataset.range(3).cache(prefix)), iter(Dataset.range(4).cache(prefix))
    assert take_all(a) and take_all(b)  # both recorded; a finished first
    assert list(Dataset.range(9).cache(prefix)) == [0, 1, 2]
    assert _leftovers(tmp_path) == ["c.cache"]


def test_file_cache_resumes(tmp_path):
    prefix = str(tmp_path / "c")
    make = lambda: Dataset.from_tensor_slices((np.arange(6), [str(i) for i in range(6)])).cache(prefix)
    # first the recording pass: a resumed recording passes elements through and records nothing
    it = iter(make())
    take_all(it, 2)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    resumed = iter(make())
    resumed.load_state_dict(state)
    assert len(take_all(resumed)) == 4
    assert _leftovers(tmp_path) == []
    # then replays from the file, resumed by byte offset (the reference pass writes the file)
    assert_resumes(make, ks=[0, 1, 5, 6])
    assert_resumes(lambda: make().repeat(2), ks=[0, 3, 6, 7, 12])
    assert _leftovers(tmp_path) == ["c.cache"]


def test_a_resumed_recording_pass_hands_its_context_to_the_next_pass(tmp_path):
    # Below a reshuffling shuffle, epoch 1 must replay epoch 0's order even if epoch 0 was resumed
    # half-way (and so could not record it): the next pass re-reads the input built like epoch 0.
    prefix = str(tmp_path / "c")
    for filename in ("", prefix):
        make = lambda f=filename: Dataset.range(8).shuffle(8, seed=4).cache(f).repeat(3)
        it = iter(make())
        head = take_all(it, 3)
        state = json.loads(json.dumps(it.state_dict()))
        rest = take_all(it)
        assert head + rest[:5] == rest[5:13] == rest[13:]
        if filename:
            os.unlink(prefix + ".cache")  # written by the original run; the resumed one must write it
        resumed = iter(make())
        resumed.load_state_dict(state)
        assert take_all(resumed) == rest
    assert _leftovers(tmp_path) == ["c.cache"]


def test_file_replay_refuses_a_changed_file(tmp_path):
    prefix = str(tmp_path / "c")
    list(Dataset.range(5).cache(prefix))
    it = iter(Dataset.range(5).cache(prefix))
    next(it)
    state = json.loads(json.dumps(it.state_dict()))
    os.unlink(prefix + ".cache")
    list(Dataset.range(6).cache(prefix))
    resumed = iter(Dataset.range(5).cache(prefix))
    with pytest.raises(StateMismatchError, match="changed since the state was saved"):
        resumed.load_state_dict(state)
