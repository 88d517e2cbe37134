"""Sources: range, from_tensor_slices, from_generator and the file matching behind list_files."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.pipeline import Dataset
from conveyor.data.sources.files import match_files
from conveyor.data.sources.generator import GeneratorNode
from conveyor.data.sources.tensors import TensorSlicesNode
from resume_check import assert_resumes

# ---------------------------------------------------------------------------------------- range


@pytest.mark.parametrize("args", [(5,), (2, 5), (1, 5, 2), (5, 1, -2), (5, 2), (0,), (-3, 4, 3)])
def test_range_matches_python_range(args):
    out = list(Dataset.range(*args))
    assert out == list(range(*args))
    assert all(type(x) is int for x in out)


def test_range_beyond_sys_maxsize_is_a_counter():
    assert list(Dataset.range(2**64).take(3)) == [0, 1, 2]
    assert list(Dataset.range(2**64, 2**64 + 2)) == [2**64, 2**64 + 1]


def test_range_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="step must not be 0"):
        Dataset.range(0, 5, 0)
    with pytest.raises(TypeError, match="1 to 3"):
        Dataset.range()
    with pytest.raises(TypeError, match="1 to 3"):
        Dataset.range(1, 2, 3, 4)
    with pytest.raises(TypeError, match="integers"):
        Dataset.range(2.5)
    with pytest.raises(TypeError, match="integers"):
        Dataset.range(True)


def test_range_accepts_numpy_integers():
    assert list(Dataset.range(np.int64(3))) == [0, 1, 2]


def test_range_resumes():
    assert_resumes(lambda: Dataset.range(3, 13, 2), ks=[0, 1, 3, 5])


# ---------------------------------------------------------------------------------------- from_tensor_slices


def test_slices_of_a_2d_array_are_rows():
    x = np.arange(6).reshape(3, 2)
    out = list(Dataset.from_tensor_slices(x))
    assert [r.tolist() for r in out] == [[0, 1], [2, 3], [4, 5]]
    assert all(r.dtype == x.dtype for r in out)


def test_slices_keep_tuple_and_dict_structure():
    out = list(Dataset.from_tensor_slices(([1, 2], ["a", "b"], {"k": np.array([[1.0], [2.0]])})))
    assert len(out) == 2
    first = out[0]
    assert type(first) is tuple and len(first) == 3
    assert first[0] == 1 and isinstance(first[0], np.integer)
    assert first[1] == "a" and type(first[1]) is str
    assert list(first[2]) == ["k"] and first[2]["k"].tolist() == [1.0]
    d = list(Dataset.from_tensor_slices({"x": np.zeros((2, 4)), "y": [0, 1]}))
    assert [list(e) for e in d] == [["x", "y"], ["x", "y"]]
    assert d[1]["y"] == 1 and d[1]["x"].shape == (4,)


def test_slices_of_lists():
    assert list(Dataset.from_tensor_slices([b"a", b"bc"])) == [b"a", b"bc"]
    assert list(Dataset.from_tensor_slices(["x", "y"])) == ["x", "y"]
    out = list(Dataset.from_tensor_slices([1.5, 2.5]))
    assert out == [1.5, 2.5] and all(isinstance(v, np.floating) for v in out)
    rows = list(Dataset.from_tensor_slices([[1, 2], [3, 4]]))
    assert [r.tolist() for r in rows] == [[1, 2], [3, 4]]
    assert list(Dataset.from_tensor_slices([])) == []


def test_slices_reject_mismatched_lengths_naming_them():
    with pytest.raises(InvalidArgumentError, match=r"x\[0\] has 3, x\[1\] has 2"):
        Dataset.from_tensor_slices(([1, 2, 3], [1, 2]))
    with pytest.raises(InvalidArgumentError, match=r"x\['b'\] has 1"):
        Dataset.from_tensor_slices({"a": np.zeros(2), "b": np.zeros(1)})


@pytest.mark.parametrize("bad", [5, np.float32(1.0), np.array(3), "abc", None, (), {}])
def test_slices_reject_scalars_and_empty_structures(bad):
    with pytest.raises(InvalidArgumentError):
        Dataset.from_tensor_slices(bad)


def test_slices_reject_mixed_and_ragged_lists():
    with pytest.raises(InvalidArgumentError, match="mixed or ragged"):
        Dataset.from_tensor_slices([1, "a"])
    with pytest.raises(InvalidArgumentError, match=r"list x\[1\] into an array.*ragged"):
        Dataset.from_tensor_slices(([1, 2], [[1, 2], [3]]))
    with pytest.raises(InvalidArgumentError, match="mixed or ragged"):
        Dataset.from_tensor_slices([np.zeros(2), None])


def test_slices_hand_out_rows_a_consumer_may_modify():
    x = np.zeros((2, 3))
    for row in Dataset.from_tensor_slices(x):
        row += 1
    assert not x.any()


def test_slices_fingerprint_describes_structure_not_data():
    node = TensorSlicesNode((np.zeros((4, 2), np.float32), ["a", "b", "c", "d"]))
    assert node.params() == {"length": 4, "structure": "(<f4[2], str, )"}
    other = TensorSlicesNode((np.ones((4, 2), np.float32), ["e", "f", "g", "h"]))
    assert other.fingerprint() == node.fingerprint()


def test_slices_resume():
    data = (np.arange(12).reshape(6, 2), [f"s{i}" for i in range(6)], {"b": [bytes([i]) for i in range(6)]})
    assert_resumes(lambda: Dataset.from_tensor_slices(data), ks=[0, 1, 4, 6])


# ---------------------------------------------------------------------------------------- from_generator


def test_generator_restarts_for_every_iterator():
    def gen(n):
        yield from range(n)

    ds = Dataset.from_generator(gen, args=(3,))
    assert list(ds) == [0, 1, 2]
    assert list(ds) == [0, 1, 2]
    assert list(ds.repeat(2)) == [0, 1, 2, 0, 1, 2]


def test_generator_is_started_lazily_and_closed():
    events = []

    def gen():
        events.append("start")
        try:
            yield 1
            yield 2
        finally:
            events.append("closed")

    it = iter(Dataset.from_generator(gen))
    assert events == []
    assert next(it) == 1
    it.close()
    assert events == ["start", "closed"]


def test_generator_cannot_save_its_position():
    it = iter(Dataset.from_generator(lambda: iter([1, 2])))
    next(it)
    with pytest.raises(TypeError, match="cannot be rewound.*from_tensor_slices"):
        it.state_dict()


def test_generator_errors():
    with pytest.raises(TypeError, match="not iterable"):
        list(Dataset.from_generator(lambda: 5))
    with pytest.raises(TypeError, match="function"):
        Dataset.from_generator([1, 2, 3])
    assert GeneratorNode(lambda a, b: [a, b], (1, 2)).params()["num_args"] == 2


# ---------------------------------------------------------------------------------------- files


def _touch(root, *names):
    for name in names:
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()


def test_match_files_sorts_the_concatenation_of_all_patterns(tmp_path):
    _touch(tmp_path, "b/2.rec", "b/1.rec", "a/3.rec", "a/0.txt")
    got = match_files([str(tmp_path / "b" / "*.rec"), str(tmp_path / "a" / "*.rec")])
    assert got == [str(tmp_path / n) for n in ("a/3.rec", "b/1.rec", "b/2.rec")]
    assert match_files(str(tmp_path / "a" / "*")) == [str(tmp_path / n) for n in ("a/0.txt", "a/3.rec")]


def test_list_files_without_shuffle_is_sorted(tmp_path):
    _touch(tmp_path, "f-10", "f-2", "f-1")
    got = list(Dataset.list_files(str(tmp_path / "f-*"), shuffle=False))
    assert got == [str(tmp_path / n) for n in ("f-1", "f-10", "f-2")]


def test_match_files_without_matches_names_the_patterns(tmp_path):
    a, b = str(tmp_path / "x*"), str(tmp_path / "y*")
    with pytest.raises(InvalidArgumentError, match=re.escape(f"No files matched pattern: {a}, {b}")):
        match_files([a, b])
    with pytest.raises(InvalidArgumentError, match="No files matched pattern"):
        match_files([])


def test_match_files_is_not_recursive(tmp_path):
    _touch(tmp_path, "d/e/deep.rec")
    with pytest.raises(InvalidArgumentError):
        match_files(str(tmp_path / "**" / "*.rec"))
