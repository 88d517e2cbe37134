"""The several-hosts benchmark's pure parts (link caps, bytes each transport and strategy puts on a link,
verdicts) and its derived values and tables: everything `hosts.py` computes without hosts.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
import harness as h  # noqa: E402

MB = 1_000_000
WORKER_HOSTS, PS_HOST = (0, 1), 2
TRANSPORTS = ("raw_tcp", "ps_push_pull", "gloo_allreduce")  # round order within a cap
STRATEGIES = ("allreduce", "ps-sync", "ps-async")
TRANSPORT_LABELS = {
    "raw_tcp": "one TCP connection host0 -> host2, send B, echo B back",
    "ps_push_pull": "conveyor transport Client (host0) -> Server (host2): push B, then pull B",
    "gloo_allreduce": "gloo all_reduce of B between host0 and host1 (conveyor's process-group setup)",
}
BUSY_FRACTION = 0.9  # a strategy is link-bound at a cap when it keeps less than this of the reference's samples/s
TRAINING_NOTE = (
    "training: samples/s = N workers x batch / the chief's median step (summary.json step_breakdown total); wall "
    "samples/s = every worker's samples / the chief's training wall seconds (summary.json); comm % = "
    "median communication / median step total of the chief's steps (summary.json step_breakdown: allreduce: "
    "DDP hook in-flight time, much of it overlapping backward; ps-*: push + pull + wait-for-server time); "
    "link ms = the least time per step the busiest link needs at the cap (payload: allreduce 2(N-1)/N x P on each "
    "worker's link, ps-* N x P each way on the ps host's; P = the model's bytes, N = 2 workers); "
    f"/ ref = samples/s over the reference cap's (uncapped, else the fastest) in the same round; link-bound = "
    f"/ ref < {BUSY_FRACTION}")



# ==================================================================================================
# Pure parts: caps, byte accounting, verdicts (tested without hosts).
# ==================================================================================================


def parse_caps(text: str) -> tuple[float | None, ...]:
    """``"1000,10000,none"`` -> (1000.0, 10000.0, None): Mbit/s per link direction, ``none`` for no cap."""
    caps: list[float | None] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if part in ("none", "uncapped", "0"):
            cap = None
        else:
            try:
                cap = float(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"cap {part!r}: expected Mbit/s (e.g. 1000) or none") from None
            if not cap > 0:
                raise argparse.ArgumentTypeError(f"cap {part!r}: must be > 0 Mbit/s (or none)")
        if cap in caps:
            raise argparse.ArgumentTypeError(f"cap {part!r} given twice")
        caps.append(cap)
    if not caps:
        raise argparse.ArgumentTypeError("no cap given")
    return tuple(caps)


def cap_key(cap: float | None) -> str:
    """The cap's name in the JSON and in contender names: ``"1000"``, ``"none"``."""
    return "none" if cap is None else f"{cap:g}"


def cap_label(cap: float | None) -> str:
    if cap is None:
        return "uncapped"
    return f"{cap / 1000:g} Gbit/s" if cap >= 1000 else f"{cap:g} Mbit/s"


def counted_bytes(transport: str, nbytes: int, hosts: int = 2) -> float:
    """Payload bytes one transport iteration counts (module docstring): what its ideal time moves at the cap."""
    if transport in ("ps_push_pull", "raw_tcp"):
        return 2.0 * nbytes  # sent, then received: the link's two directions in turn
    if transport == "gloo_allreduce":
        return 2.0 * (hosts - 1) / hosts * nbytes  # sent by each host while it receives as much
    raise ValueError(f"unknown transport {transport!r}")


def ideal_seconds(transport: str, nbytes: int, cap_mbit: float, hosts: int = 2) -> float:
    return counted_bytes(transport, nbytes, hosts) * 8 / (cap_mbit * 1e6)


def vs_cap(gbps: float | None, cap: float | None) -> float:
    """GB/s over the cap (Mbit/s); NaN uncapped or unmeasured."""
    return math.nan if cap is None else h.ratio(gbps, cap * 1e6 / 8 / 1e9)


def link_bytes_per_step(strategy: str, model_bytes: int, workers: int = 2) -> float:
    """Payload bytes the busiest link carries each way per step of every worker: a worker's for a ring all-reduce
    of the gradients (2(N-1)/N x P), the ps host's for parameter servers (N pushes in, N pulls out)."""
    if strategy == "allreduce":
        return 2.0 * (workers - 1) / workers * model_bytes
    if strategy.startswith("ps-"):
        return float(workers * model_bytes)
    raise ValueError(f"unknown strategy {strategy!r}")


def link_ms(strategy: str, model_bytes: int | None, cap: float | None, workers: int = 2) -> float:
    """The least time per step the busiest link needs at ``cap`` (NaN uncapped or unknown model size)."""
    if cap is None or not model_bytes:
        return math.nan
    return 1e3 * link_bytes_per_step(strategy, model_bytes, workers) * 8 / (cap * 1e6)


def reference_cap(caps: Sequence[float | None]) -> float | None:
    """The cap training is compared against: none (uncapped) when measured, else the fastest."""
    return None if None in caps else max(c for c in caps if c is not None)


def unbound_from(fractions: dict[str, float], caps: Sequence[float | None], reference: str) -> str | None:
    """The slowest cap (key) from which on every faster cap keeps >= BUSY_FRACTION of the reference's samples/s
    (``fractions``: cap key -> samples/s over the reference cap's); None when even the fastest one does not."""
    ordered = sorted(c for c in caps if c is not None and cap_key(c) != reference)  # slow to fast
    found = None
    for cap in reversed(ordered):
        value = fractions.get(cap_key(cap), math.nan)
        if not (math.isfinite(value) and value >= BUSY_FRACTION):
            break
        found = cap_key(cap)
    return found


def verdict(key: str | None, caps: Sequence[float | None], reference: str) -> str:
    """In words, where a strategy stops being link-bound (``key``: :func:`unbound_from`'s answer)."""
    capped = sorted(c for c in caps if c is not None and cap_key(c) != reference)
    ref = cap_label(None if reference == "none" else float(reference))
    if not capped:
        return "no cap below the reference measured"
    if key is None:
        return f"link-bound at every cap measured (< {BUSY_FRACTION} x {ref} even at {cap_label(capped[-1])})"
    if key == cap_key(capped[0]):
        return f"not link-bound at any cap measured (>= {BUSY_FRACTION} x {ref} from {cap_label(capped[0])} up)"
    below = [c for c in capped if c < float(key)]
    return (f"link-bound up to {cap_label(below[-1])}; stops being link-bound at {cap_label(float(key))} "
            f"(>= {BUSY_FRACTION} x {ref} from there up)")


def busy_note(runs: Sequence[dict[str, Any] | None], cores: int) -> str | None:
    """A warning when the machine's 1-minute load exceeded twice its cores around some run (others' work
    then shows in every figure), else None."""
    loads = h.finite(r.get("loadavg_1min") for r in runs if r)
    worst = max(loads, default=0.0)
    if worst <= 2 * cores:
        return None
    busy = sum(load > 2 * cores for load in loads)
    return (f"WARNING: the machine was busy: 1-minute load up to {worst:.1f} on {cores} cores ({busy} of "
            f"{len(loads)} runs above {2 * cores}); other processes' work is in these figures: run again on a "
            f"quiet machine")


def contender(kind: str, cap: float | None) -> str:
    return f"{kind}@{cap_key(cap)}"


def split_contender(name: str) -> tuple[str, str]:
    kind, _, key = name.rpartition("@")
    return kind, key

# ==================================================================================================
# Derived values, table, arguments, main.
# ==================================================================================================


def derive_transport(res: dict[str, Any], caps: Sequence[float | None]) -> dict[str, Any]:
    d: dict[str, Any] = {"by_cap": {}}
    for cap in caps:
        row = d["by_cap"][cap_key(cap)] = {}
        for t in TRANSPORTS:
            s = res["samples"].get(contender(t, cap), [])
            med = h.median(s)
            row[t] = {"median_gbps": med, "median_gbit_per_s": 8 * med, "min_gbps": h.lowest(s),
                      "max_gbps": h.highest(s), "vs_cap": vs_cap(med, cap), "per_round_gbps": s}
        row["ps_push_pull"]["vs_raw_tcp"] = h.ratio(row["ps_push_pull"]["median_gbps"], row["raw_tcp"]["median_gbps"])
        row["ps_push_pull"]["vs_raw_tcp_per_round"] = h.paired(row["ps_push_pull"]["per_round_gbps"],
                                                               row["raw_tcp"]["per_round_gbps"])
    for t in ("ps_push_pull", "gloo_allreduce"):
        d[f"{t}_vs_cap_1000"] = d["by_cap"].get("1000", {}).get(t, {}).get("vs_cap", math.nan)
    runs = [r for rs in res["runs"].values() for r in rs if r and "error" not in r]
    d["data_intact"] = all(r.get("roundtrip_ok", r.get("sum_ok", False)) for r in runs)
    return d


def derive_training(res: dict[str, Any], caps: Sequence[float | None], strategies: Sequence[str],
                    model_bytes: int | None = None) -> dict[str, Any]:
    ref = reference_cap(caps)
    d: dict[str, Any] = {"reference_cap": cap_key(ref), "model_bytes": model_bytes, "by_strategy": {},
                         "link_bound_below": {}}
    for strategy in strategies:
        ref_samples = res["samples"].get(contender(strategy, ref), [])
        rows = d["by_strategy"][strategy] = {}
        for cap in caps:
            name = contender(strategy, cap)
            s, runs = res["samples"].get(name, []), [r or {} for r in res["runs"].get(name, [])]
            per_round = h.paired(s, ref_samples)
            rows[cap_key(cap)] = {
                "median_samples_per_second": h.median(s), "per_round": s, "vs_reference": h.median(per_round),
                "median_wall_samples_per_second": h.median(r.get("samples_per_second") for r in runs),
                "vs_reference_per_round": per_round,
                "comm_share": h.median(r.get("comm_share") for r in runs),
                "step_ms": h.median(r.get("step_ms") for r in runs),
                "comm_ms": h.median(r.get("comm_ms") for r in runs),
                "link_ms": link_ms(strategy, model_bytes, cap, len(WORKER_HOSTS)),
            }
        fractions = {k: v["vs_reference"] for k, v in rows.items()}
        d["link_bound_below"][strategy] = unbound_from(fractions, caps, cap_key(ref))
    return d


def format_transport(d: dict[str, Any], caps: Sequence[float | None], settings: dict[str, Any], repeats: int) -> str:
    head = (f"transport: B = {settings['bytes'] / MB:.0f} MB of float32 ({settings['tensors']} ps pieces of <= 4 MiB), "
            f"{repeats} round(s) x {settings['iters']} timed iteration(s), 1 thread/process; payload bytes counted: "
            f"raw_tcp and ps_push_pull 2B per iteration (host0 sends B, then receives B), gloo_allreduce B per "
            f"iteration (each of 2 hosts sends 2(N-1)/N x B = B while receiving B); / cap = GB/s / link cap")
    rows = [("cap", "contender", "GB/s", "Gbit/s", "/ cap", "/ raw TCP", "min GB/s", "max GB/s", "per round GB/s")]
    for cap in caps:
        row = d["by_cap"][cap_key(cap)]
        for t in TRANSPORTS:
            r = row[t]
            rows.append((cap_label(cap), t, h.fmt(r["median_gbps"], ".3f"), h.fmt(r["median_gbit_per_s"], ".2f"),
                         h.fmt(r["vs_cap"], ".3f"), h.fmt(r.get("vs_raw_tcp"), ".3f") if t == "ps_push_pull" else "",
                         h.fmt(r["min_gbps"], ".3f"), h.fmt(r["max_gbps"], ".3f"),
                         h.fmt_all(r["per_round_gbps"], ".3f")))
    lines = [head, "", h.format_rows(rows, left=(0, 1, 8))]
    for cap in caps:
        tcp = d["by_cap"][cap_key(cap)]["raw_tcp"]["vs_cap"]
        if math.isfinite(tcp) and tcp < 0.9:
            lines.append(f"at {cap_label(cap)} raw TCP itself gets {tcp:.2f} of the cap: the machine (2 cores, "
                         f"shared), not the link, limits every transport there")
    lines += ["", *(f"{t}: {TRANSPORT_LABELS[t]}" for t in TRANSPORTS), f"data intact (pulled == pushed, "
              f"echo == sent, all-reduce sums right): {d['data_intact']}"]
    return "\n".join(lines)


def format_training(d: dict[str, Any], caps: Sequence[float | None], settings: dict[str, Any], repeats: int) -> str:
    head = (f"training: examples/digits/train.py, {len(WORKER_HOSTS)} worker hosts (+1 ps host for ps-*), "
            f"{settings['epochs']} epoch(s), batch {settings['batch_size']}/worker, model P = "
            f"{h.fmt(d.get('model_bytes'), ',.0f')} bytes of parameters, {repeats} round(s); medians")
    rows = [("strategy", "cap", "samples/s", "/ ref", "wall samples/s", "step ms", "comm ms", "comm %", "link ms",
             "link-bound", "samples/s per round")]
    for strategy in d["by_strategy"]:
        for cap in caps:
            r = d["by_strategy"][strategy][cap_key(cap)]
            ratio = r["vs_reference"]
            bound = "ref" if cap_key(cap) == d["reference_cap"] else (
                "-" if not math.isfinite(ratio) else ("yes" if ratio < BUSY_FRACTION else "no"))
            rows.append((strategy, cap_label(cap), h.fmt(r["median_samples_per_second"], ".0f"), h.fmt(ratio, ".3f"),
                         h.fmt(r["median_wall_samples_per_second"], ".0f"),
                         h.fmt(r["step_ms"], ".1f"), h.fmt(r["comm_ms"], ".1f"), h.fmt(r["comm_share"], ".0f", 100),
                         h.fmt(r["link_ms"], ".2f"), bound, h.fmt_all(r["per_round"], ".0f")))
    lines = [head, "", h.format_rows(rows, left=(0, 1, 9, 10)), ""]
    for strategy, key in d["link_bound_below"].items():
        lines.append(f"{strategy:<10} {verdict(key, caps, d['reference_cap'])}")
    lines.append(TRAINING_NOTE)
    return "\n".join(lines)


