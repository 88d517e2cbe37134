"""`TFRecordDataset(filenames, compression_type, buffer_size)`: the records of files, one file after
the other (TFDATA.md §13).

    TFRecordDataset(["a.tfrecord", "b.tfrecord"])          # records of a, then of b, as bytes
    TFRecordDataset(files, compression_type="GZIP")        # the whole file stream is compressed

The file names come from an input dataset (elements are `str` or `bytes` paths); the facade turns
a list into one, and `num_parallel_reads` is an interleave over one such dataset per file.
Reading and verification are the records layer's job (`conveyor.data.records.tfrecord`): a
damaged record raises `DataLossError` naming the file and the byte offset.

State: the file-name input's state, the current file and the reader's offset (next record, in
bytes of the decompressed stream), so a resumed iterator reopens the file there: a seek for
uncompressed files, decompress-and-discard for GZIP/ZLIB. Files are opened lazily, on the first
`next`, so a parallel interleave opens (and skips into) them on its reader threads.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node
from conveyor.data.errors import InvalidArgumentError
from conveyor.data.records.tfrecord import (
    COMPRESSION_TYPES,
    DEFAULT_MAX_RECORD_BYTES,
    TFRecordReader,
    _check_max_record_bytes,
)


class TFRecordNode(Node):
    name = "tfrecord"

    def __init__(self, filenames_node: Node, compression_type: str | None = None, buffer_size: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        super().__init__(filenames_node)
        if compression_type not in COMPRESSION_TYPES:
            raise InvalidArgumentError(
                f"compression_type must be one of None, '', 'GZIP', 'ZLIB' (got {compression_type!r}); "
                f"the names are upper-case, as in TensorFlow"
            )
        # tf.data's read-buffer size in bytes. The records layer sizes its own reads, so the value
        # is checked and kept (it is part of the pipeline's identity) but does not change anything.
        if buffer_size is not None and (isinstance(buffer_size, bool) or not isinstance(buffer_size, int)
                                        or buffer_size < 0):
            raise InvalidArgumentError(f"buffer_size must be a non-negative number of bytes, got {buffer_size!r}")
        self.compression_type = compression_type or None
        self.buffer_size = buffer_size
        # A read limit, not part of params(): it changes no element, only which files are refused.
        self.max_record_bytes = _check_max_record_bytes(max_record_bytes)

    def params(self) -> dict[str, Any]:
        return {"compression_type": self.compression_type, "buffer_size": self.buffer_size}

    def iterator(self, ctx: Context) -> Iter:
        return TFRecordIter(self, ctx)


def _as_path(x: Any) -> str:
    """A file-name element (str, bytes, or a numpy scalar/0-d array of either) as a str path."""
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x.item()
    if isinstance(x, (bytes, np.bytes_)):
        return os.fsdecode(bytes(x))
    if isinstance(x, (str, os.PathLike)):
        return os.fspath(str(x) if isinstance(x, np.str_) else x)
    raise TypeError(f"TFRecordDataset file names must be str or bytes, got {type(x).__name__}: {x!r}")


class TFRecordIter(Iter):
    def __init__(self, node: TFRecordNode, ctx: Context):
        super().__init__(node.name, ctx, node.inputs[0].iterator(ctx.child(0)))
        self._files = self.inputs[0]
        self._compression = node.compression_type
        self._max_record_bytes = node.max_record_bytes
        self._files_done = False
        self._path: str | None = None  # current file
        self._offset = 0  # where to (re)open it, until the reader exists
        self._reader: TFRecordReader | None = None

    def _open(self) -> TFRecordReader:
        try:
            self._reader = TFRecordReader(self._path, self._compression, offset=self._offset,
                                          max_record_bytes=self._max_record_bytes)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                errno.ENOENT, f"TFRecord file not found: {self._path} (check the file list or pattern)",
                self._path) from e
        return self._reader

    def _next(self) -> bytes:
        while True:
            reader = self._reader
            if reader is None:
                if self._path is None:
                    if self._files_done:
                        raise StopIteration
                    try:
                        self._path = _as_path(next(self._files))
                    except StopIteration:
                        self._files_done = True
                        raise
                    self._offset = 0
                reader = self._open()
            try:
                return next(reader)
            except StopIteration:
                reader.close()
                self._reader = None
                self._path = None

    def get_state(self) -> dict[str, Any]:
        return {
            "files": None if self._files_done else self._files.get_state(),
            "path": self._path,
            "offset": self._reader.offset if self._reader is not None else self._offset,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state["files"] is None:
            self._files_done = True
        else:
            self._files.set_state(state["files"])
        self._path = state["path"]
        self._offset = int(state["offset"])

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        super().close()
