"""The end of a training run: every worker's trace, the chief's plots, and the summary every rank returns.

    summary = summarize(job, profiler, run_figures)    # collective: every rank calls it

Global figures (samples, input-wait and accelerator-idle fractions) are summed over ranks;
``step_breakdown`` is this rank's; ``scaling`` is what ``conveyor predict`` reads
(``conveyor.train.scaling_figures``). The chief adds the strategy's own figures (``communication``) and
writes ``<output>/summary.json`` atomically. The keys: ``docs/training.md``, "Outputs". Where known, the
run's tokens/s, mean TFLOPS per device and MFU (over ``wall``, as samples/s) and the peak memory (GiB, the
largest rank's): ``conveyor.train.throughput``. After a restart, ``recovery``: where the stall went
(``conveyor.recovery``; the task parts are the slowest rank's). With a data service (``CONVEYOR_DATA_SERVICE``),
``data_service``: the dispatcher's report (``conveyor.data.service.report.dispatcher_report``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from conveyor import recovery
from conveyor.data.service.report import dispatcher_report
from conveyor.fileio import atomic_write
from conveyor.train.plots import plot_step_breakdown, plot_timeline
from conveyor.train.profiler import StepProfiler
from conveyor.train.scaling_figures import local_counts, scaling_block
from conveyor.train.throughput import Throughput, peak_memory_bytes

__all__ = ["summarize", "write_json_atomic"]


def summarize(job: Any, prof: StepProfiler, *, wall: float, steps: int, epochs: int, eval_result: dict[str, Any],
              resumed_from: int | None, checkpoints: Path, module: torch.nn.Module | None = None,
              throughput: Throughput | None = None, checkpoint_saves: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary (module docstring); writes the trace, and on the chief the plots and summary.json.

    `checkpoint_saves` (this rank's `BackgroundSaves.report()`: blocked and total seconds per save) is kept as is.

    `module` (the user's model, or this rank's stage of it) gives the ``scaling`` block its byte counts.
    """
    out, world = Path(job.output_dir), int(job.world_size)
    figures = prof.summary()
    totals = torch.tensor([figures["samples"], figures["input_wait_seconds"] / max(wall, 1e-9),
                           figures["accelerator_idle_fraction"], *local_counts(module, prof)],
                          dtype=torch.float64, device=torch.device(job.device))
    job.all_reduce(totals)
    samples, wait_fraction_sum, idle_sum, *counts = totals.tolist()
    outputs = _write_trace_and_plots(job, prof, out)
    summary = {
        "strategy": job.strategy.name,
        "world_size": world,
        "steps": steps,
        "epochs": epochs,
        "samples": int(samples),
        "samples_per_second": samples / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        **{k: _finite(v) for k, v in eval_result.items() if k != "eval_samples"},
        "input_wait_fraction": wait_fraction_sum / world,
        "accelerator_idle_fraction": idle_sum / world,
        **(_throughput(job, throughput, wall) if throughput is not None else {}),
        "step_breakdown": figures["step_breakdown"],
        "scaling": scaling_block(counts, job=job, samples=samples, module_known=module is not None),
        "restarts": int(job.restart_count),
        "resumed_from_step": resumed_from,
        "steps_this_run": figures["steps"],
        "checkpoints": str(checkpoints),
        **({"checkpoint_saves": checkpoint_saves} if checkpoint_saves is not None else {}),
        **({"recovery": _recovery(job)} if int(job.restart_count) > 0 else {}),
        "outputs": outputs,
    }
    # Strategies with more to say (parameter servers: push / pull / wait-for-servers seconds, bytes and
    # staleness per server; a pipeline's stages) add it. Collective: before the chief-only part.
    added = job.strategy.report(summary)
    if added:
        summary.update(added)
    if job.is_chief:
        if "recovery" not in summary:  # workers restarted alone in this attempt (ps-async/ssp): the launcher's records
            alone = recovery.block(Path(job.output_dir) / "logs", int(job.restart_count))
            if alone:
                summary["recovery"] = alone
        data_service = dispatcher_report()  # the job's data service's figures (conveyor k8s: none merges them later)
        if data_service is not None:
            summary["data_service"] = data_service
        write_json_atomic(out / "summary.json", summary)
    return summary


def _throughput(job: Any, meter: Throughput, wall: float) -> dict[str, Any]:
    """tokens/s, TFLOPS and MFU where known, and the peak memory (collective: a sum, then a max)."""
    known = [meter.total_tokens is not None, meter.total_flops is not None]
    vec = torch.tensor([meter.total_tokens or 0, meter.total_flops or 0.0, *known], dtype=torch.float64,
                       device=torch.device(job.device))
    job.all_reduce(vec)
    tokens, flops, tokens_known, flops_known = vec.tolist()
    memory = torch.tensor([peak_memory_bytes(job.device)], dtype=torch.float64, device=torch.device(job.device))
    job.all_reduce(memory, op="max")
    world = int(job.world_size)
    figures = meter.figures(flops / world if flops_known else None, tokens if tokens_known else None, wall)
    return {**figures, "peak_memory_gib": memory.item() / 2**30}


def _recovery(job: Any) -> list[dict[str, Any]]:
    """The launcher's restart records with this attempt's task parts (collective: a max over ranks)."""
    times = torch.tensor(recovery.task_times(), dtype=torch.float64, device=torch.device(job.device))
    job.all_reduce(times, op="max")
    return recovery.block(Path(job.output_dir) / "logs", int(job.restart_count), times.tolist())


def _write_trace_and_plots(job: Any, prof: StepProfiler, out: Path) -> dict[str, Any]:
    prof.write_trace(out / "trace" / f"worker-{job.rank}.json")
    plots = [out / "plots" / "timeline.png", out / "plots" / "step_breakdown.png"]
    if job.is_chief and prof.steps:  # a run that had nothing left to do keeps the plots of the run before
        plot_timeline(prof.trace(), plots[0])
        plot_step_breakdown(prof.steps, plots[1], rank=job.rank, total_steps=prof.step_count)
    return {
        "metrics": str(out / "metrics.jsonl"),
        "tensorboard": str(out / "tensorboard"),
        "trace": str(out / "trace"),
        "plots": [str(p) for p in plots if p.exists()],
        "summary": str(out / "summary.json"),
    }


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as indented strict JSON at `path`, atomically (`conveyor.fileio.atomic_write`)."""
    atomic_write(path, (json.dumps(obj, indent=2, allow_nan=False, default=_json_default) + "\n").encode())


def _json_default(x: Any) -> Any:
    raise TypeError(f"summary value of type {type(x).__name__} is not JSON")
