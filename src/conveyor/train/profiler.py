"""Where a training step's time goes: input wait, forward+backward, communication, optimizer.

    prof = StepProfiler(rank=job.rank)
    prof.start()
    for ...:
        prof.begin_step()
        batch = next(it)                     # blocking here is input wait
        prof.mark("input_wait")
        loss = loss_fn(model(x), y); loss.backward()
        prof.mark("forward_backward")
        optimizer.step()
        prof.mark("optimizer")
        prof.end_step(samples=len(y), comm_seconds=strategy_comm_delta)
        with prof.span("checkpoint"):        # work between steps: eval, checkpoints, logging
            ...
    prof.write_trace(out / "trace" / f"worker-{rank}.json")     # open in ui.perfetto.dev
    plot_timeline(prof.trace(), out / "plots" / "timeline.png")
    plot_step_breakdown(prof.steps, out / "plots" / "step_breakdown.png")

What the numbers mean:

- `input_wait`: time blocked in `next()` on the input pipeline (the pipeline's own work runs in
  the background while the model computes; only what the loop had to *wait* for shows here).
- `forward_backward`: wall time of forward and backward, **including** any gradient
  communication that ran inside backward. DDP overlaps its bucketed all-reduce with backward, so
  the two cannot be separated by subtraction without double counting: `communication` is reported
  next to it, not subtracted from it.
- `communication`: the strategy's own measure (`job.strategy.comm_seconds()` before and after the
  step): total time its collectives or parameter-server exchanges took during the step, whether
  it overlapped compute or not. In the trace it is drawn on its own track at the end of backward;
  its placement there is approximate, its length is measured.
- `optimizer`: `optimizer.step()` (and `zero_grad`).
- `accelerator_idle_fraction` = input wait / step time, summed over steps: the share of the
  training loop's time that compute sat waiting for data. (On CPU "the accelerator" is the loop's
  own compute. On CUDA the profiler synchronizes the device at phase boundaries, so the phases
  are real device time, at the price of the CPU not running ahead of the GPU.)

The trace is Chrome trace-event JSON (`{"traceEvents": [...]}`, times in µs since the Unix epoch,
so traces of several workers line up): one process per worker (pid = rank), tracks "steps",
"input", "compute", "communication", "trainer" (evaluation, checkpoints, epoch ends) and counter
tracks for the input pipeline's stages (busy fraction, elements/s) when the iterator reports them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.extras import optional_import
from conveyor.fileio import atomic_write

__all__ = ["PHASES", "StepProfiler", "StepTimes", "plot_step_breakdown", "plot_timeline"]

PHASES = ("input_wait", "forward_backward", "communication", "optimizer")
_MARKED = ("input_wait", "forward_backward", "optimizer")  # the phases that follow one another in time
_TIDS = {"steps": 0, "input": 1, "compute": 2, "communication": 3, "trainer": 4, "input pipeline": 5}
_TRACK = {"input_wait": "input", "forward_backward": "compute", "optimizer": "compute"}


@dataclass(frozen=True)
class StepTimes:
    """One step's phases in seconds; `start` is on the profiler's clock (`time.perf_counter`)."""

    step: int
    start: float
    input_wait: float
    forward_backward: float
    communication: float
    optimizer: float
    total: float
    samples: int

    @property
    def other(self) -> float:
        """Time inside the step not in a marked phase (normally ~0)."""
        return max(0.0, self.total - self.input_wait - self.forward_backward - self.optimizer)


class StepProfiler:
    """Collects per-step phase times, spans between steps and input-pipeline samples (module docstring).

    `max_trace_steps` bounds memory and trace size: the first `max_trace_steps` steps are kept in
    full for the trace and plots; every step still counts in `summary()`. `sync`: a callable run
    at every phase boundary (the trainer passes `torch.cuda.synchronize` on CUDA), or None.
    `clock`: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, rank: int = 0, *, max_trace_steps: int = 20_000, sync=None, clock=time.perf_counter):
        self.rank = int(rank)
        self._clock = clock
        self.max_trace_steps = int(max_trace_steps)
        self._sync = sync
        self.steps: list[StepTimes] = []
        self.spans: list[tuple[str, float, float, dict[str, Any]]] = []  # (name, start, duration, args)
        self.counters: list[tuple[str, float, dict[str, float]]] = []  # (name, time, values)
        self._totals = dict.fromkeys((*PHASES, "total"), 0.0)
        self._samples = 0
        self._count = 0
        self._medians: dict[str, array] = {p: array("d") for p in (*PHASES, "total")}  # 8 bytes per step
        self._origin_perf = clock()
        self._origin_wall = time.time()
        self._step_start: float | None = None
        self._last = 0.0
        self._phase: dict[str, float] = {}
        self._pipeline_prev: dict[str, Any] = {}

    # ---- recording

    def start(self) -> None:
        """Anchor the clock: trace times are wall-clock µs, measured with perf_counter from here."""
        self._origin_perf = self._clock()
        self._origin_wall = time.time()

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def begin_step(self) -> None:
        self._step_start = self._last = self._now()
        self._phase = {}

    def mark(self, phase: str) -> None:
        """End the phase `phase` now; it began where the previous mark (or `begin_step`) ended."""
        if phase not in _MARKED:
            raise ValueError(f"unknown phase {phase!r}; the marked phases are {_MARKED}")
        now = self._now()
        self._phase[phase] = self._phase.get(phase, 0.0) + now - self._last
        self._last = now

    def end_step(self, step: int, samples: int, comm_seconds: float = 0.0) -> StepTimes:
        """Close the step begun by `begin_step` (call after `mark("optimizer")`)."""
        if self._step_start is None:
            raise RuntimeError("end_step() without begin_step()")
        end = self._last
        p = self._phase
        st = StepTimes(
            step=int(step),
            start=self._step_start,
            input_wait=p.get("input_wait", 0.0),
            forward_backward=p.get("forward_backward", 0.0),
            communication=max(0.0, float(comm_seconds)),
            optimizer=p.get("optimizer", 0.0),
            total=end - self._step_start,
            samples=int(samples),
        )
        self._step_start = None
        self._count += 1
        self._samples += st.samples
        for name in (*PHASES, "total"):
            value = getattr(st, name)
            self._totals[name] += value
            self._medians[name].append(value)
        if len(self.steps) < self.max_trace_steps:
            self.steps.append(st)
        return st

    def cancel_step(self, name: str = "input_wait") -> None:
        """The step begun last did not happen (the data ran out): keep its wait as a span, not a step."""
        if self._step_start is not None:
            now = self._now()
            self.spans.append((name, self._step_start, now - self._step_start, {"end_of_data": True}))
            self._step_start = None

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Time work between steps (evaluation, checkpoint, epoch end) for the trace."""
        t0 = self._now()
        try:
            yield
        finally:
            if len(self.spans) < 4 * self.max_trace_steps:
                self.spans.append((name, t0, self._now() - t0, args))

    def sample_pipeline(self, stats: Mapping[str, Any] | None, key: Any = None) -> None:
        """Record the input pipeline's activity from `iterator.stats()` since the previous sample.

        `key` identifies the iterator (e.g. the epoch): counters restart from zero when it changes.
        Emits, per stage that reports work, its busy fraction over the interval, and the elements/s
        the consumer received.
        """
        if not stats:
            return
        now = self._clock()
        prev = self._pipeline_prev if self._pipeline_prev.get("key") == key else {"key": key}
        t_prev = prev.get("time", now - float(stats.get("elapsed_seconds", 0.0) or 0.0))
        dt = now - t_prev
        values: dict[str, float] = {}
        busy = {}
        for i, stage in enumerate(stats.get("stages", ())):
            if "busy_seconds" in stage:
                name = f"{stage.get('stage', 'stage')}#{i}"
                busy[name] = float(stage["busy_seconds"])
                if dt > 0:
                    values[f"busy {name}"] = max(0.0, busy[name] - prev.get("busy", {}).get(name, 0.0)) / dt
        elements = int(stats.get("elements", 0))
        if dt > 0:
            values["elements/s"] = max(0, elements - prev.get("elements", 0)) / dt
        self._pipeline_prev = {"key": key, "time": now, "busy": busy, "elements": elements}
        if values and len(self.counters) < self.max_trace_steps:
            self.counters.append(("input pipeline", now, values))

    # ---- results

    @property
    def step_count(self) -> int:
        return self._count

    def summary(self) -> dict[str, Any]:
        """Aggregates over every step: median seconds per phase, each phase's share, the idle fraction."""
        total = self._totals["total"]
        out: dict[str, Any] = {
            "steps": self._count,
            "samples": self._samples,
            "step_seconds_total": total,
            "step_breakdown": {p: _median(self._medians[p]) for p in (*PHASES, "total")},
            "fractions": {p: (self._totals[p] / total if total > 0 else 0.0) for p in PHASES},
            "accelerator_idle_fraction": self._totals["input_wait"] / total if total > 0 else 0.0,
            "input_wait_seconds": self._totals["input_wait"],
            "communication_note": "forward_backward includes communication that overlapped backward",
        }
        return out

    def _us(self, t: float) -> float:
        return round((self._origin_wall + (t - self._origin_perf)) * 1e6, 3)

    def trace(self) -> dict[str, Any]:
        """The Chrome/Perfetto trace of the recorded steps, spans and pipeline samples."""
        pid = self.rank
        ev: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"worker-{pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        ]
        for track, tid in _TIDS.items():
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

        def x(name: str, start: float, dur: float, track: str, args: dict | None = None) -> None:
            e = {"name": name, "cat": track, "ph": "X", "ts": self._us(start), "dur": round(dur * 1e6, 3),
                 "pid": pid, "tid": _TIDS[track]}
            if args:
                e["args"] = args
            ev.append(e)

        for s in self.steps:
            x("step", s.start, s.total, "steps", {"step": s.step, "samples": s.samples})
            t = s.start
            for phase in _MARKED:
                dur = getattr(s, phase)
                x(phase, t, dur, _TRACK[phase], {"step": s.step})
                if phase == "forward_backward" and s.communication > 0:
                    # measured length, approximate place: the end of backward, where DDP's last buckets reduce
                    c = min(s.communication, dur) if dur > 0 else s.communication
                    x("communication", t + dur - c, s.communication, "communication",
                      {"step": s.step, "seconds": s.communication, "placement": "approximate"})
                t += dur
        for name, start, dur, args in self.spans:
            x(name, start, dur, "input" if name == "input_wait" else "trainer", dict(args) or None)
        for name, t, values in self.counters:
            ev.append({"name": name, "ph": "C", "ts": self._us(t), "pid": pid, "tid": _TIDS["input pipeline"],
                       "args": {k: round(v, 6) for k, v in values.items()}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"producer": "conveyor.train.profiler", "rank": pid}}

    def write_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write `trace()` to `path` atomically (`conveyor.fileio.atomic_write`) and return the path."""
        return atomic_write(path, json.dumps(self.trace(), separators=(",", ":")).encode())


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# plots

# category -> (colour, the trace event names that belong to it)
_CATEGORIES = {
    "input wait (CPU input work)": ("tab:orange", ("input_wait",)),
    "compute (forward+backward)": ("tab:blue", ("forward_backward",)),
    "communication": ("tab:green", ("communication",)),
    "optimizer": ("tab:purple", ("optimizer",)),
    "eval / checkpoint / other": ("tab:gray", None),  # every other span on the trainer track
}


def _pyplot():
    """pyplot drawing into files, or None (said once on stderr) when the `plots` extra is missing."""
    matplotlib = optional_import("matplotlib", skipped="the plots (plots/*.png)", extra="plots")
    if matplotlib is None:
        return None
    matplotlib.use("Agg", force=False)  # files only; never open a window from a training job
    import matplotlib.pyplot as plt

    return plt


def _load_trace(trace: Mapping[str, Any] | str | os.PathLike[str] | Iterable[StepTimes]) -> dict[str, Any]:
    if isinstance(trace, (str, os.PathLike)):
        return json.loads(Path(trace).read_text())
    if isinstance(trace, Mapping):
        return dict(trace)
    prof = StepProfiler()  # a list of StepTimes: rebuild a trace around them
    prof.steps = list(trace)
    if prof.steps:
        prof._origin_perf, prof._origin_wall = prof.steps[0].start, 0.0
    return prof.trace()


def plot_timeline(trace: Mapping[str, Any] | str | os.PathLike[str] | Iterable[StepTimes],
                  path: str | os.PathLike[str], *, max_seconds: float | None = None) -> Path | None:
    """Draw the timeline of one worker: one row of bars (`broken_barh`) per category over time.

    `trace`: a `StepProfiler.trace()` dict, a path to a trace JSON, or a list of `StepTimes`.
    The rows show when the loop waited for input (the CPU input pipeline was the bottleneck), when
    it computed, communicated and stepped the optimizer, and other work (evaluation, checkpoints).
    When the trace holds input-pipeline counters, a second panel plots each stage's busy fraction
    (the CPU input work running in the background) over the same time axis. `max_seconds` clips
    the time axis (a long run's bars are thinner than a pixel otherwise). Returns None, drawing
    nothing, without matplotlib.
    """
    plt = _pyplot()
    if plt is None:
        return None
    data = _load_trace(trace)
    events = [e for e in data.get("traceEvents", ()) if e.get("ph") == "X" and e.get("name") != "step"]
    counters = [e for e in data.get("traceEvents", ()) if e.get("ph") == "C"]
    times = [e["ts"] for e in events] + [e["ts"] for e in counters]
    t0 = min(times) if times else 0.0

    rows: dict[str, list[tuple[float, float]]] = {c: [] for c in _CATEGORIES}
    for e in events:
        start, dur = (e["ts"] - t0) / 1e6, e.get("dur", 0.0) / 1e6
        if max_seconds is not None and start > max_seconds:
            continue
        cat = next((c for c, (_, names) in _CATEGORIES.items() if names and e["name"] in names),
                   "eval / checkpoint / other")
        rows[cat].append((start, max(dur, 1e-6)))

    panels = 2 if counters else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12, 3.2 + 2.2 * (panels - 1)), sharex=True, squeeze=False)
    ax = axes[0][0]
    names = list(_CATEGORIES)
    for i, cat in enumerate(names):
        colour = _CATEGORIES[cat][0]
        if rows[cat]:
            ax.broken_barh(rows[cat], (len(names) - 1 - i - 0.4, 0.8), facecolors=colour, edgecolor="none")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(list(reversed(names)))
    ax.set_ylim(-0.6, len(names) - 0.4)
    pid = (data.get("otherData") or {}).get("rank", "?")
    ax.set_title(f"worker {pid}: where the training loop's time goes")
    ax.grid(axis="x", alpha=0.3)
    if counters:
        cax = axes[1][0]
        series: dict[str, list[tuple[float, float]]] = {}
        for e in counters:
            t = (e["ts"] - t0) / 1e6
            if max_seconds is not None and t > max_seconds:
                continue
            for k, v in e.get("args", {}).items():
                if k.startswith("busy "):
                    series.setdefault(k[5:], []).append((t, v))
        for name, pts in series.items():
            cax.step([p[0] for p in pts], [p[1] for p in pts], where="pre", label=name)
        cax.set_ylabel("input stage busy\n(cores)")
        if series:
            cax.legend(loc="upper right", fontsize="small")
        cax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds since the first event")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_step_breakdown(steps: Sequence[StepTimes], path: str | os.PathLike[str], *,
                        max_bars: int = 400) -> Path | None:
    """Stacked bars of each step's phases (input wait, forward+backward, optimizer, other), with
    the measured communication as a line: a step whose orange part is large waited for data.

    More than `max_bars` steps are averaged in equal groups so the bars stay readable. Returns
    None, drawing nothing, without matplotlib.
    """
    plt = _pyplot()
    if plt is None:
        return None
    steps = list(steps)
    if not steps:
        fig, ax = plt.subplots(figsize=(12, 4))
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return _save(fig, plt, path)
    groups: list[list[StepTimes]] = [[s] for s in steps]
    if len(steps) > max_bars:
        size = -(-len(steps) // max_bars)
        groups = [steps[i : i + size] for i in range(0, len(steps), size)]
    xs = [g[0].step for g in groups]
    mean = lambda g, attr: sum(getattr(s, attr) for s in g) / len(g) * 1e3  # ms
    fig, ax = plt.subplots(figsize=(12, 4))
    bottom = [0.0] * len(groups)
    width = (xs[1] - xs[0]) * 0.9 if len(xs) > 1 else 0.8
    for attr, label, colour in (
        ("input_wait", "input wait", "tab:orange"),
        ("forward_backward", "forward+backward (incl. overlapped comm.)", "tab:blue"),
        ("optimizer", "optimizer", "tab:purple"),
        ("other", "other", "tab:gray"),
    ):
        heights = [mean(g, attr) for g in groups]
        ax.bar(xs, heights, width=width, bottom=bottom, label=label, color=colour, align="edge")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    comm = [mean(g, "communication") for g in groups]
    if any(comm):
        ax.plot([x + width / 2 for x in xs], comm, color="tab:green", label="communication (measured)")
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.set_title("step time breakdown" + (f" (mean of {len(groups[0])} steps per bar)" if len(groups[0]) > 1 else ""))
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path
