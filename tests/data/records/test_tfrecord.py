"""TFRecord framing: round trips, damage detection, resumable offsets and the record index."""

from __future__ import annotations

import errno
import gzip
import os
import struct
import tempfile
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.data.errors import DataLossError
from conveyor.data.records import (
    TFRecordReader,
    TFRecordWriter,
    build_index,
    count_records,
    default_index_path,
    masked_crc32c,
    read_index,
    read_records,
    write_index,
)
from peak_memory import peak_growth

COMPRESSIONS = [None, "GZIP", "ZLIB"]
RECORDS = [b"", b"hello", b"\x00" * 17, bytes(range(256)), b"x"]


def _write(path, records, compression=None):
    with TFRecordWriter(path, compression) as w:
        for r in records:
            w.write(r)
    return str(path)


def _offsets(records):
    out, pos = [], 0
    for r in records:
        out.append(pos)
        pos += 16 + len(r)
    return out


@pytest.mark.parametrize("compression", COMPRESSIONS + [""])
def test_round_trip(tmp_path, compression):
    records = [os.urandom(n % 300) for n in range(500)] + RECORDS
    path = _write(tmp_path / "r.tfrecord", records, compression)
    assert list(TFRecordReader(path, compression)) == records
    assert list(read_records(path, compression)) == records
    assert count_records(path, compression) == len(records)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_record_larger_than_read_chunk(tmp_path, compression):
    records = [b"a", os.urandom(3 * (1 << 20) + 7), b"b"]
    path = _write(tmp_path / "big.tfrecord", records, compression)
    assert list(TFRecordReader(path, compression)) == records


def test_compression_changes_the_bytes_and_is_whole_stream(tmp_path):
    records = [b"abc" * 100] * 20
    plain = open(_write(tmp_path / "p", records), "rb").read()
    gz = open(_write(tmp_path / "g", records, "GZIP"), "rb").read()
    zl = open(_write(tmp_path / "z", records, "ZLIB"), "rb").read()
    assert gzip.decompress(gz) == plain
    assert zlib.decompress(zl) == plain
    assert gz[:2] == b"\x1f\x8b"


def test_reads_python_gzip_and_concatenated_members(tmp_path):
    plain = open(_write(tmp_path / "p", RECORDS), "rb").read()
    path = tmp_path / "cat.gz"
    path.write_bytes(gzip.compress(plain) + gzip.compress(plain, mtime=0))
    assert list(TFRecordReader(path, "GZIP")) == RECORDS + RECORDS


def test_empty_file_is_empty_in_every_compression(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    for compression in COMPRESSIONS:
        assert list(TFRecordReader(path, compression)) == []
        assert list(TFRecordReader(_write(tmp_path / f"e{compression}", [], compression), compression)) == []


@pytest.mark.parametrize("bad", ["gzip", "SNAPPY", "zlib ", 1])
def test_unknown_compression_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="GZIP"):
        TFRecordWriter(tmp_path / "x", bad)
    with pytest.raises(ValueError, match="ZLIB"):
        TFRecordReader(_write(tmp_path / "y", []), bad)


def test_writer_validates_records_and_state(tmp_path):
    w = TFRecordWriter(tmp_path / "w")
    with pytest.raises(TypeError, match="bytes"):
        w.write("text")
    with pytest.raises(TypeError):
        w.write(3)
    w.write(bytearray(b"ab"))
    w.write(memoryview(b"cd"))
    w.flush()
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write(b"x")
    assert list(TFRecordReader(tmp_path / "w")) == [b"ab", b"cd"]


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_flush_makes_records_readable_while_writing(tmp_path, compression):
    path = tmp_path / "f"
    with TFRecordWriter(path, compression) as w:
        w.write(b"one")
        w.write(b"two")
        w.flush()
        d = zlib.decompressobj(31 if compression == "GZIP" else 15)
        assert d.decompress(path.read_bytes()) == open(_write(tmp_path / "p", [b"one", b"two"]), "rb").read()
        w.write(b"three")
    assert list(TFRecordReader(path, compression)) == [b"one", b"two", b"three"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), max_size=12))
def test_property_any_records_round_trip(records):
    with tempfile.TemporaryDirectory() as d:
        for compression in COMPRESSIONS:
            path = _write(os.path.join(d, f"p{compression}"), records, compression)
            assert list(TFRecordReader(path, compression)) == records


# --- damage ------------------------------------------------------------------------------------


def test_every_single_byte_flip_is_detected(tmp_path):
    records = [b"ab", b"", b"xyz"]
    clean = open(_write(tmp_path / "clean", records), "rb").read()
    starts = _offsets(records)
    path = tmp_path / "flipped"
    for pos in range(len(clean)):
        for xor in (0x01, 0x80, 0xFF):
            damaged = bytearray(clean)
            damaged[pos] ^= xor
            path.write_bytes(bytes(damaged))
            with pytest.raises(DataLossError) as info:
                list(TFRecordReader(path))
            err = info.value
            assert err.path == str(path)
            record = max(i for i, s in enumerate(starts) if s <= pos)
            assert err.offset == starts[record], (pos, xor, err)
            assert "corrupted record" in err.what and "CRC" in err.what
            assert str(path) in str(err) and str(err.offset) in str(err)


def test_flip_in_length_without_verification_reports_truncation(tmp_path):
    path = _write(tmp_path / "r", [b"abc"])
    data = bytearray(open(path, "rb").read())
    data[0] = 0x40  # length 64: more than the file holds
    (tmp_path / "r").write_bytes(bytes(data))
    with pytest.raises(DataLossError, match="truncated"):
        list(TFRecordReader(path, verify=False))


def test_verify_false_skips_crc_checks(tmp_path):
    path = _write(tmp_path / "r", [b"abc", b"def"])
    data = bytearray(open(path, "rb").read())
    data[12] = ord("X")
    (tmp_path / "r").write_bytes(bytes(data))
    assert list(TFRecordReader(path, verify=False)) == [b"Xbc", b"def"]
    with pytest.raises(DataLossError, match="data CRC mismatch") as info:
        list(TFRecordReader(path))
    assert info.value.offset == 0


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_truncation_at_every_byte(tmp_path, compression):
    records = [b"ab", b"", b"xyz", b"0123456789"]
    full = open(_write(tmp_path / "full", records, compression), "rb").read()
    boundaries = {s: i for i, s in enumerate(_offsets(records))} | {len(full): len(records)}
    path = tmp_path / "cut"
    for cut in range(len(full) + 1):
        path.write_bytes(full[:cut])
        got = []
        try:
            with TFRecordReader(path, compression) as reader:
                for r in reader:
                    got.append(r)
        except DataLossError as err:
            assert err.path == str(path)
            assert got == records[: len(got)]
            continue
        if compression is None:
            assert cut in boundaries, cut
            assert got == records[: boundaries[cut]]
        else:  # a compressed prefix is either nothing at all or the whole stream
            assert cut in (0, len(full)), cut
            assert got == (records if cut else [])


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_corrupt_compressed_stream_is_data_loss(tmp_path, compression):
    records = [os.urandom(50) for _ in range(40)]
    full = bytearray(open(_write(tmp_path / "c", records, compression), "rb").read())
    for pos in (len(full) // 3, len(full) // 2, len(full) - 3):
        damaged = bytearray(full)
        damaged[pos] ^= 0xFF
        (tmp_path / "d").write_bytes(bytes(damaged))
        with pytest.raises(DataLossError) as info:
            list(TFRecordReader(tmp_path / "d", compression))
        assert info.value.path == str(tmp_path / "d")
    (tmp_path / "g").write_bytes(b"this is not compressed at all" * 3)
    with pytest.raises(DataLossError, match="corrupted"):
        list(TFRecordReader(tmp_path / "g", compression))


# --- offsets, resume, index ---------------------------------------------------------------------


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_resume_from_offset(tmp_path, compression):
    records = [bytes([i]) * (i % 7) for i in range(30)]
    path = _write(tmp_path / "r", records, compression)
    expected = _offsets(records)
    reader = TFRecordReader(path, compression)
    assert reader.offset == 0
    for i in range(len(records) + 1):
        with TFRecordReader(path, compression, offset=reader.offset) as resumed:
            assert list(resumed) == records[i:]
        if i < len(records):
            assert reader.offset == expected[i]
            assert next(reader) == records[i]
    with pytest.raises(StopIteration):
        next(reader)
    reader.close()
    assert list(reader) == []


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_offset_past_end_is_data_loss(tmp_path, compression):
    path = _write(tmp_path / "r", [b"abc"], compression)
    with pytest.raises(DataLossError, match="past the end"):
        TFRecordReader(path, compression, offset=100)
    with pytest.raises(ValueError):
        TFRecordReader(path, compression, offset=-1)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_index_build_store_and_seek(tmp_path, compression):
    records = [os.urandom(i % 11) for i in range(25)]
    path = _write(tmp_path / "data.tfrecord", records, compression)
    index = build_index(path, compression)
    assert index.dtype == np.int64
    assert index.tolist() == _offsets(records)
    written = write_index(path, index)
    assert written == default_index_path(path) == path + ".index"
    text = open(written).read()
    assert text == "".join(f"{v}\n" for v in _offsets(records))
    loaded = read_index(path)
    np.testing.assert_array_equal(loaded, index)
    for i in (0, 1, 13, len(records) - 1):
        assert list(TFRecordReader(path, compression, offset=loaded[i])) == records[i:]


def test_index_custom_path_empty_and_invalid(tmp_path):
    path = _write(tmp_path / "e.tfrecord", [])
    assert build_index(path).tolist() == []
    custom = tmp_path / "elsewhere.idx"
    assert write_index(path, [], index_path=custom) == str(custom)
    assert custom.read_text() == ""
    assert read_index(path, index_path=custom).tolist() == []
    with pytest.raises(ValueError, match="increasing"):
        write_index(path, [0, 16, 16])
    (tmp_path / "bad.index").write_text("0\nsixteen\n")
    with pytest.raises(ValueError, match="not a TFRecord index"):
        read_index(tmp_path / "bad")
    (tmp_path / "neg.index").write_text("-5\n")
    with pytest.raises(ValueError, match=">= 0"):
        read_index(tmp_path / "neg")


def test_build_index_reports_damage(tmp_path):
    path = _write(tmp_path / "r", [b"abc", b"def"])
    (tmp_path / "r").write_bytes(open(path, "rb").read()[:-2])
    with pytest.raises(DataLossError, match="truncated"):
        build_index(path)


# --- TensorFlow cross-check (only where TensorFlow is installed) ------------------------------------


def test_matches_tensorflow_byte_for_byte(tmp_path):
    tf = pytest.importorskip("tensorflow")
    records = [b"", b"hello", os.urandom(1000)]
    ours = _write(tmp_path / "ours", records)
    theirs = str(tmp_path / "theirs")
    with tf.io.TFRecordWriter(theirs) as w:
        for r in records:
            w.write(r)
    assert open(ours, "rb").read() == open(theirs, "rb").read()
    for compression in ("GZIP", "ZLIB"):
        theirs = str(tmp_path / f"theirs{compression}")
        with tf.io.TFRecordWriter(theirs, tf.io.TFRecordOptions(compression_type=compression)) as w:
            for r in records:
                w.write(r)
        assert list(TFRecordReader(theirs, compression)) == records
        ours = _write(tmp_path / f"ours{compression}", records, compression)
        got = [t.numpy() for t in tf.data.TFRecordDataset(ours, compression_type=compression)]
        assert got == records

@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("size", [100, 3 << 20])  # flushed on close; written through at once
def test_a_full_disk_names_the_file(compression, size):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full (a device whose writes fail with ENOSPC)")
    with pytest.raises(OSError, match=r"No space left on device: '/dev/full'") as e:
        with TFRecordWriter("/dev/full", compression) as w:
            w.write(os.urandom(size))
            w.flush()
    assert e.value.errno == errno.ENOSPC and e.value.filename == "/dev/full"



# --- hostile lengths: refused before anything is allocated --------------------------------------


def _header(length: int) -> bytes:
    """A record header claiming ``length`` bytes, with a valid length CRC."""
    len_bytes = struct.pack("<Q", length)
    return len_bytes + struct.pack("<I", masked_crc32c(len_bytes))


def _read_expecting_loss(path, compression=None, **kwargs) -> DataLossError:
    with pytest.raises(DataLossError) as info:
        list(TFRecordReader(path, compression, **kwargs))
    return info.value


def _loss_and_peak(path, compression=None, **kwargs) -> tuple[DataLossError, int]:
    """The error reading ``path`` raises, and the peak Python allocation on the way to it."""
    tracemalloc.start()
    try:
        err = _read_expecting_loss(path, compression, **kwargs)
        return err, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_compressed_length_bomb_is_refused_before_inflating(tmp_path, compression):
    # The bomb, scaled down: a header claiming 2**40 bytes, then 64 MiB of zeros (~64 KiB
    # compressed). Before the fix the reader inflated all of it before calling it truncated.
    path = tmp_path / "bomb"
    comp = zlib.compressobj(9, zlib.DEFLATED, {"GZIP": 31, "ZLIB": 15}[compression])
    zeros = bytes(1 << 20)
    with open(path, "wb") as f:
        f.write(comp.compress(_header(1 << 40)))
        for _ in range(64):
            f.write(comp.compress(zeros))
        f.write(comp.flush())
    err, peak = _loss_and_peak(path, compression)
    assert err.path == str(path) and err.offset == 0
    assert str(1 << 40) in str(err) and "max_record_bytes" in str(err)
    assert peak < 8 << 20, peak


_READ_ALL = """
try:
    result = [len(r) for r in reader]
except DataLossError as e:
    result = [str(e)]
"""


def _read_in_a_process(path, compression) -> tuple[list, int]:
    """Record lengths (or the error) of ``path`` read in a fresh process, and its peak memory growth."""
    setup = ("from conveyor.data.errors import DataLossError\nfrom conveyor.data.records import TFRecordReader\n"
             "reader = TFRecordReader(sys.argv[1], sys.argv[2] or None)")
    return peak_growth(setup, _READ_ALL, str(path), compression or "")


@pytest.mark.parametrize(("compression", "cut"), [("GZIP", False), ("ZLIB", False), ("GZIP", True), (None, False)])
def test_a_long_record_costs_its_length_once(tmp_path, compression, cut):
    # A GZIP bomb under the 2 GiB cap: 128 MiB of zeros in ~128 KiB. The reader joined its chunks and
    # then sliced the record out of them, holding it twice (the 2 MB file cost 4.0 GB).
    n = 128 << 20
    data = bytes(n)
    path = tmp_path / "long"
    framed = _header(n) + data + struct.pack("<I", masked_crc32c(data))
    if cut:  # the stream ends half-way through the record
        framed = framed[: n // 2]
    if compression:
        comp = zlib.compressobj(9, zlib.DEFLATED, {"GZIP": 31, "ZLIB": 15}[compression])
        framed = comp.compress(framed) + comp.flush()
        assert len(framed) < n // 256
    path.write_bytes(framed)
    del data, framed
    lengths, growth = _read_in_a_process(path, compression)
    if cut:
        assert len(lengths) == 1 and "truncated record" in lengths[0] and str(path) in lengths[0]
        assert growth < 0.7 * n, growth  # what arrived of it, about once
    else:
        assert lengths == [n]
        assert growth < 1.3 * n, growth


def test_uncompressed_length_past_end_of_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(_header(1 << 62) + bytes(8 << 20))
    for verify in (True, False):
        err, peak = _loss_and_peak(path, verify=verify)
        assert err.offset == 0 and "truncated record" in err.what
        assert str(1 << 62) in err.what and str(8 << 20) in err.what  # what it claims, what is left
        assert peak < 4 << 20, peak


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_max_record_bytes_bounds_every_record(tmp_path, compression):
    records = [b"a" * 100, b"b" * 200, b""]
    path = _write(tmp_path / "r", records, compression)
    assert list(TFRecordReader(path, compression, max_record_bytes=200)) == records
    err = _read_expecting_loss(path, compression, max_record_bytes=199)
    assert err.offset == 116 and "200" in err.what and "max_record_bytes" in str(err)
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises((TypeError, ValueError), match="max_record_bytes"):
            TFRecordReader(path, compression, max_record_bytes=bad)


def test_tfrecord_dataset_passes_max_record_bytes_on(tmp_path):
    from conveyor.data import TFRecordDataset

    path = _write(tmp_path / "r", [b"x" * 50], "GZIP")
    assert list(TFRecordDataset(path, "GZIP", max_record_bytes=50)) == [b"x" * 50]
    with pytest.raises(DataLossError, match="max_record_bytes"):
        list(TFRecordDataset(path, "GZIP", max_record_bytes=49))
    with pytest.raises(DataLossError, match="max_record_bytes"):
        list(TFRecordDataset([path, path], "GZIP", num_parallel_reads=2, max_record_bytes=49))


# --- a file read with the wrong compression says which one to pass -------------------------------


@pytest.mark.parametrize(("written", "read_as"), [("GZIP", None), ("ZLIB", None), ("GZIP", "ZLIB"),
                                                  ("ZLIB", "GZIP")])
def test_wrong_compression_names_the_right_one(tmp_path, written, read_as):
    path = _write(tmp_path / "r.tfrecord.gz", RECORDS, written)
    err = _read_expecting_loss(path, read_as)
    assert err.offset == 0
    assert f"compression_type='{written}'" in str(err) and "rewrite" not in str(err)
    cls, args = err.__reduce__()  # how the error crosses a process boundary: the fix goes along
    assert cls(*args).args == err.args


@pytest.mark.parametrize("read_as", ["GZIP", "ZLIB"])
def test_uncompressed_file_read_as_compressed_says_so(tmp_path, read_as):
    path = _write(tmp_path / "r.tfrecord", RECORDS)
    err = _read_expecting_loss(path, read_as)
    assert err.offset == 0 and "compression_type=None" in str(err)


def test_damaged_first_record_is_not_blamed_on_compression(tmp_path):
    path = tmp_path / "r"
    path.write_bytes(b"\x00" * 40)
    err = _read_expecting_loss(path)
    assert "compression_type" not in str(err) and "rewrite it" in str(err)


def test_detect_compression(tmp_path):
    from conveyor.data.records import detect_compression

    for compression, expected in ((None, ""), ("GZIP", "GZIP"), ("ZLIB", "ZLIB")):
        assert detect_compression(_write(tmp_path / f"r{compression}", RECORDS, compression)) == expected
    for content, expected in ((b"", None), (b"\x00" * 40, None), (b"\x1f\x8b\x08" + b"\x00" * 20, "GZIP"),
                              (b"\x78\x9c" + b"\xff" * 20, None)):  # a zlib header alone is not enough
        (tmp_path / "x").write_bytes(content)
        assert detect_compression(tmp_path / "x") == expected, content
