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

`forward_backward` includes communication that overlapped backward; `communication` is reported next
to it, never subtracted. Never imports matplotlib (the plots are `conveyor.train.plots`). What each
number means and the trace's tracks: `docs/training.md`, "Profiling".
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

from conveyor.fileio import atomic_write

__all__ = ["PHASES", "StepProfiler", "StepTimes"]

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
        # The input pipeline's own work, summed over samples (`input_cost`): its map workers' busy seconds
        # and the batches the loop received; None until a map stage reports busy time.
        self._input_busy: float | None = None
        self._input_batches = 0

    @classmethod
    def from_steps(cls, steps: Iterable[StepTimes], rank: int = 0) -> StepProfiler:
        """A profiler holding `steps` (recorded elsewhere), whose `trace()` starts at the first step."""
        prof = cls(rank)
        prof.steps = list(steps)
        if prof.steps:
            prof._origin_perf, prof._origin_wall = prof.steps[0].start, 0.0
        return prof

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
        self._add_input_cost(busy, prev, elements)
        self._pipeline_prev = {"key": key, "time": now, "busy": busy, "elements": elements}
        if values and len(self.counters) < self.max_trace_steps:
            self.counters.append(("input pipeline", now, values))

    def _add_input_cost(self, busy: Mapping[str, float], prev: Mapping[str, Any], elements: int) -> None:
        # Only map stages' busy time is their workers' compute; prefetch's is time spent waiting upstream.
        mapped = {name: value for name, value in busy.items() if name.startswith("map")}
        if mapped:
            before = prev.get("busy", {})
            self._input_busy = (self._input_busy or 0.0) + sum(max(0.0, v - before.get(n, 0.0))
                                                               for n, v in mapped.items())
        self._input_batches += max(0, elements - prev.get("elements", 0))

    def input_cost(self) -> tuple[float | None, int]:
        """(seconds the input pipeline's map workers were busy, batches the loop received) over the sampled
        intervals; the seconds are None when no map stage reports busy time (sequential or thread maps)."""
        return self._input_busy, self._input_batches

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
