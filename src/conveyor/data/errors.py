"""Errors raised by the input pipeline."""

from __future__ import annotations


class DataLossError(OSError):
    """A record is damaged or truncated.

    Named after TensorFlow's error of the same meaning. Carries the file and the byte offset
    (in the decompressed stream for GZIP/ZLIB files) of the record that could not be read.
    """

    #: What to do about it, unless the reader knows better (e.g. the file is just compressed).
    DEFAULT_FIX = "The file is damaged or truncated; rewrite it, or drop it from the file list."

    def __init__(self, path: str, offset: int, what: str, fix: str | None = None):
        self.path = str(path)
        self.offset = int(offset)
        self.what = what
        self.fix = fix or self.DEFAULT_FIX
        super().__init__(f"{self.path}: {what} at byte offset {self.offset}. {self.fix}")

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (DataLossError, (self.path, self.offset, self.what, self.fix))


class InvalidArgumentError(ValueError):
    """An argument to a dataset op is out of range (tf.errors.InvalidArgumentError's meaning)."""


class StateError(ValueError):
    """A saved iterator state cannot be loaded into this pipeline: it is malformed, does not fit the
    pipeline, or no longer fits the files it points into.

    States come from checkpoints, which others may be able to write, so `load_state_dict` checks
    every field before it opens or allocates anything. `field` names the offending entry, as a
    path into the dict given to `load_state_dict` (e.g. `state["state"]["input"]["offset"]`), or
    is None when the state as a whole does not fit.
    """

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.field))


class StateMismatchError(StateError):
    """An iterator state was saved from a different pipeline (or format version), or a file it
    points into changed since it was saved."""


class RedistributeError(StateError):
    """The saved position of an interrupted epoch cannot be dealt over another number of workers
    (`conveyor.data.redistribute`); the message names the op that holds it back."""
