"""How much a piece of code grows a process's peak resident memory, measured in a fresh Python.

    result, growth = peak_growth("import numpy as np", "result = int(np.ones(1 << 20).sum())")

The code runs in its own process so that nothing the test process holds counts, and the measure is
Linux's VmHWM (the high-water mark of this process's own memory; ``ru_maxrss`` would carry the
parent's peak over the exec). Tests that use it are skipped where /proc/self/status is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

_SCRIPT = """
import json, sys

def _peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

{setup}
_before = _peak()
{body}
print(json.dumps([result, _peak() - _before]))
"""


def peak_growth(setup: str, body: str, *argv: str, timeout: float = 180) -> tuple[Any, int]:
    """Run ``setup``, then ``body`` (which sets ``result``, a JSON value) in a fresh Python with ``argv``;
    return ``result`` and how many bytes the peak resident memory grew while ``body`` ran."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux's /proc/self/status (VmHWM) to measure a process's peak memory")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(setup=setup, body=body), *argv],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"the measured process failed (status {proc.returncode}):\n{proc.stderr[-3000:]}"
    result, growth = json.loads(proc.stdout.splitlines()[-1])
    return result, growth
