"""Where a test suite's CPU goes: a pytest plugin that writes each test's CPU-seconds, and a report by file.

    pytest -p conveyor.testing.cpu_profile --cpu-profile runs/cpu.jsonl [-n 2 ...]
    python -m conveyor.testing.cpu_profile runs/cpu.jsonl [--top 40]

Each test (setup, call and teardown, so a module fixture's work counts where it happens) appends one JSON line
{"id", "self", "children", "wall"}: the CPU of the pytest process (an xdist worker: its own) and of the child
processes it waited for, with theirs (``getrusage(RUSAGE_CHILDREN)``: a launcher's tasks count when the
launcher is reaped). CPU, not wall time, because wall time on a shared machine measures the other users;
a process never waited for (one left running, one in another namespace's daemon) is not counted.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-profile", metavar="PATH", default=None,
                     help="append each test's CPU-seconds (this process, waited-for children) to PATH as JSON lines")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-profile")
    own, children, started = *_cpu(), time.monotonic()
    yield
    if path:
        own_after, children_after = _cpu()
        record = {"id": item.nodeid, "self": round(own_after - own, 3), "children": round(children_after - children, 3),
                  "wall": round(time.monotonic() - started, 3)}
        with open(path, "a") as f:  # one short line per write: the workers of a parallel run append to one file
            f.write(json.dumps(record) + "\n")


def by_file(lines: list[str]) -> dict[str, dict[str, float]]:
    """Totals per test file: tests, self, children, cpu (their sum) and wall seconds."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"tests": 0, "self": 0.0, "children": 0.0, "wall": 0.0})
    for line in lines:
        record = json.loads(line)
        total = files[record["id"].split("::")[0]]
        total["tests"] += 1
        for key in ("self", "children", "wall"):
            total[key] += record[key]
    for total in files.values():
        total["cpu"] = total["self"] + total["children"]
    return dict(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU-seconds per test file, from a --cpu-profile file")
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    files = by_file(args.path.read_text().splitlines())
    print(f"{sum(f['cpu'] for f in files.values()):.0f} CPU-s in {sum(int(f['tests']) for f in files.values())} tests")
    print(f"{'cpu':>8} {'self':>8} {'children':>8} {'wall':>8} {'tests':>5}  file")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["cpu"])[:args.top]:
        print(f"{f['cpu']:8.1f} {f['self']:8.1f} {f['children']:8.1f} {f['wall']:8.1f} {int(f['tests']):5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
