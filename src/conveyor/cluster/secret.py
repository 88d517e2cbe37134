"""The job secret from a file or a variable: hex (as `openssl rand -hex 32` writes it), at least 16 bytes.

    read_secret_file("job.secret", "--job-secret-file", error=CommandError, fix=MAKE_SECRET)   # -> bytes
    parse_secret(os.environ["CONVEYOR_JOB_SECRET"], "CONVEYOR_JOB_SECRET", error=..., fix=...)

A file others can read, another user owns, or that is not a regular file is refused (they could sign
messages as the job), as ssh refuses such a key.
Errors are raised as ``error`` (the caller's own type) and end with ``fix``; the value is never echoed.
Used by `conveyor run` and by the data service's roles.
"""

from __future__ import annotations

import os
import stat


def read_secret_file(path: str, where: str, *, error: type[Exception], fix: str) -> bytes:
    try:  # links are followed (a Kubernetes Secret volume's files are links): the file itself is checked
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
        with open(fd, encoding="ascii", errors="replace") as f:
            info = os.fstat(f.fileno())
            text = f.read() if stat.S_ISREG(info.st_mode) else ""
    except OSError as e:
        raise error(f"{where} {path}: {e.strerror or e}; {fix}") from None
    _check_secret_file(path, where, info, error, fix)
    return parse_secret(text, f"{where} {path}", error=error, fix=fix)


def _check_secret_file(path: str, where: str, info: os.stat_result, error: type[Exception], fix: str) -> None:
    """Like ssh with a private key: a file others could read, or one another user owns (who could have
    created it in a shared folder before the secret was written into it, and kept it open), is refused."""
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{where} {path} is not a regular file; {fix}")
    if info.st_uid not in (os.geteuid(), 0):  # root could read it anyway
        raise error(f"{where} {path} belongs to another user (uid {info.st_uid}, you are {os.geteuid()}): "
                    f"they could read or replace the secret; delete it and write a fresh one yourself: {fix}")
    if mode & 0o077:  # others could forge the job's messages
        raise error(f"{where} {path} is readable by other users (mode {mode:04o}): anyone "
                    f"on this machine could sign messages as the job; chmod 600 {path} (a Kubernetes "
                    f"Secret volume: defaultMode 0400)")


def parse_secret(text: str, where: str, *, error: type[Exception], fix: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise error(f"{where}: expected at least 32 hex digits; {fix}")
    return secret
