"""Turn arrays or a folder of images into sharded TFRecord files of ``tf.train.Example``.

    summary = convert_arrays({"image": x, "label": y}, "data/", shards=8)
    summary = convert_image_folder("photos/", "data/", shards=8, splits={"train": 0.9, "test": 0.1}, seed=0)

The output is what TensorFlow's converters produce: ``<prefix>-00000-of-00008.tfrecord`` files of one
Example per row, plus ``dataset.json`` (records per shard, features, source) and, for image folders,
``classes.txt``. Rows are dealt round-robin over the shards (splits are shuffled, with seed 0 unless
given), and no shard appears under its final name unless every shard was written. Needs numpy, Pillow
and tqdm, never torch. Layout and encodings: ``docs/data.md``, "Converting data to TFRecord".
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from conveyor.data.records import TFRecordWriter, encode_example
from conveyor.fileio import atomic_write

__all__ = [
    "IMAGE_EXTENSIONS",
    "ConversionError",
    "check_class_names",
    "convert_arrays",
    "convert_image_folder",
    "load_npz",
    "shard_filename",
]

SUMMARY_FORMAT = "conveyor.dataset"
SUMMARY_VERSION = 1
SUMMARY_FILE = "dataset.json"
CLASSES_FILE = "classes.txt"

#: File name endings (lower case) taken as images in a class folder; other files are skipped and counted.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
IMAGE_FORMATS = ("keep", "jpeg", "png")
_PIL_FORMAT = {"jpeg": "JPEG", "png": "PNG"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")
_INT64_MAX = np.iinfo(np.int64).max


class ConversionError(ValueError):
    """The source cannot be converted as asked (the message names the array, file or argument)."""


def check_class_names(names: Sequence[str], origin: str, fix: str) -> None:
    """Refuse a class name that would not be one line of ``classes.txt`` (line i names class i): one
    holding a line break (``\\n``, ``\\r``, and the others ``str.splitlines`` splits at), or empty."""
    for i, name in enumerate(names):
        if name.splitlines() != [name]:
            raise ConversionError(f"{origin}: class {i} is named {name!r}, which is not one line of {CLASSES_FILE} "
                                  f"(line i names class i); {fix}")


def shard_filename(prefix: str, index: int, count: int) -> str:
    """TensorFlow's shard naming: ``train-00003-of-00008.tfrecord``."""
    return f"{prefix}-{index:05d}-of-{count:05d}.tfrecord"


def _shard_pattern(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}-\d{{5}}-of-\d{{5}}\.tfrecord$")


# ------------------------------------------------------------------------------------ arrays


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load every array of an ``.npz`` file (never unpickling: object arrays are refused)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise ConversionError(
                f"{path} holds an object array, which only loads by unpickling; store strings as "
                f"fixed-width arrays (np.array(values, dtype=str)) or bytes instead"
            ) from None
        raise ConversionError(f"{path}: not a readable .npz file ({e})") from None
    except (OSError, EOFError) as e:
        raise ConversionError(f"{path}: not a readable .npz file ({e})") from None


def convert_arrays(
    arrays: Mapping[str, np.ndarray],
    out_dir: str | os.PathLike,
    shards: int = 1,
    *,
    prefix: str = "train",
    compression_type: str | None = None,
    splits: Mapping[str, float] | None = None,
    seed: int | None = None,
    image_keys: Sequence[str] = (),
    image_format: str = "png",
    quality: int = 90,
    overwrite: bool = False,
    progress: bool = False,
    source: str | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Write one Example per row of equally long arrays; return the summary (also in dataset.json).

    Every array becomes a feature of the same name (see the module docstring for how). Arrays named
    in ``image_keys`` are stored as encoded images (``image_format`` "png", the default for
    "keep", or "jpeg" at ``quality``). ``source`` is recorded in the summary; ``extra_files``
    (name → text) are written next to it, as ``classes.txt`` is for image folders.
    """
    arrays = {str(k): np.asarray(v) for k, v in arrays.items()}
    image_keys = tuple(image_keys)
    n = _rows(arrays, image_keys)
    fmt = _check_image_format(image_format, quality)
    fmt = "png" if fmt == "keep" else fmt
    features, encoders = _array_features(arrays, image_keys, fmt, quality)

    def make_record(i: int) -> bytes:
        feats: dict[str, Any] = {}
        for key, arr, encode in encoders:
            row = arr[i]
            feats[key] = encode(row)
            if key not in image_keys and np.ndim(row):
                feats[f"{key}/shape"] = np.asarray(row.shape, dtype=np.int64)
        return encode_example(feats)

    return _convert(
        n, make_record, out_dir, shards, prefix=prefix, compression_type=compression_type, splits=splits,
        seed=seed, overwrite=overwrite, progress=progress,
        info={"source": source, "source_kind": "arrays", "features": features}, extra_files=extra_files,
    )


def _rows(arrays: Mapping[str, np.ndarray], image_keys: Sequence[str]) -> int:
    """The number of records: every array's first dimension, which must be the same."""
    if not arrays:
        raise ConversionError("no arrays to convert")
    for key, arr in arrays.items():
        if arr.ndim == 0:
            raise ConversionError(f"array {key!r} is a scalar; every array needs one row per record")
    lengths = {key: len(arr) for key, arr in arrays.items()}
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k}: {n}" for k, n in lengths.items())
        raise ConversionError(
            f"arrays must have the same first dimension (one row per record), got {listing}; "
            f"convert arrays of different lengths separately (e.g. with different prefixes)"
        )
    for key in image_keys:
        if key not in arrays:
            raise ConversionError(f"image key {key!r} is not one of the arrays ({', '.join(arrays)})")
    return next(iter(lengths.values()))


def _array_features(
    arrays: Mapping[str, np.ndarray], image_keys: Sequence[str], fmt: str, quality: int
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, np.ndarray, Callable[[np.ndarray], Any]]]]:
    """The summary's description of each feature, and ``(key, array, row encoder)`` per array."""
    features: dict[str, dict[str, Any]] = {}
    encoders: list[tuple[str, np.ndarray, Callable[[np.ndarray], Any]]] = []
    for key, arr in arrays.items():
        row_shape = list(arr.shape[1:])
        if key in image_keys:
            _check_image_array(key, arr, fmt)
            features[key] = {"dtype": "string", "shape": [], "encoding": fmt, "image_shape": row_shape}
            encoders.append((key, arr, lambda row, f=fmt: _encode_array_image(row, f, quality)))
            continue
        features[key] = {"dtype": _example_dtype(key, arr), "shape": row_shape,
                         "source_dtype": str(arr.dtype)}
        encoders.append((key, arr, _raw_bytes if arr.dtype.kind == "V" else _as_is))
        if row_shape:
            shape_key = f"{key}/shape"
            if shape_key in arrays:
                raise ConversionError(
                    f"array {shape_key!r} clashes with the shape feature of array {key!r}; rename one of them"
                )
            features[shape_key] = {"dtype": "int64", "shape": [len(row_shape)]}
    return features, encoders


def _as_is(row: Any) -> Any:
    return row  # a numpy scalar or array row: encode_example takes both


def _raw_bytes(row: np.void) -> bytes:
    return row.tobytes()


def _example_dtype(key: str, arr: np.ndarray) -> str:
    kind = arr.dtype.kind
    if kind in "iub":
        if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > _INT64_MAX:
            raise ConversionError(f"array {key!r} holds uint64 values above the int64 range of an Example")
        return "int64"
    if kind == "f":
        return "float32"
    if kind in "SU":
        return "string"
    if kind == "V" and arr.dtype.names is None and arr.ndim == 1:
        return "string"
    raise ConversionError(
        f"array {key!r} has dtype {arr.dtype}, which a tf.train.Example cannot hold; convert it to an "
        f"integer, float or string array first"
    )


def _check_image_array(key: str, arr: np.ndarray, fmt: str) -> None:
    ok_shape = arr.ndim == 3 or (arr.ndim == 4 and arr.shape[3] in (1, 3, 4))
    if arr.dtype != np.uint8 or not ok_shape:
        raise ConversionError(
            f"image key {key!r} must be a uint8 array of shape (N, H, W) or (N, H, W, C) with C in 1, 3, 4; "
            f"got {arr.dtype} {tuple(arr.shape)}"
        )
    if fmt == "jpeg" and arr.ndim == 4 and arr.shape[3] == 4:
        raise ConversionError(
            f"image key {key!r} has 4 channels, which JPEG cannot store; "
            f"use image_format='png' (--image-format png)"
        )


def _encode_array_image(row: np.ndarray, fmt: str, quality: int) -> bytes:
    if row.ndim == 3 and row.shape[2] == 1:
        row = row[:, :, 0]
    return _save_image(Image.fromarray(np.ascontiguousarray(row)), fmt, quality)


def _save_image(img: Image.Image, fmt: str, quality: int) -> bytes:
    if fmt == "jpeg" and img.mode not in ("L", "RGB", "CMYK"):
        img = img.convert("RGB")
    elif fmt == "png" and img.mode not in ("1", "L", "LA", "I", "P", "RGB", "RGBA", "I;16"):
        img = img.convert("RGBA" if "A" in img.mode else "RGB")
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="PNG")
    return buf.getvalue()


def _check_image_format(image_format: str, quality: int) -> str:
    fmt = str(image_format).lower()
    fmt = "jpeg" if fmt == "jpg" else fmt
    if fmt not in IMAGE_FORMATS:
        raise ConversionError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}")
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ConversionError(f"JPEG quality must be an integer from 1 to 100, got {quality!r}")
    return fmt


# ------------------------------------------------------------------------------ image folders


def scan_image_folder(folder: str | os.PathLike) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """Classes (sorted sub-folder names), (relative path, label) per image, and skipped files.

    Images are found recursively inside each class folder, in sorted order; hidden files and
    folders are ignored, other files without an image ending are skipped (and reported).
    """
    root = Path(folder)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such folder")
    if not root.is_dir():
        raise ConversionError(f"{root} is not a folder")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    check_class_names(classes, str(root), "rename that folder")
    if not classes:
        raise ConversionError(
            f"{root} has no sub-folders; expected one sub-folder per class holding its images "
            f"(e.g. {root / 'cat' / '001.jpg'})"
        )
    files: list[tuple[str, int]] = []
    skipped: list[str] = []
    for label, name in enumerate(classes):
        found = 0
        for dirpath, dirnames, filenames in os.walk(root / name):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fname in sorted(filenames):
                if fname.startswith("."):
                    continue
                rel = Path(dirpath, fname).relative_to(root).as_posix()
                if fname.lower().endswith(IMAGE_EXTENSIONS):
                    files.append((rel, label))
                    found += 1
                else:
                    skipped.append(rel)
        if not found:
            raise ConversionError(
                f"class folder {root / name} holds no image files (looked for {' '.join(IMAGE_EXTENSIONS)}); "
                f"remove it or add its images"
            )
    return classes, files, skipped


def convert_image_folder(
    folder: str | os.PathLike,
    out_dir: str | os.PathLike,
    shards: int = 1,
    *,
    prefix: str = "train",
    compression_type: str | None = None,
    splits: Mapping[str, float] | None = None,
    seed: int | None = None,
    image_format: str = "keep",
    quality: int = 90,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write one Example per image of a ``folder/<class>/<image>`` tree; return the summary.

    Features: ``image`` (the file's bytes unchanged with ``image_format="keep"``, else re-encoded
    as "jpeg" at ``quality`` or "png"), ``label`` (index of the class in sorted folder order),
    ``label/name`` and ``filename`` (path relative to ``folder``). Every image is checked to be
    readable; one that is not stops the conversion with its path.
    """
    fmt = _check_image_format(image_format, quality)
    root = Path(folder)
    classes, files, skipped = scan_image_folder(root)
    names = [c.encode("utf-8") for c in classes]

    def make_record(i: int) -> bytes:
        rel, label = files[i]
        path = root / rel
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConversionError(f"cannot read image {path}: {e.strerror or e}") from None
        try:
            with Image.open(io.BytesIO(data)) as img:
                if fmt == "keep":
                    img.verify()  # structure and checksums, without a full decode
                else:
                    img.load()
                    data = _save_image(img, fmt, quality)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ConversionError(f"cannot read image {path}: {e}") from None
        return encode_example({"image": data, "label": label, "label/name": names[label], "filename": rel})

    out = Path(out_dir)
    features = {
        "image": {"dtype": "string", "shape": [], "encoding": "original" if fmt == "keep" else fmt},
        "label": {"dtype": "int64", "shape": []},
        "label/name": {"dtype": "string", "shape": []},
        "filename": {"dtype": "string", "shape": []},
    }
    info = {"source": str(root), "source_kind": "image_folder", "features": features,
            "classes": classes, "skipped_files": skipped}
    return _convert(len(files), make_record, out, shards, prefix=prefix, compression_type=compression_type,
                       splits=splits, seed=seed, overwrite=overwrite, progress=progress, info=info,
                       extra_files={CLASSES_FILE: "".join(f"{c}\n" for c in classes)})


# ------------------------------------------------------------------------------ shared writer


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConversionError(
            f"{what} {name!r} must be a plain file-name prefix (letters, digits, '_', '.', '-'), like 'train'"
        )
    return name


def _plan(n: int, prefix: str, splits: Mapping[str, float] | None,
          seed: int | None) -> tuple[dict[str, np.ndarray], int | None]:
    """Row ids per split, in writing order, and the seed actually used."""
    if splits:
        splits = {_check_name("split name", k): float(v) for k, v in splits.items()}
        for name, frac in splits.items():
            if not 0.0 < frac <= 1.0:
                raise ConversionError(f"split {name!r} has fraction {frac}; fractions must be in (0, 1]")
        total = sum(splits.values())
        if abs(total - 1.0) > 1e-6:
            example = " ".join(f"--split {k}=..." for k in splits)
            raise ConversionError(
                f"split fractions sum to {total:g}; they must sum to 1 ({example}), so that no row is dropped"
            )
        if seed is None:
            seed = 0
    else:
        splits = {_check_name("prefix", prefix): 1.0}
    order = np.arange(n) if seed is None else np.random.default_rng(seed).permutation(n)
    bounds = np.rint(np.cumsum(list(splits.values())) * n).astype(np.int64)
    bounds[-1] = n
    out, start = {}, 0
    for name, end in zip(splits, bounds, strict=True):
        out[name] = order[start:int(end)]
        start = int(end)
    return out, seed


def _convert(
    n: int,
    make_record: Callable[[int], bytes],
    out_dir: str | os.PathLike,
    shards: int,
    *,
    prefix: str,
    compression_type: str | None,
    splits: Mapping[str, float] | None,
    seed: int | None,
    overwrite: bool,
    progress: bool,
    info: dict[str, Any],
    extra_files: dict[str, str] | None = None,
) -> dict[str, Any]:
    if not isinstance(shards, (int, np.integer)) or isinstance(shards, bool) or shards < 1:
        raise ConversionError(f"the number of shards must be a positive integer, got {shards!r}")
    shards = int(shards)
    compression = None if compression_type in (None, "", "none", "NONE") else str(compression_type).upper()
    if compression not in (None, "GZIP", "ZLIB"):
        raise ConversionError(f"compression must be GZIP, ZLIB or none, got {compression_type!r}")
    plan, seed = _plan(n, prefix, splits, seed)

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"output {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    stale = _existing_shards(out, plan)
    if stale and not overwrite:
        listing = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise ConversionError(
            f"{out} already holds shards with these names ({listing}); pass overwrite=True "
            f"(--overwrite) to replace them, or choose another folder or prefix"
        )

    with tqdm(total=n, disable=not progress, file=sys.stderr, unit="rec", desc="converting",
              dynamic_ncols=True) as bar:
        written, counts = _write_shards(out, plan, shards, compression, make_record, bar.update)
    split_summaries = {
        split: {**info, "num_records": int(len(rows)), "compression": compression, "seed": seed,
                "shards": [{"file": name, "records": c} for name, c in counts[split]]}
        for split, rows in plan.items()
    }
    for name in stale:
        if name not in written:
            (out / name).unlink(missing_ok=True)
    summary = _merge_summary(out, split_summaries)
    for fname, text in (extra_files or {}).items():
        atomic_write(out / fname, text.encode("utf-8"))
    atomic_write(out / SUMMARY_FILE, (json.dumps(summary, indent=2) + "\n").encode("utf-8"))
    return summary


def _write_shards(
    out: Path, plan: Mapping[str, np.ndarray], shards: int, compression: str | None,
    make_record: Callable[[int], bytes], advance: Callable[[int], Any],
) -> tuple[set[str], dict[str, list[tuple[str, int]]]]:
    """Write every split's rows round-robin over its ``shards`` files; return the file names written and
    ``(file, records)`` per split.

    Every shard is written under a hidden temporary name and renamed only once all are complete; on any
    error the temporary files are removed and no shard appears under a final name.
    """
    temps: list[tuple[Path, Path]] = []
    counts: dict[str, list[tuple[str, int]]] = {}
    try:
        for split, rows in plan.items():
            counts[split] = []
            for k in range(shards):
                name = shard_filename(split, k, shards)
                tmp = out / f".{name}.tmp-{os.getpid()}"
                temps.append((tmp, out / name))
                part = rows[k::shards]
                with TFRecordWriter(tmp, compression) as writer:
                    for row in part:
                        writer.write(make_record(int(row)))
                        advance(1)
                counts[split].append((name, len(part)))
        for tmp, final in temps:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    return {final.name for _, final in temps}, counts


def _existing_shards(out: Path, plan: Mapping[str, Any]) -> list[str]:
    patterns = [_shard_pattern(split) for split in plan]
    return sorted(p.name for p in out.iterdir() if any(pat.match(p.name) for pat in patterns))


def _merge_summary(out: Path, splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The new summary, keeping splits an earlier run wrote to this folder if their shards remain."""
    kept: dict[str, Any] = {}
    try:
        old = json.loads((out / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and old.get("format") == SUMMARY_FORMAT and isinstance(old.get("splits"), dict):
        for name, split in old["splits"].items():
            if name in splits or not isinstance(split, dict):
                continue
            files = [s.get("file") for s in split.get("shards", []) if isinstance(s, dict)]
            if files and all(isinstance(f, str) and (out / f).exists() for f in files):
                kept[name] = split
    return {"format": SUMMARY_FORMAT, "version": SUMMARY_VERSION, "splits": {**kept, **splits}}
