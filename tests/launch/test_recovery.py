"""Where the stall after a failure goes (issue 19 item 6): the launcher's restart records and the tasks' marks make
summary.json's ``recovery`` block, whose parts are non-negative and add up to its total (conveyor.recovery)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor import recovery

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "digits" / "train.py"
PARTS = ("detect", "stop", "pause", "process_start", "imports", "group_init", "setup", "restore", "first_step")


def test_the_block_splits_the_stall_into_parts_that_add_up(tmp_path):
    recovery.note_restart(tmp_path, attempt=1, task="worker:1", died=100.0, seen=100.1, stopped=100.4, started=101.4)
    recovery.note_restart(tmp_path, attempt=2, task="worker:0", seen=200.0, stopped=200.5, started=201.0)
    times = [201.6, 203.0, 203.5, 204.0, 204.5, 205.0]  # process start, then the task marks in order
    first, second = recovery.block(tmp_path, 2, times)
    assert first == {"attempt": 1, "task": "worker:1", "from": "died", "detect": pytest.approx(0.1),
                     "stop": pytest.approx(0.3), "pause": pytest.approx(1.0), "total": pytest.approx(1.4)}
    assert second["from"] == "seen" and "detect" not in second  # no fault record: the stall counts from "seen"
    assert [second[p] for p in PARTS[1:]] == pytest.approx([0.5, 0.5, 0.6, 1.4, 0.5, 0.5, 0.5, 0.5])
    assert second["total"] == pytest.approx(5.0)


def test_an_unknown_moment_leaves_its_part_to_the_next_one(tmp_path):
    recovery.note_restart(tmp_path, attempt=1, task="worker:1", seen=10.0, stopped=11.0, started=12.0)
    (entry,) = recovery.block(tmp_path, 1, [-1.0, 13.0, 14.0, -1.0, 15.0, 16.0])
    assert "process_start" not in entry and "setup" not in entry
    assert entry["imports"] == pytest.approx(1.0) and entry["restore"] == pytest.approx(1.0)
    assert entry["total"] == pytest.approx(6.0)


def test_the_fault_hook_says_when_it_killed(capsys):
    assert recovery.fault_time(["x", "conveyor fault: SIGKILL at after-step step 5 time 123.5", "y"]) == 123.5
    assert recovery.fault_time(["Killed"]) is None


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_restarted_run_reports_where_its_stall_went(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "conveyor.cli.main", "run", "-n", "2", "--data-dir", str(tmp_path / "data"),
           "--output-dir", str(out), "--max-restarts", "1", "--restart-delay", "0", str(SCRIPT),
           "--epochs", "1", "--batch-size", "64", "--checkpoint-every", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360,
                          env={**os.environ, "CONVEYOR_FAULT": "worker:1:after-step:9"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from_step"] in (4, 8)
    (entry,) = summary["recovery"]
    assert entry["attempt"] == 1 and entry["task"] == "worker:1" and entry["from"] == "died"
    parts = [entry[p] for p in PARTS]  # every part known on Linux
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(entry["total"], abs=1e-6)
    assert 0 < entry["total"] < 300
