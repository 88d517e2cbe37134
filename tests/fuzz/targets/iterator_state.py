"""Fuzz target: `DatasetIterator.load_state_dict` + `next()` over tampered states; oracle: success or StateError.

The pipeline is the representative one (list_files -> interleave(TFRecordDataset) -> shuffle -> map
-> batch) over three tiny TFRecord files written once, at import, into a temporary folder. An input
starting with `{` is decoded as a JSON state as it is; any other input is a list of structured
mutations (3 bytes each: which field, what to put there) applied to a real saved state, so the
fuzzer reaches the checks deep inside the tree instead of stopping at the format marker.
"""

from __future__ import annotations

import json
import os
import warnings

import _common

from conveyor.data import Dataset, StateError, TFRecordDataset, TFRecordWriter

EXPECTED = (StateError,)  # StateMismatchError (other pipeline, changed file) is one



_DIR = _common.private_temp_dir("conveyor-fuzz-state-")
_FILES = []
for _i, _n in enumerate((3, 5, 4)):
    _FILES.append(os.path.join(_DIR, f"part-{_i}.tfrecord"))
    with TFRecordWriter(_FILES[-1]) as _w:
        for _j in range(_n):
            _w.write(b"rec-%d-%d" % (_i, _j) * (_j + 1))


def _size(record):
    # total: a tampered shuffle buffer may hold any element, and a user function's own failure on
    # it is not what this target looks for
    return len(record) if isinstance(record, bytes) else -1


_DS = (Dataset.list_files(os.path.join(_DIR, "*.tfrecord"), seed=1)
       .interleave(TFRecordDataset, cycle_length=2)
       .shuffle(4, seed=2)
       .map(_size)
       .batch(2))


def _saved(k: int) -> str:
    it = iter(_DS)
    for _ in range(k):
        next(it)
    text = json.dumps(it.state_dict())
    it.close()
    return text


_STATES = [_saved(k) for k in (0, 2, 4)]
_OTHER_FILE = _FILES[2]
_PALETTE = [None, -1, 0, 1, 3, 2**64, 1.5, "x", "/etc/passwd", _OTHER_FILE, [], {}, True, False,
            {"b": "cmVj"}, {"nd": "!", "dtype": "<i8", "shape": []}, {"nd": "AAAAAAAAAAA=", "dtype": "|O",
                                                                   "shape": [1]}, [None], "PCG64"]


def _places(node, out):
    """Every (container, key) in the state tree, in a stable order."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((node, key))
        _places(value, out)
    return out


def _mutate(state, ops: bytes) -> None:
    for i in range(0, min(len(ops), 24) - 2, 3):
        places = _places(state, [])
        if not places:
            return
        container, key = places[int.from_bytes(ops[i:i + 2], "little") % len(places)]
        choice = ops[i + 2]
        value = container[key]
        if choice < len(_PALETTE):
            container[key] = json.loads(json.dumps(_PALETTE[choice]))
        elif choice < 40 and type(value) is int:
            container[key] = value + (choice - 30)  # near the real value: off-by-one territory
        elif choice < 50 and isinstance(value, list) and value:
            del value[choice % len(value)]
        elif choice < 60 and isinstance(value, list) and value:
            value.append(json.loads(json.dumps(value[choice % len(value)])))
        elif choice < 70 and isinstance(container, dict):
            del container[key]
        else:
            other_container, other_key = places[choice % len(places)]
            container[key] = json.loads(json.dumps(other_container[other_key]))


def target(data: bytes) -> None:
    """Load a (tampered) state into a fresh iterator and read a few batches."""
    if data[:1] == b"{":
        try:
            state = json.loads(data.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            return  # not JSON: the checkpoint reader's business, not the iterator's
    else:
        state = json.loads(_STATES[data[0] % len(_STATES)] if data else _STATES[0])
        _mutate(state, data[1:])
    it = iter(_DS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a state without size/mtime resumes with a warning
            it.load_state_dict(state)
            for _ in range(3):
                next(it)
    except StopIteration:
        pass
    finally:
        it.close()


SEEDS = [s.encode() for s in _STATES] + [b"\x00", b"\x01\x10\x00\x1f", b"\x02\x20\x00\x08\x05\x00\x41"]
