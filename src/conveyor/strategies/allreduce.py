"""Synchronous data parallelism by all-reduce: PyTorch's DistributedDataParallel, timed.

    job = conveyor.init("allreduce")                 # every worker
    model, optimizer = job.prepare(model, optimizer) # model is DDP-wrapped, optimizer returned unchanged
    loss_fn(model(x), y).backward()                  # gradients averaged over all workers in here
    optimizer.step()

What it promises beyond plain DDP: every worker starts from rank 0's parameters and buffers;
:meth:`AllReduceStep.comm_seconds` (``strategy.step``) is the wall time of each step's gradient
communication as DDP's own runtime timer measures it (C++, every step; no Python comm hook on the
buckets): from the first bucket's all-reduce launch to backward finding the last one done, much of it
overlapping backward, so not the time it added to the step. A dead or silent peer surfaces as a
``PeerError`` naming its rank and task (in backward: under the Trainer's guard or any ``collective_guard``).
Any torch optimizer works unchanged; with one process the model is returned unwrapped. Why and how:
``docs/strategies.md``, "Data-parallel all-reduce".
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from conveyor.comm.process_group import collective_guard
from conveyor.strategies.base import Step, Strategy, check_optimizer

__all__ = ["AllReduceStep", "AllReduceStrategy"]

# torch 2.13 deprecates `broadcast_buffers` for `forward_sync_buffers` (same meaning for True); older
# torch (>= 2.4, which conveyor supports) only knows the first.
_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
_SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"


class _GuardedDDP(DistributedDataParallel):
    """DDP whose forward-time collectives raise ``PeerError`` (not a bare gloo error) when a peer is gone."""

    def __init__(self, module: nn.Module, *, job: Any, **kwargs: Any) -> None:
        with collective_guard(job, "DDP setup (parameter broadcast from rank 0)"):
            super().__init__(module, **kwargs)
        self._conveyor_job = job
        self.conveyor_steps = 0  # forwards that began a step whose gradients DDP all-reduces (see _CommClock)
        # DDP's runtime timer on every step, not only the first 10 and then every 100th: the communication
        # time of each step (AllReduceStep.comm_seconds) without a Python comm hook on every bucket.
        self._set_ddp_runtime_logging_sample_rate(1)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.conveyor_steps += 1  # DDP's own test for a forward that starts a step it times (_pre_forward)
        with collective_guard(self._conveyor_job, "DDP forward (buffer broadcast)"):
            return super().forward(*inputs, **kwargs)


class AllReduceStrategy(Strategy):
    """DistributedDataParallel (gloo on CPU, NCCL on CUDA: one process per device), its own all-reduce timed."""

    name = "allreduce"

    def setup(self, job: Any) -> None:
        super().setup(job)
        self.step = AllReduceStep(job)

    def prepare(self, model: nn.Module, optimizer: Any, *, split: Sequence[str] | None = None
                ) -> tuple[nn.Module, Any]:
        job = self.job
        check_optimizer(model, optimizer)
        if isinstance(model, DistributedDataParallel):
            raise ValueError("the model is already wrapped in DistributedDataParallel; pass the plain module to "
                             "job.prepare()")
        model = model.to(job.device)
        if job.world_size == 1:
            return model, optimizer
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("the model has no parameter that requires a gradient: there is nothing to all-reduce")
        device_ids = [job.device.index] if job.device.type == "cuda" else None
        ddp = _GuardedDDP(model, job=job, device_ids=device_ids, **{_SYNC_BUFFERS: True})
        self.step.watch(ddp)
        return ddp, optimizer

    def report(self, summary: dict[str, Any]) -> dict[str, Any] | None:
        """``scaling.allreduce_bus_bandwidth`` (bytes/s) of a run of several workers: 2(N-1)/N x gradient bytes /
        communication seconds per step, a lower bound (that time includes the gaps between buckets while
        backward computes)."""
        world = int(self.job.world_size)
        scaling = dict(summary.get("scaling") or {})
        comm = float((summary.get("step_breakdown") or {}).get("communication", 0.0))
        if world < 2 or comm <= 0 or scaling.get("gradient_bytes") is None:
            return None
        scaling["allreduce_bus_bandwidth"] = 2 * (world - 1) / world * scaling["gradient_bytes"] / comm
        return {"scaling": scaling}


class AllReduceStep(Step):
    """The plain step; its communication time is what DDP's own runtime timer measured of each step."""

    shadows = True  # zero gradients in DDP's all-reduce: the others' mean over all N workers, as torch's Join

    def __init__(self, job: Any) -> None:
        self._job = job
        self._clocks: list[_CommClock] = []

    def check(self, model: nn.Module, train_data: Any) -> None:
        if self._job.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise ValueError(
                "the model is not wrapped for the allreduce strategy, so workers would train apart without "
                "averaging gradients: pass the model and optimizer that `job.prepare(model, optimizer)` returned"
            )

    def watch(self, ddp: _GuardedDDP) -> None:
        """Count the communication of `ddp`'s steps in :meth:`comm_seconds` (``prepare`` calls it)."""
        self._clocks.append(_CommClock(ddp))

    def comm_seconds(self) -> float:
        """Seconds of gradient communication of the steps done so far (see the module docstring).

        Read it before and after a step; the difference is that step's communication time, complete once
        ``backward()`` has returned (the step's all-reduces have finished by then). On CUDA, reading it waits
        for the step's all-reduces to finish (DDP's timer is two CUDA events).
        """
        return sum(clock.read() for clock in self._clocks)


class _CommClock:
    """The communication seconds of one DDP model's steps, read from DDP's own runtime timer.

    DDP times every step it samples in C++ (clock reads on CPU, CUDA events on GPU): ``backward_comm_time``
    runs from the launch of the first bucket's all-reduce to the moment backward found the last one done.
    ``_GuardedDDP`` samples every step; DDP itself copies a step's figures into its logging data only at the
    next forward, so a read after a new step asks for the copy (``set_runtime_stats_and_log``) at once. A
    step is counted once, by the time its communication started.
    """

    def __init__(self, ddp: _GuardedDDP) -> None:
        self._ddp = weakref.ref(ddp)  # the clock must not keep a model the user dropped alive
        self._seen_steps = 0
        self._last_start: int | None = None
        self.seconds = 0.0

    def read(self) -> float:
        ddp = self._ddp()
        if ddp is None or ddp.conveyor_steps == self._seen_steps:
            return self.seconds  # no new training forward since the last read: nothing new to count
        self._seen_steps = ddp.conveyor_steps
        ddp.logger.set_runtime_stats_and_log()
        ints = ddp.logger._get_ddp_logging_data().ints_map
        start, took = ints.get("backward_comm_time_start"), ints.get("backward_comm_time")
        if start is not None and took is not None and start != self._last_start:
            self._last_start = start
            self.seconds += took / 1e9
        return self.seconds
