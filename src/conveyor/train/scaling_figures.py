"""The ``scaling`` block of ``summary.json``: what ``conveyor predict`` needs from a run, measured in it.

    local = local_counts(module, prof)            # this rank's counts, summed over ranks by the summary
    block = scaling_block(summed, job=job, samples=samples)

Keys (None where the run could not measure it): ``batch_size`` (samples per step per data-parallel
worker, or per pipeline replica), ``parameter_bytes`` and ``gradient_bytes`` (of the whole model),
``input_core_seconds_per_batch`` (the input pipeline's map workers' busy seconds per batch: its cost on
one core), ``compute_threads`` (torch's intra-op threads), ``cpu_cores`` (cores this process may run
on), ``device`` and ``device_name``. A strategy adds its own through its ``report`` (an ``allreduce`` run of
several workers: ``allreduce_bus_bandwidth``, :meth:`conveyor.strategies.AllReduceStrategy.report`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["local_counts", "scaling_block"]



def local_counts(module: torch.nn.Module | None, prof: Any) -> list[float]:
    """This rank's parameter and gradient bytes, steps, input busy seconds and batches, and whether busy
    time was reported (1.0) — summed over ranks by the caller."""
    params = list(module.parameters()) if module is not None else []
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    busy, batches = prof.input_cost()
    return [float(param_bytes), float(grad_bytes), float(prof.step_count), float(busy or 0.0), float(batches),
            0.0 if busy is None else 1.0]


def scaling_block(summed: list[float], *, job: Any, samples: float, module_known: bool = True) -> dict[str, Any]:
    """The block (module docstring) from `local_counts` summed over every rank of `job`."""
    param_sum, grad_sum, steps_sum, busy, batches, reported = summed
    world = int(job.world_size)
    shards = int(job.data_shard[0]) or 1  # data-parallel workers, or pipeline replicas
    block: dict[str, Any] = {
        # every rank holds a whole model (data parallelism) or one stage of one (pipeline): / shards
        "batch_size": samples / steps_sum * world / shards if steps_sum else None,
        "parameter_bytes": int(param_sum / shards) if module_known else None,
        "gradient_bytes": int(grad_sum / shards) if module_known else None,
        "input_core_seconds_per_batch": busy / batches if reported and batches else None,
        "compute_threads": torch.get_num_threads(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        **_device(torch.device(job.device)),
    }
    return block


def _device(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": device.type, "device_name": name}
