"""The job secret from a file or a variable: hex (as `openssl rand -hex 32` writes it), at least 16 bytes.

    read_secret_file("job.secret", "--job-secret-file", error=CommandError, fix=MAKE_SECRET)   # -> bytes
    parse_secret(os.environ["CONVEYOR_JOB_SECRET"], "CONVEYOR_JOB_SECRET", error=..., fix=...)

A file others can read is refused (they could sign messages as the job), as ssh refuses such a key.
Errors are raised as ``error`` (the caller's own type) and end with ``fix``; the value is never echoed.
Used by `conveyor run` and by the data service's roles.
"""

from __future__ import annotations

import os
import stat


def read_secret_file(path: str, where: str, *, error: type[Exception], fix: str) -> bytes:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as e:
        raise error(f"{where} {path}: {e.strerror or e}; {fix}") from None
    if stat.S_IMODE(mode) & 0o077:  # like ssh with a private key: others could forge the job's messages
        raise error(f"{where} {path} is readable by other users (mode {stat.S_IMODE(mode):04o}): anyone "
                    f"on this machine could sign messages as the job; chmod 600 {path} (a Kubernetes "
                    f"Secret volume: defaultMode 0400)")
    return parse_secret(text, f"{where} {path}", error=error, fix=fix)


def parse_secret(text: str, where: str, *, error: type[Exception], fix: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise error(f"{where}: expected at least 32 hex digits; {fix}")
    return secret
