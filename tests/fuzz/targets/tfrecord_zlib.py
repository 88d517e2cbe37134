"""Fuzz target: TFRecordReader over ZLIB file contents, against the framing oracle in
_tfrecord_common.py (records and the offset of the first DataLossError must match)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_tfrecord_common", Path(__file__).with_name("_tfrecord_common.py"))
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)

COMPRESSION = "ZLIB"
EXPECTED = _common.EXPECTED
SEEDS = _common.seeds(COMPRESSION)


def target(data: bytes) -> None:
    _common.check(data, COMPRESSION)
