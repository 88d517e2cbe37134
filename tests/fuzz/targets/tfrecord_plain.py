"""Fuzz target: TFRecordReader over uncompressed file contents, against the framing oracle in
_tfrecord_common.py (records and the offset of the first DataLossError must match)."""

from __future__ import annotations

import _tfrecord_common as _common

COMPRESSION = None
EXPECTED = _common.EXPECTED
SEEDS = _common.seeds(COMPRESSION)


def target(data: bytes) -> None:
    _common.check(data, COMPRESSION)
