"""StepProfiler: exact phase accounting on a fake clock, Chrome trace shape (the plots: test_plots.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conveyor.train.profiler import PHASES, StepProfiler, StepTimes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def profile(steps: int = 4, wait: float = 0.03, fb: float = 0.05, opt: float = 0.02, comm: float = 0.01):
    """A profiler fed `steps` steps of known phase lengths (every 2nd step waits twice as long)."""
    clock = Clock()
    prof = StepProfiler(rank=3, clock=clock)
    prof.start()
    for step in range(1, steps + 1):
        prof.begin_step()
        clock.advance(wait * (2 if step % 2 == 0 else 1))
        prof.mark("input_wait")
        clock.advance(fb)
        prof.mark("forward_backward")
        clock.advance(opt)
        prof.mark("optimizer")
        prof.end_step(step, samples=8, comm_seconds=comm)
        if step == 2:
            with prof.span("checkpoint", step=step):
                clock.advance(0.1)
    prof.begin_step()
    clock.advance(0.004)
    prof.cancel_step()  # the data ran out: a wait, but no step
    return prof


def test_phases_and_summary_are_exact():
    prof = profile()
    assert prof.step_count == 4 and len(prof.steps) == 4
    first = prof.steps[0]
    assert first == StepTimes(step=1, start=100.0, input_wait=pytest.approx(0.03), forward_backward=pytest.approx(0.05),
                              communication=0.01, optimizer=pytest.approx(0.02), total=pytest.approx(0.1), samples=8)
    assert first.other == pytest.approx(0.0, abs=1e-12)
    s = prof.summary()
    assert s["steps"] == 4 and s["samples"] == 32
    assert s["step_breakdown"]["input_wait"] == pytest.approx(0.045)  # median of 0.03, 0.06, 0.03, 0.06
    assert s["step_breakdown"]["forward_backward"] == pytest.approx(0.05)
    assert s["step_breakdown"]["communication"] == pytest.approx(0.01)
    assert s["step_breakdown"]["total"] == pytest.approx(0.115)
    total = 0.1 + 0.13 + 0.1 + 0.13  # the checkpoint and the final wait are outside every step
    assert s["accelerator_idle_fraction"] == pytest.approx(0.18 / total)
    assert s["fractions"]["forward_backward"] == pytest.approx(0.2 / total)
    assert set(s["fractions"]) == set(PHASES)


def test_trace_is_chrome_json_with_every_phase(tmp_path):
    prof = profile()
    path = prof.write_trace(tmp_path / "trace" / "worker-3.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in slices} == {"step", *PHASES, "checkpoint", "input_wait"}
    for e in slices:
        assert e["pid"] == 3 and isinstance(e["tid"], int) and e["dur"] >= 0 and e["ts"] > 1e15  # µs since 1970
    by_name = {}
    for e in slices:
        by_name.setdefault(e["name"], []).append(e)
    assert len(by_name["step"]) == 4 and len(by_name["forward_backward"]) == 4
    assert by_name["forward_backward"][0]["dur"] == pytest.approx(50_000)
    step, wait, fb = by_name["step"][0], by_name["input_wait"][0], by_name["forward_backward"][0]
    assert wait["ts"] == pytest.approx(step["ts"]) and fb["ts"] == pytest.approx(wait["ts"] + wait["dur"])
    comm = by_name["communication"][0]
    assert comm["args"]["placement"] == "approximate"
    assert comm["ts"] + comm["dur"] == pytest.approx(fb["ts"] + fb["dur"])  # drawn at the end of backward
    assert [e for e in by_name["input_wait"] if e.get("args", {}).get("end_of_data")]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"steps", "input", "compute", "communication", "trainer"} <= names
    assert any(e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == "worker-3" for e in events)


def test_pipeline_samples_become_counters():
    clock = Clock()
    prof = StepProfiler(clock=clock)
    stats = {"elements": 10, "elapsed_seconds": 1.0, "stages": [
        {"stage": "map", "elements": 10, "busy_seconds": 0.5}, {"stage": "batch", "elements": 10}]}
    prof.sample_pipeline(stats, key=0)
    clock.advance(2.0)
    prof.sample_pipeline({**stats, "elements": 30, "stages": [{"stage": "map", "busy_seconds": 2.5}]}, key=0)
    clock.advance(1.0)
    prof.sample_pipeline({**stats, "elements": 4, "elapsed_seconds": 1.0,
                          "stages": [{"stage": "map", "busy_seconds": 0.25}]}, key=1)  # a new epoch's iterator
    values = [c[2] for c in prof.counters]
    assert values[0] == {"busy map#0": 0.5, "elements/s": 10.0}
    assert values[1] == {"busy map#0": 1.0, "elements/s": 10.0}
    assert values[2] == {"busy map#0": 0.25, "elements/s": 4.0}
    counters = [e for e in prof.trace()["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == 3 and counters[0]["args"] == {"busy map#0": 0.5, "elements/s": 10.0}
    prof.sample_pipeline(None)  # an iterator without stats: nothing
    assert len(prof.counters) == 3
    # the map workers' busy seconds and the batches received, summed over the intervals and both epochs
    busy, batches = prof.input_cost()
    assert busy == pytest.approx(0.5 + 2.0 + 0.25) and batches == 10 + 20 + 4


def test_input_cost_is_unknown_without_a_map_stage_that_reports_busy_time():
    prof = StepProfiler(clock=Clock())
    prof.sample_pipeline({"elements": 5, "elapsed_seconds": 1.0,
                          "stages": [{"stage": "prefetch", "busy_seconds": 3.0}, {"stage": "map[threads]"}]})
    assert prof.input_cost() == (None, 5)


def test_misuse_is_named():
    prof = StepProfiler()
    with pytest.raises(ValueError, match="unknown phase 'backward'"):
        prof.mark("backward")
    with pytest.raises(RuntimeError, match="without begin_step"):
        prof.end_step(1, 8)


def test_only_the_first_steps_are_kept_for_the_trace():
    prof = StepProfiler(max_trace_steps=3, clock=Clock())
    for step in range(10):
        prof.begin_step()
        prof.mark("input_wait")
        prof.end_step(step, 1)
    assert len(prof.steps) == 3 and prof.summary()["steps"] == 10


def test_a_profiler_from_recorded_steps_traces_them_from_the_first():
    steps = profile().steps
    trace = StepProfiler.from_steps(steps, rank=5).trace()
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "step"]
    assert [e["args"]["step"] for e in slices] == [1, 2, 3, 4] and slices[0]["ts"] == 0.0
    assert trace["otherData"]["rank"] == 5


def test_measuring_never_imports_matplotlib():
    code = "import sys, conveyor.train.profiler; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"
