"""One job per output folder (issue 22, defect 4): the lock refuses a second holder at once, naming it, and a
kill -9 of the holder frees the folder; real processes, since the lock is the kernel's per-process record lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.cluster.output_lock import LOCK_NAME, OutputDirBusyError, OutputLock, lock_for_script
from conveyor.cluster.variables import OUTPUT_LOCK_VAR

HOLD = """
import sys, time
from conveyor.cluster.output_lock import OutputLock
OutputLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def acquire_elsewhere(folder: Path) -> subprocess.CompletedProcess:
    """Another process's try (a lock held by this process would not refuse this one: POSIX locks are per process)."""
    code = "import sys\nfrom conveyor.cluster.output_lock import OutputLock\nOutputLock.acquire(sys.argv[1]).release()"
    return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=60)


def test_a_second_process_is_refused_naming_the_holder_until_the_holder_is_killed(tmp_path):
    first = holder(tmp_path)
    try:
        started = time.monotonic()
        second = acquire_elsewhere(tmp_path)
        assert second.returncode == 1 and time.monotonic() - started < 30
        assert "OutputDirBusyError" in second.stderr and f"pid {first.pid} on host " in second.stderr
        assert "another --output-dir" in second.stderr and f"kill {first.pid}" in second.stderr
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert acquire_elsewhere(tmp_path).returncode == 0  # the kernel released it with the process
    assert (tmp_path / LOCK_NAME).exists()  # never deleted: a new holder locks the same file


def test_one_process_may_take_it_twice_and_releases_it_with_the_last_holder(tmp_path):
    a, b = OutputLock.acquire(tmp_path), OutputLock.acquire(tmp_path)
    a.release()
    assert acquire_elsewhere(tmp_path).returncode == 1  # still held by `b`
    b.release()
    assert acquire_elsewhere(tmp_path).returncode == 0


def test_a_script_takes_it_on_rank_0_unless_the_launcher_holds_it(tmp_path):
    assert lock_for_script(1, tmp_path, {}) is None
    assert lock_for_script(0, tmp_path, {OUTPUT_LOCK_VAR: str(tmp_path / LOCK_NAME)}) is None
    lock = lock_for_script(0, tmp_path, {})
    try:
        assert acquire_elsewhere(tmp_path).returncode == 1
    finally:
        lock.release()


def test_the_error_is_a_usage_error():
    assert OutputDirBusyError.usage_error is True


@pytest.mark.parametrize("content", ["", "not json", '{"pid": "x"}'])
def test_a_lock_file_without_a_readable_holder_still_refuses(tmp_path, content):
    first = holder(tmp_path)
    try:
        (tmp_path / LOCK_NAME).write_text(content)  # only the lock matters, not what the file says
        second = acquire_elsewhere(tmp_path)
        assert second.returncode == 1 and "a process that has not written its name yet" in second.stderr
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
