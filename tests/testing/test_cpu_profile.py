"""conveyor.testing.cpu_profile: each test's CPU, its own and its waited-for children's, and the report by file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conveyor.testing.cpu_profile import by_file, main

TESTS = """
import subprocess, sys

def test_spins_here():
    sum(range(3_000_000))

def test_spins_in_a_child():
    subprocess.run([sys.executable, "-c", "sum(range(30_000_000))"], check=True)

def test_waits():
    pass
"""


def test_every_test_is_written_with_its_own_and_its_childrens_cpu(tmp_path: Path, capsys):
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "cpu.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conveyor.testing.cpu_profile", "-p",
                           "no:cacheprovider", "--cpu-profile", str(out), "test_sample.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    records = {r["id"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"test_spins_here", "test_spins_in_a_child", "test_waits"}
    assert records["test_spins_in_a_child"]["children"] > records["test_spins_in_a_child"]["self"]
    assert records["test_spins_in_a_child"]["children"] > 0.1 and records["test_waits"]["children"] == 0
    assert records["test_spins_here"]["self"] > 0 and records["test_spins_here"]["children"] == 0
    total = by_file(out.read_text().splitlines())["test_sample.py"]
    assert total["tests"] == 3 and abs(total["cpu"] - total["self"] - total["children"]) < 1e-9
    assert main([str(out)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[0].endswith("CPU-s in 3 tests") and report[2].endswith("test_sample.py")
