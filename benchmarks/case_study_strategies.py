"""CIFAR-10 case study, part 3: parameter servers against all-reduce, synchronous against asynchronous, with a
straggler — one table assembled from what the existing benchmarks wrote, not measured again.

Sources (`<results>/<name>-latest.json`, default `benchmarks/results/`, as `make bench` leaves them):

- `ps_training`: the digits example trained by 2 workers under `allreduce`, `ps-sync` and `ps-async` (1 ps
  task), and the two ps strategies again with worker 1 made 2x slower: samples/s, test accuracy;
- `ps`: push + pull through 2 parameter servers against a gloo all-reduce and raw loopback TCP (GB/s);
- `allreduce`: conveyor's allreduce strategy against a bare DDP loop on ResNet-20, 1 and 2 workers.

A source that is missing is run here first with its `--quick` options (when `run_missing`), and the table
says so. Every ratio in the table is one its source computed within one run (ratios of medians of rounds
run back to back); figures of different sources are never divided by each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402

HERE = Path(__file__).resolve().parent
SOURCES = ("ps_training", "ps", "allreduce")


def load_sources(results: Path, run_missing: bool, timeout: float) -> dict[str, dict[str, Any]]:
    """{name: {"path", "report", "ran_here"}} or {name: {"error": why}} per source."""
    out: dict[str, dict[str, Any]] = {}
    for name in SOURCES:
        path = Path(results) / f"{name}-latest.json"
        ran_here = False
        if not path.exists() and run_missing:
            ran_here = True
            error = run_quick(name, Path(results), timeout)
            if error:
                out[name] = {"error": error, "ran_here": True}
                continue
        if not path.exists():
            out[name] = {"error": f"{path} is missing (run python benchmarks/{name}.py)", "ran_here": ran_here}
            continue
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            out[name] = {"error": f"{path}: {e}", "ran_here": ran_here}
            continue
        out[name] = {"path": str(path), "report": report, "ran_here": ran_here}
    return out


def run_quick(name: str, results: Path, timeout: float) -> str | None:
    """`python benchmarks/<name>.py --quick --out <results>`; None when it wrote its JSON, else why not."""
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--quick", "--out", str(results)]
    print(f"  {name}-latest.json is missing: running {' '.join(cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return f"benchmarks/{name}.py --quick timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return f"benchmarks/{name}.py --quick exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-400:]}"
    return None


def _row(config: str, measure: str, value: Any, ratio: Any = None, against: str = "", accuracy: Any = None,
         source: str = "") -> dict[str, Any]:
    return {"configuration": config, "measure": measure, "value": h.or_none(value), "ratio": h.or_none(ratio),
            "against": against, "accuracy": h.or_none(accuracy), "source": source}


def ps_training_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    d, c = report["derived"], report["config"]
    sps, acc = d["median_samples_per_second"], d["median_eval_accuracy"]
    workers, ps, slow = c.get("workers", 2), c.get("ps_tasks", 1), c.get("slowdown", 2.0)
    vs_unslowed = d.get("straggler_vs_unslowed_samples_per_second", {})
    rows = []
    for name in ("allreduce", "ps-sync", "ps-async"):
        if name in sps:
            shown = f"{name}, {workers} workers" + ("" if name == "allreduce" else f" + {ps} ps")
            rows.append(_row(shown, "samples/s", sps[name], h.ratio(sps[name], sps.get("allreduce")), "allreduce",
                             acc[name], "ps_training"))
    for name in ("ps-sync", "ps-async"):
        slowed = f"{name}+straggler"
        if slowed in sps:
            rows.append(_row(f"{name}, worker 1 {slow:g}x slower", "samples/s", sps[slowed], vs_unslowed.get(slowed),
                             f"{name}, no straggler", acc[slowed], "ps_training"))
    ratio = d.get("straggler_async_vs_sync_samples_per_second")
    if h.or_none(ratio) is not None:
        rows.append(_row(f"straggler: ps-async against ps-sync ({slow:g}x slower worker)", "samples/s ratio", None,
                         ratio, "ps-sync, same straggler", d.get("straggler_accuracy_gap"), "ps_training"))
    return rows


def ps_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    d, c = report["derived"], report["config"]
    gbps = d["median_gbps"]
    size = f"{c.get('bytes', 0) / 1e6:.0f} MB"
    return [
        _row(f"conveyor ps push + pull, 2 servers, {size}", "GB/s", gbps.get("conveyor_ps"),
             d.get("conveyor_vs_gloo_busbw"), "gloo all-reduce bus bandwidth", source="ps"),
        _row(f"gloo all-reduce, 2 processes, {size}", "bus GB/s", gbps.get("gloo_allreduce"), source="ps"),
        _row(f"raw loopback TCP, {size}", "GB/s", gbps.get("raw_tcp"),
             h.ratio(gbps.get("raw_tcp"), gbps.get("gloo_allreduce")), "gloo all-reduce bus bandwidth", source="ps"),
    ]


def allreduce_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    d, c = report["derived"], report["config"]
    med, eff = d["median"], d["scaling_efficiency"]
    model = f"{c.get('model', '?')}, batch {c.get('batch', '?')}/worker"
    share = (d.get("comm_share", {}).get("conveyor_2") or {}).get("median")
    return [
        _row(f"conveyor allreduce, 2 workers ({model})", "samples/s", med.get("conveyor_2"),
             d.get("conveyor_vs_bare_2"), "bare DDP, 2 workers", source="allreduce"),
        _row("conveyor allreduce, 1 -> 2 workers", "scaling efficiency", eff.get("conveyor"), source="allreduce"),
        _row("bare DDP, 1 -> 2 workers", "scaling efficiency", eff.get("bare_ddp"), source="allreduce"),
        _row("conveyor allreduce, 2 workers", "share of step in all-reduce", share, source="allreduce"),
    ]


ROWS = {"ps_training": ps_training_rows, "ps": ps_rows, "allreduce": allreduce_rows}


def assemble(sources: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The table's rows, and an error line per source that gave none."""
    rows, errors = [], []
    for name in SOURCES:
        src = sources.get(name, {"error": "not loaded"})
        if "error" in src:
            errors.append(f"{name}: {src['error']}")
            continue
        try:
            rows += ROWS[name](src["report"])
        except (KeyError, TypeError, AttributeError) as e:
            errors.append(f"{name}: its JSON lacks {e} (written by an older benchmarks/{name}.py? run it again)")
    return rows, errors


def _value(row: dict[str, Any]) -> str:
    v = row["value"]
    if v is None:
        return "-"
    if "efficiency" in row["measure"] or "share" in row["measure"]:
        return f"{v:.0%}"
    return f"{v:.2f}" if "GB/s" in row["measure"] else f"{v:.0f}"


def format_table(rows: list[dict[str, Any]], sources: dict[str, dict[str, Any]], errors: list[str]) -> str:
    lines = ["parameter servers against all-reduce, sync against async, with a straggler (from the benchmarks' JSON; "
             "every ratio is within one source's run)", ""]
    table = [("configuration", "measure", "median", "ratio", "against", "accuracy", "source")]
    for r in rows:
        table.append((r["configuration"], r["measure"], _value(r), h.fmt(r["ratio"], ".2f"), r["against"],
                      h.fmt(r["accuracy"], ".3f"), r["source"]))
    lines.append(h.format_rows(table, left=(0, 1, 4, 6)) if rows else "(no source could be read)")
    lines.append("(straggler row: accuracy = |ps-async - ps-sync| test accuracy)")
    for name in SOURCES:
        src = sources.get(name, {})
        if "report" in src:
            rep = src["report"]
            note = ", run here with --quick because it was missing" if src["ran_here"] else ""
            lines.append(f"{name}: {rep.get('machine', {}).get('date', '?')}, `{rep.get('command', '?')}`, "
                         f"{rep.get('config', {}).get('repeats', '?')} round(s){note}")
    lines += [f"missing: {e}" for e in errors]
    return "\n".join(lines)
