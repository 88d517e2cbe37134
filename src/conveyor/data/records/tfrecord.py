"""TFRecord files: writing, verified reading, resumable offsets and a record index.

Framing (docs/tfdata-semantics.md §14): every record is ``uint64 length | uint32 masked_crc32c(length bytes) |
data | uint32 masked_crc32c(data)``, little-endian, with no file header or footer. GZIP and ZLIB
compress the *whole* file stream, not each record, exactly as TensorFlow does, so files move freely
between TensorFlow and conveyor.

Offsets are byte positions in the *decompressed* stream. That is the only coordinate that means
the same thing for all three compressions, which is what lets an input pipeline save "next record
starts at byte N" in a checkpoint and resume exactly there. A compressed stream cannot be seeked,
so resuming inside a GZIP/ZLIB file decompresses and discards everything before the offset.

The reader does its own buffering on an unbuffered file: it pulls large chunks and cuts records
out of them with ``struct.unpack_from``, so the per-record cost is a couple of slices and two C
CRC calls rather than several ``read`` calls.

A record's length comes from the file, so it is checked before anything is allocated for it:
never more than ``max_record_bytes`` (2 GiB by default), and for an uncompressed regular file
never more than what is left of the file. A damaged or hostile header (or a decompression bomb
behind one) is a :class:`DataLossError`, not gigabytes of memory.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import numpy as np

from conveyor.data.errors import DataLossError, InvalidArgumentError
from conveyor.fileio import atomic_write, raise_naming

from .crc import masked_crc32c

__all__ = [
    "COMPRESSION_TYPES",
    "DEFAULT_MAX_RECORD_BYTES",
    "TFRecordReader",
    "TFRecordWriter",
    "build_index",
    "count_records",
    "default_index_path",
    "detect_compression",
    "not_regular",
    "read_index",
    "read_records",
    "write_index",
]

#: Accepted values of ``compression_type``; ``None`` and ``""`` both mean uncompressed.
COMPRESSION_TYPES: tuple[str | None, ...] = (None, "", "GZIP", "ZLIB")

# zlib window bits per compression: 15 = zlib wrapper, 31 = gzip wrapper (TensorFlow's
# ZlibCompressionOptions use MAX_WBITS, +16 for GZIP, and mem_level 9).
_WBITS = {"ZLIB": 15, "GZIP": 31}
_MEM_LEVEL = 9

_HEADER = struct.Struct("<QI")
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_HEADER_SIZE = 12
_FOOTER_SIZE = 4

_CHUNK = 1 << 20  # bytes pulled from the file (or the inflater) at a time
_MAX_READ = 1 << 26  # cap on a single read, so a garbage length cannot ask for 2**63 bytes
_WRITE_BUFFER = 1 << 18  # compressed writer: bytes gathered before handing them to zlib
_SNIFF_BYTES = 1 << 16  # raw bytes examined to recognise a file's compression

#: Default ``max_record_bytes``: the longest record a reader accepts. Protobuf messages cannot
#: exceed 2 GiB either, so no genuine tf.train.Example is refused.
DEFAULT_MAX_RECORD_BYTES = 2 << 30


def _check_compression(compression_type: str | None) -> str | None:
    """Normalise ``compression_type`` to None, "GZIP" or "ZLIB"; refuse anything else."""
    if compression_type is None or compression_type == "":
        return None
    if compression_type in _WBITS:
        return compression_type
    raise ValueError(
        f"compression_type must be one of None, '', 'GZIP', 'ZLIB' (got {compression_type!r}); "
        f"TFRecord compression names are upper-case, as in TensorFlow."
    )


def _check_max_record_bytes(max_record_bytes: int) -> int:
    if isinstance(max_record_bytes, bool) or not isinstance(max_record_bytes, int) or max_record_bytes < 0:
        raise ValueError(
            f"max_record_bytes must be a non-negative int (bytes), got {max_record_bytes!r}; "
            f"the default is {DEFAULT_MAX_RECORD_BYTES} (2 GiB)"
        )
    return max_record_bytes


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
# Opening a FIFO for reading blocks until a writer opens it; non-blocking, the open returns at once.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def not_regular(mode: int) -> str | None:
    """What a file of this ``st_mode`` is when it is not a regular file ("a FIFO (named pipe), not a
    regular file"); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _KINDS if test(mode)), "a special file")
    return f"{kind}, not a regular file"


def _open_regular(path: str) -> BinaryIO:
    """``path`` opened for unbuffered reading, refusing what is not a regular file: a FIFO blocks every
    read until some writer comes (forever, if none does), and a device such as /dev/zero never ends."""
    fd = os.open(path, os.O_RDONLY | _NONBLOCK)
    try:
        what = not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise InvalidArgumentError(f"{path} is {what}: TFRecord files are read from regular files only; "
                                       f"remove it from the file list (or narrow the file pattern)")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _valid_header(head: bytes) -> bool:
    return len(head) >= _HEADER_SIZE and _CRC.unpack_from(head, 8)[0] == masked_crc32c(head[:8])


def detect_compression(path: str | os.PathLike) -> str | None:
    """Recognise a TFRecord file's compression from its first bytes.

    Returns ``"GZIP"`` or ``"ZLIB"`` when the start of the file inflates that way into a valid
    record header, ``""`` (uncompressed) when it starts with a valid record header as it is, and
    None when neither works (an empty or damaged file). A file that starts with the GZIP magic is
    ``"GZIP"`` even if what follows is damaged, so that reading it blames the stream. At most 12
    bytes are inflated, whatever the file holds.
    """
    with _open_regular(os.fspath(path)) as f:
        head = f.read(_SNIFF_BYTES)
    if _valid_header(head):
        return ""
    for name, wbits in _WBITS.items():
        try:
            first = zlib.decompressobj(wbits).decompress(head, _HEADER_SIZE)
        except zlib.error:
            continue
        if _valid_header(first):
            return name
    return "GZIP" if head[:3] == b"\x1f\x8b\x08" else None


def _compression_fix(path: str, compression: str | None) -> str | None:
    """What to tell a reader that fails on a file's first record, if the file's compression is
    recognisably not the one it was read with; None when that is not the explanation."""
    try:
        found = detect_compression(path) if os.path.isfile(path) else None
    except OSError:
        return None
    if found is None or (found or None) == compression:
        return None
    if found == "":
        return "The file is not compressed: read it with compression_type=None."
    return f"The file is {found}-compressed: read it with compression_type='{found}'."


class TFRecordWriter:
    """Write records to a TFRecord file (TensorFlow's ``tf.io.TFRecordWriter`` format).

    Writes go straight to ``path``, as TensorFlow does; an interrupted writer leaves a file whose
    last record is truncated, which every reader reports as :class:`DataLossError` rather than
    silently dropping. Use it as a context manager so the compressed stream is always finished.
    """

    def __init__(self, path: str | os.PathLike, compression_type: str | None = None):
        self._compression = _check_compression(compression_type)
        self.path = os.fspath(path)
        self._file: BinaryIO | None = open(self.path, "wb", buffering=_CHUNK)
        self._compressor = None
        self._pending = bytearray()
        if self._compression is not None:
            self._compressor = zlib.compressobj(
                zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, _WBITS[self._compression], _MEM_LEVEL
            )
        self._last_len = -1
        self._last_header = b""

    def write(self, record: bytes | bytearray | memoryview) -> None:
        """Append one record."""
        if self._file is None:
            raise ValueError(f"TFRecordWriter for {self.path!r} is closed")
        if type(record) is not bytes:
            if isinstance(record, (bytearray, memoryview)):
                record = bytes(record)
            else:
                raise TypeError(
                    f"TFRecordWriter.write takes bytes, got {type(record).__name__}; "
                    f"encode text first (e.g. s.encode('utf-8'))"
                )
        n = len(record)
        if n != self._last_len:  # consecutive records often share a length: reuse the header
            len_bytes = _LEN.pack(n)
            self._last_header = len_bytes + _CRC.pack(masked_crc32c(len_bytes))
            self._last_len = n
        footer = _CRC.pack(masked_crc32c(record))
        try:
            if self._compressor is None:
                write = self._file.write
                write(self._last_header)
                write(record)
                write(footer)
            else:
                pending = self._pending
                pending += self._last_header
                pending += record
                pending += footer
                if len(pending) >= _WRITE_BUFFER:
                    self._file.write(self._compressor.compress(pending))
                    pending.clear()
        except OSError as e:  # a full disk says "No space left on device", not where
            raise_naming(e, self.path)

    def flush(self) -> None:
        """Push everything written so far to the operating system.

        For compressed files this emits a zlib sync-flush point, so a reader can decompress every
        record written before the flush even while the writer keeps going.
        """
        if self._file is None:
            return
        try:
            if self._compressor is not None:
                self._file.write(self._compressor.compress(self._pending))
                self._pending.clear()
                self._file.write(self._compressor.flush(zlib.Z_SYNC_FLUSH))
            self._file.flush()
        except OSError as e:
            raise_naming(e, self.path)

    def close(self) -> None:
        """Finish the stream and close the file (idempotent)."""
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            try:
                if self._compressor is not None:
                    f.write(self._compressor.compress(self._pending))
                    self._pending.clear()
                    f.write(self._compressor.flush(zlib.Z_FINISH))
                    self._compressor = None
            finally:
                f.close()  # flushes the buffer: where a full disk shows
        except OSError as e:
            raise_naming(e, self.path)

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _StreamError(Exception):
    """Raised by the inflater; the reader turns it into a DataLossError with the record offset."""


class _Inflater:
    """A ``read(n)`` interface over a GZIP/ZLIB stream that never holds more than ``n`` bytes.

    Concatenated streams (e.g. ``cat a.gz b.gz``) are read as one, like ``gunzip`` does. An input
    that ends in the middle of a stream is an error: the tail of the data is missing.
    """

    def __init__(self, raw: BinaryIO, wbits: int):
        self._raw = raw
        self._wbits = wbits
        self._d = zlib.decompressobj(wbits)
        self._saw_input = False

    def read(self, n: int) -> bytes:
        d = self._d
        try:
            while True:
                if d.unconsumed_tail:
                    data = d.decompress(d.unconsumed_tail, n)
                elif d.eof:
                    rest = d.unused_data or self._raw.read(_CHUNK)
                    if not rest:
                        return b""
                    d = self._d = zlib.decompressobj(self._wbits)
                    data = d.decompress(rest, n)
                else:
                    raw = self._raw.read(_CHUNK)
                    if not raw:
                        if not self._saw_input:
                            return b""  # an empty file is an empty stream
                        raise _StreamError("truncated record: compressed stream ends early")
                    self._saw_input = True
                    data = d.decompress(raw, n)
                if data:
                    return data
        except zlib.error as e:
            raise _StreamError(f"corrupted compressed stream ({e})") from None


class TFRecordReader:
    """Iterate over the records of one TFRecord file, verifying both CRCs of every record.

    ``offset`` is where to start, in bytes of the decompressed stream; it must be a record
    boundary, such as a previous reader's :attr:`offset` or an entry of :func:`build_index`.
    After each record, :attr:`offset` is the position of the next one, so saving it and opening a
    new reader there resumes exactly. A damaged or truncated record raises
    :class:`~conveyor.data.errors.DataLossError` carrying the file and the record's offset;
    nothing is skipped silently. ``verify=False`` skips the CRC checks (truncation is still
    detected) for data whose integrity is checked elsewhere.

    ``max_record_bytes`` bounds the length a record header may claim (default
    :data:`DEFAULT_MAX_RECORD_BYTES`, 2 GiB); a longer one is a ``DataLossError`` before anything
    is read or inflated for it. In an uncompressed regular file, a record must also fit in what is
    left of the file. Raise the bound only for files known to hold larger records.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        compression_type: str | None = None,
        offset: int = 0,
        verify: bool = True,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ):
        compression = _check_compression(compression_type)
        self.max_record_bytes = _check_max_record_bytes(max_record_bytes)
        offset = int(offset)
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.path = os.fspath(path)
        self.compression_type = compression
        self.verify = bool(verify)
        #: Byte offset (decompressed stream) of the next record to be read.
        self.offset = offset
        self._buf = b""
        self._pos = 0
        self._last_len = -1
        self._last_len_crc = -1
        self._size: int | None = None  # of an uncompressed regular file, to bound record lengths
        self._raw: BinaryIO | None = _open_regular(self.path)
        try:
            if compression is None:
                size = self._size = os.fstat(self._raw.fileno()).st_size  # a regular file: _open_regular
                if offset > size:
                    what = f"offset is past the end of the file ({size} bytes)"
                    raise DataLossError(self.path, offset, what)
                self._raw.seek(offset)
                self._read = self._raw.read
            else:
                self._read = _Inflater(self._raw, _WBITS[compression]).read
                self._discard(offset)
        except BaseException:
            self.close()
            raise

    def _discard(self, n: int) -> None:
        """Decompress and drop the first ``n`` bytes (a compressed stream cannot seek)."""
        left = n
        try:
            while left:
                chunk = self._read(min(left, _CHUNK))
                if not chunk:
                    raise self._loss("offset is past the end of the stream", n)
                left -= len(chunk)
        except _StreamError as e:
            raise self._loss(str(e), n - left) from None

    def _loss(self, what: str, offset: int | None = None, fix: str | None = None) -> DataLossError:
        """The error for the record at ``offset`` (default: the current one). When the very first
        record fails, a wrong ``compression_type`` is the likeliest cause: say which one fits."""
        offset = self.offset if offset is None else offset
        if fix is None and offset == 0:
            fix = _compression_fix(self.path, self.compression_type)
        return DataLossError(self.path, offset, what, fix)

    def _check_fits(self, length: int) -> None:
        """Refuse a record longer than the bound or than the rest of an uncompressed file, before
        reading any of it (a garbage length would otherwise be read, or inflated, in full)."""
        if self._size is not None:
            end = self.offset + _HEADER_SIZE + length + _FOOTER_SIZE
            if end > self._size:  # the file may have grown since it was opened: look again
                self._size = os.fstat(self._raw.fileno()).st_size
            if end > self._size:
                left = max(self._size - self.offset - _HEADER_SIZE, 0)
                raise self._loss(
                    f"truncated record: the header claims {length} bytes (+{_FOOTER_SIZE} of CRC) but "
                    f"only {left} bytes are left in the file"
                )
        if length > self.max_record_bytes:
            raise self._loss(
                f"corrupted record: the header claims {length} bytes, more than max_record_bytes "
                f"({self.max_record_bytes})",
                fix="The file is damaged; rewrite it or drop it from the file list. If it really holds "
                "records this long, pass a larger max_record_bytes.",
            )

    def _fill(self, need: int) -> bytes:
        """Make at least ``need`` bytes available from ``_pos`` (fewer only at end of input)."""
        buf, pos = self._buf, self._pos
        parts = [buf[pos:]] if pos < len(buf) else []
        have = len(buf) - pos
        read = self._read
        try:
            while have < need:
                chunk = read(min(max(_CHUNK, need - have), _MAX_READ))
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
        except _StreamError as e:
            raise self._loss(str(e)) from None
        buf = self._buf = b"".join(parts)
        self._pos = 0
        return buf

    def _next_long(self, buf: bytes, pos: int, length: int) -> bytes:
        """The record whose header is at ``buf[pos:]`` and whose data does not fit in the buffer.

        Its data is streamed into one buffer of its own, so it costs about its length once: joining
        the chunks and then slicing the record out of them held it twice (a GZIP bomb claiming 2 GiB
        cost 4 GiB). ``BytesIO`` grows by ``realloc`` and ``getvalue`` hands over that very buffer.
        """
        out = io.BytesIO()
        start = pos + _HEADER_SIZE
        out.write(memoryview(buf)[start : start + length])  # what the last fill brought of it
        left = length - out.tell()
        self._buf, self._pos = b"", 0
        read = self._read
        try:
            while left:
                chunk = read(min(left, _CHUNK))
                if not chunk:
                    raise self._loss("truncated record: partial data")
                out.write(chunk)
                left -= len(chunk)
        except _StreamError as e:
            raise self._loss(str(e)) from None
        data = out.getvalue()
        del out
        footer = self._fill(_FOOTER_SIZE)
        if len(footer) < _FOOTER_SIZE:
            raise self._loss("truncated record: partial data")
        if self.verify and _CRC.unpack_from(footer, 0)[0] != masked_crc32c(data):
            raise self._loss("corrupted record: data CRC mismatch")
        self._pos = _FOOTER_SIZE
        self.offset += _HEADER_SIZE + length + _FOOTER_SIZE
        return data

    def __iter__(self) -> TFRecordReader:
        return self

    def __next__(self) -> bytes:
        if self._raw is None:
            raise StopIteration
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEADER_SIZE:
            buf = self._fill(_HEADER_SIZE)
            pos = 0
            if len(buf) < _HEADER_SIZE:
                if not buf:
                    raise StopIteration
                raise self._loss("truncated record: partial header")
        length, len_crc = _HEADER.unpack_from(buf, pos)
        if self.verify:
            if length != self._last_len:
                self._last_len_crc = masked_crc32c(buf[pos : pos + 8])
                self._last_len = length
            if len_crc != self._last_len_crc:
                raise self._loss("corrupted record: length CRC mismatch")
        if length > self.max_record_bytes:
            self._check_fits(length)
        end = pos + _HEADER_SIZE + length + _FOOTER_SIZE
        if len(buf) < end:  # not all buffered: check the length before reading (or inflating) it
            self._check_fits(length)
            if length > _CHUNK:
                return self._next_long(buf, pos, length)
            buf = self._fill(end - pos)
            end -= pos
            pos = 0
            if len(buf) < end:
                raise self._loss("truncated record: partial data")
        data = buf[pos + _HEADER_SIZE : end - _FOOTER_SIZE]
        if self.verify and _CRC.unpack_from(buf, end - _FOOTER_SIZE)[0] != masked_crc32c(data):
            raise self._loss("corrupted record: data CRC mismatch")
        self._pos = end
        self.offset += end - pos
        return data

    def close(self) -> None:
        """Close the file (idempotent); iteration then stops."""
        raw, self._raw = self._raw, None
        self._buf = b""
        self._pos = 0
        if raw is not None:
            raw.close()

    def __enter__(self) -> TFRecordReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        raw = getattr(self, "_raw", None)
        if raw is not None:
            raw.close()


def read_records(
    path: str | os.PathLike,
    compression_type: str | None = None,
    offset: int = 0,
    verify: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[bytes]:
    """Yield every record of a file, closing it when the generator finishes or is dropped."""
    with TFRecordReader(path, compression_type, offset, verify, max_record_bytes) as reader:
        yield from reader


def count_records(path: str | os.PathLike, compression_type: str | None = None) -> int:
    """Count the records of a file, verifying each one on the way."""
    n = 0
    with TFRecordReader(path, compression_type) as reader:
        for _ in reader:
            n += 1
    return n


def build_index(path: str | os.PathLike, compression_type: str | None = None) -> np.ndarray:
    """Return the offset of every record as an int64 array, verifying the file on the way.

    ``TFRecordReader(path, compression_type, offset=index[i])`` then starts at record ``i``, which
    is what random access and record-level sharding need. For GZIP/ZLIB files the offsets are in
    the decompressed stream, so starting there still decompresses the preceding bytes.
    """
    offsets: list[int] = []
    with TFRecordReader(path, compression_type) as reader:
        while True:
            start = reader.offset
            try:
                next(reader)
            except StopIteration:
                break
            offsets.append(start)
    return np.array(offsets, dtype=np.int64)


def default_index_path(path: str | os.PathLike) -> str:
    """The index file that belongs to a TFRecord file: ``<path>.index``."""
    return os.fspath(path) + ".index"


def write_index(
    path: str | os.PathLike, offsets: Iterable[int] | np.ndarray, index_path: str | os.PathLike | None = None
) -> str:
    """Store a record index for the TFRecord file ``path``; return the index file's path.

    Format: plain ASCII text, one decimal record offset per line, in increasing order, each line
    ending in ``\\n`` (an empty index is an empty file). Text keeps the file readable with any tool
    and free of pickle/npy parsing. It goes to ``<path>.index`` unless ``index_path`` is given,
    and is written to a temporary file then renamed, so concurrent readers never see half of it.
    """
    target = os.fspath(index_path) if index_path is not None else default_index_path(path)
    values = [int(v) for v in np.asarray(offsets, dtype=np.int64).reshape(-1)]
    _check_offsets(values, target)
    atomic_write(target, "".join(f"{v}\n" for v in values).encode("ascii"))
    return target


def read_index(path: str | os.PathLike, index_path: str | os.PathLike | None = None) -> np.ndarray:
    """Load the record index written by :func:`write_index` for the TFRecord file ``path``."""
    source = os.fspath(index_path) if index_path is not None else default_index_path(path)
    with open(source, encoding="ascii") as f:
        text = f.read()
    try:
        values = [int(tok) for tok in text.split()]
    except ValueError:
        raise ValueError(f"{source}: not a TFRecord index (expected one decimal offset per line)") from None
    _check_offsets(values, source)
    return np.array(values, dtype=np.int64)


def _check_offsets(values: list[int], where: str) -> None:
    """Refuse offsets that cannot be an index: negative or not strictly increasing."""
    prev = -1
    for i, v in enumerate(values):
        if v <= prev:
            raise ValueError(
                f"{where}: record offsets must be >= 0 and strictly increasing; entry {i} is {v} after {prev}"
            )
        prev = v
