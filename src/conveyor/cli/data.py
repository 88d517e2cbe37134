"""`conveyor data`: make TFRecord datasets and look inside them.

    conveyor data convert mnist.npz data/mnist --keys image=x_train,label=y_train --image-key image --shards 8
    conveyor data convert photos/ data/photos --shards 16 --split train=0.9 --split test=0.1 --seed 0
    conveyor data convert cifar-10-binary.tar.gz data/cifar10 --shards 8
    conveyor data inspect data/photos/train-*.tfrecord --limit 2
    conveyor data serve --port 5050 --secret-file job.secret      # the data service: docs/data-service.md

`convert` only parses arguments; the work is in `conveyor.data.convert` and `conveyor.data.cifar`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from conveyor.cli import Command, CommandError
from conveyor.cli.data_service import add_parsers as add_service_parsers
from conveyor.data.cifar import IMAGE_ENCODINGS, LAYOUTS, TAR_ENDINGS, convert_cifar, detect_cifar
from conveyor.data.convert import IMAGE_FORMATS, convert_arrays, convert_image_folder, load_npz
from conveyor.data.errors import DataLossError
from conveyor.data.records import TFRecordReader, decode_example, detect_compression, not_regular
from conveyor.fileio import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = actions.add_parser(
        "convert",
        help="write sharded TFRecord files of tf.train.Example from an .npz file, an image folder or a CIFAR archive",
        description="Write SOURCE as OUTPUT_DIR/<prefix>-00000-of-0000N.tfrecord files of tf.train.Example, "
        "plus dataset.json (and classes.txt for image folders and CIFAR). SOURCE is an .npz file (one record per "
        "row of its equally long arrays), a folder with one sub-folder of images per class, or an official CIFAR "
        f"archive as downloaded ({', '.join(lay.archive for lay in LAYOUTS)}) or its extracted folder, which "
        "becomes train-* and test-* shards of image, label (and coarse_label for CIFAR-100).",
    )
    p.add_argument("source", metavar="SOURCE",
                   help="an .npz file, a folder with one sub-folder per class, or a CIFAR-10/100 archive")
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="folder for the shards (created if missing)")
    p.add_argument("--shards", type=int, default=1, metavar="N", help="files per split (default 1)")
    p.add_argument("--prefix", default=None,
                   help="file name prefix when there are no splits (default train; CIFAR: the archive's splits)")
    p.add_argument("--compression", default="none", type=str.upper, choices=["GZIP", "ZLIB", "NONE"],
                   help="compress whole files like TensorFlow (default none)")
    p.add_argument("--split", action="append", default=[], metavar="NAME=FRACTION",
                   help="cut the rows into named splits, each its own set of shards; repeat, fractions sum "
                   "to 1 (e.g. --split train=0.9 --split test=0.1); implies shuffling (seed 0 unless --seed)")
    p.add_argument("--seed", type=int, default=None, help="shuffle the rows with this seed first")
    p.add_argument("--image-format", default="keep", choices=sorted({*IMAGE_FORMATS, *IMAGE_ENCODINGS}),
                   help="image folders: keep the files' bytes, or re-encode; .npz image keys and CIFAR: keep means "
                   "png; CIFAR only: raw stores each image as its 3,072 bytes of R, G, B planes, the layout of "
                   "TensorFlow's generate_cifar10_tfrecords.py")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality, 1-100 (default 90)")
    p.add_argument("--image-key", action="append", default=[], metavar="KEY",
                   help=".npz only: store this uint8 (N,H,W[,C]) array as encoded images; repeatable")
    p.add_argument("--keys", default=None, metavar="K,...",
                   help=".npz only: the arrays to convert, each NAME or FEATURE=NAME to rename it "
                   "(default: every array)")
    p.add_argument("--overwrite", action="store_true", help="replace shards of the same names in OUTPUT_DIR")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(action_run=run_convert)

    p = actions.add_parser(
        "inspect", help="count records, show the first records' features, verify every CRC",
        description="For each FILE: count its records while verifying both CRCs of every record, and show "
        "the features of the first records. Exits with 1 if a file is damaged.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="TFRecord files")
    p.add_argument("--limit", type=int, default=1, metavar="N", help="records to show per file (default 1)")
    p.add_argument("--compression", default="auto", type=str.upper, choices=["AUTO", "GZIP", "ZLIB", "NONE"],
                   help="file compression (default: detected)")
    p.set_defaults(action_run=run_inspect)
    add_service_parsers(actions)


def run(args: argparse.Namespace) -> int:
    return args.action_run(args)


COMMAND = Command("data", "convert data to TFRecord files, inspect them, run the data service", add_arguments, run)


# ------------------------------------------------------------------------------------ convert


def parse_splits(specs: list[str]) -> dict[str, float] | None:
    """``["train=0.9", "test=0.1"]`` → ``{"train": 0.9, "test": 0.1}``."""
    if not specs:
        return None
    out: dict[str, float] = {}
    for spec in specs:
        name, sep, frac = spec.partition("=")
        try:
            value = float(frac)
        except ValueError:
            value = None
        if not sep or not name or value is None:
            raise CommandError(f"--split wants NAME=FRACTION (e.g. train=0.9), got {spec!r}")
        if name in out:
            raise CommandError(f"--split {name} is given twice")
        out[name] = value
    return out


def _select_arrays(arrays: dict[str, np.ndarray], keys: str | None, source: str) -> dict[str, np.ndarray]:
    if keys is None:
        return arrays
    out: dict[str, np.ndarray] = {}
    for item in filter(None, (k.strip() for k in keys.split(","))):
        feature, _, name = item.rpartition("=")
        feature = feature or name
        if name not in arrays:
            have = ", ".join(arrays) or "none"
            raise CommandError(f"--keys: {source} has no array {name!r} (it has {have})")
        if feature in out:
            raise CommandError(f"--keys: feature {feature!r} is named twice")
        out[feature] = arrays[name]
    if not out:
        raise CommandError("--keys names no array")
    return out


def run_convert(args: argparse.Namespace) -> int:
    source = Path(args.source)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    compression = None if args.compression == "NONE" else args.compression
    if source.name.lower().endswith(TAR_ENDINGS) or (source.is_dir() and detect_cifar(source)):
        summary = _convert_cifar(args, source, compression, progress)
        _report_conversion(summary, args.output_dir)
        return 0
    if args.image_format == "raw":
        raise CommandError(f"--image-format raw applies to CIFAR archives; {source} is not one")
    common = dict(prefix=args.prefix or "train", compression_type=compression,
                  splits=parse_splits(args.split), seed=args.seed, image_format=args.image_format,
                  quality=args.quality, overwrite=args.overwrite, progress=progress)
    if source.is_dir():
        for flag, value in (("--image-key", args.image_key), ("--keys", args.keys)):
            if value:
                raise CommandError(f"{flag} applies to .npz sources; {source} is an image folder")
        summary = convert_image_folder(source, args.output_dir, args.shards, **common)
    elif source.suffix.lower() == ".npz" and source.is_file():
        arrays = _select_arrays(load_npz(source), args.keys, str(source))
        summary = convert_arrays(arrays, args.output_dir, args.shards, image_keys=args.image_key,
                                 source=str(source), **common)
    elif not source.exists():
        raise CommandError(f"{source}: no such file or folder")
    else:
        raise CommandError(f"{source} is neither an .npz file, a folder with one sub-folder per class, nor a CIFAR "
                           f"archive ({', '.join(TAR_ENDINGS)})")
    _report_conversion(summary, args.output_dir)
    return 0


def _convert_cifar(args: argparse.Namespace, source: Path, compression: str | None, progress: bool) -> dict[str, Any]:
    """An official CIFAR archive: its own train and test splits, and its own features."""
    if not source.exists():
        raise CommandError(f"{source}: no such file; download it from https://www.cs.toronto.edu/~kriz/cifar.html")
    for flag, value in (("--split", args.split), ("--prefix", args.prefix), ("--keys", args.keys),
                        ("--image-key", args.image_key)):
        if value:
            raise CommandError(f"{flag} does not apply to a CIFAR archive, which brings its own train and test "
                               f"splits and features (image, label)")
    return convert_cifar(source, args.output_dir, args.shards, image_format=args.image_format,
                         quality=args.quality, compression_type=compression, seed=args.seed,
                         overwrite=args.overwrite, progress=progress)


def _report_conversion(summary: dict[str, Any], out_dir: str) -> None:
    splits = summary["splits"]
    written = {name: s for name, s in splits.items() if s.get("source") is not None}
    skipped: list[str] = []
    for name, split in written.items():
        sizes = [s["records"] for s in split["shards"]]
        span = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
        comp = f", {split['compression']}" if split.get("compression") else ""
        first = split["shards"][0]["file"]
        print(f"{name}: {split['num_records']} records in {len(sizes)} shard(s) of {span} "
              f"({os.path.join(out_dir, first)}, ...{comp})")
        skipped = split.get("skipped_files") or skipped
    if skipped:
        print(f"skipped {len(skipped)} file(s) without an image file ending, e.g. {skipped[0]}")
    print(f"summary: {os.path.join(out_dir, 'dataset.json')}")


# ------------------------------------------------------------------------------------ inspect


def _check_inspectable(path: str) -> None:
    """Refuse what is not a regular file, saying what it is (inspect reads each file twice, and a
    device such as /dev/zero never ends)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CommandError(f"{path}: no such file") from None
    except OSError as e:
        raise CommandError(f"{path}: cannot read it ({e.strerror})") from None
    what = not_regular(mode)
    if what is not None:
        raise CommandError(f"{path}: {what}")


def run_inspect(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise CommandError(f"--limit must be >= 0, got {args.limit}")
    for path in args.files:
        _check_inspectable(path)
    damaged = total = 0
    for path in args.files:
        # An undecidable file is read as uncompressed: the reader then names the damage.
        compression = (detect_compression(path) or None) if args.compression == "AUTO" else (
            None if args.compression == "NONE" else args.compression)
        first: list[bytes] = []
        count = 0
        error: DataLossError | None = None
        try:
            with TFRecordReader(path, compression) as reader:
                for record in reader:
                    if count < args.limit:
                        first.append(record)
                    count += 1
        except DataLossError as e:
            error = e
        total += count
        size = os.path.getsize(path)
        kind = compression or "uncompressed"
        if error is None:
            print(f"{path}: {count} records, {format_bytes(size)}, {kind}, all CRCs OK")
        else:
            damaged += 1
            print(f"{path}: DAMAGED after {count} good records, {format_bytes(size)}, {kind}")
            print(f"conveyor data inspect: {error}", file=sys.stderr)
        for i, record in enumerate(first):
            print(f"  record {i}:")
            for line in describe_record(record):
                print(f"    {line}")
    if len(args.files) > 1:
        note = f", {damaged} damaged" if damaged else ""
        print(f"total: {total} records in {len(args.files)} files{note}")
    return 1 if damaged else 0


def describe_record(record: bytes) -> list[str]:
    """One line per feature: name, kind, number of values, a preview."""
    try:
        features = decode_example(record)
    except (DecodeError, ValueError, TypeError):
        return [f"not a tf.train.Example ({len(record)} bytes)"]
    if not features:
        return [f"no features ({len(record)} bytes)"]
    width = max(len(k) for k in features)
    lines = []
    for key in sorted(features):
        values = features[key]
        if isinstance(values, list):
            kind = "bytes"
            preview = " ".join(_bytes_preview(v) for v in values[:4]) + (" ..." if len(values) > 4 else "")
        else:
            kind = str(values.dtype)
            shown = " ".join(_number(v) for v in values[:8].tolist())
            preview = f"[{shown}{' ...' if len(values) > 8 else ''}]"
        lines.append(f"{key:<{width}}  {kind:<7}  {len(values):>6}  {preview}")
    return lines


def _number(v: float | int) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _bytes_preview(b: bytes) -> str:
    if b.startswith(b"\x89PNG\r\n\x1a\n"):
        return f"<{len(b)} bytes, png>"
    if b.startswith(b"\xff\xd8\xff"):
        return f"<{len(b)} bytes, jpeg>"
    if len(b) <= 40:
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and text.isprintable():
            return repr(b)
    return f"<{len(b)} bytes>"


