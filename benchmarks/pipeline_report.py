"""The input-pipeline benchmark's report: goals, the text table and details, and the JSON written.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from machine import write_results  # noqa: E402
from pipeline_contenders import CONTENDERS, SHOWN, tensorflow_available  # noqa: E402
from pipeline_measure import ratio_or_none  # noqa: E402

# Report
# ---------------------------------------------------------------------------------------------


MEMORY_GOAL = h.Goal("no memory growth over 5 epochs", "growth_mb", "epoch 5 peak <= 1.05 x epoch 1 peak + 20 MB")
IDLE_GOAL = h.Goal("idle <= 5 % (S = 80 % of per-batch CPU work)", "idle_fraction", 0.05, "<=")


def workload_goals(name: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of one workload as PASS/FAIL rows (goals as data: `h.Goal`, the threshold per workload)."""
    d, pr = res["derived"], res["derived"]["per_round"]
    goal_dl = res["workload"]["goal_vs_dataloader"]
    rows = [h.Goal(f"{name}: parallel >= 0.9 x limit", "parallel_vs_limit", 0.9).row(
                d["parallel_vs_limit"], workload=name, per_round=pr["parallel_vs_limit"]),
            h.Goal(f"{name}: parallel >= {goal_dl} x dataloader", "parallel_vs_dataloader", goal_dl).row(
                d["parallel_vs_dataloader"], workload=name, per_round=pr["parallel_vs_dataloader"])]
    idle = res.get("idle_cpu") or {"error": "the parallel approach has no rate"}
    rows.append(dataclasses.replace(IDLE_GOAL, name=f"{name}: {IDLE_GOAL.name}").row(
        idle.get("idle_fraction"), workload=name, **({"error": idle["error"]} if "error" in idle else {})))
    m = res["memory"]
    if m is not None:
        rows.append(dataclasses.replace(MEMORY_GOAL, name=f"{name}: {MEMORY_GOAL.name}").row(
            m.get("growth_mb"), passed="grows" in m and not m["grows"], workload=name,
            **({"error": m["error"]} if "error" in m else {})))
    return rows


def evaluate_goals(results: dict[str, dict]) -> list[dict[str, Any]]:
    return [g for name, res in results.items() for g in workload_goals(name, res)]


def _fmt_rate(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}"


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _rate_rows(name: str, res: dict[str, Any]) -> list[tuple[str, ...]]:
    med, lo, hi, d = res["median"], res["min"], res["max"], res["derived"]
    limit, dl = d["limit"], med["dataloader"]
    rows: list[tuple[str, ...]] = []
    for c in CONTENDERS:
        if c == "tfdata" and c not in med:
            rows.append((name, "tfdata", "skipped (TensorFlow not installed)"))
            continue
        if c not in med:
            continue
        if med[c] is None:
            rows.append((name, SHOWN[c], "FAILED (every round; see errors)"))
            continue
        infos = [i for i in res.get("sample_info", {}).get(c, []) if i and i.get("own_cores")]
        used = f"{statistics.median(i['own_cores'] for i in infos):.2f}" if infos else ""
        per_cpu = _fmt_rate(statistics.median(i["records"] / i["seconds"] / i["own_cores"] for i in infos)
                            if infos else None)
        failed = sum(1 for x in res["samples"][c] if not math.isfinite(x))
        span = f"{_fmt_rate(lo[c])}-{_fmt_rate(hi[c])}" + (f" ({failed} failed)" if failed else "")
        rows.append((name, SHOWN[c], _fmt_rate(med[c]), span, _fmt_ratio(ratio_or_none(med[c], limit)),
                     _fmt_ratio(ratio_or_none(med[c], dl)), used, per_cpu))
        if c == "single_thread":
            rows.append((name, f"limit ({d['cores']} x single)", _fmt_rate(limit), "", "1.00x",
                         _fmt_ratio(ratio_or_none(limit, dl)), "", ""))
    return rows


def format_table(results: dict[str, dict]) -> str:
    header = ("workload", "contender", "records/s (median)", "min-max", "vs limit", "vs dataloader",
              "cores used", "records/CPU-s")
    rows: list[tuple[str, ...] | None] = [header]
    for name, res in results.items():
        if len(rows) > 1:
            rows.append(None)
        rows += _rate_rows(name, res)
    return h.format_rows(rows, left=(0, 1), underline=True)


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_details(results: dict[str, dict]) -> str:
    out = []
    for name, res in results.items():
        d, idle, m = res["derived"], res["idle"], res["memory"]
        prm = d["per_round_median"]
        line = (f"{name}: parallel/limit {_f(d['parallel_vs_limit'])}, parallel/dataloader "
                f"{_f(d['parallel_vs_dataloader'])}, parallel/sequential {_f(d['parallel_vs_sequential'])} (medians "
                f"of per-round ratios: {_f(prm['parallel_vs_limit'])}, {_f(prm['parallel_vs_dataloader'])}, "
                f"{_f(prm['parallel_vs_sequential'])})")
        if "parallel_plain" in res["median"]:
            line += (f"; parallel_plain/limit {_f(d['parallel_plain_vs_limit'])} "
                     f"(how far {d['cores']} independent plain loops scale), "
                     f"parallel/parallel_plain {_f(d['parallel_vs_parallel_plain'])}")
        if "tfdata" in res["median"]:
            line += f"; tfdata/parallel {_f(d['tfdata_vs_parallel'])}"
        else:
            line += "; tf.data: skipped (TensorFlow not installed)"
        out.append(line)
        infos = [i for v in res.get("sample_info", {}).values() for i in v if "other_cores" in i]
        if infos:
            other = [i["other_cores"] for i in infos]
            steal = [i["steal_cores"] for i in infos]
            out.append(f"{name}: other processes used {min(other):.2f}-{max(other):.2f} cores during the "
                       f"measurements (median {statistics.median(other):.2f}), hypervisor steal "
                       f"{min(steal):.2f}-{max(steal):.2f}; load average before/after "
                       f"{res['load_average']['before']} / {res['load_average']['after']}")
        if idle is None or "error" in idle:
            out.append(f"{name}: idle: not measured ({(idle or {}).get('error', 'the parallel approach has no rate')})")
        else:
            out.append(f"{name}: idle {idle['idle_fraction']:.1%} with a consumer sleeping "
                       f"{idle['sleep_s'] * 1e3:.1f} ms/batch (80 % of the pipeline's {idle['batch_time_s'] * 1e3:.1f} "
                       f"ms wall per batch: faster than the pipeline, so >= 20 % is forced) "
                       f"for {idle['batches']} batches; longest wait {idle['longest_wait_s'] * 1e3:.0f} ms"
                       + (f"; other processes used {idle['cpu']['other_cores']:.2f} cores meanwhile"
                          if "cpu" in idle else ""))
        ic = res.get("idle_cpu") or {}
        if "idle_fraction" in ic:
            out.append(f"{name}: idle {ic['idle_fraction']:.1%} with a consumer sleeping {ic['sleep_s'] * 1e3:.1f} "
                       f"ms/batch (80 % of the per-batch CPU work, batch / single-thread rate); longest wait "
                       f"{ic['longest_wait_s'] * 1e3:.0f} ms")
        if m is not None and "error" in m:
            out.append(f"{name}: memory: not measured ({m['error']})")
        elif m is not None:
            out.append(f"{name}: peak RSS of the process tree per epoch (MB): "
                       + ", ".join(f"{p:.0f}" for p in m["peak_mb_per_epoch"])
                       + f"; baseline {m['baseline_mb']:.0f} MB, after close {m['after_close_mb']:.0f} MB "
                       f"({m['epochs']} epochs x {m['records_per_epoch']:,} records)")
        for err in res.get("errors", []):
            out.append(f"{name}: ERROR {err}")
    return "\n".join(out)


def _show_goal(g: dict[str, Any]) -> str:
    v = g["value"]
    if "idle" in g["name"]:
        return f"{v:.1%}"
    if "memory" in g["name"]:
        return f"epoch 5 - epoch 1 = {v:+.0f} MB"
    rounds = h.finite(g.get("per_round") or [])
    return f"{v:.2f}x" + (f" (per round {min(rounds):.2f}-{max(rounds):.2f})" if rounds else "")


def format_goals(goals: list[dict[str, Any]]) -> str:
    return h.format_goals(goals, _show_goal)


def machine_info() -> dict[str, Any]:
    return h.machine_start(("numpy", "torch", "Pillow", "psutil"),
                           memory_gb=round(psutil.virtual_memory().total / 2**30, 1),
                           tensorflow="installed" if tensorflow_available() else None)


def write_json(report: dict[str, Any], out_dir: Path) -> Path:
    return write_results("pipeline", report, out_dir)


def build_report(results: dict[str, dict], config: dict[str, Any]) -> dict[str, Any]:
    goals = evaluate_goals(results)
    return {
        "benchmark": "pipeline",
        "machine": machine_info(),
        "config": config,
        "results": results,
        "goals": goals,
        "all_pass": all(g["pass"] for g in goals),
        "table": format_table(results),
    }


# ---------------------------------------------------------------------------------------------
