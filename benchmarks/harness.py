"""The harness every benchmark runs on: contenders, interleaved rounds, medians and paired ratios,
goals as data, machine facts, one table printer, one JSON writer and one argument parser.

A benchmark is its workloads, its contenders (each a `Contender`: a name that says what it is and a
label for the table), a `measure(name, round)` function and its goals (`Goal` rows evaluated
against the derived values). Failures are data: a contender that fails leaves a NaN sample and an
error line, never a crash, and a goal whose value is missing is "not measured" and fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
from machine import loadavg, machine_facts, write_results  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------ contenders


@dataclasses.dataclass(frozen=True)
class Contender:
    """What is measured: `name` (in the JSON, on the command line) and `label` (what it is, for people)."""

    name: str
    label: str = ""

    def shown(self) -> str:
        return f"{self.name} ({self.label})" if self.label else self.name


class ContenderFailed(RuntimeError):
    """A contender's run failed; `run` is what it left to keep in the JSON (None when nothing)."""

    def __init__(self, message: str, run: Any = None) -> None:
        super().__init__(message)
        self.run = run


def run_launcher(cmd: Sequence[str], timeout: float, *, threads: int = 1, cwd: Path | None = None,
                 cpus: Sequence[int] | None = None) -> tuple[int | None, str]:
    """Run a launcher (``conveyor run``) to its end; (exit status, or None on a timeout, and its output).

    It runs in a session of its own, so that a timeout stops the launcher and every task it started and
    nothing else; ``threads`` is each task's OMP_NUM_THREADS, ``cpus`` the cores it is confined to.
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=pin)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
    return proc.returncode, output


def round_order(names: Sequence[str], rnd: int, reverse_odd: bool = True) -> list[str]:
    """The contenders of round `rnd` (from 0): odd rounds reversed, so the machine's drift hits all alike
    and neighbours in the list always run back to back."""
    return list(names)[::-1] if reverse_odd and rnd % 2 else list(names)


def interleaved_rounds(names: Sequence[str], repeats: int, measure: Callable[[str, int], tuple[Any, Any]], *,
                       describe: Callable[[Any, Any], str] = lambda value, run: f"{value:.3f}",
                       reverse_odd: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """`repeats` rounds of every contender. `measure(name, round)` returns (sample, run) or raises
    `ContenderFailed`; a failure leaves a NaN sample, its run and an error line.

    Returns {"samples": {name: [...]}, "runs": {name: [...]}, "order": [name, ...], "errors": [...]}.
    """
    samples: dict[str, list[Any]] = {c: [] for c in names}
    runs: dict[str, list[Any]] = {c: [] for c in names}
    order: list[str] = []
    errors: list[str] = []
    width = max((len(c) for c in names), default=0)
    for rnd in range(repeats):
        for c in round_order(names, rnd, reverse_odd):
            order.append(c)
            try:
                value, run = measure(c, rnd)
                shown = describe(value, run)
            except ContenderFailed as e:
                value, run, shown = math.nan, e.run, f"FAILED: {e}"
                errors.append(f"round {rnd + 1} {c}: {e}")
            samples[c].append(value)
            runs[c].append(run)
            log(f"  round {rnd + 1}/{repeats} {c:<{width}} {shown}")
    return {"samples": samples, "runs": runs, "order": order, "errors": errors}


# ------------------------------------------------------------------------------------ statistics


def finite(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def median(xs: Iterable[float | None]) -> float:
    """Median of the finite values; NaN when there are none (a failed or skipped contender)."""
    vals = finite(xs)
    return statistics.median(vals) if vals else math.nan


def lowest(xs: Iterable[float | None]) -> float:
    return min(finite(xs), default=math.nan)


def highest(xs: Iterable[float | None]) -> float:
    return max(finite(xs), default=math.nan)


def ratio(a: float | None, b: float | None) -> float:
    """a / b; NaN when either is missing or b is not positive."""
    ok = a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and b > 0
    return a / b if ok else math.nan


def gap(a: float | None, b: float | None) -> float:
    """|a - b|; NaN when either is missing."""
    return abs(a - b) if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) else math.nan


def paired(a: Sequence[float | None], b: Sequence[float | None], scale: float = 1.0,
           op: Callable[[float | None, float | None], float] = ratio) -> list[float]:
    """Per round: op(a[i], scale x b[i]) (default the ratio); rounds missing on one side are NaN."""
    n = max(len(a), len(b))

    def at(xs: Sequence[float | None], i: int) -> float | None:
        return xs[i] if i < len(xs) else None

    return [op(at(a, i), None if at(b, i) is None else scale * at(b, i)) for i in range(n)]


def or_none(x: float | None) -> float | None:
    """A missing figure as None (for reports that say "not measured" rather than NaN)."""
    return x if x is not None and math.isfinite(x) else None


def fmt(x: float | None, spec: str, scale: float = 1.0, missing: str = "-") -> str:
    return missing if x is None or not math.isfinite(x) else format(x * scale, spec)


def fmt_all(xs: Iterable[float | None], spec: str) -> str:
    return " ".join(fmt(x, spec) for x in xs)


# ------------------------------------------------------------------------------------ goals


@dataclasses.dataclass(frozen=True)
class Goal:
    """A goal as data: `key` names the derived value, checked `compare` ("<=" or ">=") `threshold`."""

    name: str
    key: str
    threshold: Any
    compare: str = ">="

    def met(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.threshold if self.compare == ">=" else value <= self.threshold

    def row(self, value: float | None, passed: bool | None = None, **extra: Any) -> dict[str, Any]:
        """The goal's PASS/FAIL row; `passed` overrides the threshold check (a goal judged on more than one value)."""
        ok = self.met(value) if passed is None else passed
        return {"name": self.name, "value": value, "threshold": self.threshold, "compare": self.compare,
                "pass": bool(ok), **extra}


def evaluate_goals(goals: Sequence[Goal], derived: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [g.row(derived.get(g.key)) for g in goals]


def format_goals(rows: list[dict[str, Any]], show: Callable[[dict[str, Any]], str] | None = None) -> str:
    """One PASS/FAIL line per goal row: name, value (`show(row)`, default 3 decimals) or "not measured", goal."""
    lines = []
    for g in rows:
        value = g["value"]
        if value is None or not math.isfinite(value):
            shown = "not measured" + (f" ({g['error']})" if g.get("error") else "")
        else:
            shown = show(g) if show else f"{value:.3f}"
        goal = g["threshold"] if isinstance(g["threshold"], str) else f"{g.get('compare', '>=')} {g['threshold']}"
        lines.append(f"{'PASS' if g['pass'] else 'FAIL'} {g['name']}: {shown} (goal {goal})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ table


def format_rows(rows: Sequence[Sequence[str] | None], left: Iterable[int] = (0,), underline: bool = False) -> str:
    """Aligned columns; `left` columns flush left, the rest right. A row shorter than the first spills its
    last cell past the columns (a "skipped" note); None is a blank line."""
    head = rows[0]
    full = [r for r in rows if r is not None and len(r) == len(head)]
    widths = [max(len(r[i]) for r in full) for i in range(len(head))]
    left = set(left)

    def line(r: Sequence[str]) -> str:
        if len(r) < len(head):
            return "  ".join([*(v.ljust(w) for v, w in zip(r[:-1], widths, strict=False)), r[-1]]).rstrip()
        return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    out = [line(head)]
    if underline:
        out.append("  ".join("-" * w for w in widths))
    out += ["" if r is None else line(r) for r in rows[1:]]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ machine, report, JSON


def machine_start(packages: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    """The machine facts, with the load average at the start (`machine_end` adds the one at the end)."""
    return {**machine_facts(packages), **extra, "loadavg_start": loadavg()}


def machine_end(machine: dict[str, Any]) -> dict[str, Any]:
    machine["loadavg_end"] = loadavg()
    return machine


def command_line(script: str, argv: Sequence[str] | None) -> str:
    return " ".join([Path(sys.executable).name, f"benchmarks/{script}.py", *(sys.argv[1:] if argv is None else argv)])


def publish_run(name: str, head: dict[str, Any], res: dict[str, Any], derived: dict[str, Any],
                goals: list[dict[str, Any]], table: str, started: float, goal_lines: str,
                out_dir: Path) -> Path:
    """Complete a rounds-based report (`head` + the rounds' samples, runs and errors, the derived values,
    goals and table, the wall time since `started`) and `publish` it."""
    report = {**head, "samples": res["samples"], "runs": res["runs"], "derived": derived, "goals": goals,
              "all_pass": all(g["pass"] for g in goals), "errors": res["errors"], "table": table,
              "wall_seconds": time.perf_counter() - started}
    return publish(name, report, goal_lines, out_dir)


def publish(name: str, report: dict[str, Any], goal_lines: str, out_dir: Path, details: str = "") -> Path:
    """Print the report's table, details, errors and PASS/FAIL lines, then write the JSON."""
    print()
    print(report["table"])
    if details:
        print("\n" + details)
    if report.get("errors"):
        print("\nerrors:\n  " + "\n  ".join(report["errors"]))
    print()
    print(goal_lines)
    path = write_results(name, report, out_dir)
    print(f"\nJSON: {path} (and {path.parent / f'{name}-latest.json'}); total {report['wall_seconds']:.0f} s")
    return path


# ------------------------------------------------------------------------------------ arguments


def parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The common flags: --repeats, --quick (`quick` says what it does), --out."""
    p = argparse.ArgumentParser(description=doc.strip().split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"JSON folder (default {RESULTS_DIR})")
    return p


def settle(p: argparse.ArgumentParser, args: argparse.Namespace, defaults: Mapping[str, tuple[Any, Any]],
           positive: Sequence[str] = (), non_negative: Sequence[str] = ()) -> argparse.Namespace:
    """Fill unset flags from `defaults` ({flag: (full, quick)}), then check the ranges."""
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in positive:
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    for name in non_negative:
        if not getattr(args, name) >= 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


def contender_names(names: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated subset of `names`, returned in `names`' order (the round order)."""

    def pick(text: str) -> tuple[str, ...]:
        chosen = {n.strip() for n in text.split(",") if n.strip()}
        unknown = sorted(chosen - set(names))
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown}; choose from {', '.join(names)}")
        return tuple(n for n in names if n in chosen)

    return pick
