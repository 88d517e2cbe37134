"""The pipeline's figures for ``summary.json``: per-stage compute, wait, and the bubble, measured and in theory.

Each process reports its stage's totals over the run (:class:`~.runner.StageRunner` ``seconds``):
``compute`` (its forward, loss and backward chunks), ``window`` (the wall time from the latest
stage's schedule start to the latest one's end: the same for every stage of a pipeline),
``start_wait`` (time its schedule ran before the latest one started: waiting for a slower
optimizer step or data load, not the schedule's doing) and ``steps``. The window beyond compute
is waiting for the previous stage's activations, the next stage's gradients, a send to complete,
or the pipeline to drain — the send/receive wait. Its share of the window is the stage's
*measured bubble*, next to GPipe's and 1F1B's (S−1)/(M+S−1), which assumes equal stages and free
communication; a slow stage shows as more wait on the others. Replicas of a stage are averaged.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pipeline_figures", "theoretical_bubble"]


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """The idle share of each stage with equal stages and free communication: (S−1)/(M+S−1)."""
    return (stages - 1) / (microbatches + stages - 1)


def pipeline_figures(reports: list[dict[str, Any]], *, stages: int, microbatches: int, schedule: str,
                     split: list[list[str]]) -> dict[str, Any]:
    """``summary["pipeline"]`` from every process's report (``stage``, ``compute``, ``window``, ``start_wait``,
    ``steps``)."""
    per_stage = []
    for s in range(stages):
        mine = [r for r in reports if r["stage"] == s and r["steps"]]
        steps = sum(r["steps"] for r in mine)
        compute = sum(r["compute"] for r in mine)
        late = sum(r["start_wait"] for r in mine)
        wall = sum(r["window"] for r in mine)
        wait = max(0.0, wall - compute)
        per_stage.append({
            "stage": s,
            "layers": split[s],
            "compute_seconds_per_step": compute / steps if steps else None,
            "send_recv_wait_seconds_per_step": wait / steps if steps else None,
            "start_wait_seconds_per_step": late / steps if steps else None,
            "bubble_fraction": wait / wall if wall > 0 else None,
        })
    measured = [st["bubble_fraction"] for st in per_stage if st["bubble_fraction"] is not None]
    return {
        "stages": stages,
        "replicas": len(reports) // stages if stages else 0,
        "microbatches": microbatches,
        "schedule": schedule,
        "theoretical_bubble_fraction": theoretical_bubble(stages, microbatches),
        "measured_bubble_fraction": sum(measured) / len(measured) if measured else None,
        "per_stage": per_stage,
    }
