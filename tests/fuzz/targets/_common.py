"""Helpers the fuzz targets share (the leading underscore keeps this file from being a target).

The runner puts this folder on ``sys.path``, so a target says ``import _common``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def private_temp_dir(prefix: str) -> str:
    """A temporary folder for this process, removed at exit; folders of earlier runs whose process is gone
    are removed first, since libFuzzer ends with _exit, which skips atexit."""
    root = tempfile.gettempdir()
    if os.path.isdir("/proc"):
        for name in os.listdir(root):
            pid = name[len(prefix):].split("-")[0]
            if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(os.path.join(root, name), True)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def expand_runs(text: str, limit: int = 1 << 18) -> str:
    """NUL, a character c and a count character n stand for c written 32 * (ord(n) % 256) times, up to
    ``limit`` characters in all.

    No environment variable or argv string can hold NUL, so the escape hides no real input; it lets the
    fuzzer reach what its 4 KiB inputs cannot spell out (1000-level nesting, 5000-digit numbers).
    """
    head, *runs = text.split("\x00")
    out, size = [head], len(head)
    for run in runs:
        count = 32 * (ord(run[1]) % 256) if len(run) >= 2 else 0
        piece = run[:1] * min(count, max(0, limit - size)) + run[2:]
        out.append(piece)
        size += len(piece)
    return "".join(out)
