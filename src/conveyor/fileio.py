"""How conveyor writes files, and how it puts bytes into JSON. Standard library only.

Every package may import this module — the data layer too (`docs/architecture.md`, "Layers"), so it
must never import torch, numpy or anything of conveyor's.

    atomic_write(out / "summary.json", json.dumps(summary).encode())

A reader of `path` sees the old file or the new one, never a part: the bytes go to a temporary
file beside `path` (same folder, so the same file system), which is flushed, fsynced, renamed over
`path` (atomic on POSIX and Windows), and the folder is fsynced so the new name survives a power
loss. If anything fails the temporary file is removed and `path` is untouched. The temporary name
starts with `.tmp-`: hidden, and what `CheckpointManager.cleanup` recognises as a crashed writer's.
Every OSError names a file, a full disk's too (`raise_naming`).

Every file conveyor writes into an output folder gets the mode `umask_mode()` gives (like any Unix
tool's output: a shared folder must be readable by other hosts and TensorBoard; `umask 077` makes it
private).

Bytes in JSON (`bytes_to_json` / `bytes_from_json`): standard base64 with padding, as ASCII text.
One codec for every JSON file conveyor writes — state trees' `{"__bytes__": ...}`, RNG states in a
worker's data state, pipeline elements in iterator states — so they read each other's bytes alike.
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path
from typing import NoReturn

__all__ = ["atomic_write", "bytes_from_json", "bytes_to_json", "format_bytes", "raise_naming", "sync_dir",
           "umask_mode", "write_file"]


def umask_mode(base: int = 0o666) -> int:
    """`base` less the process umask: the mode `open()` gives a new file.

    Writers whose library picks its own mode (safetensors writes a 0600 temp file, then renames it)
    chmod to this.
    """
    try:  # Linux reports it; os.umask can only read it by setting it, which races with other threads
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return base & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def raise_naming(error: OSError, path: str | os.PathLike[str]) -> NoReturn:
    """Raise `error`, naming `path` if it names no file.

    `write`, `flush`, `close` and `fsync` report a full disk (or a quota, or an I/O error) as a bare
    "[Errno 28] No space left on device"; which file it was is what the user needs to act. Call it
    in an `except OSError` around such calls.
    """
    if error.filename is not None or error.errno is None:
        raise error
    raise OSError(error.errno, error.strerror, os.fspath(path)) from error  # the subclass its errno maps to


def write_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True, mode: int | None = None) -> None:
    """Create or truncate `path` and write `data` to it (not atomic: for files inside a folder that is).

    `fsync` makes the bytes durable before returning. `mode` None follows the umask (0666 less it);
    a number is set exactly. An OSError names `path` (a full disk too).
    """
    try:
        with open(path, "wb") as f:
            if mode is not None:
                os.chmod(path, mode)
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except OSError as e:
        raise_naming(e, path)


def sync_dir(folder: str | os.PathLike[str]) -> None:
    """fsync a folder so the names created or renamed in it survive a crash (POSIX only; a no-op on Windows)."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        raise_naming(e, folder)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str], data: bytes, *, fsync: bool = True, mode: int | None = None
) -> Path:
    """Replace `path` with `data` atomically (module docstring) and return it; creates missing parent folders.

    `fsync=False` keeps the atomicity for readers but not the durability across a power loss (for
    tests and scratch output). `mode` None follows the umask; a number is set exactly.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    try:
        write_file(tmp, bytes(data), fsync=fsync, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        sync_dir(path.parent)
    return path


def bytes_to_json(data: bytes | bytearray | memoryview) -> str:
    """`data` as JSON-safe text (standard base64); `bytes_from_json` reads it back."""
    return base64.b64encode(data).decode("ascii")


def bytes_from_json(text: str) -> bytes:
    """The bytes `bytes_to_json` wrote. A damaged file raises: `ValueError` (`binascii.Error`) where `text`
    is not base64 — stray characters are refused, not skipped — and `TypeError` where it is not a string."""
    return base64.b64decode(text, validate=True)


def format_bytes(n: float) -> str:
    """A size for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.0 GiB`` (GiB is the largest unit)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GiB ends the loop")
