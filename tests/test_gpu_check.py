"""scripts/gpu_check.py (`make gpu-check`) proven on the CPU: the whole check end to end from a fresh offline
install of a wheel built from this checkout, and its failure paths (no wheels, a stale wheel, two wheels of
one name, a spent budget, a part that breaks, a process that outlives its budget).

The end-to-end run installs into a fresh folder layered over this interpreter (which has torch) with
PYTHONPATH, as the GPU machine does over its image's Python: see README.md, "On a GPU".
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# The whole CPU run's budget: about a minute of work on an idle 2-core machine, 3-4 minutes when 7 other
# helpers load it; the parts' budgets only bound a hang, and the GPU run keeps the issue's 480 s.
BUDGET = 900


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_check", None)
        sys.path.remove(str(SCRIPT.parent))


def _context(gc, tmp_path: Path, seconds: float = 60.0):
    return gc.parts.Context(device="cpu", python=sys.executable, wheels=tmp_path / "wheels", out=tmp_path / "out",
                            work=tmp_path, sizes=gc.parts.SIZES["cpu"], deadline=time.monotonic() + seconds,
                            env=dict(os.environ))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1100)
def test_every_part_runs_on_the_cpu_from_a_fresh_offline_install(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=240, cwd=tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--wheels", str(wheels), "--out", str(out),
                           "--budget", str(BUDGET)], capture_output=True, text=True, timeout=BUDGET + 60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["result"] == "passed" and list(report["parts"]) == ["install", "tests", "train", "case_study",
                                                                      "strategies"]
    assert all(p["status"] == "passed" and p["seconds"] <= p["budget"] for p in report["parts"].values())
    install = report["parts"]["install"]["figures"]
    assert install["from_site"] and install["wheels"] == {"conveyor": "0.1.0"} and not install["unmet"]
    assert report["install_line"].startswith("installed conveyor 0.1.0") and "torch" in report["install_line"]
    tests = report["parts"]["tests"]["figures"]  # no CUDA here: every gpu test skips, none fails
    assert tests["skipped"] == tests["tests"] >= 5 and "tests/strategies/test_pipeline.py" in tests["files"]
    train = report["parts"]["train"]["figures"]
    assert train["example"]["steps"] == 2 and train["example"]["samples_per_second"] > 0
    assert train["feeding_point"]["device_name"] == "cpu" and train["feeding_point"]["batch"] == 16
    assert report["parts"]["case_study"]["figures"]["cifar"]["ceiling_samples_per_second"] > 0
    assert "equal one process" in report["parts"]["strategies"]["detail"]
    text = (out / "gpu_check.md").read_text()
    assert "# gpu-check on cpu: passed" in text and all(f"| {p} | passed |" in text for p in report["parts"])
    assert (out / "gpu_feeding_cifar.png").is_file() and "reports:" in proc.stdout


def test_without_wheels_the_install_fails_naming_the_fix_and_the_rest_is_skipped(gc, tmp_path, capsys):
    (tmp_path / "none").mkdir()
    code = gc.main(["--device", "cpu", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert code == 1 and report["result"] == "FAILED"
    install = report["parts"]["install"]
    assert install["status"] == "failed" and "make gpu-wheels" in install["detail"]
    assert {p["status"] for name, p in report["parts"].items() if name != "install"} == {"skipped"}
    assert "install: failed" in capsys.readouterr().err
    assert "| install | failed |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_two_wheels_of_one_name_are_refused(gc, tmp_path):
    for name in ("pyzmq-26.0.0-cp312-abi3-x.whl", "pyzmq-27.0.0-cp312-abi3-x.whl", "conveyor-0.1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(gc.parts.PartFailed, match="two wheels of pyzmq"):
        gc.parts.wheel_files(tmp_path)


def test_a_wheel_built_from_other_source_is_refused(gc, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(ROOT / "src" / "conveyor", site / "conveyor", ignore=shutil.ignore_patterns("__pycache__"))
    gc.parts.check_fresh(site)  # the same source: fine
    (site / "conveyor" / "errors.py").write_text("# changed\n")
    with pytest.raises(gc.parts.PartFailed, match=r"other source than this checkout \(1 files differ, e.g. errors"):
        gc.parts.check_fresh(site)


def test_parts_report_a_spent_budget_a_failure_and_a_crash_by_name(gc, tmp_path):
    ctx = _context(gc, tmp_path)
    ctx.installed = True

    def broken(ctx, budget):
        raise gc.parts.PartFailed("the thing broke; do this")

    def buggy(ctx, budget):
        raise KeyError("steps")

    assert gc.run_part("train", broken, ctx, 30)["detail"] == "the thing broke; do this"
    crashed = gc.run_part("train", buggy, ctx, 30)
    assert crashed["status"] == "failed" and crashed["detail"] == "KeyError: 'steps'" and crashed["budget"] < 30.1
    spent = gc.run_part("strategies", broken, ctx, 58)  # the later parts' reserve leaves it under 5 s
    assert spent["status"] == "incomplete" and spent["skipped"] == ["strategies"]
    report = {"parts": {"strategies": spent}}
    assert gc.verdict(report) == ["strategies: incomplete: not run: the check's time budget was spent"]


def test_a_process_past_its_budget_is_stopped_with_everything_it_started(gc, tmp_path):
    marker = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(marker)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    started = time.monotonic()
    status, output = gc.parts.run([sys.executable, "-c", code], 3, dict(os.environ))
    assert status is None and "started" in output and time.monotonic() - started < 30
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_junit_counts(gc, tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
                    '<testcase name="a"><skipped message="needs a CUDA device"/></testcase>'
                    '<testcase name="b"><skipped message="needs 2 GPUs"/></testcase></testsuite></testsuites>')
    assert gc.parts.junit_counts(path) == {"tests": 4, "failures": 1, "errors": 0, "skipped": 2, "passed": 1,
                                           "skip_reasons": ["needs 2 GPUs", "needs a CUDA device"]}


def test_arguments(gc):
    args = gc.parse_args(["--out", "x", "--parts", "strategies,tests"])
    assert args.parts == ("install", "tests", "strategies") and args.budget == 45 + 60 + 60 and args.device == "cuda"
    assert gc.parse_args(["--out", "x"]).budget == 480  # the 8 minutes
    with pytest.raises(SystemExit):
        gc.parse_args(["--out", "x", "--parts", "nope"])
