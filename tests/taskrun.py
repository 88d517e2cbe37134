"""Shared by the multi-process tests: wait for the task processes a test started, never forever."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from typing import IO

import pytest


def wait_all(procs: Sequence[tuple[subprocess.Popen, IO]], deadline: float, what: str,
             logs: Callable[[], str]) -> None:
    """Wait for every process up to `deadline` seconds in all; on time-out fail the test with the
    logs. Whatever still runs afterwards is killed, and every log file is closed."""
    end = time.monotonic() + deadline
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: still running after {deadline:g} s\n{logs()}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
