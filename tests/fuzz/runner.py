"""Runs one fuzz target for a time budget and prints one JSON line with what it tried and found.

    python tests/fuzz/runner.py tfrecord_plain --seconds 60       # a target in tests/fuzz/targets/
    python tests/fuzz/runner.py path/to/target.py --seconds 5     # or any target file

A target module defines ``target(data: bytes)``, ``EXPECTED`` (the parser's documented errors,
which are not findings) and ``SEEDS`` (valid inputs to mutate from). The engine is atheris
(libFuzzer, coverage-guided over the ``conveyor`` package) where it is installed, otherwise
hypothesis drawing bytes for the same budget. Exit status: 0 no finding, 1 a finding, 2 usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

TARGETS = Path(__file__).resolve().parent / "targets"


def target_path(name: str) -> Path:
    path = Path(name) if name.endswith(".py") else TARGETS / f"{name}.py"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.py"))) or "none"
        raise SystemExit(f"runner: no fuzz target {name!r} (known: {known})")
    return path


def load_target(path: Path) -> ModuleType:
    if str(path.parent) not in sys.path:  # so that a target can import the helpers beside it (_common.py)
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"fuzz_target_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attr in ("target", "EXPECTED", "SEEDS"):
        if not hasattr(module, attr):
            raise SystemExit(f"runner: {path} defines no {attr}; see tests/fuzz/runner.py")
    return module


def guarded(module: ModuleType):
    """The target with its documented errors swallowed: whatever else escapes is a finding."""

    def one_input(data: bytes) -> None:
        try:
            module.target(data)
        except module.EXPECTED:
            pass

    return one_input


def atheris_worker(path: Path, seconds: float, workdir: Path) -> None:
    """Runs inside the child process: libFuzzer never returns, it exits when the budget is spent."""
    import atheris

    with atheris.instrument_imports(include=["conveyor"]):
        module = load_target(path)
    corpus = workdir / "corpus"
    corpus.mkdir()
    for i, seed in enumerate(module.SEEDS):
        (corpus / f"seed-{i}").write_bytes(seed)
    argv = [sys.argv[0], f"-max_total_time={max(1, int(seconds))}", "-timeout=20", "-rss_limit_mb=3072",
            "-print_final_stats=1", f"-artifact_prefix={workdir}/", str(corpus)]
    atheris.Setup(argv, guarded(module))
    atheris.Fuzz()


def run_atheris(path: Path, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="conveyor-fuzz-") as tmp:
        cmd = [sys.executable, __file__, str(path), "--seconds", str(seconds), "--worker", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, errors="replace")
        log = proc.stdout + proc.stderr
        runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log) or re.search(r"Done (\d+) runs", log)
        findings = []
        if proc.returncode != 0:
            crash = [p.name for p in Path(tmp).glob("crash-*")] + [p.name for p in Path(tmp).glob("timeout-*")]
            tail = log[log.find("=== Uncaught Python exception"):] if "Uncaught Python" in log else log[-3000:]
            findings.append({"exit_status": proc.returncode, "artifacts": crash, "log": tail[-3000:]})
        return {"engine": "atheris", "inputs": int(runs.group(1)) if runs else 0, "findings": findings}


def run_hypothesis(path: Path, seconds: float) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    module = load_target(path)
    one_input = guarded(module)
    seeds = list(module.SEEDS) or [b""]
    inputs = st.one_of(st.binary(max_size=4096), st.sampled_from(seeds),
                       st.tuples(st.sampled_from(seeds), st.integers(0, 4096), st.binary(max_size=16))
                       .map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]):]))
    count = 0

    @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(inputs)
    def chunk(data: bytes) -> None:
        nonlocal count
        count += 1
        one_input(data)

    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk()
    except Exception as exc:  # noqa: BLE001 - any escape is the finding being reported
        return {"engine": "hypothesis", "inputs": count, "findings": [{"log": f"{type(exc).__name__}: {exc}"}]}
    return {"engine": "hypothesis", "inputs": count, "findings": []}


def have_atheris() -> bool:
    return importlib.util.find_spec("atheris") is not None and os.environ.get("CONVEYOR_FUZZ_ENGINE") != "hypothesis"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a name in tests/fuzz/targets/ or a path to a target file")
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument("--json", type=Path, help="also write the report to this file")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    path = target_path(args.target)
    if args.worker:
        atheris_worker(path, args.seconds, args.worker)
        return 0
    started = time.monotonic()
    report = run_atheris(path, args.seconds) if have_atheris() else run_hypothesis(path, args.seconds)
    report = {"target": path.stem, **report, "seconds": round(time.monotonic() - started, 1)}
    line = json.dumps(report)
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    return 1 if report["findings"] or not report["inputs"] else 0


if __name__ == "__main__":
    sys.exit(main())
