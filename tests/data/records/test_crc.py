"""CRC-32C and TensorFlow's mask against the vectors of docs/tfdata-semantics.md §14."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.records import TFRecordWriter, crc32c, mask, masked_crc32c, unmask


def test_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283


def test_table_row_empty_payload():
    length = struct.pack("<Q", 0)
    assert crc32c(length) == 0x8C28B28A
    assert mask(0x8C28B28A) == 0x07980329
    assert crc32c(b"") == 0x00000000
    assert mask(0) == 0xA282EAD8
    assert masked_crc32c(b"") == 0xA282EAD8


def test_table_row_hello():
    length = struct.pack("<Q", 5)
    assert crc32c(length) == 0xE4094DC0
    assert masked_crc32c(length) == 0x3E04B2EA
    assert crc32c(b"hello") == 0x9A71BB4C
    assert masked_crc32c(b"hello") == 0x191C1FBB


def test_accepts_memoryview_and_bytearray():
    assert crc32c(memoryview(b"123456789")) == 0xE3069283
    assert crc32c(bytearray(b"123456789")) == 0xE3069283


def test_full_records_match_table(tmp_path):
    path = tmp_path / "vectors.tfrecord"
    with TFRecordWriter(path) as w:
        w.write(b"")
        w.write(b"hello")
    expected = bytes.fromhex(
        "0000000000000000 29039807 d8ea82a2"  # b""
        "0500000000000000 eab2043e 68656c6c6f bb1f1c19"  # b"hello"
    )
    assert path.read_bytes() == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=0xFFFFFFFF))
def test_unmask_inverts_mask(crc):
    masked = mask(crc)
    assert 0 <= masked <= 0xFFFFFFFF
    assert unmask(masked) == crc
