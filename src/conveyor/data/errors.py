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


class StateMismatchError(ValueError):
    """An iterator state was saved from a different pipeline (or format version)."""
