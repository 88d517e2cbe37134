"""Pictures of one worker's run, drawn from `StepProfiler`'s trace and steps (matplotlib, the `plots` extra).

    plot_timeline(prof.trace(), out / "plots" / "timeline.png")
    plot_step_breakdown(prof.steps, out / "plots" / "step_breakdown.png", rank=rank, total_steps=prof.step_count)

Each plot shows one worker's view (its title names the rank): other workers may have waited for
data, or computed, differently; their traces are in `trace/worker-<rank>.json`. The labels are in the
user's terms: a pipeline stage that `DatasetIterator.stats()` calls `map_batch[processes]#4` is
shown as "map + batch (processes)" (`stage_labels`). `timeline_figure` and `step_breakdown_figure`
return the figure unsaved, for a notebook or a test; the `plot_*` functions save it and return the
path, or None (drawing nothing, one notice on stderr) without matplotlib.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from conveyor.extras import optional_import
from conveyor.fileio import atomic_write
from conveyor.train.profiler import StepProfiler, StepTimes

__all__ = ["plot_step_breakdown", "plot_timeline", "stage_label", "stage_labels", "step_breakdown_figure",
           "timeline_figure"]

TraceLike = Mapping[str, Any] | str | os.PathLike[str] | Iterable[StepTimes]

# category -> (colour, the trace event names that belong to it)
_CATEGORIES = {
    "input wait (CPU input work)": ("tab:orange", ("input_wait",)),
    "compute (forward+backward)": ("tab:blue", ("forward_backward",)),
    "communication": ("tab:green", ("communication",)),
    "optimizer": ("tab:purple", ("optimizer",)),
    "eval / checkpoint / other": ("tab:gray", None),  # every other span on the trainer track
}
_OTHER = "eval / checkpoint / other"
_BARS = (
    ("input_wait", "input wait", "tab:orange"),
    ("forward_backward", "forward+backward (incl. overlapped comm.)", "tab:blue"),
    ("optimizer", "optimizer", "tab:purple"),
    ("other", "other", "tab:gray"),
)
# Op names the data layer made up, as the calls the user wrote (a fused map(...).batch(...)).
_KINDS = {"map_batch": "map + batch"}
_STAGE = re.compile(r"(?P<kind>[^\[#]+)(?:\[(?P<mode>[^\]]*)\])?(?:#(?P<index>\d+))?")


# ---- labels


def stage_label(stage: str) -> str:
    """A stage as the user wrote it: "map_batch[processes]#4" -> "map + batch (processes)", "prefetch#6" -> "prefetch".
    """
    m = _STAGE.fullmatch(stage)
    if m is None:
        return stage
    kind = _KINDS.get(m["kind"], m["kind"])
    return f"{kind} ({m['mode']})" if m["mode"] else kind


def stage_labels(stages: Iterable[str]) -> dict[str, str]:
    """Each stage name's label; stages that would read alike are numbered in pipeline order ("map (threads) 2").

    The data layer's `#index` is the stage's position in `stats()["stages"]`, upstream first.
    """
    names = sorted(dict.fromkeys(stages), key=_stage_index)
    plain = {n: stage_label(n) for n in names}
    alike = Counter(plain.values())
    seen: Counter[str] = Counter()
    out = {}
    for name in names:
        label = plain[name]
        if alike[label] > 1:
            seen[label] += 1
            label = f"{label} {seen[label]}"
        out[name] = label
    return out


def _stage_index(stage: str) -> int:
    m = _STAGE.fullmatch(stage)
    return int(m["index"]) if m is not None and m["index"] is not None else -1


def _whose(rank: Any) -> str:
    """The title's first words: which worker, and that it is that worker's view only."""
    if rank is None or rank == "?":
        return "one worker's view (rank unknown)"
    return f"worker {rank}'s view (rank {rank})"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


# ---- timeline


def timeline_figure(trace: TraceLike, *, max_seconds: float | None = None, rank: int | None = None):
    """The timeline of one worker as an unsaved figure, or None without matplotlib (`plot_timeline`)."""
    figure = _figure_class()
    if figure is None:
        return None
    data = _load_trace(trace, rank)
    rank = rank if rank is not None else (data.get("otherData") or {}).get("rank")
    events = [e for e in data.get("traceEvents", ()) if e.get("ph") == "X" and e.get("name") != "step"]
    counters = [e for e in data.get("traceEvents", ()) if e.get("ph") == "C"]
    times = [e["ts"] for e in events] + [e["ts"] for e in counters]
    t0 = min(times) if times else 0.0
    end = max([(e["ts"] + e.get("dur", 0.0) - t0) / 1e6 for e in events] or [0.0])

    panels = 2 if counters else 1
    fig = figure(figsize=(12, 3.2 + 2.2 * (panels - 1)))
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    _draw_rows(axes[0], _timeline_rows(events, t0, max_seconds))
    axes[0].set_title(f"{_whose(rank)}: where this worker's training loop's time goes")
    if counters:
        _draw_pipeline(axes[1], counters, t0, max_seconds)
    cut = max_seconds is not None and end > max_seconds
    shown = f" (the first {max_seconds:g} s of {end:.3g} s shown)" if cut else ""
    axes[-1].set_xlabel(f"seconds since the first event{shown}")
    fig.tight_layout()
    return fig


def plot_timeline(trace: TraceLike, path: str | os.PathLike[str], *, max_seconds: float | None = None,
                  rank: int | None = None) -> Path | None:
    """Draw the timeline of one worker: one row of bars (`broken_barh`) per category over time.

    `trace`: a `StepProfiler.trace()` dict, a path to a trace JSON, or a list of `StepTimes`; `rank`
    names the worker in the title (a trace says its own rank). The rows show when the loop waited
    for input (the CPU input pipeline was the bottleneck), when it computed, communicated and
    stepped the optimizer, and other work (evaluation, checkpoints). When the trace holds
    input-pipeline counters, a second panel plots each stage's busy fraction (the CPU input work
    running in the background) over the same time axis. `max_seconds` clips the time axis (a long
    run's bars are thinner than a pixel otherwise), and the axis label says so. Returns None,
    drawing nothing, without matplotlib.
    """
    return _save(timeline_figure(trace, max_seconds=max_seconds, rank=rank), path)


def _timeline_rows(events: list[dict], t0: float, max_seconds: float | None) -> dict[str, list[tuple[float, float]]]:
    rows: dict[str, list[tuple[float, float]]] = {c: [] for c in _CATEGORIES}
    for e in events:
        start, dur = (e["ts"] - t0) / 1e6, e.get("dur", 0.0) / 1e6
        if max_seconds is not None and start > max_seconds:
            continue
        cat = next((c for c, (_, names) in _CATEGORIES.items() if names and e["name"] in names), _OTHER)
        rows[cat].append((start, max(dur, 1e-6)))
    return rows


def _draw_rows(ax, rows: dict[str, list[tuple[float, float]]]) -> None:
    names = list(_CATEGORIES)
    for i, cat in enumerate(names):
        if rows[cat]:
            ax.broken_barh(rows[cat], (len(names) - 1 - i - 0.4, 0.8), facecolors=_CATEGORIES[cat][0],
                           edgecolor="none")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.grid(axis="x", alpha=0.3)


def _draw_pipeline(ax, counters: list[dict], t0: float, max_seconds: float | None) -> None:
    """Each input stage's busy fraction over time, labelled as the user wrote the stage."""
    series: dict[str, list[tuple[float, float]]] = {}
    for e in counters:
        t = (e["ts"] - t0) / 1e6
        if max_seconds is not None and t > max_seconds:
            continue
        for k, v in e.get("args", {}).items():
            if k.startswith("busy "):
                series.setdefault(k[5:], []).append((t, v))
    labels = stage_labels(series)
    for name in labels:  # pipeline order, so the legend reads upstream to downstream
        pts = series[name]
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="pre", label=labels[name])
    ax.set_ylabel("input stage busy\n(cores)")
    if series:
        ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)


# ---- step breakdown


def step_breakdown_figure(steps: Sequence[StepTimes], *, max_bars: int = 400, rank: int | None = None,
                          total_steps: int | None = None):
    """The step breakdown as an unsaved figure, or None without matplotlib (`plot_step_breakdown`)."""
    figure = _figure_class()
    if figure is None:
        return None
    steps = list(steps)
    fig = figure(figsize=(12, 4))
    ax = fig.subplots()
    if not steps:
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{_whose(rank)}: step time breakdown")
        ax.set_axis_off()
        return fig
    groups = _groups(steps, max_bars)
    xs = [g[0].step for g in groups]
    width = (xs[1] - xs[0]) * 0.9 if len(xs) > 1 else 0.8
    tops = _draw_bars(ax, groups, xs, width)
    _mark_clipped(ax, xs, width, tops, per_bar=len(groups[0]))
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.set_title(f"{_whose(rank)}: step time breakdown" + _steps_note(steps, groups, total_steps))
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_step_breakdown(steps: Sequence[StepTimes], path: str | os.PathLike[str], *, max_bars: int = 400,
                        rank: int | None = None, total_steps: int | None = None) -> Path | None:
    """Stacked bars of each step's phases (input wait, forward+backward, optimizer, other), with
    the measured communication as a line: a step whose orange part is large waited for data.

    More than `max_bars` steps are averaged in equal groups so the bars stay readable. When a few
    bars dwarf the rest (the first step's warm-up, a stall) the y axis stops at twice the 95th
    percentile: those bars are marked with a red triangle, and the legend says how many were
    clipped and the tallest one's time. `rank` names the worker in the title; `total_steps` (the
    profiler's `step_count`) lets the title say when the profiler kept only the first steps.
    Returns None, drawing nothing, without matplotlib.
    """
    return _save(step_breakdown_figure(steps, max_bars=max_bars, rank=rank, total_steps=total_steps), path)


def _groups(steps: list[StepTimes], max_bars: int) -> list[list[StepTimes]]:
    if len(steps) <= max_bars:
        return [[s] for s in steps]
    size = -(-len(steps) // max_bars)
    return [steps[i : i + size] for i in range(0, len(steps), size)]


def _mean_ms(group: list[StepTimes], attr: str) -> float:
    return sum(getattr(s, attr) for s in group) / len(group) * 1e3


def _draw_bars(ax, groups: list[list[StepTimes]], xs: list[int], width: float) -> list[float]:
    """The stacked bars and the communication line; returns each bar's height in ms."""
    bottom = [0.0] * len(groups)
    for attr, label, colour in _BARS:
        heights = [_mean_ms(g, attr) for g in groups]
        ax.bar(xs, heights, width=width, bottom=bottom, label=label, color=colour, align="edge")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    comm = [_mean_ms(g, "communication") for g in groups]
    if any(comm):
        ax.plot([x + width / 2 for x in xs], comm, color="tab:green", label="communication (measured)")
    return bottom


def _y_cap(tops: list[float]) -> float | None:
    """Where to stop the y axis (ms), or None: only when a few bars are over 3x the 95th percentile,
    since autoscaling to them would flatten every other bar."""
    if len(tops) < 10:
        return None
    p95 = sorted(tops)[int(0.95 * (len(tops) - 1))]
    return 2 * p95 if p95 > 0 and max(tops) > 3 * p95 else None


def _mark_clipped(ax, xs: list[int], width: float, tops: list[float], per_bar: int) -> None:
    cap = _y_cap(tops)
    if cap is None:
        return
    clipped = [(x, top) for x, top in zip(xs, tops, strict=True) if top > cap]
    what = ("step" if per_bar == 1 else "bar") + ("s" if len(clipped) > 1 else "")
    ax.set_ylim(0, cap)
    ax.plot([x + width / 2 for x, _ in clipped], [cap] * len(clipped), linestyle="none", marker="^",
            markersize=7, color="tab:red", clip_on=False, zorder=5,
            label=f"{len(clipped)} {what} above {_seconds(cap / 1e3)} clipped, max {_seconds(max(tops) / 1e3)}")


def _steps_note(steps: list[StepTimes], groups: list[list[StepTimes]], total_steps: int | None) -> str:
    notes = []
    if total_steps is not None and total_steps > len(steps):
        notes.append(f"showing the first {len(steps):,} of {total_steps:,} steps")
    if len(groups[0]) > 1:
        notes.append(f"mean of {len(groups[0])} steps per bar")
    return f"\n({'; '.join(notes)})" if notes else ""


# ---- shared


def _figure_class():
    """matplotlib's `Figure`, or None (said once on stderr) when the `plots` extra is missing.

    A bare `Figure` draws into files without pyplot: no backend to choose, no window a training job
    could open, and nothing left in pyplot's list of open figures.
    """
    if optional_import("matplotlib", skipped="the plots (plots/*.png)", extra="plots") is None:
        return None
    from matplotlib.figure import Figure

    return Figure


def _load_trace(trace: TraceLike, rank: int | None) -> dict[str, Any]:
    if isinstance(trace, (str, os.PathLike)):
        return json.loads(Path(trace).read_text())
    if isinstance(trace, Mapping):
        return dict(trace)
    data = StepProfiler.from_steps(trace, rank=rank or 0).trace()
    data["otherData"]["rank"] = rank  # steps do not say whose they are
    return data


def _save(fig, path: str | os.PathLike[str]) -> Path | None:
    if fig is None:
        return None
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format=path.suffix.lstrip(".") or "png")
    atomic_write(path, buffer.getvalue())
    return path
