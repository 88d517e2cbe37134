"""The scaling model's outputs: an aligned table, a JSON document and a plot (the ``plots`` extra).

    print(format_table(points))
    write_json(path, measured=m, cluster=c, options=o, points=points)
    plot(path, points, title="...")       # None, after one line on stderr, without matplotlib

The JSON holds every input (the measured step, the cluster, the model's options) next to every point,
so a prediction can be checked and redone from it alone.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conveyor.extras import optional_import
from conveyor.fileio import atomic_write
from conveyor.scaling.cluster import Cluster
from conveyor.scaling.measured import Measured
from conveyor.scaling.model import BOUNDS, STRATEGIES, Options, Point

__all__ = ["format_table", "plot", "prediction_document", "write_json"]

TITLES = {"allreduce": "ring all-reduce (flat)", "allreduce-hierarchical": "all-reduce, hierarchical "
          "(reduce-scatter in the node, ring across nodes, all-gather)", "ps-sync": "parameter servers, synchronous",
          "ps-async": "parameter servers, asynchronous", "pipeline": "pipeline stages x data-parallel replicas"}
_MARKERS = {"input": "v", "compute": "o", "communication": "s", "bubble": "^", "server": "D"}


def _ms(seconds: float) -> str:
    return _num(seconds * 1e3)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.4g}"


def _aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1  # the bound's name: flush left
    return ["  ".join(v.ljust(w) if i == last else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def format_table(points: Sequence[Point], options: Options | None = None) -> str:
    """One block per strategy: N, nodes, step ms, samples/s, speedup, efficiency, exposed communication,
    input and bubble ms, and the bound."""
    lines: list[str] = []
    for strategy in [s for s in STRATEGIES if any(p.strategy == s for p in points)]:
        title = TITLES[strategy]
        if strategy == "pipeline" and options is not None:
            title += f" ({options.stages} stages, {options.microbatches} microbatches)"
        rows = [["N", "nodes", "step ms", "samples/s", "speedup", "efficiency", "comm ms", "input ms", "bubble ms",
                 "bound"]]
        for p in (p for p in points if p.strategy == strategy):
            rows.append([str(p.workers), str(p.nodes), _ms(p.step_seconds), _num(p.samples_per_second),
                         _num(p.efficiency * p.workers), f"{p.efficiency:.1%}", _ms(p.parts["communication"]),
                         _ms(p.parts["input"]), _ms(p.parts.get("bubble", 0.0)), p.bound])
        lines += [f"{strategy}: {title}", *("  " + line for line in _aligned(rows)), ""]
    return "\n".join(lines).rstrip()


def prediction_document(*, measured: Measured, cluster: Cluster, options: Options,
                        points: Sequence[Point]) -> dict[str, Any]:
    return {"measured": dataclasses.asdict(measured), "cluster": dataclasses.asdict(cluster),
            "options": dataclasses.asdict(options), "points": [dataclasses.asdict(p) for p in points]}


def write_json(path: str | Path, **document: Any) -> Path:
    """`prediction_document(**document)` as indented JSON at `path`, atomically."""
    text = json.dumps(prediction_document(**document), indent=2, allow_nan=False) + "\n"
    return atomic_write(path, text.encode())


def plot(path: str | Path, points: Sequence[Point], title: str = "") -> Path | None:
    """Samples/s (with the ideal line) and efficiency against N, one line per strategy, markers by bound."""
    if optional_import("matplotlib", skipped="the scaling plot", extra="plots") is None or not points:
        return None
    from matplotlib.figure import Figure  # a bare Figure: no pyplot, no backend to choose

    fig = Figure(figsize=(12, 4.8))
    rate_ax, eff_ax = fig.subplots(1, 2)
    base = next((p.samples_per_second / p.workers / p.efficiency for p in points if p.efficiency > 0), 0.0)
    counts = sorted({p.workers for p in points})
    rate_ax.plot(counts, [n * base for n in counts], "k:", label="ideal")
    for strategy in [s for s in STRATEGIES if any(p.strategy == s for p in points)]:
        mine = [p for p in points if p.strategy == strategy]
        line, = rate_ax.plot([p.workers for p in mine], [p.samples_per_second for p in mine], label=strategy)
        eff_ax.plot([p.workers for p in mine], [p.efficiency for p in mine], color=line.get_color())
        for p in mine:
            for ax, y in ((rate_ax, p.samples_per_second), (eff_ax, p.efficiency)):
                ax.plot(p.workers, y, _MARKERS[p.bound], color=line.get_color(), markersize=5)
    for bound in BOUNDS:
        if any(p.bound == bound for p in points):
            eff_ax.plot([], [], _MARKERS[bound], color="grey", label=f"bound: {bound}")
    rate_ax.set(xscale="log", yscale="log", xlabel="workers N", ylabel="samples/s", title="throughput")
    eff_ax.set(xscale="log", xlabel="workers N", ylabel="scaling efficiency", ylim=(0, 1.05), title="efficiency")
    for ax in (rate_ax, eff_ax):
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.grid(True, alpha=0.3)
    rate_ax.legend(fontsize=8)
    eff_ax.legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format="png")
    return atomic_write(path, buffer.getvalue())
