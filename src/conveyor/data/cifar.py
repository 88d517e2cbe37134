"""Read the official CIFAR-10 / CIFAR-100 archives and write them as TFRecord shards.

    summary = convert_cifar("cifar-10-binary.tar.gz", "data/cifar10", shards=8)
    conveyor data convert cifar-10-python.tar.gz data/cifar10 --shards 8      # the same, from the CLI

Four archives are read as downloaded from https://www.cs.toronto.edu/~kriz/cifar.html (or their
extracted folder): ``cifar-10-binary.tar.gz`` (``cifar-10-batches-bin/data_batch_{1..5}.bin``,
``test_batch.bin``: records of 1 label byte + 3,072 pixel bytes; ``batches.meta.txt``),
``cifar-10-python.tar.gz`` (``cifar-10-batches-py/data_batch_{1..5}``, ``test_batch``: pickled dicts
of ``data`` (uint8 N×3072) and ``labels``; ``batches.meta``), ``cifar-100-binary.tar.gz``
(``cifar-100-binary/train.bin``, ``test.bin``: 2 label bytes, coarse then fine, + 3,072;
``coarse_label_names.txt``, ``fine_label_names.txt``) and ``cifar-100-python.tar.gz``
(``cifar-100-python/train``, ``test``: ``data``, ``fine_labels``, ``coarse_labels``; ``meta``).
The 3,072 pixel bytes are the red, green and blue 32×32 planes, each row-major.

Members are read straight out of the archive, never extracted, so a tar file cannot write
outside the output folder. The pickles of the python version go through :class:`CifarUnpickler`,
which admits only the numpy globals those files reference.

What is written: ``train-*`` and ``test-*`` shards of ``tf.train.Example`` with ``image`` (PNG of
the 32×32×3 image by default; JPEG with ``image_format="jpeg"``; with ``"raw"``, the 3,072-byte
record of planes as is, the layout of tensorflow/models' ``generate_cifar10_tfrecords.py``),
``label`` (int64: the class, the fine class for CIFAR-100) and, for CIFAR-100, ``coarse_label``.
Next to them: ``dataset.json``, ``classes.txt`` (line i names label i) and, for CIFAR-100,
``coarse_classes.txt``. Both versions of an archive give identical shards.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import tarfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conveyor.data.convert import ConversionError, check_class_names, convert_arrays

__all__ = ["LAYOUTS", "CifarData", "CifarLayout", "CifarUnpickler", "UnsafePickleError", "convert_cifar",
           "detect_cifar", "read_cifar"]

PIXELS = 3 * 32 * 32
CIFAR_PAGE = "https://www.cs.toronto.edu/~kriz/cifar.html"
IMAGE_ENCODINGS = ("png", "jpeg", "raw")
TAR_ENDINGS = (".tar.gz", ".tgz", ".tar")


@dataclass(frozen=True)
class CifarLayout:
    """One official archive: where its files are and how their labels are stored."""

    archive: str  # the file name as downloaded
    folder: str  # its top folder
    binary: bool
    splits: Mapping[str, tuple[str, ...]]
    label_keys: tuple[str, ...]  # features, in the order of a binary record's label bytes
    num_classes: Mapping[str, int]  # feature → number of classes
    names: Mapping[str, str]  # feature → the member (binary: text file; python: meta key) naming its classes
    meta: str | None = None  # python version: the pickle holding the class names

    @property
    def dataset(self) -> str:
        return "CIFAR-100" if "coarse_label" in self.label_keys else "CIFAR-10"

    @property
    def url(self) -> str:
        return f"https://www.cs.toronto.edu/~kriz/{self.archive}"


_TRAIN10 = tuple(f"data_batch_{i}" for i in range(1, 6))
LAYOUTS = (
    CifarLayout("cifar-10-binary.tar.gz", "cifar-10-batches-bin", True,
                {"train": tuple(f"{n}.bin" for n in _TRAIN10), "test": ("test_batch.bin",)},
                ("label",), {"label": 10}, {"label": "batches.meta.txt"}),
    CifarLayout("cifar-10-python.tar.gz", "cifar-10-batches-py", False,
                {"train": _TRAIN10, "test": ("test_batch",)},
                ("label",), {"label": 10}, {"label": "label_names"}, meta="batches.meta"),
    CifarLayout("cifar-100-binary.tar.gz", "cifar-100-binary", True, {"train": ("train.bin",), "test": ("test.bin",)},
                ("coarse_label", "label"), {"coarse_label": 20, "label": 100},
                {"coarse_label": "coarse_label_names.txt", "label": "fine_label_names.txt"}),
    CifarLayout("cifar-100-python.tar.gz", "cifar-100-python", False, {"train": ("train",), "test": ("test",)},
                ("coarse_label", "label"), {"coarse_label": 20, "label": 100},
                {"coarse_label": "coarse_label_names", "label": "fine_label_names"}, meta="meta"),
)
# python version: the dict key holding each feature's labels
_PY_LABEL_KEY = {("CIFAR-10", "label"): "labels", ("CIFAR-100", "label"): "fine_labels",
                 ("CIFAR-100", "coarse_label"): "coarse_labels"}
_CLASS_FILES = {"label": "classes.txt", "coarse_label": "coarse_classes.txt"}


@dataclass
class CifarData:
    """An archive read into memory: per split, the records' pixel planes (N×3072 uint8) and labels."""

    layout: CifarLayout
    source: str
    pixels: dict[str, np.ndarray]
    labels: dict[str, dict[str, np.ndarray]]  # split → feature → int64 labels
    class_names: dict[str, list[str]]  # feature → names, index = label


# ------------------------------------------------------------------------------ the unpickler


class UnsafePickleError(ConversionError):
    """A pickle references a global that a CIFAR file never does; nothing of it was run."""


def _numpy_reconstruct() -> Any:
    # The function numpy itself pickles arrays with, taken from numpy rather than imported by name:
    # numpy 2 moved it to numpy._core, and importing numpy.core there warns.
    return np.ndarray.__reduce__(np.zeros(0, np.uint8))[0]


_RECONSTRUCT = _numpy_reconstruct()


class _NdarrayType:
    """What ``numpy.ndarray`` unpickles to: only a token for `_empty_array`. The class itself would be
    callable from the pickle, and ``ndarray((10**9,), "O")`` fills 8 GB with None."""


_NDARRAY = _NdarrayType()


def _empty_array(subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` as its pickles call it: an empty ndarray, filled by ``__setstate__``
    (which checks the data against the shape). Any other shape would be allocated before that check."""
    if subtype is not _NDARRAY or shape != (0,):
        raise pickle.UnpicklingError(f"an array is reconstructed as {subtype!r} of shape {shape!r}, not as numpy "
                                     f"pickles one (ndarray of shape (0,))")
    return _RECONSTRUCT(np.ndarray, (0,), b"b")


def _plain_dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """``numpy.dtype(spec, align, copy)`` for a plain number type, returned as numpy's shared instance.

    The pickle then sets that dtype's state, which numpy ignores for its shared instances: a copy
    would take any flags, and a uint8 flagged as holding objects makes numpy read pixels as pointers.
    """
    dtype = np.dtype(spec) if isinstance(spec, (str, bytes)) else None
    if dtype is None or dtype.kind not in "biuf" or dtype.isbuiltin != 1:
        raise pickle.UnpicklingError(f"the dtype {spec!r} is not a plain number type, which CIFAR arrays are")
    return dtype


class CifarUnpickler(pickle.Unpickler):
    """An unpickler that admits only the globals of the official CIFAR python-version files.

    Unpickling can call any importable function, so `pickle.load` is banned in this project
    (pyproject's banned-api). The CIFAR files are pickles, though, and torchvision users have them.
    This subclass is the sanctioned exception: every global goes through `find_class`, which returns
    only numpy's array reconstructor, `numpy.ndarray` and `numpy.dtype` — all that the files (written
    by Python 2's cPickle, protocol 2) reference; dicts, lists, strings and ints need no global.
    Anything else (``os.system``, ``builtins.eval``, ...) stops loading before it can be called.
    Those three are admitted only as the files use them: an empty array, a plain number dtype.
    """

    def __init__(self, file: io.BufferedIOBase, name: str):
        # latin1: the files are Python 2 pickles, and numpy needs their str data back byte for byte.
        super().__init__(file, encoding="latin1")
        self.name = name
        self.allowed = {  # each in the narrow form the files use it in (see the functions)
            ("numpy.core.multiarray", "_reconstruct"): _empty_array,  # how the official files spell it
            ("numpy._core.multiarray", "_reconstruct"): _empty_array,  # the same, pickled under numpy 2
            ("numpy", "ndarray"): _NDARRAY,
            ("numpy", "dtype"): _plain_dtype,
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            allowed = ", ".join(f"{m}.{n}" for m, n in self.allowed)
            raise UnsafePickleError(
                f"{self.name} references the global {module}.{name}, which no CIFAR file contains; refusing to "
                f"unpickle it (allowed: {allowed}). Use the archive from {CIFAR_PAGE}"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.name} holds a persistent id, which no CIFAR file contains; refusing to "
                                f"unpickle it")


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_opcodes(data: bytes, name: str) -> None:
    """Read the pickle's opcodes without running them, refusing memo slots a pickler never writes.

    A pickler numbers its memo slots from 0, one per opcode at most. The unpickler grows its memo
    table to twice the largest slot it is given and zeroes it: ``LONG_BINPUT 2**28`` in a 9-byte
    pickle costs 4 GiB. Truncated or unknown opcodes stop here too (ValueError).
    """
    for count, (op, arg, _) in enumerate(pickletools.genops(data), 1):
        if op.name in _MEMO_PUTS and int(arg) >= count:
            raise ConversionError(f"{name} is damaged: its opcode {count} stores into memo slot {arg}, which no "
                                  f"pickler writes (it would cost {arg * 16} bytes of memory); not a CIFAR file")


def _unpickle(data: bytes, name: str) -> dict[str, Any]:
    try:
        _check_opcodes(data, name)
        obj = CifarUnpickler(io.BytesIO(data), name).load()
    except ConversionError:  # UnsafePickleError, or a memo bomb: already says what and where
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, MemoryError, UnicodeDecodeError) as e:
        raise ConversionError(f"{name} is damaged: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise ConversionError(f"{name} holds a {type(obj).__name__}, not the dict of a CIFAR batch")
    # Python 2 pickles load with str keys under latin1; ones written by Python 3 may have bytes keys.
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


# ------------------------------------------------------------------------------ archives


# What an official member can hold, checked before it is read: its records (CIFAR-10 has 10,000 per
# batch, CIFAR-100 50,000 in train and 10,000 in test) plus, in a pickle, a label and a file name each.
_RECORDS = {"train": 50_000, "test": 10_000}
_PICKLE_BYTES_PER_RECORD = PIXELS + 256  # the official pickles hold about PIXELS + 32
_SMALL_MEMBER = 1 << 16  # class names (the largest, CIFAR-100's meta, is 1.5 KB) and tar extension headers
_MAX_ENTRIES = 64  # an official archive holds 5 to 9


def _member_limits(layout: CifarLayout) -> dict[str, int]:
    """Member → the most bytes it may hold in an official archive."""
    limits = {}
    for split, names in layout.splits.items():
        records = _RECORDS[split] // len(names)
        for name in names:
            limits[name] = (records * (len(layout.label_keys) + PIXELS) if layout.binary
                            else records * _PICKLE_BYTES_PER_RECORD + _SMALL_MEMBER)
    for name in [layout.meta] if layout.meta else layout.names.values():
        limits[name] = _SMALL_MEMBER
    return limits


def _too_large(layout: CifarLayout, where: str, size: int, limit: int) -> ConversionError:
    return ConversionError(f"{where} is {size} bytes, more than the {limit} an official {layout.archive} member "
                           f"can hold: not a CIFAR archive (a decompression bomb, or damaged), so it is not read; "
                           f"download {layout.archive} again from {layout.url}")


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose extension blocks are size-checked before tarfile reads them whole into
    memory: a long name or pax header claiming 3 GiB would otherwise be allocated on ``next()``."""

    _EXTENSIONS = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                   tarfile.SOLARIS_XHDTYPE)

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in self._EXTENSIONS and self.size > _SMALL_MEMBER:
            raise ConversionError(f"{tar.name} holds a tar extension header of {self.size} bytes (a long name or "
                                  f"pax header needs a few hundred): not a CIFAR archive (a decompression bomb, or "
                                  f"damaged), so it is not read; download it again from {CIFAR_PAGE}")
        return super()._proc_member(tar)


def _open_tar(path: Path) -> tarfile.TarFile:
    return tarfile.open(path, "r:*", tarinfo=_BoundedTarInfo)


def _tar_members(path: Path, layout: CifarLayout, limits: dict[str, int]) -> dict[str, bytes]:
    """The regular files named in ``limits`` (full member names), read in one pass (a .tar.gz cannot seek
    cheaply), each checked against its limit before it is read."""
    found: dict[str, bytes] = {}
    with _open_tar(path) as tar:
        for count, member in enumerate(tar, 1):
            if count > _MAX_ENTRIES:
                raise ConversionError(f"{path} holds more than {_MAX_ENTRIES} entries, and an official "
                                      f"{layout.archive} fewer than 10: not a CIFAR archive; download it again "
                                      f"from {layout.url}")
            if member.isfile() and member.name in limits:
                if member.size > limits[member.name]:
                    raise _too_large(layout, f"{member.name} in {path}", member.size, limits[member.name])
                found[member.name] = tar.extractfile(member).read()
                if len(found) == len(limits):
                    break
    return found


def _folder_members(root: Path, layout: CifarLayout, limits: dict[str, int]) -> dict[str, bytes]:
    """The regular files of an extracted folder, each checked against its limit before it is read."""
    found = {}
    for name, limit in limits.items():
        path = root / name
        if not path.is_file():  # follows links; a FIFO or device is not a file (and is reported missing)
            continue
        size = path.stat().st_size
        if size > limit:
            raise _too_large(layout, str(path), size, limit)
        found[f"{layout.folder}/{name}"] = path.read_bytes()
    return found


def _read_members(path: Path, layout: CifarLayout, wanted: list[str]) -> dict[str, bytes]:
    limits = {n: limit for n, limit in _member_limits(layout).items() if n in wanted}
    names = {f"{layout.folder}/{n}" for n in wanted}
    if path.is_dir():
        found = _folder_members(path if path.name == layout.folder else path / layout.folder, layout, limits)
    else:
        try:
            found = _tar_members(path, layout, {f"{layout.folder}/{n}": limit for n, limit in limits.items()})
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            raise ConversionError(f"{path} is damaged or incomplete ({e}); download it again from "
                                  f"{layout.url}") from None
    missing = sorted(names - set(found))
    if missing:
        raise ConversionError(f"{path} lacks {', '.join(missing)}: not a complete {layout.archive}; download it "
                              f"again from {layout.url}")
    return {name.split("/", 1)[1]: data for name, data in found.items()}


def detect_cifar(path: str | os.PathLike) -> CifarLayout | None:
    """Which official archive (or extracted folder) ``path`` is; None if it is none of them.

    A tar file that holds none of the four layouts is an error, as is one that cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        for layout in LAYOUTS:
            if path.name == layout.folder or (path / layout.folder).is_dir():
                return layout
        return None
    if not path.is_file() or not path.name.lower().endswith(TAR_ENDINGS):
        return None
    try:
        with _open_tar(path) as tar:
            first = tar.next()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise ConversionError(f"{path} is damaged or not a tar archive ({e}); download the CIFAR archive again "
                              f"from {CIFAR_PAGE}") from None
    top = first.name.split("/", 1)[0] if first is not None else ""
    for layout in LAYOUTS:
        if top == layout.folder:
            return layout
    folders = ", ".join(f"{lay.folder}/ ({lay.archive})" for lay in LAYOUTS)
    raise ConversionError(f"{path} is a tar archive, but its first entry {top or '(none)'!r} is none of the CIFAR "
                          f"folders {folders}")


# ------------------------------------------------------------------------------ reading


def read_cifar(path: str | os.PathLike) -> CifarData:
    """Read an official CIFAR archive (or its extracted folder) into arrays, checking every file."""
    path = Path(path)
    layout = detect_cifar(path)
    if layout is None:
        raise ConversionError(f"{path} is none of the CIFAR archives (" + ", ".join(lay.archive for lay in LAYOUTS)
                              + f") nor their extracted folders; get one from {CIFAR_PAGE}")
    batches = [n for files in layout.splits.values() for n in files]
    meta = [layout.meta] if layout.meta else list(layout.names.values())
    files = _read_members(path, layout, batches + meta)

    def where(member: str) -> str:
        return f"{member} in {path}"

    pixels: dict[str, np.ndarray] = {}
    labels: dict[str, dict[str, np.ndarray]] = {}
    for split, names in layout.splits.items():
        parts = [_parse_batch(layout, where(n), files[n]) for n in names]
        pixels[split] = np.concatenate([p for p, _ in parts])
        labels[split] = {k: np.concatenate([lab[k] for _, lab in parts]) for k in layout.label_keys}
    return CifarData(layout, str(path), pixels, labels, _class_names(layout, files, where))


def _parse_batch(layout: CifarLayout, name: str, data: bytes) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    if layout.binary:
        pixels, labels = _parse_binary(layout, name, data)
    else:
        pixels, labels = _parse_python(layout, name, _unpickle(data, name))
    for key, values in labels.items():
        bad = np.flatnonzero((values < 0) | (values >= layout.num_classes[key]))
        if bad.size:
            raise ConversionError(
                f"{name}: record {bad[0]} has {key} {values[bad[0]]}, outside 0-{layout.num_classes[key] - 1} of "
                f"{layout.dataset}; the file is damaged or from another dataset"
            )
    return pixels, labels


def _parse_binary(layout: CifarLayout, name: str, data: bytes) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    nlab = len(layout.label_keys)
    size = nlab + PIXELS
    if not data or len(data) % size:
        raise ConversionError(
            f"{name} is {len(data)} bytes, not a whole number of {size}-byte {layout.dataset} records ({nlab} label "
            f"byte(s) + {PIXELS} pixel bytes): it is truncated or damaged; download {layout.archive} again from "
            f"{layout.url}"
        )
    records = np.frombuffer(data, np.uint8).reshape(-1, size)
    labels = {key: records[:, i].astype(np.int64) for i, key in enumerate(layout.label_keys)}
    return records[:, nlab:], labels


def _parse_python(layout: CifarLayout, name: str, batch: dict[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    data = batch.get("data")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ConversionError(f"{name}: 'data' must be a uint8 array of N×{PIXELS} pixels, got {what}")
    labels = {}
    for key in layout.label_keys:
        pykey = _PY_LABEL_KEY[(layout.dataset, key)]
        labels[key] = _python_labels(name, pykey, batch.get(pykey), len(data))
    return data, labels


def _python_labels(name: str, key: str, values: Any, n: int) -> np.ndarray:
    """``values`` as n int64 labels, checked to be a flat list of n ints *before* numpy converts it: in
    a pickle's memo, 600 bytes of nested lists can stand for 10**9 integers (8 GB as an array)."""
    if isinstance(values, np.ndarray) and values.shape == (n,) and values.dtype.kind in "iu":
        return values.astype(np.int64)
    seq = isinstance(values, (list, tuple))
    odd = next((v for v in values if type(v) is not int), None) if seq and len(values) == n else None
    if seq and len(values) == n and odd is None:
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass  # an integer beyond int64: refused below
    if seq and len(values) != n:
        got = f"{len(values)} items"
    elif seq:
        got = f"an item of type {type(odd).__name__}" if odd is not None else "an integer beyond int64"
    elif isinstance(values, np.ndarray):
        got = f"a {values.dtype} array of shape {values.shape}"
    else:
        got = type(values).__name__
    raise ConversionError(f"{name}: '{key}' must be a list of {n} integers (one per row of 'data'), got {got}")


def _class_names(layout: CifarLayout, files: dict[str, bytes], where: Callable[[str], str]) -> dict[str, list[str]]:
    """Feature → class names: from the text files (binary version) or the meta pickle (python version)."""
    meta = _unpickle(files[layout.meta], where(layout.meta)) if layout.meta else {}
    out = {}
    for key, source in layout.names.items():
        if layout.meta:
            origin, names = f"{where(layout.meta)} ('{source}')", meta.get(source)
        else:
            origin, names = where(source), files[source].decode("utf-8", "replace").splitlines()
        if isinstance(names, list):
            names = [n.decode("latin1") if isinstance(n, bytes) else n for n in names]
            names = [n.strip() for n in names if isinstance(n, str) and n.strip()]
        if not isinstance(names, list) or len(names) != layout.num_classes[key]:
            raise ConversionError(f"{origin} must name the {layout.num_classes[key]} classes of {layout.dataset}, "
                                  f"one each")
        check_class_names(names, origin, f"not a CIFAR file; download {layout.archive} again from {layout.url}")
        out[key] = names
    return out


# ------------------------------------------------------------------------------ writing


def convert_cifar(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    shards: int = 1,
    *,
    image_format: str = "png",
    quality: int = 90,
    compression_type: str | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write an official CIFAR archive as ``train-*`` / ``test-*`` shards; return the summary.

    ``image_format``: "png" (the default), "jpeg" (at ``quality``) or "raw" (the 3,072-byte record of
    planes, as tensorflow/models' CIFAR-10 generator writes it). ``shards`` files per split; ``seed``
    shuffles the rows of each split first.
    """
    fmt = str(image_format).lower()
    fmt = "png" if fmt == "keep" else fmt
    if fmt not in IMAGE_ENCODINGS:
        raise ConversionError(f"CIFAR images are written as {', '.join(IMAGE_ENCODINGS)}, got {image_format!r}")
    data = read_cifar(path)
    extra = {_CLASS_FILES[k]: "".join(f"{n}\n" for n in names) for k, names in data.class_names.items()}
    summary: dict[str, Any] = {}
    for split, pixels in data.pixels.items():
        if fmt == "raw":
            image = np.ascontiguousarray(pixels).view(f"V{PIXELS}").reshape(-1)
        else:  # planes (N, 3, 32, 32) → images (N, 32, 32, 3)
            image = np.ascontiguousarray(pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        arrays = {"image": image, **{k: data.labels[split][k] for k in ("label", "coarse_label")
                                     if k in data.labels[split]}}
        summary = convert_arrays(
            arrays, out_dir, shards, prefix=split, compression_type=compression_type, seed=seed,
            image_keys=() if fmt == "raw" else ("image",), image_format=fmt if fmt != "raw" else "png",
            quality=quality, overwrite=overwrite, progress=progress, extra_files=extra,
            source=f"{data.source} ({data.layout.archive}, {data.layout.dataset} {split})",
        )
    return summary
