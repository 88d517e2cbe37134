"""convert: arrays and image folders → sharded TFRecord files that read back exactly."""

from __future__ import annotations

import io
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from conveyor.data import FixedLenFeature, TFRecordDataset, VarLenFeature, parse_single_example
from conveyor.data import convert as convert_mod
from conveyor.data.convert import (
    ConversionError,
    convert_arrays,
    convert_image_folder,
    load_npz,
    shard_filename,
)


def _arrays(n=10):
    return {
        "idx": np.arange(n, dtype=np.int64),
        "x": (np.arange(n * 6, dtype=np.float32) / 7).reshape(n, 2, 3),
        "flag": np.arange(n) % 2 == 0,
        "name": np.array([f"row{i}" for i in range(n)]),
        "small": np.arange(n, dtype=np.uint8),
    }


_SPEC = {
    "idx": FixedLenFeature([], "int64"),
    "x": FixedLenFeature([6], "float32"),
    "x/shape": FixedLenFeature([2], "int64"),
    "flag": FixedLenFeature([], "int64"),
    "name": FixedLenFeature([], "string"),
    "small": FixedLenFeature([], "int64"),
}


def _files(out, prefix="train"):
    return sorted(str(out / f) for f in os.listdir(out) if f.startswith(prefix + "-"))


def _read(files, spec, compression_type=None):
    ds = TFRecordDataset(files, compression_type=compression_type)
    return [parse_single_example(r, spec) for r in ds]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_arrays_round_trip_through_shards(tmp_path, compression):
    arrays = _arrays(10)
    summary = convert_arrays(arrays, tmp_path, shards=4, compression_type=compression, source="mem")
    files = _files(tmp_path)
    assert [os.path.basename(f) for f in files] == [shard_filename("train", k, 4) for k in range(4)]
    assert files[0].endswith("train-00000-of-00004.tfrecord")

    rows = sorted(_read(files, _SPEC, compression), key=lambda r: int(r["idx"]))
    assert [int(r["idx"]) for r in rows] == list(range(10))
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(r["x"].reshape(r["x/shape"]), arrays["x"][i])
        assert bool(r["flag"]) == arrays["flag"][i]
        assert r["name"] == f"row{i}".encode()
        assert int(r["small"]) == i

    split = summary["splits"]["train"]
    assert [s["records"] for s in split["shards"]] == [3, 3, 2, 2]  # round-robin: sizes differ by <= 1
    assert split["num_records"] == 10 and split["compression"] == compression
    assert split["features"]["x"] == {"dtype": "float32", "shape": [2, 3], "source_dtype": "float32"}
    assert json.loads((tmp_path / "dataset.json").read_text()) == summary


def test_round_robin_order_within_shards(tmp_path):
    convert_arrays({"idx": np.arange(7)}, tmp_path, shards=3)
    per_shard = [[int(r["idx"]) for r in _read([f], {"idx": FixedLenFeature([], "int64")})]
                 for f in _files(tmp_path)]
    assert per_shard == [[0, 3, 6], [1, 4], [2, 5]]


def test_scalar_rows_have_no_shape_feature(tmp_path):
    convert_arrays({"idx": np.arange(3)}, tmp_path)
    (row,) = _read(_files(tmp_path)[:1], {"idx/shape": VarLenFeature("int64")})[:1]
    assert row["idx/shape"].size == 0


def test_shuffle_with_seed_and_splits(tmp_path):
    n = 50
    splits = {"train": 0.8, "test": 0.2}
    summary = convert_arrays({"idx": np.arange(n)}, tmp_path, shards=2, splits=splits, seed=3)
    spec = {"idx": FixedLenFeature([], "int64")}
    train = [int(r["idx"]) for r in _read(_files(tmp_path, "train"), spec)]
    test = [int(r["idx"]) for r in _read(_files(tmp_path, "test"), spec)]
    assert len(train) == 40 and len(test) == 10
    assert sorted(train + test) == list(range(n))
    assert train != sorted(train)  # shuffled
    assert summary["splits"]["train"]["seed"] == 3
    assert set(summary["splits"]) == {"train", "test"}

    again = tmp_path / "again"
    convert_arrays({"idx": np.arange(n)}, again, shards=2, splits={"train": 0.8, "test": 0.2}, seed=3)
    assert [int(r["idx"]) for r in _read(_files(again, "test"), spec)] == test  # same seed, same rows


def test_splits_must_sum_to_one(tmp_path):
    with pytest.raises(ConversionError, match="sum to 0.9"):
        convert_arrays({"idx": np.arange(5)}, tmp_path, splits={"train": 0.8, "test": 0.1})


def test_arrays_of_different_lengths_are_named(tmp_path):
    with pytest.raises(ConversionError, match=r"x: 3, y: 4"):
        convert_arrays({"x": np.zeros(3), "y": np.zeros(4)}, tmp_path)
    assert not list(tmp_path.iterdir())


def test_image_key_is_stored_as_png_or_jpeg(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(3, 5, 4, 3), dtype=np.uint8)
    gray = np.full((3, 5, 4), 128, dtype=np.uint8)
    summary = convert_arrays({"image": images, "gray": gray, "label": np.arange(3)}, tmp_path,
                             image_keys=["image", "gray"])
    spec = {"image": FixedLenFeature([], "string"), "gray": FixedLenFeature([], "string"),
            "label": FixedLenFeature([], "int64")}
    for r in _read(_files(tmp_path), spec):
        i = int(r["label"])
        assert r["image"].startswith(b"\x89PNG")
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(r["image"]))), images[i])
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(r["gray"]))), gray[i])
    assert summary["splits"]["train"]["features"]["image"]["encoding"] == "png"

    jpeg_dir = tmp_path / "jpeg"
    convert_arrays({"gray": gray}, jpeg_dir, image_keys=["gray"], image_format="jpeg", quality=95)
    (r,) = _read(_files(jpeg_dir), {"gray": FixedLenFeature([], "string")})[:1]
    assert r["gray"].startswith(b"\xff\xd8\xff")
    assert np.abs(np.asarray(Image.open(io.BytesIO(r["gray"]))).astype(int) - 128).max() <= 2


def test_bad_image_key_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="uint8"):
        convert_arrays({"x": np.zeros((2, 3, 3), np.float32)}, tmp_path, image_keys=["x"])
    with pytest.raises(ConversionError, match="not one of the arrays"):
        convert_arrays({"x": np.zeros((2, 3, 3), np.uint8)}, tmp_path, image_keys=["y"])


def test_load_npz_refuses_object_arrays(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, a=np.array([b"x", None], dtype=object))
    with pytest.raises(ConversionError, match="object array"):
        load_npz(path)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_npz(tmp_path / "missing.npz")


def test_existing_shards_need_overwrite_and_stale_ones_go(tmp_path):
    convert_arrays({"idx": np.arange(6)}, tmp_path, shards=3)
    with pytest.raises(ConversionError, match="--overwrite"):
        convert_arrays({"idx": np.arange(6)}, tmp_path, shards=2)
    convert_arrays({"idx": np.arange(6)}, tmp_path, shards=2, overwrite=True)
    names = [os.path.basename(f) for f in _files(tmp_path)]
    assert names == [shard_filename("train", k, 2) for k in range(2)]


def test_summary_keeps_other_prefixes(tmp_path):
    convert_arrays({"idx": np.arange(6)}, tmp_path, prefix="train")
    summary = convert_arrays({"idx": np.arange(2)}, tmp_path, prefix="test")
    assert {k: v["num_records"] for k, v in summary["splits"].items()} == {"train": 6, "test": 2}


# ------------------------------------------------------------------------------ image folders


def _png(value: int, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (4, 3), value).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "photos"
    for c, n in (("dog", 2), ("cat", 3)):
        (root / c).mkdir(parents=True)
        for i in range(n):
            (root / c / f"{i}.png").write_bytes(_png(i * 50 if c == "cat" else (i, 9, 9)))
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    return root


def test_image_folder_labels_classes_and_bytes(tmp_path, folder):
    out = tmp_path / "out"
    summary = convert_image_folder(folder, out, shards=2)
    assert (out / "classes.txt").read_text() == "cat\ndog\n"
    spec = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64"),
            "label/name": FixedLenFeature([], "string"), "filename": FixedLenFeature([], "string")}
    rows = _read(_files(out), spec)
    got = sorted((r["filename"].decode(), int(r["label"]), r["label/name"].decode()) for r in rows)
    assert got == [("cat/0.png", 0, "cat"), ("cat/1.png", 0, "cat"), ("cat/2.png", 0, "cat"),
                   ("dog/0.png", 1, "dog"), ("dog/1.png", 1, "dog")]
    for r in rows:  # "keep": the file's bytes, unchanged
        assert r["image"] == (folder / r["filename"].decode()).read_bytes()
    split = summary["splits"]["train"]
    assert split["classes"] == ["cat", "dog"]
    assert split["skipped_files"] == ["cat/notes.txt"]
    assert [s["records"] for s in split["shards"]] == [3, 2]


def test_image_folder_reencodes(tmp_path, folder):
    out = tmp_path / "out"
    convert_image_folder(folder, out, image_format="jpeg", quality=80)
    rows = _read(_files(out), {"image": FixedLenFeature([], "string")})
    assert all(r["image"].startswith(b"\xff\xd8\xff") for r in rows)


def test_empty_class_folder_is_an_error(tmp_path, folder):
    (folder / "empty").mkdir()
    with pytest.raises(ConversionError, match="empty holds no image files"):
        convert_image_folder(folder, tmp_path / "out")


def test_folder_without_classes_is_an_error(tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(_png(1))
    with pytest.raises(ConversionError, match="one sub-folder per class"):
        convert_image_folder(tmp_path / "flat", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert_image_folder(tmp_path / "nowhere", tmp_path / "out")


@pytest.mark.parametrize("name", ["two\nlines", "carriage\rreturn", "line\u2028separator"])
def test_a_class_folder_named_across_lines_is_refused(tmp_path, folder, name):
    # classes.txt names class i on line i: a newline in a name shifted every later class by a line
    (folder / name).mkdir()
    (folder / name / "0.png").write_bytes(_png(7))
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=rf"{folder}: class \d is named {re.escape(repr(name))}, which is not "
                                              rf"one line of classes\.txt .*rename that folder"):
        convert_image_folder(folder, out)
    assert _leftovers(out) == []


def _leftovers(out):
    return sorted(os.listdir(out)) if out.exists() else []


def test_unreadable_image_is_named_and_leaves_no_shard(tmp_path, folder):
    (folder / "dog" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"dog/1\.png"):
        convert_image_folder(folder, out, shards=2)
    assert _leftovers(out) == []  # no final shard, no temporary file, no summary


def test_interrupted_conversion_leaves_no_final_named_shard(tmp_path, monkeypatch):
    real = convert_mod.encode_example
    calls = []

    def failing(features):
        calls.append(1)
        if len(calls) == 7:  # mid-way through the second of three shards
            raise KeyboardInterrupt
        return real(features)

    monkeypatch.setattr(convert_mod, "encode_example", failing)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert_arrays({"idx": np.arange(12)}, out, shards=3)
    assert _leftovers(out) == []

    monkeypatch.setattr(convert_mod, "encode_example", real)  # the next run starts clean
    convert_arrays({"idx": np.arange(12)}, out, shards=3)
    assert len(_files(out)) == 3


def test_a_full_disk_names_the_shard_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    import conveyor.data.records.tfrecord as tfrecord_mod

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full (a device whose writes fail with ENOSPC)")
    real_open = open
    written = []

    def onto_a_full_disk(path, mode="r", buffering=-1):
        written.append(str(path))
        return real_open("/dev/full", mode, buffering)

    monkeypatch.setattr(tfrecord_mod, "open", onto_a_full_disk, raising=False)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left on device") as e:
        convert_arrays({"x": np.zeros((300, 4096), np.uint8)}, out, shards=2)
    assert e.value.errno == errno.ENOSPC and e.value.filename == written[-1]
    assert os.path.dirname(written[-1]) == str(out) and "train-0000" in written[-1]
    assert _leftovers(out) == []
