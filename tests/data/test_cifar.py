"""CIFAR-10/100 archives (binary and python versions, built here in the official layouts) → TFRecord shards.

The archives cannot be downloaded on this machine, so each test writes a small one: the same
members, record layout and pickled dicts as the official files, with a few records per batch.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import tarfile

import numpy as np
import pytest
from PIL import Image

from conveyor.cli.main import main
from conveyor.data import FixedLenFeature, TFRecordDataset, parse_single_example
from conveyor.data.cifar import CifarUnpickler, UnsafePickleError, convert_cifar, read_cifar
from conveyor.data.convert import ConversionError
from peak_memory import peak_growth

PER_BATCH = 3
NAMES10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
NAMES100 = [f"fine{i}" for i in range(100)]
COARSE100 = [f"coarse{i}" for i in range(20)]
SPEC = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")}


def _pixels(n: int, seed: int) -> np.ndarray:
    pixels = np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)
    pixels[:, -16:] = 0  # trailing zero bytes, which a fixed-width bytes array would silently drop
    return pixels


def _cifar10(total=6 * PER_BATCH):
    pixels = _pixels(total, 0)
    labels = np.arange(total) % 10
    return [(pixels[i:i + PER_BATCH], labels[i:i + PER_BATCH]) for i in range(0, total, PER_BATCH)]


def _py_pickle(obj) -> bytes:
    """As the official files are: numpy arrays under numpy.core.multiarray._reconstruct (the pickles
    were written by Python 2 with numpy 1; protocol 3 keeps bytes free of _codecs.encode)."""
    data = pickle.dumps(obj, protocol=3)
    data = data.replace(b"cnumpy._core.multiarray\n_reconstruct\n", b"cnumpy.core.multiarray\n_reconstruct\n")
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in data or b"_reconstruct" not in data
    return data


class _Zeros(io.RawIOBase):
    """``n`` zero bytes, streamed: a member of gigabytes in an archive of kilobytes."""

    def __init__(self, n: int):
        self.left = n

    def readable(self):
        return True

    def readinto(self, b):
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


def _tar(path, folder: str, members: dict[str, bytes | int]):
    """An archive of ``folder/<name>`` members; an int member is that many zero bytes."""
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(folder)
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = data if isinstance(data, int) else len(data)
            tar.addfile(info, io.BufferedReader(_Zeros(data), 1 << 20) if isinstance(data, int) else io.BytesIO(data))
    return path


def _batch_names(python: bool):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return names if python else [f"{n}.bin" for n in names]


def cifar10_binary(tmp_path, batches=None, **replace):
    batches = batches or _cifar10()
    members = {name: np.concatenate([lab[:, None].astype(np.uint8), pix], axis=1).tobytes()
               for name, (pix, lab) in zip(_batch_names(False), batches, strict=True)}
    members["batches.meta.txt"] = ("\n".join(NAMES10) + "\n\n").encode()
    members.update(replace)
    return _tar(tmp_path / "cifar-10-binary.tar.gz", "cifar-10-batches-bin", members)


def cifar10_python_members(batches=None):
    batches = batches or _cifar10()
    members = {}
    for name, (pix, lab) in zip(_batch_names(True), batches, strict=True):
        members[name] = _py_pickle({b"batch_label": f"{name} of 6".encode(), b"labels": [int(x) for x in lab],
                                    b"data": pix, b"filenames": [f"img{i}.png".encode() for i in range(len(pix))]})
    members["batches.meta"] = _py_pickle({b"label_names": [n.encode() for n in NAMES10],
                                          b"num_cases_per_batch": PER_BATCH, b"num_vis": 3072})
    return members


def cifar10_python(tmp_path, **replace):
    members = {**cifar10_python_members(), **replace}
    return _tar(tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py", members)


def _cifar100_arrays():
    pixels = _pixels(8, 1)
    fine = np.array([0, 99, 5, 42, 7, 63, 1, 2])
    coarse = np.array([19, 0, 3, 11, 4, 13, 2, 9])
    return {"train": (pixels[:5], fine[:5], coarse[:5]), "test": (pixels[5:], fine[5:], coarse[5:])}


def cifar100_archive(tmp_path, python: bool):
    members = {}
    for split, (pix, fine, coarse) in _cifar100_arrays().items():
        if python:
            members[split] = _py_pickle({b"data": pix, b"fine_labels": fine.tolist(),
                                         b"coarse_labels": coarse.tolist(), b"batch_label": b"x", b"filenames": []})
        else:
            labels = np.stack([coarse, fine], axis=1).astype(np.uint8)  # coarse byte first, then fine
            members[f"{split}.bin"] = np.concatenate([labels, pix], axis=1).tobytes()
    if python:
        members["meta"] = _py_pickle({b"fine_label_names": [n.encode() for n in NAMES100],
                                      b"coarse_label_names": [n.encode() for n in COARSE100]})
    else:
        members["fine_label_names.txt"] = "\n".join(NAMES100).encode()
        members["coarse_label_names.txt"] = "\n".join(COARSE100).encode()
    if python:
        return _tar(tmp_path / "cifar-100-python.tar.gz", "cifar-100-python", members)
    return _tar(tmp_path / "cifar-100-binary.tar.gz", "cifar-100-binary", members)


def _records(out, split, spec=SPEC):
    files = sorted(str(p) for p in out.glob(f"{split}-*.tfrecord"))
    return [parse_single_example(r, spec) for r in TFRecordDataset(files)]


def _hwc(planes: np.ndarray) -> np.ndarray:
    return planes.reshape(3, 32, 32).transpose(1, 2, 0)


def _by_label_then_pixels(rows):
    return sorted(rows, key=lambda r: (int(r["label"]), bytes(r["image"])))


# ------------------------------------------------------------------------------ CIFAR-10


@pytest.mark.parametrize("version", ["binary", "python"])
def test_cifar10_archive_becomes_train_and_test_shards_of_png(tmp_path, version):
    archive = (cifar10_binary if version == "binary" else cifar10_python)(tmp_path)
    out = tmp_path / "out"
    summary = convert_cifar(archive, out, shards=2)
    assert sorted(p.name for p in out.glob("*.tfrecord")) == [
        "test-00000-of-00002.tfrecord", "test-00001-of-00002.tfrecord",
        "train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    assert {k: s["num_records"] for k, s in summary["splits"].items()} == {"train": 15, "test": 3}
    assert json.loads((out / "dataset.json").read_text()) == summary
    assert (out / "classes.txt").read_text().splitlines() == NAMES10

    batches = _cifar10()
    want = {"train": batches[:5], "test": batches[5:]}
    for split, parts in want.items():
        rows = _records(out, split)
        pixels = np.concatenate([p for p, _ in parts])
        labels = np.concatenate([lab for _, lab in parts])
        got = {(int(r["label"]), np.asarray(Image.open(io.BytesIO(r["image"]))).tobytes()) for r in rows}
        assert got == {(int(lab), _hwc(pix).tobytes()) for pix, lab in zip(pixels, labels, strict=True)}
        assert len(rows) == len(labels)


def test_both_versions_of_an_archive_give_identical_shards(tmp_path):
    a = convert_cifar(cifar10_binary(tmp_path), tmp_path / "a", shards=2)
    b = convert_cifar(cifar10_python(tmp_path), tmp_path / "b", shards=2)
    for name in ("train-00000-of-00002.tfrecord", "test-00001-of-00002.tfrecord", "classes.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a["splits"]["train"]["features"] == b["splits"]["train"]["features"]


def test_raw_layout_is_tensorflows_generator_layout(tmp_path):
    """tensorflow/models generate_cifar10_tfrecords.py: image = the 3,072 bytes of planes, label = int64."""
    out = tmp_path / "out"
    summary = convert_cifar(cifar10_python(tmp_path), out, shards=1, image_format="raw")
    assert set(summary["splits"]["test"]["features"]) == {"image", "label"}
    rows = _records(out, "test")
    pixels, labels = _cifar10()[5]
    assert [(bytes(r["image"]), int(r["label"])) for r in rows] == [
        (pix.tobytes(), int(lab)) for pix, lab in zip(pixels, labels, strict=True)]
    assert all(len(r["image"]) == 3072 for r in rows)


def test_extracted_folder_reads_like_the_archive(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name, data in cifar10_python_members().items():
        (folder / name).write_bytes(data)
    (tmp_path / "arc").mkdir()
    from_folder = read_cifar(folder)
    from_parent = read_cifar(tmp_path)
    from_archive = read_cifar(cifar10_python(tmp_path / "arc"))
    for got in (from_folder, from_parent):
        assert got.layout.archive == "cifar-10-python.tar.gz"
        for split in ("train", "test"):
            assert (got.pixels[split] == from_archive.pixels[split]).all()
            assert (got.labels[split]["label"] == from_archive.labels[split]["label"]).all()


# ------------------------------------------------------------------------------ CIFAR-100


@pytest.mark.parametrize("python", [False, True], ids=["binary", "python"])
def test_cifar100_has_fine_and_coarse_labels(tmp_path, python):
    out = tmp_path / "out"
    summary = convert_cifar(cifar100_archive(tmp_path, python), out, shards=1)
    assert set(summary["splits"]["train"]["features"]) == {"image", "label", "coarse_label"}
    assert (out / "classes.txt").read_text().splitlines() == NAMES100
    assert (out / "coarse_classes.txt").read_text().splitlines() == COARSE100
    spec = {**SPEC, "coarse_label": FixedLenFeature([], "int64")}
    for split, (pix, fine, coarse) in _cifar100_arrays().items():
        rows = _records(out, split, spec)
        got = [(int(r["label"]), int(r["coarse_label"]), np.asarray(Image.open(io.BytesIO(r["image"]))).tobytes())
               for r in rows]
        assert got == [(int(f), int(c), _hwc(p).tobytes()) for p, f, c in zip(pix, fine, coarse, strict=True)]


# ------------------------------------------------------------------------------ damage


def test_truncated_record_is_named_and_nothing_is_written(tmp_path):
    good = cifar10_binary(tmp_path)
    batch = read_cifar(good).pixels["train"]  # any bytes of the right kind
    cut = np.concatenate([np.zeros((3, 1), np.uint8), batch[:3]], axis=1).tobytes()[:-100]
    archive = cifar10_binary(tmp_path, **{"data_batch_3.bin": cut})
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"data_batch_3\.bin in .* is 9119 bytes, not a whole number of "
                                              r"3073-byte CIFAR-10 records .*truncated"):
        convert_cifar(archive, out)
    assert not out.exists()


def test_cut_off_archive_is_damaged(tmp_path):
    archive = cifar10_binary(tmp_path)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"is damaged or incomplete .*download it again from "
                                              r"https://www\.cs\.toronto\.edu/~kriz/cifar-10-binary\.tar\.gz"):
        convert_cifar(archive, tmp_path / "out")


def test_not_a_tar_archive(tmp_path):
    bogus = tmp_path / "cifar-10-binary.tar.gz"
    bogus.write_bytes(b"<html>not found</html>")
    with pytest.raises(ConversionError, match="damaged or not a tar archive"):
        convert_cifar(bogus, tmp_path / "out")


def test_missing_member_is_named(tmp_path):
    members = cifar10_python_members()
    del members["data_batch_4"]
    archive = _tar(tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py", members)
    with pytest.raises(ConversionError, match=r"lacks cifar-10-batches-py/data_batch_4: not a complete "
                                              r"cifar-10-python\.tar\.gz"):
        convert_cifar(archive, tmp_path / "out")


def test_label_out_of_range_is_refused(tmp_path):
    batches = _cifar10()
    batches[1] = (batches[1][0], np.array([1, 12, 3]))
    with pytest.raises(ConversionError, match=r"data_batch_2\.bin in .*: record 1 has label 12, outside 0-9"):
        read_cifar(cifar10_binary(tmp_path, batches))


def test_damaged_pickle_is_named(tmp_path):
    data = cifar10_python_members()["test_batch"]
    archive = cifar10_python(tmp_path, test_batch=data[: len(data) // 2])
    with pytest.raises(ConversionError, match=r"test_batch in .* is damaged: not a readable pickle"):
        read_cifar(archive)


def test_a_class_name_across_lines_is_refused(tmp_path):
    # classes.txt names label i on line i: "cat\ndog" as one name shifted every later class by a line
    names = [n.encode() for n in NAMES10]
    names[3] = b"cat\ndog"
    meta = _py_pickle({b"label_names": names, b"num_cases_per_batch": PER_BATCH, b"num_vis": 3072})
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=r"batches\.meta in .* \('label_names'\): class 3 is named 'cat\\ndog', "
                                              r"which is not one line of classes\.txt"):
        convert_cifar(cifar10_python(tmp_path, **{"batches.meta": meta}), out)
    assert not out.exists()


# ------------------------------------------------------------------------------ bombs: refused before allocating

_BIG = 256 << 20  # what each bomb below makes the converter allocate, before the checks (or more)
_BOUND = 100 << 20  # what refusing it may cost
_READ = """
try:
    result = int(read_cifar(sys.argv[1]).pixels["train"][0, 0])  # a pixel: the arrays are plain numbers
except ConversionError as e:
    result = str(e)
"""


def _read_in_a_process(path) -> tuple[str | int, int]:
    """read_cifar's error for ``path`` (or its first pixel) in a fresh process, and how much its peak
    memory grew on the way."""
    return peak_growth("from conveyor.data.cifar import read_cifar\n"
                       "from conveyor.data.convert import ConversionError", _READ, str(path))


def _refused_in_a_process(path) -> tuple[str, int]:
    error, growth = _read_in_a_process(path)
    assert isinstance(error, str), f"the bomb was read without an error (pixel {error})"
    return error, growth


def _laughs(fanout: int) -> bytes:
    """A CIFAR-10 batch of 1 row whose 'labels' are 3 nested lists of ``fanout`` memo references each:
    a few hundred bytes standing for fanout**3 integers (the issue's 597-byte archive)."""
    def key(s):
        return b"X" + len(s).to_bytes(4, "little") + s.encode()
    lists = (b"]q\x00(" + b"K\x01" * fanout + b"e0" + b"]q\x01(" + b"h\x00" * fanout + b"e0"
             + b"]q\x02(" + b"h\x01" * fanout + b"e")
    row = pickle.dumps(np.zeros((1, 3072), np.uint8), protocol=3)[2:-1]
    return b"\x80\x02}(" + key("labels") + lists + key("data") + row + b"u."


class _Reduces:
    """Pickles as the reduce tuple it is given: crafted calls to the globals the unpickler admits."""

    def __init__(self, *reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


_RECONSTRUCT = np.ndarray.__reduce__(np.zeros(0, np.uint8))[0]


def _batch_with(data) -> bytes:
    return pickle.dumps({"data": data, "labels": [0]}, protocol=3)  # 3: bytes without _codecs.encode


_CRAFTED = {
    # labels: a 4 KB list of lists of memo references that np.asarray expanded to 400**3 int64s (512 MB)
    "memo labels": (_laughs(400), r"data_batch_1 in .*: 'labels' must be a list of 1 integers .*got 400 items"),
    # a 9-byte pickle storing into memo slot 2**25: the unpickler zeroes a table of 2**26 pointers (512 MB)
    "memo slot": (b"\x80\x02]r" + (1 << 25).to_bytes(4, "little") + b".",
                  r"data_batch_1 in .* is damaged: its opcode 3 stores into memo slot 33554432, which no pickler "
                  r"writes"),
    # numpy.ndarray called as a function: 2.5e7 objects, each set to None (200 MB)
    "ndarray call": (_batch_with(_Reduces(np.ndarray, ((25_000_000,), "O"))),
                     r"data_batch_1 in .* is damaged: not a readable pickle \(TypeError"),
    # _reconstruct of a shape other than numpy's (0,): allocated before __setstate__ checks the data
    "reconstruct shape": (_batch_with(_Reduces(_RECONSTRUCT, (np.ndarray, (_BIG,), b"b"))),
                          r"data_batch_1 in .* is damaged: .*not as numpy pickles one"),
    # an object array given fewer items than its shape: numpy leaves the rest unset, and crashes
    "object array": (_batch_with(_Reduces(_RECONSTRUCT, (np.ndarray, (0,), b"b"),
                                          (1, (1, 3072), np.dtype(object), False, [1]))),
                     r"data_batch_1 in .* is damaged: .*dtype 'O8' is not a plain number type"),
    # a uint8 dtype whose state flags it as holding objects: numpy would take the pixels for pointers
    "object flags": (_batch_with(_Reduces(_RECONSTRUCT, (np.ndarray, (0,), b"b"),
                                          (1, (1, 3072), _Reduces(np.dtype, ("u1", False, True),
                                                                  (3, "|", None, None, None, -1, -1, 63)),
                                           False, b"A" * 3072))), None),
}


@pytest.mark.parametrize("bomb", list(_CRAFTED))
def test_a_crafted_batch_pickle_is_refused_within_bounded_memory(tmp_path, bomb):
    data, match = _CRAFTED[bomb]
    assert len(data) < 10_000
    archive = cifar10_python(tmp_path, data_batch_1=data)
    if match is None:  # numpy's shared uint8 dtype ignores the flags: the batch reads as plain pixels
        pixel, growth = _read_in_a_process(archive)
        assert pixel == ord("A")
    else:
        error, growth = _refused_in_a_process(archive)
        assert re.search(match, error), error
    assert growth < _BOUND, growth


def test_a_member_declaring_gigabytes_is_refused_before_it_is_read(tmp_path):
    # The 3 MB archive declaring a 3 GiB member, scaled down: 256 MiB of zeros in ~250 KB.
    archive = cifar10_python(tmp_path, data_batch_1=_BIG)
    assert archive.stat().st_size < 2 << 20
    error, growth = _refused_in_a_process(archive)
    assert re.search(r"cifar-10-batches-py/data_batch_1 in .* is 268435456 bytes, more than the \d+ an official "
                     r"cifar-10-python\.tar\.gz member can hold: not a CIFAR archive", error), error
    assert growth < _BOUND, growth


def test_a_tar_extension_header_declaring_gigabytes_is_refused_before_it_is_read(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py")
        info.type, info.size = tarfile.XHDTYPE, _BIG  # a pax header, which tarfile reads whole
        tar.addfile(info, io.BufferedReader(_Zeros(_BIG), 1 << 20))
    error, growth = _refused_in_a_process(archive)
    assert f"{archive} holds a tar extension header of {_BIG} bytes" in error
    assert growth < _BOUND, growth


def test_an_oversized_file_in_an_extracted_folder_is_refused_before_it_is_read(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name, data in cifar10_python_members().items():
        (folder / name).write_bytes(data)
    with open(folder / "data_batch_2", "r+b") as f:
        f.truncate(_BIG)  # sparse: no disk space
    error, growth = _refused_in_a_process(folder)
    assert f"{folder / 'data_batch_2'} is {_BIG} bytes, more than the" in error
    assert growth < _BOUND, growth


def test_an_archive_of_many_entries_is_refused(tmp_path):
    members = {**{f"junk{i}": b"" for i in range(100)}, **cifar10_python_members()}
    with pytest.raises(ConversionError, match=r"holds more than 64 entries, and an official cifar-10-python\.tar"
                                              r"\.gz fewer than 10"):
        read_cifar(_tar(tmp_path / "cifar-10-python.tar.gz", "cifar-10-batches-py", members))


# ------------------------------------------------------------------------------ the unpickler


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Evals:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


@pytest.mark.parametrize("payload", ["os.system", "eval"])
def test_pickle_with_any_other_global_is_refused_without_running_it(tmp_path, payload):
    marker = tmp_path / "ran"
    evil = _RunsACommand(marker) if payload == "os.system" else _Evals()
    # Protocol 2 spells builtins as Python 2's __builtin__.
    spelled = rf"{os.system.__module__}\.system" if payload == "os.system" else r"__builtin__\.eval"
    batch = pickle.dumps({"data": evil, "labels": [0]}, protocol=2)  # str keys: no _codecs.encode first
    archive = cifar10_python(tmp_path, data_batch_2=batch)
    with pytest.raises(UnsafePickleError, match=rf"data_batch_2 in .* references the global {spelled}, which no "
                                                rf"CIFAR file contains; refusing to unpickle it"):
        convert_cifar(archive, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_unpickler_admits_exactly_what_the_official_files_reference():
    import pickletools

    data = cifar10_python_members()["data_batch_1"]
    referenced = {arg.replace("\n", ".").replace(" ", ".") for op, arg, _ in pickletools.genops(data)
                  if op.name == "GLOBAL"}
    assert referenced == {"numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype"}
    loaded = CifarUnpickler(io.BytesIO(data), "data_batch_1").load()
    assert loaded[b"data"].dtype == np.uint8 and loaded[b"data"].shape == (PER_BATCH, 3072)
    for module, name in (("numpy", "frombuffer"), ("numpy.core.numeric", "_frombuffer"), ("_codecs", "encode"),
                         ("builtins", "getattr"), ("numpy", "load")):
        with pytest.raises(UnsafePickleError, match=rf"references the global {module}\.{name}"):
            CifarUnpickler(io.BytesIO(b""), "x").find_class(module, name)


# ------------------------------------------------------------------------------ the command


def test_convert_command_reads_cifar_and_refuses_what_does_not_apply(tmp_path, capsys):
    archive = cifar10_binary(tmp_path)
    out = tmp_path / "out"
    assert main(["data", "convert", str(archive), str(out), "--shards", "2", "--image-format", "raw"]) == 0
    text = capsys.readouterr().out
    assert "train: 15 records in 2 shard(s)" in text and "test: 3 records in 2 shard(s)" in text
    assert len(_records(out, "train")[0]["image"]) == 3072

    assert main(["data", "convert", str(archive), str(out), "--split", "train=1"]) == 2
    assert "--split does not apply to a CIFAR archive" in capsys.readouterr().err
    assert main(["data", "convert", str(tmp_path / "cifar-10-python.tar.gz"), str(out)]) == 2
    assert "no such file; download it from https://www.cs.toronto.edu/~kriz/cifar.html" in capsys.readouterr().err
    np.savez(tmp_path / "x.npz", x=np.zeros(3))
    assert main(["data", "convert", str(tmp_path / "x.npz"), str(out), "--image-format", "raw"]) == 2
    assert "--image-format raw applies to CIFAR archives" in capsys.readouterr().err
