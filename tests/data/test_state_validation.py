"""Tampered iterator states: every field is checked before anything is opened, files must be unchanged.

A state comes from a checkpoint that others may be able to write: `load_state_dict` must refuse a
bad one with `StateError` naming the field (never a bare TypeError/KeyError, never by opening a
file the pipeline does not list), and must never resume into a file that changed since.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import numpy as np
import pytest

import conveyor.data.provenance as provenance
import conveyor.data.sources.tfrecord as tfrecord_source
from conveyor.data import AUTOTUNE, Dataset, StateError, StateMismatchError, TFRecordDataset
from conveyor.data.records import TFRecordWriter
from resume_check import assert_resumes

# ---------------------------------------------------------------- helpers


def saved_state(ds: Dataset, k: int) -> dict:
    """The JSON round-tripped state of an iterator of `ds` after `k` elements."""
    it = iter(ds)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    it.close()
    return state


def load(ds: Dataset, state: dict, steps: int = 3) -> list:
    """Load `state` into a fresh iterator of `ds` and read up to `steps` elements."""
    it = iter(ds)
    try:
        it.load_state_dict(state)
        out = []
        for _ in range(steps):
            try:
                out.append(next(it))
            except StopIteration:
                break
        return out
    finally:
        it.close()


def write_records(path, records: list[bytes]) -> str:
    with TFRecordWriter(str(path)) as w:
        for r in records:
            w.write(r)
    return str(path)


@pytest.fixture
def tf_files(tmp_path):
    return [write_records(tmp_path / f"f{i}.tfrecord", [f"f{i}-{j}".encode() * 3 for j in range(5)])
            for i in range(3)]


@pytest.fixture
def opened(monkeypatch):
    """Every path a TFRecord source opens (or stats) during the test."""
    paths: list[str] = []
    reader, stat = tfrecord_source.TFRecordReader, tfrecord_source.os.stat

    def spy_reader(path, *args, **kwargs):
        paths.append(str(path))
        return reader(path, *args, **kwargs)

    def spy_stat(path, *args, **kwargs):
        paths.append(str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(tfrecord_source, "TFRecordReader", spy_reader)
    monkeypatch.setattr(tfrecord_source.os, "stat", spy_stat)
    return paths


# ---------------------------------------------------------------- one pipeline per op


def _square(x):
    return x * x


def _even(x):
    return x % 2 == 0


OPS = {
    "range": lambda files: Dataset.range(10),
    "from_tensor_slices": lambda files: Dataset.from_tensor_slices(np.arange(10)),
    "tfrecord": lambda files: TFRecordDataset(files),
    "batch": lambda files: Dataset.range(10).batch(3),
    "filter": lambda files: Dataset.range(10).filter(_even),
    "map": lambda files: Dataset.range(10).map(_square),
    "map[threads]": lambda files: Dataset.range(10).map(_square, num_parallel_calls=2, use_processes=False),
    "map_batch[processes]": lambda files: Dataset.range(40).map(_square, num_parallel_calls=2).batch(4),
    "interleave": lambda files: Dataset.range(3).interleave(lambda x: Dataset.range(4), cycle_length=2),
    "interleave[parallel]": lambda files: Dataset.range(3).interleave(lambda x: Dataset.range(4), cycle_length=2,
                                                                       num_parallel_calls=2),
    "prefetch": lambda files: Dataset.range(10).prefetch(2),
    "repeat": lambda files: Dataset.range(3).repeat(3),
    "shard": lambda files: Dataset.range(10).shard(2, 1),
    "shuffle": lambda files: Dataset.range(10).shuffle(4, seed=1),
    "skip": lambda files: Dataset.range(10).skip(2),
    "take": lambda files: Dataset.range(10).take(6),
    "unbatch": lambda files: Dataset.range(10).batch(4).unbatch(),
    "cache": lambda files: Dataset.range(10).cache(),
}

GARBAGE = [None, "x", -1, 2**70, 1.5, True, [], {}, [{"nd": 1}], {"x": 1}]


def _mutations(op_state):
    """The op's own state replaced by garbage, then each of its fields in turn."""
    for g in GARBAGE:
        yield f"state={g!r}", g
    if isinstance(op_state, dict):
        for key in op_state:
            for g in GARBAGE:
                changed = dict(op_state)
                changed[key] = g
                yield f"{key}={g!r}", changed


@pytest.mark.parametrize("op", sorted(OPS))
def test_garbage_in_any_field_raises_state_error_or_loads(op, tf_files):
    make = OPS[op]
    state = saved_state(make(tf_files), 2)
    refused = 0
    for what, op_state in _mutations(state["state"]):
        bad = copy.deepcopy(state)
        bad["state"] = op_state
        try:
            load(make(tf_files), bad)
        except StateError as e:
            refused += 1
            assert e.field is not None and e.field.startswith('state["state"]'), (what, e)
            assert "--no-resume" in str(e), (what, e)
        except Exception as e:  # a bare TypeError / KeyError / ... is the defect
            pytest.fail(f"{op}: {what} raised {type(e).__name__}: {e}")
    assert refused >= len(GARBAGE) - 1  # the op's whole state as garbage is refused (None: finished ok)


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_null_state_is_refused(op, tf_files):
    state = saved_state(OPS[op](tf_files), 2)
    state["state"] = None
    with pytest.raises(StateError, match=r'state\["state"\]'):
        load(OPS[op](tf_files), state)


def test_the_error_names_the_field_and_what_was_expected(monkeypatch):
    monkeypatch.setattr(provenance, "enabled", False)  # a buffer of saved elements (see test_provenance.py)
    ds = Dataset.range(20).shuffle(8, seed=0)
    state = saved_state(ds, 3)
    state["state"]["buffer"][3] = {"nd": "!!", "dtype": "<i8", "shape": []}
    with pytest.raises(StateError) as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["buffer"][3]'
    state = saved_state(ds, 3)
    state["state"]["draws_used"] = "x"
    with pytest.raises(StateError, match=r'state\["state"\]\["draws_used"\]: expected int >= 0 and <= 1024, '
                                         r"got 'x'"):
        load(ds, state)


def test_top_level_fields_are_checked():
    ds = Dataset.range(5)
    for key, value in [("root_seed", "x"), ("iteration", -1), ("exhausted", "no")]:
        state = saved_state(ds, 1)
        state[key] = value
        with pytest.raises(StateError, match=rf'state\["{key}"\]'):
            load(ds, state)


def test_a_state_from_a_differently_shaped_pipeline_is_refused_even_with_a_forged_fingerprint():
    other = saved_state(Dataset.range(10).batch(2), 2)
    ds = Dataset.range(10).take(5)
    with pytest.raises(StateMismatchError, match="different pipeline"):
        load(ds, other)
    other["pipeline"] = saved_state(ds, 0)["pipeline"]
    with pytest.raises(StateError, match=r"'taken'"):
        load(ds, other)


def test_a_refused_state_leaves_a_fresh_iterator():
    ds = Dataset.range(5).prefetch(2)
    state = saved_state(ds, 2)
    state["state"]["buffer"] = "x"
    it = iter(ds)
    with pytest.raises(StateError):
        it.load_state_dict(state)
    assert [int(x) for x in it] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- files outside the file list


def test_a_path_outside_the_file_list_is_refused_before_it_is_opened(tf_files, opened):
    ds = TFRecordDataset(tf_files)
    state = saved_state(ds, 2)
    state["state"]["path"] = "/etc/passwd"
    with pytest.raises(StateError, match="not in this pipeline's file list") as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["path"]'
    assert "/etc/passwd" not in opened


def _files_pipeline(tf_files):
    directory = os.path.dirname(tf_files[0])
    return (Dataset.list_files(os.path.join(directory, "*.tfrecord"), seed=3)
            .interleave(TFRecordDataset, cycle_length=2))


@pytest.mark.parametrize("where", ["interleave element", "inner path", "file-list shuffle buffer"])
def test_a_foreign_file_name_anywhere_upstream_is_refused_before_it_is_opened(where, tf_files, opened, monkeypatch):
    monkeypatch.setattr(provenance, "enabled", False)  # file names saved as such (see test_provenance.py)
    ds = _files_pipeline(tf_files)
    state = saved_state(ds, 2)
    interleave = state["state"]
    if where == "interleave element":
        interleave["slots"][0]["element"] = "/etc/passwd"
    elif where == "inner path":
        interleave["slots"][0]["inner"]["path"] = "/etc/passwd"
    else:
        interleave["input"]["buffer"][0] = "/etc/passwd"
    with pytest.raises(StateError, match="/etc/passwd"):
        load(ds, state)
    assert "/etc/passwd" not in opened


# ---------------------------------------------------------------- files that changed since the state


def _state_inside_first_file(tf_files):
    ds = TFRecordDataset(tf_files)
    state = saved_state(ds, 2)
    assert state["state"]["path"] == tf_files[0]
    return ds, state


def test_a_rewritten_file_is_refused_as_changed_not_damaged(tf_files):
    ds, state = _state_inside_first_file(tf_files)
    before = os.path.getsize(tf_files[0])
    write_records(tf_files[0], [b"new content"] * 7)
    with pytest.raises(StateMismatchError) as e:
        load(ds, state)
    message = str(e.value)
    assert "changed since the checkpoint" in message and "damaged" not in message
    assert f"{before} bytes" in message and f"{os.path.getsize(tf_files[0])} bytes" in message
    assert "Restore the original file" in message and "--no-resume" in message


def test_a_file_with_the_same_size_but_a_new_mtime_is_refused(tf_files):
    ds, state = _state_inside_first_file(tf_files)
    st = os.stat(tf_files[0])
    with open(tf_files[0], "r+b") as f:  # same size, other bytes
        data = f.read()
        f.seek(0)
        f.write(bytes(reversed(data)))
    os.utime(tf_files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert os.path.getsize(tf_files[0]) == st.st_size
    with pytest.raises(StateMismatchError, match="changed since the checkpoint"):
        load(ds, state)


def test_an_unchanged_file_resumes_and_the_state_records_its_size_and_mtime(tf_files):
    ds, state = _state_inside_first_file(tf_files)
    st = os.stat(tf_files[0])
    assert (state["state"]["size"], state["state"]["mtime_ns"]) == (st.st_size, st.st_mtime_ns)
    assert load(ds, state, 1) == [b"f0-2" * 3]


def test_a_state_from_before_size_and_mtime_were_recorded_resumes_with_a_warning(tf_files):
    ds, state = _state_inside_first_file(tf_files)
    del state["state"]["size"], state["state"]["mtime_ns"]
    with pytest.warns(UserWarning, match="cannot check that the file is unchanged"):
        assert load(ds, state, 1) == [b"f0-2" * 3]


def test_an_offset_that_is_not_a_record_is_refused_naming_the_field(tf_files):
    ds, state = _state_inside_first_file(tf_files)
    state["state"]["offset"] += 3
    with pytest.raises(StateError) as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["offset"]'
    state["state"]["offset"] = os.path.getsize(tf_files[0]) + 1
    with pytest.raises(StateError, match="past the end"):
        load(ds, state)


@pytest.mark.parametrize("shift", [8, 3, 10**6])
def test_an_offset_that_is_not_a_record_is_refused_without_size_and_mtime_too(tf_files, shift):
    # A state without size/mtime (tampered, or from before they were recorded) resumed at any offset,
    # then blamed the intact file: DataLossError "rewrite it" (the iterator_state fuzz target's finding).
    ds, state = _state_inside_first_file(tf_files)
    del state["state"]["size"], state["state"]["mtime_ns"]
    state["state"]["offset"] += shift
    with pytest.warns(UserWarning, match="cannot check"), pytest.raises(StateError) as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["offset"]'
    offset = state["state"]["offset"]
    assert f"{tf_files[0]} has no record at byte {offset}" in str(e.value) and "rewrite" not in str(e.value)


def test_a_tampered_offset_inside_an_interleave_is_a_state_error(tf_files):
    # /work/shared/repro/state_offset_dataloss.py: the same through list_files -> interleave -> shuffle
    ds = (Dataset.list_files(tf_files, seed=1).interleave(TFRecordDataset, cycle_length=2)
          .shuffle(4, seed=2).map(len).batch(2))
    state = saved_state(ds, 4)
    inner = next(s for s in state["state"]["input"]["input"]["input"]["slots"] if s)["inner"]
    del inner["size"], inner["mtime_ns"]
    inner["offset"] += 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StateError, match=rf"{inner['path']} has no record at byte {inner['offset']}") as e:
            load(ds, state)
    assert e.value.field.endswith('["inner"]["offset"]')


def test_a_changed_file_in_a_parallel_interleave_is_refused_when_loading(tmp_path):
    # longer than the readers' read-ahead, so the state is positioned inside the files
    big = [write_records(tmp_path / f"big{i}.tfrecord", [b"r%d" % j for j in range(100)]) for i in range(2)]
    ds = TFRecordDataset(big, num_parallel_reads=2)
    state = saved_state(ds, 3)
    opened_files = [s["inner"]["path"] for s in state["state"]["slots"] if s and s["inner"] and s["inner"]["path"]]
    assert opened_files
    write_records(opened_files[0], [b"other"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StateMismatchError, match="changed since the checkpoint"):
            load(ds, state)


def test_list_files_pipeline_still_resumes_with_autotune(tf_files):
    assert_resumes(lambda: _files_pipeline(tf_files).prefetch(AUTOTUNE), ks=[0, 4, 9, 15])


# ---------------------------------------------------------------- buffers saved as provenances


def _shuffled_records(tf_files):
    """A shuffle buffer of records from every file: saved as [file, offset] references."""
    return Dataset.from_tensor_slices(tf_files).interleave(TFRecordDataset, cycle_length=3).shuffle(12, seed=0)


def _provenance_state(tf_files):
    ds = _shuffled_records(tf_files)
    state = saved_state(ds, 2)
    buffer = state["state"]["buffer"]
    assert set(buffer) == {"sources", "refs"} and len(buffer["refs"]) == 2 * 11
    return ds, state, buffer


def test_a_provenance_naming_a_file_outside_the_list_is_refused_before_it_is_opened(tf_files, opened):
    ds, state, buffer = _provenance_state(tf_files)
    buffer["sources"][0][0] = "/etc/passwd"  # the interleave element that opened the file
    with pytest.raises(StateError, match="/etc/passwd") as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["buffer"]["sources"][0][0]'
    ds, state, buffer = _provenance_state(tf_files)
    buffer["sources"][0][1][0] = "/etc/passwd"  # the file the inner TFRecordDataset read
    with pytest.raises(StateError, match="not in this pipeline's file list") as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["buffer"]["sources"][0][1][0]'
    assert "/etc/passwd" not in opened


@pytest.mark.parametrize("shift", [1, 5, -1])
def test_a_provenance_offset_that_is_not_a_record_boundary_is_refused(tf_files, shift):
    ds, state, buffer = _provenance_state(tf_files)
    k = next(k for k in range(1, len(buffer["refs"]), 2) if buffer["refs"][k] > 0)
    buffer["refs"][k] += shift
    with pytest.raises(StateError, match="no record") as e:
        load(ds, state)
    assert e.value.field == f'state["state"]["buffer"]["refs"][{k}]'


def test_a_provenance_offset_past_the_end_is_refused(tf_files):
    ds, state, buffer = _provenance_state(tf_files)
    buffer["refs"][1] = os.path.getsize(tf_files[0]) * 4
    with pytest.raises(StateError) as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["buffer"]["refs"][1]'


@pytest.mark.parametrize("bad, field", [
    ({"sources": [], "refs": [0, 0]}, '["refs"][0]'),
    ({"sources": [None], "refs": [1, 0]}, '["refs"][0]'),
    ({"sources": [[1, 2]], "refs": [0]}, '["refs"]'),
    ({"sources": [[1, 2]], "refs": [0, 0] * 13}, '["refs"]'),
    ({"sources": [[1]], "refs": [0, 0]}, '["sources"][0]'),
    ({"sources": [[1, 2]], "refs": [0, "x"]}, '["sources"][0][0]'),
    ({"refs": []}, ""),
])
def test_malformed_provenances_name_the_field(tf_files, bad, field):
    ds, state, _ = _provenance_state(tf_files)
    state["state"]["buffer"] = bad
    with pytest.raises(StateError) as e:
        load(ds, state)
    assert e.value.field == 'state["state"]["buffer"]' + field


def test_provenances_for_a_buffer_of_mapped_elements_are_refused(tf_files):
    ds, state, buffer = _provenance_state(tf_files)
    mapped = (Dataset.from_tensor_slices(tf_files).interleave(TFRecordDataset, cycle_length=3).map(bytes)
              .shuffle(12, seed=0))
    other = saved_state(mapped, 2)
    assert isinstance(other["state"]["buffer"], list)  # a map's outputs cannot be re-read: saved as they are
    other["state"]["buffer"] = buffer
    with pytest.raises(StateError, match="cannot re-read") as e:
        load(mapped, other)
    assert e.value.field == 'state["state"]["buffer"]'


def test_a_file_changed_under_a_provenance_is_refused(tf_files):
    ds, state, buffer = _provenance_state(tf_files)
    changed = buffer["sources"][0][1][0]
    write_records(changed, [b"other records"] * 9)
    with pytest.raises(StateMismatchError, match="changed since the checkpoint") as e:
        load(ds, state)
    assert changed in str(e.value) and "--no-resume" in str(e.value)
