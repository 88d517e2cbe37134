"""The paired half of benchmarks/allreduce.py: bare DDP and conveyor step by step in the same 2 processes.

    runs = run_paired(run_contender, config, runs=3, log=print)  # rank 0's step times of every run
    d = derive_paired(runs)                                      # per-pair ratios, their median, min, max
    lines = format_paired(d)                                     # the table's paired rows and ratio line

Each run is one pair of processes started as ``conveyor run -n 2`` starts them. In it, conveyor's model
comes from ``job.prepare`` (strategy allreduce) and a second copy from ``DistributedDataParallel(model)``
with DDP's defaults on the same default process group; after ``--warmup`` steps of each, the two take
turns for ``--paired-steps`` pairs, the order alternating (conveyor first in even pairs), a barrier after
every step, rank 0 timing each step (wall and process CPU). Both see the machine at the same moment, so the
drift that separate runs on a shared machine suffer (other processes, a core slower for a while) cancels in
each pair's ratio. A pair's ratio is bare's step time / conveyor's (conveyor's throughput relative to
bare DDP's); the goal is judged on the median over every pair of every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import harness as h

NAME = "paired"
METHOD = ("same 2 processes (conveyor run -n 2's environment): conveyor's job.prepare model and a bare "
          "DistributedDataParallel(model) on the same group, one step of each in turn (order alternating), a "
          "barrier after every step, rank 0's wall time per step; per pair bare / conveyor")


def run_paired(run_contender: Callable[[str, dict[str, Any]], list[dict[str, Any]]], config: dict[str, Any],
               runs: int, log: Callable[[str], None] = print) -> list[dict[str, Any] | None]:
    """`runs` paired runs (`run_contender("paired", config)` returns every rank's result); rank 0's result of
    each, with both ranks' parameter sums; None for a run that failed (its error logged)."""
    out: list[dict[str, Any] | None] = []
    for i in range(runs):
        try:
            ranks = run_contender(NAME, config)
        except h.ContenderFailed as e:
            log(f"  paired run {i + 1}/{runs} FAILED: {e}")
            out.append(None)
            continue
        head = dict(ranks[0])
        fps = {k: [r["fingerprint"][k] for r in ranks] for k in ("conveyor", "bare")}
        head["ranks_in_sync"] = all(max(v) - min(v) <= 1e-9 * max(1.0, abs(v[0])) for v in fps.values())
        head["fingerprints"] = fps
        ratios = pair_ratios(head)
        log(f"  paired run {i + 1}/{runs}: conveyor / bare {h.median(ratios):.3f} (median of {len(ratios)} pairs, "
            f"min {h.lowest(ratios):.3f}, max {h.highest(ratios):.3f})")
        out.append(head)
    return out


def pair_ratios(run: dict[str, Any]) -> list[float]:
    """Bare DDP's step time / conveyor's, pair by pair (conveyor's throughput relative to bare's)."""
    s = run["seconds"]
    return [b / c for c, b in zip(s["conveyor"], s["bare"], strict=True)]


def derive_paired(runs: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The paired figures over every pair of every run (NaN where none ran)."""
    done = [r for r in runs if r is not None]
    ratios = [x for r in done for x in pair_ratios(r)]
    sums = {k: sum(sum(r["seconds"][k]) for r in done) for k in ("conveyor", "bare")}
    cpu = {k: h.median([x for r in done for x in r["cpu_seconds"][k]]) for k in ("conveyor", "bare")}
    step = {k: h.median([x for r in done for x in r["seconds"][k]]) for k in ("conveyor", "bare")}
    comm = [r["comm_s"] / sum(r["seconds"]["conveyor"]) for r in done if r.get("comm_s") is not None]
    return {
        "method": METHOD, "runs": len(runs), "runs_done": len(done), "pairs": len(ratios),
        "median": h.median(ratios), "min": h.lowest(ratios), "max": h.highest(ratios),
        "ratio_of_sums": h.ratio(sums["bare"], sums["conveyor"]) if done else math.nan,
        "per_run_median": [h.median(pair_ratios(r)) if r is not None else None for r in runs],
        "step_ms_median": {k: 1e3 * v for k, v in step.items()},
        "cpu_ms_median": {k: 1e3 * v for k, v in cpu.items()},
        "cpu_ratio": h.ratio(cpu["bare"], cpu["conveyor"]),
        "conveyor_comm_share": h.median(comm),
        "ranks_in_sync": all(r["ranks_in_sync"] for r in done) if done else None,
    }


def format_paired(d: dict[str, Any], batch: int) -> list[str]:
    """The table's paired section: a row per side, then the ratio (the goal's figure) and how it was measured."""
    rows = [("paired (same 2 processes)", "step ms", "cpu ms", "samples/s")]
    for k in ("bare", "conveyor"):
        ms = d["step_ms_median"][k]
        rate = 2 * batch / (ms / 1e3) if ms and math.isfinite(ms) else None
        name = "bare_ddp_2" if k == "bare" else "conveyor_2"
        rows.append((name, h.fmt(ms, ".1f"), h.fmt(d["cpu_ms_median"][k], ".1f"), h.fmt(rate, ".1f")))
    return [
        h.format_rows(rows), "",
        f"conveyor_2 / bare_ddp_2, paired  {h.fmt(d['median'], '.3f')}  (median of {d['pairs']} per-pair ratios in "
        f"{d['runs_done']} run(s); min {h.fmt(d['min'], '.3f')}, max {h.fmt(d['max'], '.3f')}; ratio of sums "
        f"{h.fmt(d['ratio_of_sums'], '.3f')}; per run {h.fmt_all(d['per_run_median'], '.3f')}; CPU per step "
        f"{h.fmt(d['cpu_ratio'], '.3f')})",
        f"paired: conveyor's comm share {h.fmt(d['conveyor_comm_share'], '.1f', 100)} % (comm_seconds over its step "
        f"time); ranks in sync (parameter sums equal, both models) {d['ranks_in_sync']}",
    ]
