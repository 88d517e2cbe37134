"""Every fuzz target in tests/fuzz/targets/ runs briefly here; `make fuzz` runs them longer.

CONVEYOR_FUZZ_SECONDS sets the budget per target (default 3). The targets run at the same time, each in
its own process (libFuzzer's budget is wall time), so the whole set costs about one target's time.
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


def start(target: str | Path, seconds: float, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RUNNER), str(target), "--seconds", str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def report_of(proc: subprocess.Popen, seconds: float) -> tuple[int, dict]:
    try:
        out, err = proc.communicate(timeout=seconds + 240)
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"runner printed no report:\n{out}\n{err}"
    return proc.returncode, json.loads(lines[-1])


def fuzz(target: str | Path, seconds: float, **env: str) -> tuple[int, dict]:
    return report_of(start(target, seconds, **env), seconds)


@pytest.fixture(scope="module")
def fuzzing():
    """Every target started at once; each test collects its own target's report."""
    procs = {target: start(target, SECONDS) for target in TARGETS}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_finds_nothing(fuzzing, target):
    status, report = report_of(fuzzing[target], SECONDS)
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
