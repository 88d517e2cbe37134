"""Shared by the tfrecord_* fuzz targets (not a target itself: its name starts with "_").

The oracle is the framing spelled out from the format (length, masked CRC of the length, data,
masked CRC of the data) over the whole decompressed stream, which zlib inflates for GZIP/ZLIB
files. The reader must yield exactly the records the oracle finds and fail where it fails.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib

from conveyor.data.errors import DataLossError
from conveyor.data.records import TFRecordReader, TFRecordWriter, masked_crc32c
from conveyor.data.records.tfrecord import DEFAULT_MAX_RECORD_BYTES

EXPECTED = (DataLossError,)

# Inputs past this are cut: deflate expands at most ~1032x, so no input can make the reader (or
# the oracle) inflate more than ~8 MiB, whatever the record headers claim.
MAX_INPUT = 1 << 13
_INFLATE_LIMIT = 1100 * MAX_INPUT
_WBITS = {"GZIP": 31, "ZLIB": 15}
# A folder per input, removed before returning: libFuzzer leaves by exit(), so a folder kept for
# the whole run would never be cleaned up.
_TMP_PREFIX = "conveyor-fuzz-tfrecord-"


def seeds(compression: str | None) -> list[bytes]:
    """Whole files written by the real writer: a few record lists, in this compression."""
    out = []
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX) as tmp:
        path = os.path.join(tmp, "seed")
        for records in ([], [b""], [b"hello", b"x" * 40], [bytes(range(256)), b"", b"\x00" * 20]):
            with TFRecordWriter(path, compression) as w:
                for r in records:
                    w.write(r)
            with open(path, "rb") as f:
                out.append(f.read())
    return out


def frame(stream: bytes, verify: bool) -> tuple[list[bytes], int | None]:
    """The records of a decompressed stream, and the offset of the first bad one (None: clean)."""
    records: list[bytes] = []
    pos, size = 0, len(stream)
    while pos < size:
        if size - pos < 12:
            return records, pos
        length, len_crc = struct.unpack_from("<QI", stream, pos)
        if verify and len_crc != masked_crc32c(stream[pos : pos + 8]):
            return records, pos
        end = pos + 12 + length + 4
        if end > size or length > DEFAULT_MAX_RECORD_BYTES:
            return records, pos
        data = stream[pos + 12 : end - 4]
        if verify and struct.unpack_from("<I", stream, end - 4)[0] != masked_crc32c(data):
            return records, pos
        records.append(data)
        pos = end
    return records, None


def inflate(data: bytes, compression: str) -> bytes | None:
    """The whole stream as gunzip reads it (members back to back), or None if it is not one."""
    out = bytearray()
    rest = data
    while rest:
        d = zlib.decompressobj(_WBITS[compression])
        try:
            out += d.decompress(rest, _INFLATE_LIMIT - len(out))
        except zlib.error:
            return None
        assert not d.unconsumed_tail, "oracle inflate limit reached: MAX_INPUT is too large"
        if not d.eof:
            return None  # the stream stops in the middle
        rest = d.unused_data
    return bytes(out)


def read(path: str, compression: str | None, verify: bool) -> tuple[list[bytes], int | None]:
    """What the real reader yields, and the offset of its DataLossError (None: none)."""
    records: list[bytes] = []
    try:
        with TFRecordReader(path, compression, verify=verify) as reader:
            for record in reader:
                records.append(record)
    except DataLossError as e:
        assert e.path == path, e
        return records, e.offset
    return records, None


def check(data: bytes, compression: str | None) -> None:
    """Write ``data`` as a file, read it back with both verify settings, compare to the oracle."""
    data = data[:MAX_INPUT]
    stream = data if compression is None else inflate(data, compression)
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX) as tmp:
        path = os.path.join(tmp, "input")
        with open(path, "wb") as f:
            f.write(data)
        for verify in (True, False):
            got = read(path, compression, verify)
            if stream is None:  # not a valid compressed stream: some DataLossError must say so
                assert got[1] is not None, f"reader accepted a damaged {compression} stream: {got[0]!r}"
                continue
            assert got == frame(stream, verify), (verify, got, frame(stream, verify))
