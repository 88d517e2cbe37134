"""The pipeline's summary figures: the bubble is measured over the window the stages share, start waits apart."""

from __future__ import annotations

import pytest

from conveyor.strategies.pipeline.figures import pipeline_figures, theoretical_bubble


def test_bubble_is_idle_over_the_shared_window_and_a_late_start_is_counted_apart() -> None:
    # two steps of a 2-stage pipeline: a 10 s window each; stage 1 computed 8 s per step, stage 0 7 s and
    # also ran 1 s per step before stage 1 started (stage 1's optimizer step was slower)
    reports = [{"stage": 0, "compute": 14.0, "window": 20.0, "start_wait": 2.0, "steps": 2},
               {"stage": 1, "compute": 16.0, "window": 20.0, "start_wait": 0.0, "steps": 2}]
    fig = pipeline_figures(reports, stages=2, microbatches=4, schedule="1f1b", split=[["a"], ["b"]])
    first, second = fig["per_stage"]
    assert first["bubble_fraction"] == pytest.approx(0.3) and second["bubble_fraction"] == pytest.approx(0.2)
    assert first["send_recv_wait_seconds_per_step"] == pytest.approx(3.0)
    assert first["start_wait_seconds_per_step"] == pytest.approx(1.0) and second["start_wait_seconds_per_step"] == 0
    assert first["compute_seconds_per_step"] == pytest.approx(7.0) and first["layers"] == ["a"]
    assert fig["theoretical_bubble_fraction"] == pytest.approx(theoretical_bubble(2, 4)) == pytest.approx(0.2)
    assert fig["measured_bubble_fraction"] == pytest.approx(0.25) and fig["replicas"] == 1


def test_replicas_of_a_stage_are_pooled_and_a_stage_without_steps_has_no_figures() -> None:
    reports = [{"stage": 0, "compute": 6.0, "window": 10.0, "start_wait": 0.0, "steps": 1},
               {"stage": 1, "compute": 0.0, "window": 0.0, "start_wait": 0.0, "steps": 0},
               {"stage": 0, "compute": 8.0, "window": 10.0, "start_wait": 0.0, "steps": 1},
               {"stage": 1, "compute": 0.0, "window": 0.0, "start_wait": 0.0, "steps": 0}]
    fig = pipeline_figures(reports, stages=2, microbatches=2, schedule="gpipe", split=[["a"], ["b"]])
    assert fig["replicas"] == 2
    assert fig["per_stage"][0]["bubble_fraction"] == pytest.approx(0.3)
    assert fig["per_stage"][1]["bubble_fraction"] is None and fig["measured_bubble_fraction"] == pytest.approx(0.3)
