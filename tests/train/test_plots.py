"""The plots: drawn from a trace, a trace file or steps; labelled in the user's terms; the worker named."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.data import Dataset
from conveyor.train.plots import (
    plot_step_breakdown,
    plot_timeline,
    stage_label,
    stage_labels,
    step_breakdown_figure,
    timeline_figure,
)
from conveyor.train.profiler import StepProfiler, StepTimes
from train.test_profiler import Clock, profile

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG


def test_plots_from_a_trace_a_trace_file_or_steps(tmp_path):
    prof = profile(steps=6)
    prof.sample_pipeline({"elements": 5, "elapsed_seconds": 1.0, "stages": [{"stage": "map", "busy_seconds": 0.4}]})
    trace_file = prof.write_trace(tmp_path / "worker-3.json")
    assert is_png(plot_timeline(prof.trace(), tmp_path / "plots" / "timeline.png"))  # with the counter panel
    assert is_png(plot_timeline(trace_file, tmp_path / "from-file.png", max_seconds=0.3))
    assert is_png(plot_timeline(prof.steps, tmp_path / "from-steps.png"))
    assert is_png(plot_step_breakdown(prof.steps, tmp_path / "plots" / "step_breakdown.png"))
    many = [StepTimes(i, i * 0.1, 0.01, 0.05, 0.0, 0.01, 0.07, 4) for i in range(1, 1001)]
    assert is_png(plot_step_breakdown(many, tmp_path / "many.png", max_bars=50))  # averaged in groups
    assert is_png(plot_step_breakdown([], tmp_path / "none.png"))
    assert not list(tmp_path.rglob(".*tmp*"))  # written through temporary names, nothing left behind


# ---- labels


@pytest.mark.parametrize(("stage", "label"), [
    ("prefetch#6", "prefetch"),
    ("map_batch[processes]#4", "map + batch (processes)"),
    ("map[threads]#2", "map (threads)"),
    ("map#1", "map"),
    ("from_tensor_slices#0", "from_tensor_slices"),
    ("interleave", "interleave"),
])
def test_a_stage_is_labelled_as_the_user_wrote_it(stage, label):
    assert stage_label(stage) == label


def test_stages_that_read_alike_are_numbered_in_pipeline_order():
    labels = stage_labels(["map[threads]#12", "prefetch#13", "map[threads]#3", "map[processes]#7"])
    assert labels == {"map[threads]#3": "map (threads) 1", "map[processes]#7": "map (processes)",
                      "map[threads]#12": "map (threads) 2", "prefetch#13": "prefetch"}
    assert list(labels) == ["map[threads]#3", "map[processes]#7", "map[threads]#12", "prefetch#13"]


def test_the_data_layers_own_stage_names_get_plain_labels():
    ds = Dataset.range(32).map(lambda x: x + 1, 2, use_processes=False).map(lambda x: x * 2, 2, use_processes=False)
    it = iter(ds.batch(8).prefetch(2))
    list(it)
    names = [f"{s['stage']}#{i}" for i, s in enumerate(it.stats()["stages"])]
    assert list(stage_labels(names).values()) == ["range", "map (threads) 1", "map (threads) 2", "batch", "prefetch"]


def pipeline_profile() -> StepProfiler:
    """A rank-3 profile whose pipeline samples name stages as a process-map pipeline does."""
    clock = Clock()
    prof = StepProfiler(rank=3, clock=clock)
    prof.start()
    for step in (1, 2):
        prof.begin_step()
        clock.advance(0.1)
        prof.mark("input_wait")
        prof.end_step(step, samples=4)
    stages = [{"stage": "from_tensor_slices"}, {"stage": "map[processes]", "busy_seconds": 0.2},
              {"stage": "map[processes]", "busy_seconds": 0.1}, {"stage": "map_batch[processes]", "busy_seconds": 0.3},
              {"stage": "prefetch", "busy_seconds": 0.05}]
    for k in range(1, 3):
        clock.advance(0.5)
        prof.sample_pipeline({"elements": 4 * k, "elapsed_seconds": 0.5 * k,
                              "stages": [{**s, "busy_seconds": s["busy_seconds"] * k} if "busy_seconds" in s else s
                                         for s in stages]})
    return prof


def test_the_timeline_legend_shows_stages_as_the_user_wrote_them():
    fig = timeline_figure(pipeline_profile().trace())
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["map (processes) 1", "map (processes) 2", "map + batch (processes)", "prefetch"]


# ---- whose view


def test_both_titles_say_which_workers_view_they_show():
    prof = pipeline_profile()
    timeline = timeline_figure(prof.trace()).axes[0].get_title()
    breakdown = step_breakdown_figure(prof.steps, rank=3).axes[0].get_title()
    for title in (timeline, breakdown):
        assert "worker 3's view" in title and "rank 3" in title, title
    assert "worker 3" in step_breakdown_figure([], rank=3).axes[0].get_title()
    assert "rank unknown" in timeline_figure(prof.steps).axes[0].get_title()  # steps alone do not say whose
    assert "worker 7's view" in timeline_figure(prof.steps, rank=7).axes[0].get_title()


# ---- what is clipped


def steps_with_stalls(n: int = 50, stalls: tuple[int, ...] = (5, 20, 40)) -> list[StepTimes]:
    """`n` steps of 70 ms, of which `stalls` waited 7 s longer for input."""
    return [StepTimes(i, i * 0.1, 7.03 if i in stalls else 0.01, 0.05, 0.0, 0.01, 7.1 if i in stalls else 0.07, 4)
            for i in range(1, n + 1)]


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_bars_clipped_by_the_y_axis_are_marked_and_counted():
    ax = step_breakdown_figure(steps_with_stalls()).axes[0]
    bottom, top = ax.get_ylim()
    assert top == pytest.approx(140)  # twice the 95th percentile (70 ms): the 70 ms bars fill half the height
    assert "3 steps above 140 ms clipped, max 7.1 s" in legend_texts(ax)
    [marks] = [line for line in ax.get_lines() if line.get_marker() == "^"]
    assert list(marks.get_xdata()) == pytest.approx([5.45, 20.45, 40.45])  # the middle of each clipped bar
    assert list(marks.get_ydata()) == pytest.approx([140] * 3) and not marks.get_clip_on()


def test_averaged_bars_are_counted_as_bars_and_nothing_is_clipped_without_outliers():
    ax = step_breakdown_figure(steps_with_stalls(1000, stalls=(500,)), max_bars=50).axes[0]
    assert any(t.startswith("1 bar above") for t in legend_texts(ax))
    assert "mean of 20 steps per bar" in ax.get_title()
    even = step_breakdown_figure(steps_with_stalls(stalls=())).axes[0]
    assert not [t for t in legend_texts(even) if "clipped" in t]
    assert even.get_ylim()[1] >= 70
    assert not [line for line in even.get_lines() if line.get_marker() == "^"]


def test_the_title_says_when_the_profiler_kept_only_the_first_steps():
    ax = step_breakdown_figure(steps_with_stalls(), rank=0, total_steps=1250).axes[0]
    assert "showing the first 50 of 1,250 steps" in ax.get_title()
    assert "showing" not in step_breakdown_figure(steps_with_stalls(), total_steps=50).axes[0].get_title()


def test_the_timeline_says_when_its_time_axis_is_cut():
    trace = profile(steps=6).trace()
    assert "the first 0.3 s of 0.794 s shown" in timeline_figure(trace, max_seconds=0.3).axes[-1].get_xlabel()
    assert "shown" not in timeline_figure(trace).axes[-1].get_xlabel()
