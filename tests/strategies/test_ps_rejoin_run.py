"""`conveyor run` restarts a dead ps-async (or ps-ssp) worker alone: the ps tasks and worker 0 keep their processes
and go on, the replacement continues where the servers applied its predecessor's last step, the job exits 0, and
every record of the epoch the dead worker was dealing is applied exactly once.

The job (ps_rejoin_job.py) counts every update applied in its model: -w[e, id] is how often record id was applied in
epoch e. Worker 1 dies mid-epoch 0 (of 40 steps) by the test-only fault hook (SIGKILL once its step 25 is applied)
or by a SIGKILL from outside at a random moment after its step 25. Worker 0 sleeps longer per step (0.25 s against
0.1 s), so the job's shared step count is far from its end while worker 1 is down.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SCRIPT = Path(__file__).with_name("ps_rejoin_job.py")


def _run(tmp_path: Path, strategy: str, outside: bool) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--ps", "2", "--strategy", strategy,
           "--output-dir", str(out), "--max-restarts", "2", "--timeout", "120", str(SCRIPT)]
    env = {**os.environ, **({} if outside else {"CONVEYOR_FAULT": "worker:1:after-step:25"})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        if outside:
            _kill_worker_1_after(out / "steps-1.jsonl", 25, deadline=time.monotonic() + 240)
        stdout, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, ""), out


def _kill_worker_1_after(path: Path, step: int, deadline: float) -> None:
    """SIGKILL worker 1 from outside once it logged `step` (anywhere in the step after)."""
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[-1])["step"] >= step:
            time.sleep(random.uniform(0.0, 0.05))
            os.kill(json.loads(lines[-1])["pid"], signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError(f"worker 1 never reached step {step}")


def _steps(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-{rank}.jsonl").read_text().splitlines()]


def _check(run: subprocess.CompletedProcess, out: Path) -> dict[str, float]:
    """The launcher's, the processes' and the model's evidence; worker 0's pace before and while worker 1 was down."""
    said = run.stdout
    assert run.returncode == 0, said[-5000:]
    started = re.search(r"attempt 0: started worker:0 pid (\d+), worker:1 pid (\d+), ps:0 pid (\d+), ps:1 pid (\d+)",
                        said)
    assert started, said[-3000:]
    assert "attempt 1" not in said and "restarting the job" not in said, said[-3000:]  # the ps were never restarted
    replacement = int(re.search(r"worker:1 restarted alone: pid (\d+)", said).group(1))
    records = json.loads((out / "logs" / "restarts.json").read_text())
    assert [(r["task"], r["attempt"], r.get("alone")) for r in records] == [("worker:1", 0, True)], records
    assert json.loads((out / "summary.json").read_text())["recovery"][0]["alone"] is True
    for ps in ("ps-0", "ps-1"):  # one process each, from start to end
        log = (out / "logs" / f"{ps}.log").read_text()
        assert log.count(f"=== {ps.replace('-', ':')} started ===") == 1 and "=== restart" not in log, log[:500]
    w0, w1 = _steps(out, 0), _steps(out, 1)
    assert {s["pid"] for s in w0} == {int(started.group(1))}  # worker 0 kept its process
    assert {s["pid"] for s in w1} <= {int(started.group(2)), replacement} and replacement in {s["pid"] for s in w1}
    applied = json.loads((out / "applied.json").read_text())["applied"]
    assert all(v in (0.0, 1.0) for row in applied for v in row), "a record's update was applied twice"
    assert applied[0] == [1.0] * len(applied[0]), [i for i, v in enumerate(applied[0]) if v != 1.0]
    # worker 0's pace: before worker 1 died, and from its death to the replacement's first step
    died = records[0]["died"] or records[0]["seen"]
    back = min(s["time"] for s in w1 if s["pid"] == replacement)
    before = [s["time"] for s in w0 if s["time"] < died]
    assert len(before) >= 2, "worker 0 had not started stepping when worker 1 died"
    during = [s for s in w0 if died <= s["time"] < back]
    return {"down_s": back - died, "steps_during": len(during),
            "rate_before": (len(before) - 1) / max(before[-1] - before[0], 1e-9),
            "rate_during": len(during) / max(back - died, 1e-9)}


@pytest.mark.parametrize("outside", [False, True], ids=["fault-hook", "sigkill-from-outside"])
def test_a_ps_async_worker_killed_mid_epoch_is_restarted_alone_and_every_record_applies_once(tmp_path, outside):
    pace = _check(*_run(tmp_path, "ps-async", outside))
    print(f"worker 0 while worker 1 was down: {pace}")
    # ps-async: the other worker never waits for the dead one
    assert pace["steps_during"] >= 3 and pace["rate_during"] >= 0.25 * pace["rate_before"], pace


def test_a_ps_ssp_worker_killed_mid_epoch_is_restarted_alone_and_every_record_applies_once(tmp_path):
    _check(*_run(tmp_path, "ps-ssp:2", outside=False))
