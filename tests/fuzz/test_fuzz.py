"""Every fuzz target in tests/fuzz/targets/ runs briefly here; `make fuzz` runs them longer.

CONVEYOR_FUZZ_SECONDS sets the budget per target (default 3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "runner.py"
SECONDS = float(os.environ.get("CONVEYOR_FUZZ_SECONDS", "3"))
TARGETS = sorted(p.stem for p in (HERE / "targets").glob("*.py") if not p.name.startswith("_"))


def fuzz(target: str | Path, seconds: float, **env: str) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(RUNNER), str(target), "--seconds", str(seconds)],
                          capture_output=True, text=True, timeout=seconds + 240, env={**os.environ, **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"runner printed no report:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[-1])


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_finds_nothing(target):
    status, report = fuzz(target, SECONDS)
    assert report["findings"] == [], json.dumps(report["findings"], indent=1)
    assert report["inputs"] > 0 and status == 0


CRASHY = '''
class Refused(ValueError):
    pass

EXPECTED = (Refused,)
SEEDS = [b"fine", b"refuse", b"boom"]

def target(data):
    if data == b"refuse":
        raise Refused("documented error: not a finding")
    if data == b"boom":
        raise KeyError("an undocumented error: a finding")
'''


@pytest.mark.parametrize("engine", ["atheris", "hypothesis"])
def test_runner_reports_an_undocumented_error_and_ignores_documented_ones(tmp_path, engine):
    if engine == "atheris":
        pytest.importorskip("atheris")
    crashy = tmp_path / "crashy.py"
    crashy.write_text(CRASHY)
    status, report = fuzz(crashy, 2, CONVEYOR_FUZZ_ENGINE=engine)
    assert status == 1 and report["engine"] == engine
    assert "KeyError" in report["findings"][0]["log"]

    calm = tmp_path / "calm.py"
    calm.write_text(CRASHY.replace('raise KeyError("an undocumented error: a finding")', "return None"))
    status, report = fuzz(calm, 2, CONVEYOR_FUZZ_ENGINE=engine)
    assert (status, report["findings"]) == (0, []) and report["inputs"] > 0
