"""The pipeline-parallel benchmark's derived values (memory ratios, measured against theoretical bubble,
activations held) and its report table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402
from pipeline_parallel_worker import STAGES  # noqa: E402

CONTENDERS_SPEC = (  # round order; odd rounds reversed, so the compared pair always runs back to back
    h.Contender("one_process", "whole model, one process, one thread"),
    h.Contender("two_halves", "each of 2 processes trains its half alone, whole batch: the 2-process ceiling"),
    h.Contender("bare_pipelining", "hand-written PipelineStage + Schedule1F1B loop, 2 processes, gloo"),
    h.Contender("conveyor_pipeline", "conveyor --strategy pipeline --stages 2, schedule 1f1b, 2 processes"),
)
CONTENDERS = tuple(c.name for c in CONTENDERS_SPEC)
SCHEDULES = ("gpipe", "1f1b")
LINKS = {"cpu": "gloo on 127.0.0.1", "cuda": "NCCL, one GPU per process"}

# ------------------------------------------------------------------------------------ derived values

_PHASES = ("import", "built", "ready")


def _largest_process(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each run's process with the largest peak RSS; medians over the runs of its peak, phases and part peaks."""
    picked = []
    for run in runs:
        peaks = run.get("peak_rss_mb") or []
        if not peaks:
            continue
        i = max(range(len(peaks)), key=peaks.__getitem__)
        mem = (run.get("memory") or [{}] * len(peaks))[i]
        picked.append({"peak_rss_mb": peaks[i], "setup_peak_rss_mb": mem.get("setup_peak_rss_mb"),
                       "train_peak_rss_mb": mem.get("train_peak_rss_mb"),
                       **{f"{ph}_rss_mb": (mem.get("rss_mb") or {}).get(ph) for ph in _PHASES}})
    keys = ("peak_rss_mb", "setup_peak_rss_mb", "train_peak_rss_mb", *(f"{ph}_rss_mb" for ph in _PHASES))
    return {k: h.median(p[k] for p in picked) for k in keys}


def theory(stages: int, m: int) -> float:
    return (stages - 1) / (m + stages - 1)


def cost_aware_theory(compute: Sequence[float], m: int) -> list[float]:
    """Each stage's idle share when the stages' compute per step is `compute`, not equal as (S-1)/(M+S-1)
    assumes: the window is then the slowest stage's M microbatches plus one microbatch of each other stage
    (the fill and the drain), (M-1) c_max + sum(c) with c a stage's compute per microbatch."""
    window = ((m - 1) * max(compute) + sum(compute)) / m
    return [1 - c / window for c in compute]


def _bubble_rows(sweep: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """Per (schedule, M): each stage's measured bubble and its gap to theory; the largest gap at M >= 4."""
    rows, gaps = [], []
    for key, run in sweep.items():
        schedule, m = key.split("/")
        fig = run.get("figures")
        if fig is None:
            rows.append({"schedule": schedule, "microbatches": int(m), "error": run.get("error")})
            continue
        stages = fig["per_stage"]
        gap = max((h.gap(s["bubble_fraction"], fig["theoretical_bubble_fraction"]) for s in stages),
                  default=float("nan"))
        compute = [1e3 * s["compute_seconds_per_step"] for s in stages]
        expected = cost_aware_theory(compute, int(m))
        cost_gap = max(h.gap(st["bubble_fraction"], e) for st, e in zip(stages, expected, strict=True))
        rows.append({"schedule": schedule, "microbatches": int(m), "theory": fig["theoretical_bubble_fraction"],
                     "measured": [s["bubble_fraction"] for s in stages],
                     "compute_ms": compute, "cost_aware": expected,
                     "max_gap_cost_aware": cost_gap,
                     "wait_ms": [1e3 * s["send_recv_wait_seconds_per_step"] for s in stages],
                     "start_wait_ms": [1e3 * (s.get("start_wait_seconds_per_step") or 0.0) for s in stages],
                     "max_gap": gap, "activations": run.get("activations"),
                     "samples_per_s": run.get("samples_per_s")})
        if int(m) >= 4:
            gaps.append(gap)
    # a failed (schedule, M) at M >= 4 leaves the goal unmeasured rather than passing on the rest
    failed = any("error" in r and r["microbatches"] >= 4 for r in rows)
    return rows, (float("nan") if failed or not gaps else max(h.finite(gaps) or [float("nan")]))


def _activations(rows: list[dict[str, Any]], schedule: str) -> dict[str, Any] | None:
    """Stage 0's saved activations at the largest M the sweep ran for `schedule`."""
    mine = [r for r in rows if r["schedule"] == schedule and r.get("activations")]
    if not mine:
        return None
    top = max(mine, key=lambda r: r["microbatches"])
    return {"microbatches": top["microbatches"], **top["activations"]}


def derive(res: dict[str, Any], sweep: dict[str, Any], four: dict[str, Any] | None, m: int,
           paired: dict[str, Any] | None = None) -> dict[str, Any]:
    s = {c: list(res["samples"].get(c, [])) for c in CONTENDERS}
    runs = {c: [r for r in res["runs"].get(c, []) if r is not None] for c in CONTENDERS}
    med = {c: h.median(v) for c, v in s.items()}
    memory = {c: _largest_process(runs[c]) for c in CONTENDERS}
    if four and "peak_rss_mb" in four:
        memory["conveyor_4_stages"] = _largest_process([four])
    peak = {c: m["peak_rss_mb"] for c, m in memory.items()}
    gpu_peak = {c: h.median(max(r["peak_gpu_mb"]) for r in runs[c] if "peak_gpu_mb" in r) for c in CONTENDERS}
    ideal = STAGES * (1 - theory(STAGES, m))
    rows, max_gap = _bubble_rows(sweep)
    for r in rows:  # each sweep run's rate against its own ideal, S (1 - b(M)) one_process
        r["vs_ideal"] = h.ratio(r.get("samples_per_s"), STAGES * (1 - theory(STAGES, r["microbatches"]))
                                * med["one_process"])
    act = {sch: _activations(rows, sch) for sch in SCHEDULES}
    a1, ag = act["1f1b"], act["gpipe"]
    four_peak = peak.get("conveyor_4_stages")
    above = {c: m["peak_rss_mb"] - m["import_rss_mb"] for c, m in memory.items()}
    return {
        "median_samples_per_s": med, "min": {c: h.lowest(v) for c, v in s.items()},
        "max": {c: h.highest(v) for c, v in s.items()},
        "step_ms": {c: h.median(r["step_ms_median"] for r in runs[c]) for c in CONTENDERS},
        "peak_rss_mb": peak, "memory": memory,
        "peak_rss_mb_4_stages": four_peak,
        "peak_gpu_mb": gpu_peak, "memory_ratio_2_gpu": h.ratio(gpu_peak["conveyor_pipeline"], gpu_peak["one_process"]),
        "memory_ratio_2": h.ratio(peak["conveyor_pipeline"], peak["one_process"]),
        "memory_ratio_2_bare": h.ratio(peak["bare_pipelining"], peak["one_process"]),
        "memory_ratio_4": h.ratio(four_peak, peak["one_process"]),
        "memory_ratio_2_above_import": h.ratio(above["conveyor_pipeline"], above["one_process"]),
        "conveyor_vs_bare": h.ratio(med["conveyor_pipeline"], med["bare_pipelining"]),
        "conveyor_vs_bare_paired": (paired or {}).get("conveyor_vs_bare"),
        "conveyor_vs_bare_per_pair": (paired or {}).get("per_pair", []),
        "conveyor_vs_bare_per_round": h.paired(s["conveyor_pipeline"], s["bare_pipelining"]),
        "ideal_speedup": ideal,
        "conveyor_vs_ideal": h.ratio(med["conveyor_pipeline"], ideal * med["one_process"]),
        "conveyor_vs_ideal_per_round": h.paired(s["conveyor_pipeline"], s["one_process"], scale=ideal),
        "bare_vs_ideal": h.ratio(med["bare_pipelining"], ideal * med["one_process"]),
        "two_process_efficiency": h.ratio(med["two_halves"], STAGES * med["one_process"]),
        "conveyor_vs_halves": h.ratio(med["conveyor_pipeline"], (1 - theory(STAGES, m)) * med["two_halves"]),
        "bubble": rows, "bubble_max_gap": max_gap, "activations_stage0": act,
        "bubble_max_gap_cost_aware": max(h.finite(r.get("max_gap_cost_aware") for r in rows if r["microbatches"] >= 4)
                                         or [float("nan")]),
        "act_1f1b": a1["peak_microbatches"] if a1 else None,
        "act_gpipe_share": ag["peak_microbatches"] / ag["microbatches"] if ag and ag["peak_microbatches"] else None,
    }


# ------------------------------------------------------------------------------------ report


def _throughput_rows(res: dict[str, Any], d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("contender", "procs", "samples/s", "min", "max", "step ms", "per round")]
    for c in CONTENDERS:
        procs = "1" if c == "one_process" else str(STAGES)
        rows.append((c, procs, h.fmt(d["median_samples_per_s"][c], ".1f"), h.fmt(d["min"][c], ".1f"),
                     h.fmt(d["max"][c], ".1f"), h.fmt(d["step_ms"][c], ".0f"),
                     h.fmt_all(res["samples"].get(c, []), ".1f") or "skipped"))
    return rows


def _memory_rows(d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("RSS MB, largest process", "peak", "x one_process", "after imports", "model built", "after the cut",
             "set-up peak", "training peak")]
    base = d["memory"]["one_process"]["peak_rss_mb"]
    parts = ("import", "built", "ready", "setup_peak", "train_peak")
    for name, m in d["memory"].items():
        rows.append((name, h.fmt(m["peak_rss_mb"], ".0f"), h.fmt(h.ratio(m["peak_rss_mb"], base), ".3f"),
                     *(h.fmt(m[f"{k}_rss_mb"], ".0f") for k in parts)))
    return rows


def _sweep_rows(d: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = [("schedule", "M", "theory", "stage 0", "stage 1", "max gap", "with these costs", "gap to it",
             "compute ms/step", "wait ms/step",
             "start wait ms/step", "samples/s", "x S(1-b) one_process", "stage-0 act. (microbatches)")]
    for r in d["bubble"]:
        if "error" in r:
            rows.append((r["schedule"], str(r["microbatches"]), f"FAILED: {r['error']}"))
            continue
        act = r["activations"] or {}
        rows.append((r["schedule"], str(r["microbatches"]), h.fmt(r["theory"], ".3f"),
                     *(h.fmt(x, ".3f") for x in r["measured"]), h.fmt(r["max_gap"], ".3f"),
                     " / ".join(h.fmt(x, ".3f") for x in r["cost_aware"]), h.fmt(r["max_gap_cost_aware"], ".3f"),
                     " / ".join(h.fmt(x, ".0f") for x in r["compute_ms"]),
                     " / ".join(h.fmt(x, ".0f") for x in r["wait_ms"]),
                     " / ".join(h.fmt(x, ".0f") for x in r["start_wait_ms"]),
                     h.fmt(r.get("samples_per_s"), ".1f"), h.fmt(r.get("vs_ideal"), ".3f"),
                     f"{h.fmt(act.get('peak_microbatches'), '.2f')} ({h.fmt(act.get('peak_bytes'), '.1f', 1e-6)} MB)"))
    return rows


def format_table(res: dict[str, Any], d: dict[str, Any], config: dict[str, Any], repeats: int) -> str:
    m = config["microbatches"]
    head = (f"pipeline_parallel benchmark: MLP {config['depth']} x Linear({config['width']}) + Adam "
            f"({config['params']:,} params, {config['state_mb']:.0f} MB params+grads+Adam), batch {config['batch']}, "
            f"{config['steps']} timed steps after {config['warmup']} warm-up, {repeats} round(s), "
            f"1 thread/process, {LINKS[config.get('device', 'cpu')]}"
            f"; pipelines: 2 stages cut before block {config['split']}, 1F1B, M={m}")
    four = d["peak_rss_mb_4_stages"]
    lines = [head, "", h.format_rows(_throughput_rows(res, d), left=(0, 8)), "",
             f"conveyor_pipeline / bare_pipelining     {h.fmt(d['conveyor_vs_bare'], '.3f')}  (separate runs, ratio of "
             f"medians; per round {h.fmt_all(d['conveyor_vs_bare_per_round'], '.3f')})",
             f"  the same, step by step in one pair of processes {h.fmt(d['conveyor_vs_bare_paired'], '.3f')}  (per "
             f"pair {h.fmt_all(d['conveyor_vs_bare_per_pair'], '.3f') or 'not run'})",
             f"conveyor_pipeline / (S(1-b) one_process) {h.fmt(d['conveyor_vs_ideal'], '.3f')}  (S(1-b) = "
             f"{d['ideal_speedup']:.3f}; per round {h.fmt_all(d['conveyor_vs_ideal_per_round'], '.3f')}; bare "
             f"{h.fmt(d['bare_vs_ideal'], '.3f')})",
             f"two_halves / (S one_process)            {h.fmt(d['two_process_efficiency'], '.3f')}  (how fast two "
             f"processes run at once on this machine, each against one alone: the ceiling of the line above)",
             f"conveyor_pipeline / ((1-b) two_halves)  {h.fmt(d['conveyor_vs_halves'], '.3f')}  (the pipeline's "
             f"own losses: microbatches, sends, imbalance)",
             "", h.format_rows(_memory_rows(d), left=(0,)), "",
             f"peak RSS, largest process: 1 stage {h.fmt(d['peak_rss_mb']['one_process'], '.0f')} MB, 2 stages "
             f"{h.fmt(d['peak_rss_mb']['conveyor_pipeline'], '.0f')} MB (x{h.fmt(d['memory_ratio_2'], '.3f')}; bare "
             f"x{h.fmt(d['memory_ratio_2_bare'], '.3f')}; above the imports x"
             f"{h.fmt(d['memory_ratio_2_above_import'], '.3f')}), 4 stages "
             + (f"{four:.0f} MB (x{h.fmt(d['memory_ratio_4'], '.3f')})" if four else "not run (--four-stages)"),
             *([f"peak GPU memory, largest process: 1 stage {h.fmt(d['peak_gpu_mb']['one_process'], '.0f')} MB, "
                f"2 stages {h.fmt(d['peak_gpu_mb']['conveyor_pipeline'], '.0f')} MB "
                f"(x{h.fmt(d['memory_ratio_2_gpu'], '.3f')})"] if config.get("device") == "cuda" else []),
             "", "bubble (conveyor's summary figures over the timed steps; wait = send/recv wait) and stage 0's "
             "saved activations (saved_tensors_hooks, one extra step):", "",
             h.format_rows(_sweep_rows(d), left=(0,)), "",
             f"largest gap at M >= 4: to (S-1)/(M+S-1) {h.fmt(d['bubble_max_gap'], '.3f')}, to the theory with each "
             f"run's measured stage costs {h.fmt(d['bubble_max_gap_cost_aware'], '.3f')} (what sends, latency and "
             f"jitter add; the rest of the first is one stage computing longer than the other)"]
    return "\n".join(lines)
