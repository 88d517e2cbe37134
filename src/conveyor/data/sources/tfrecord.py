"""`TFRecordDataset(filenames, compression_type, buffer_size)`: the records of files, one file after
the other (docs/tfdata-semantics.md §13).

    TFRecordDataset(["a.tfrecord", "b.tfrecord"])          # records of a, then of b, as bytes
    TFRecordDataset(files, compression_type="GZIP")        # the whole file stream is compressed

The file names come from an input dataset (elements are `str` or `bytes` paths); the facade turns
a list into one, and `num_parallel_reads` is an interleave over one such dataset per file.
Reading and verification are the records layer's job (`conveyor.data.records.tfrecord`): a
damaged record raises `DataLossError` naming the file and the byte offset.

State: the file-name input's state, the current file, the reader's offset (next record, in
bytes of the decompressed stream) and the file's size and modification time (ns) when it was
opened, so a resumed iterator reopens the file there: a seek for uncompressed files,
decompress-and-discard for GZIP/ZLIB. Files are opened lazily, on the first `next`, so a parallel
interleave opens (and skips into) them on its reader threads.

Loading a state never opens a file it does not list: the saved file must be one of the file-name
input's elements when those are known (a list, `list_files`, and shuffle/shard/take/... of them;
names computed by `map` cannot be listed and are taken as they are). A file whose size or
modification time differs from the saved ones is refused (`StateMismatchError`: the offset would
land in other data); a state saved before these were recorded is accepted with a warning. Either
way a record must start at the saved offset (its header's CRC is checked on the first read), or the
state is refused (`StateError` naming the file and the byte).
"""

from __future__ import annotations

import errno
import os
import warnings
from typing import Any

import numpy as np

from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.errors import DataLossError, InvalidArgumentError, StateMismatchError
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

    def reread(self, source: StateField, locators: list[StateField]) -> list:
        """Records at the saved offsets of one file, which must be listed and unchanged: the file is
        opened once and read in offset order, seeking over long gaps (uncompressed files)."""
        parts = source.as_list(length=3)
        path = _listed(self.inputs[0], parts[0])
        saved = (parts[1].as_int(0), parts[2].as_int(None))
        offsets = [f.as_int(0) for f in locators]
        try:
            now = _stat(path)
        except FileNotFoundError:
            raise StateMismatchError(f"{path}, which the iterator state holds records of, no longer exists; "
                                     f"restore it, or start without the data state (--no-resume)",
                                     source.where) from None
        if now != saved:
            raise _changed(path, saved, now, min(offsets, default=0), source.where)
        records = _read_at(path, self.compression_type, sorted(zip(offsets, locators, strict=True),
                                                               key=lambda p: p[0]))
        return [records[o] for o in offsets]


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
        self._files_node = node.inputs[0]
        self._files = self.inputs[0]
        self._compression = node.compression_type
        self._max_record_bytes = node.max_record_bytes
        self._files_done = False
        self._path: str | None = None  # current file
        self._offset = 0  # where to (re)open it, until the reader exists
        self._reader: TFRecordReader | None = None
        self._stat: tuple[int, int] | None = None  # (size, mtime_ns) of the current file when opened
        self._resumed: StateField | None = None  # the restored offset field, until the file is reopened
        self._resumed_where: str | None = None  # where the restored state sat in the whole state
        self._resumed_unchecked = False  # the restored state recorded no size and mtime to check the file by
        self._tracking = False
        self._source: list | None = None  # [path, size, mtime_ns] of the open file, the elements' provenance
        self._last_offset = 0  # where the record the last `next` returned starts

    def _open(self) -> TFRecordReader:
        try:
            self._reader = TFRecordReader(self._path, self._compression, offset=self._offset,
                                          max_record_bytes=self._max_record_bytes)
            seen = _stat(self._path)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                errno.ENOENT, f"TFRecord file not found: {self._path} (check the file list or pattern)",
                self._path) from e
        except DataLossError as e:  # the saved offset is past the end of the (unchanged) file
            raise self._bad_offset(e) from None
        if self._stat is not None and seen != self._stat:  # changed between loading the state and now
            self._reader.close()
            self._reader = None
            raise _changed(self._path, self._stat, seen, self._offset, self._resumed_where)
        self._stat = seen
        self._source = [self._path, *seen]
        return self._reader

    def _bad_offset(self, e: DataLossError) -> Exception:
        """A read error right where a restored state points means the state's offset is wrong (the
        file was checked to be unchanged); anywhere else it is the file's."""
        field, self._resumed = self._resumed, None
        if field is None or e.offset != self._offset:
            return e
        why = ("although its size and modification time are those saved with the state" if not self._resumed_unchecked
               else "so the offset is not a record boundary (the state records no size and modification time to "
               "tell whether the file changed)")
        return field.error(f"{self._path} has no record at byte {self._offset} ({e.what}), {why}")

    def enable_provenance(self) -> bool:
        # Only files from a known list: a restore re-opens what the state names, which must be listed.
        self._tracking = self._files_node.known_elements() is not None
        if self._tracking:  # an instance attribute: iterators that do not track pay nothing per record
            self._next = self._next_tracked
        return self._tracking

    def provenance(self) -> tuple[list, int] | None:
        return (self._source, self._last_offset) if self._tracking else None

    def _next_tracked(self) -> bytes:
        record = TFRecordIter._next(self)
        # the reader stays open until the next call; a record takes 16 + len bytes
        self._last_offset = self._reader.offset - len(record) - _FRAMING
        return record

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
                    self._stat = None
                reader = self._open()
                if self._resumed is not None:  # once per restore, not per record
                    try:
                        return next(reader)
                    except DataLossError as e:
                        raise self._bad_offset(e) from None
                    except StopIteration:
                        pass
                    finally:
                        self._resumed = None
                    self._end_of_file(reader)
                    continue
            try:
                return next(reader)
            except StopIteration:
                self._end_of_file(reader)

    def _end_of_file(self, reader: TFRecordReader) -> None:
        reader.close()
        self._reader = None
        self._path = None
        self._stat = None

    def get_state(self) -> dict[str, Any]:
        state = {
            "files": None if self._files_done else self._files.get_state(),
            "path": self._path,
            "offset": self._reader.offset if self._reader is not None else self._offset,
        }
        if self._path is not None and self._stat is not None:
            state["size"], state["mtime_ns"] = self._stat
        return state

    def set_state(self, state: StateField) -> None:
        state.fields(("files", "path", "offset"), optional=("size", "mtime_ns"))
        if state["files"].is_none():
            self._files_done = True
        else:
            self._files.set_state(state["files"])
        self._offset = state["offset"].as_int(0)
        if state["path"].is_none():
            self._path = None
            return
        self._path = self._listed(state["path"])
        size, mtime = state.get("size"), state.get("mtime_ns")
        if size is None and mtime is None:
            warnings.warn(f"resuming inside {self._path} from a state saved by an earlier conveyor, which did not "
                          f"record the file's size and modification time: cannot check that the file is unchanged",
                          stacklevel=2)
            # The offset is still checked, on the first read: a record must start there (its header's CRC),
            # or the state, not the file, is wrong.
            self._resumed, self._resumed_where, self._resumed_unchecked = state["offset"], state.where, True
            return
        if size is None or mtime is None:
            raise (size or mtime).error("expected both 'size' and 'mtime_ns' of the file, got only this one")
        saved = (size.as_int(0), mtime.as_int(None))
        if self._compression is None and self._offset > saved[0]:
            raise state["offset"].error(f"offset {self._offset} is past the end of {self._path} ({saved[0]} bytes)")
        try:
            now = _stat(self._path)
        except FileNotFoundError:
            raise StateMismatchError(f"{self._path}, which the iterator state is positioned in, no longer exists; "
                                     f"restore it, or start without the data state (--no-resume)",
                                     state.where) from None
        if now != saved:
            raise _changed(self._path, saved, now, self._offset, state.where)
        self._stat = saved
        self._resumed, self._resumed_where, self._resumed_unchecked = state["offset"], state.where, False

    def _listed(self, field: StateField) -> str:
        """The saved current file, which must be one the file-name input can produce."""
        return _listed(self._files_node, field, required=False)

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        super().close()


_FRAMING = 16  # bytes around each record's data: length (8), its CRC (4), the data's CRC (4)
_SEEK_GAP = 1 << 18  # re-open at the next wanted offset rather than read through more than this


def _listed(files_node: Node, field: StateField, required: bool = True) -> str:
    """A saved file name, which must be one `files_node` can produce (when that list is known, or
    always when `required`)."""
    path = field.as_str()
    known = files_node.known_elements()
    if known is None and required:
        raise field.error(f"{path!r} cannot be checked against this pipeline's file list (the names are computed)")
    if known is not None and path not in {_as_path(x) for x in known}:
        raise field.error(f"{path!r} is not in this pipeline's file list")
    return path


def _read_at(path: str, compression: str | None, wanted: list[tuple[int, StateField]]) -> dict[int, bytes]:
    """The records starting at the `wanted` offsets (sorted), each checked to be a record boundary."""
    records: dict[int, bytes] = {}
    reader: TFRecordReader | None = None
    try:
        for offset, field in wanted:
            if offset in records:
                continue
            if reader is None or (compression is None and offset - reader.offset > _SEEK_GAP):
                if reader is not None:
                    reader.close()
                reader = _open_at(path, compression, offset, field)
            records[offset] = _record_at(reader, offset, field)
    finally:
        if reader is not None:
            reader.close()
    return records


def _open_at(path: str, compression: str | None, offset: int, field: StateField) -> TFRecordReader:
    try:
        return TFRecordReader(path, compression, offset=offset)
    except DataLossError as e:
        raise field.error(f"{path} has no record at byte {offset} ({e.what})") from None


def _record_at(reader: TFRecordReader, offset: int, field: StateField) -> bytes:
    try:
        while reader.offset < offset:  # read through a short gap (or, compressed, any gap)
            next(reader)
        if reader.offset != offset:
            raise field.error(f"{reader.path} has no record boundary at byte {offset} (a record spans it)")
        return next(reader)
    except DataLossError as e:
        raise field.error(f"{reader.path} has no record at byte {offset} ({e.what})") from None
    except StopIteration:
        raise field.error(f"offset {offset} is past the last record of {reader.path}") from None


def _stat(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _changed(path: str, saved: tuple[int, int], now: tuple[int, int], offset: int,
             field: str | None) -> StateMismatchError:
    return StateMismatchError(
        f"{path} changed since the checkpoint: it had {saved[0]} bytes and mtime_ns {saved[1]} when the iterator "
        f"state was saved, and has {now[0]} bytes and mtime_ns {now[1]} now, so the saved position (byte {offset}) "
        f"would land in other data. Restore the original file, or start without the data state (--no-resume)", field)
