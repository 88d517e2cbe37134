"""`match_files(patterns)`: the file list behind `Dataset.list_files`.

tf.data semantics (docs/tfdata-semantics.md §2): every glob pattern is expanded (`MatchingFiles`), the matches of
all patterns are concatenated and the whole list is sorted lexicographically (the kernel's
`std::sort`; Python's code-point order on `str` is the same order as bytes of UTF-8). Duplicates
are kept. When nothing matches at all, `InvalidArgumentError("No files matched pattern: ...")`
names the patterns, joined by ", " as tf.data does. A FIFO, socket or device among the matches is an
`InvalidArgumentError` too (a FIFO would block its reader forever).

    match_files("data/train-*.tfrecord")                    # ['data/train-0.tfrecord', ...]
    match_files(["b/*.tfrecord", "a/*.tfrecord"])            # a/... before b/...

Patterns use Python's `glob` syntax (`*`, `?`, `[...]`; no recursive `**`). The list is taken
once, when the dataset is built, so every iterator (and every worker building the same pipeline)
sees the same files.
"""

from __future__ import annotations

import glob
import os
import stat

from conveyor.data.errors import InvalidArgumentError
from conveyor.data.records.tfrecord import not_regular


def match_files(file_pattern: str | os.PathLike | list | tuple) -> list[str]:
    """All files matching the pattern(s), sorted; raise if there are none."""
    patterns = [file_pattern] if isinstance(file_pattern, (str, bytes, os.PathLike)) else list(file_pattern)
    names = []
    for p in patterns:
        if isinstance(p, bytes):
            p = p.decode()
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"list_files expects glob patterns (str), got {type(p).__name__} {p!r}")
        names.append(os.fspath(p))
    matches = [(m, p) for p in names for m in glob.glob(p, recursive=False)]
    if not matches:
        shown = ", ".join(names) if names else "(no patterns given)"
        raise InvalidArgumentError(f"No files matched pattern: {shown}")
    for m, p in matches:
        _check_not_special(m, p)
    return sorted(m for m, _ in matches)


def _check_not_special(path: str, pattern: str) -> None:
    """Refuse a FIFO, socket or device among the matches: reading a FIFO blocks until some writer comes
    (forever, if none does), and a device such as /dev/zero never ends. Folders are left to the reader,
    as tf.data lists them too."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # gone, or a dangling link: the reader names it when it opens it
    what = None if stat.S_ISDIR(mode) else not_regular(mode)
    if what is not None:
        raise InvalidArgumentError(f"{path} (matched by {pattern}) is {what}: a dataset reads regular files only; "
                                   f"move it away or narrow the pattern")
