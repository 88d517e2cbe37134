"""shuffle: tf.data's buffer semantics (docs/tfdata-semantics.md §4, §16) and exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.base import AUTOTUNE
from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from resume_check import assert_resumes, canon


def ints(ds) -> list[int]:
    return [int(x) for x in ds]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), buffer_size=st.integers(1, 50), seed=st.integers(0, 2**31 - 1))
def test_output_is_a_permutation_within_the_window(n, buffer_size, seed):
    out = ints(Dataset.range(n).shuffle(buffer_size, seed=seed))
    assert sorted(out) == list(range(n))
    # Output k can only come from inputs [0, k + buffer_size): the buffer holds buffer_size elements.
    for k, x in enumerate(out):
        assert x < k + buffer_size


def test_first_output_is_drawn_from_the_first_buffer_size_inputs():
    firsts = {ints(Dataset.range(100).shuffle(10, seed=s))[0] for s in range(200)}
    assert firsts == set(range(10))  # every slot of the first buffer gets chosen, nothing beyond


def test_buffer_size_one_is_identity():
    assert ints(Dataset.range(20).shuffle(1, seed=5)) == list(range(20))


def test_seed_reproducibility():
    a = ints(Dataset.range(50).shuffle(50, seed=42))
    b = ints(Dataset.range(50).shuffle(50, seed=42))
    c = ints(Dataset.range(50).shuffle(50, seed=43))
    assert a == b
    assert a != c
    assert a != list(range(50))


def test_reshuffle_each_iteration_true_changes_order_per_iterator_and_epoch():
    ds = Dataset.range(30).shuffle(30, seed=1)  # reshuffle_each_iteration defaults to True
    first, second = ints(ds), ints(ds)
    assert sorted(first) == sorted(second) == list(range(30))
    assert first != second

    epochs = ints(Dataset.range(30).shuffle(30, seed=1).repeat(3))
    e = [epochs[i * 30:(i + 1) * 30] for i in range(3)]
    assert all(sorted(x) == list(range(30)) for x in e)
    assert e[0] != e[1] and e[1] != e[2] and e[0] != e[2]


def test_reshuffle_each_iteration_false_repeats_the_order():
    ds = Dataset.range(30).shuffle(30, seed=1, reshuffle_each_iteration=False)
    first = ints(ds)
    assert ints(ds) == first
    assert first != list(range(30))
    # Every epoch of an enclosing repeat gets the same order too. (The order differs from `first`:
    # seeds also depend on the op's position in the pipeline, and under repeat it sits one deeper.)
    epochs = ints(ds.repeat(3))
    assert epochs[:30] == epochs[30:60] == epochs[60:]
    # Unseeded too: the seed is drawn once per Dataset object.
    unseeded = Dataset.range(30).shuffle(30, reshuffle_each_iteration=False)
    assert ints(unseeded) == ints(unseeded)


def test_shuffle_then_repeat_keeps_epochs_separate():
    out = ints(Dataset.range(12).shuffle(5, seed=3).repeat(4))
    for i in range(4):
        assert sorted(out[i * 12:(i + 1) * 12]) == list(range(12))


def test_repeat_then_shuffle_mixes_epochs():
    # The opposite order has no epoch boundaries: some element of epoch 2 comes out before the
    # last of epoch 1 for at least one seed.
    mixed = False
    for seed in range(20):
        out = ints(Dataset.range(6).repeat(2).shuffle(6, seed=seed))
        assert sorted(out) == sorted(list(range(6)) * 2)
        mixed |= sorted(out[:6]) != list(range(6))
    assert mixed


def test_structured_elements_survive_the_buffer():
    xs = np.arange(12, dtype=np.float32).reshape(6, 2)
    out = list(Dataset.from_tensor_slices((xs, [b"a", b"b", b"c", b"d", b"e", b"f"])).shuffle(4, seed=0))
    assert sorted(canon(x) for x in out) == sorted(
        canon(x) for x in Dataset.from_tensor_slices((xs, [b"a", b"b", b"c", b"d", b"e", b"f"])))


@pytest.mark.parametrize("bad", [0, -2, AUTOTUNE, 1.5, None, True])
def test_invalid_buffer_size(bad):
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).shuffle(bad)


def test_resume():
    assert_resumes(lambda: Dataset.range(40).shuffle(7, seed=3), ks=[0, 1, 6, 7, 20, 33, 39, 40])


def test_resume_across_epochs_and_with_reshuffle():
    assert_resumes(lambda: Dataset.range(10).shuffle(4, seed=1).repeat(3), ks=[0, 5, 10, 14, 29, 30])
    assert_resumes(lambda: Dataset.range(10).shuffle(4, seed=1, reshuffle_each_iteration=False).repeat(2),
                   ks=[3, 10, 17])


def test_resume_at_random_block_boundaries():
    # Draws come in blocks of 1024; the state must regenerate a partly used block exactly.
    assert_resumes(lambda: Dataset.range(1100).shuffle(8, seed=9), ks=[1023, 1024, 1025])


def test_resume_structured_elements():
    xs = np.arange(20, dtype=np.int16).reshape(10, 2)
    names = [f"n{i}".encode() for i in range(10)]
    assert_resumes(lambda: Dataset.from_tensor_slices({"x": xs, "name": names}).shuffle(5, seed=2),
                   ks=[0, 3, 9])


def test_resume_numpy_scalar_elements():  # buffered np.int64 must come back as np.int64, not array([v])
    assert_resumes(lambda: Dataset.from_tensor_slices(np.arange(10)).shuffle(5, seed=2), ks=[3])


def test_resume_unseeded_uses_the_saved_root_seed():
    ds = Dataset.range(25).shuffle(25)
    it = iter(ds)
    head = ints(next(it) for _ in range(8))
    state = json.loads(json.dumps(it.state_dict()))
    rest = ints(it)
    resumed = iter(Dataset.range(25).shuffle(25))  # another Dataset: another root seed
    resumed.load_state_dict(state)
    assert ints(resumed) == rest
    assert sorted(head + rest) == list(range(25))
