"""Synchronous data parallelism by all-reduce: PyTorch's DistributedDataParallel, timed.

    job = conveyor.init("allreduce")                 # every worker
    model, optimizer = job.prepare(model, optimizer) # model is DDP-wrapped, optimizer returned unchanged
    loss_fn(model(x), y).backward()                  # gradients averaged over all workers in here
    optimizer.step()

What it promises beyond plain DDP: every worker starts from rank 0's parameters and buffers;
:meth:`AllReduceStep.comm_seconds` (``strategy.step``) is the wall time the gradient all-reduces were in
flight (much of it overlapping backward, so not the time it added to the step); a dead or silent peer surfaces as a
``PeerError`` naming its rank and task. Any torch optimizer works unchanged; with one process the model
is returned unwrapped. Why and how: ``docs/strategies.md``, "Data-parallel all-reduce".
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
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

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with collective_guard(self._conveyor_job, "DDP forward (buffer broadcast)"):
            return super().forward(*inputs, **kwargs)


class AllReduceStrategy(Strategy):
    """DistributedDataParallel (gloo on CPU, NCCL on CUDA: one process per device) with a timing comm hook."""

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
        ddp.register_comm_hook(None, self.step.allreduce_hook)
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
    """The plain step, with the gradient all-reduce DDP runs in ``backward`` timed by its comm hook."""

    shadows = True  # zero gradients in DDP's all-reduce: the others' mean over all N workers, as torch's Join

    def __init__(self, job: Any) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._total = 0.0

    def check(self, model: nn.Module, train_data: Any) -> None:
        if self._job.world_size > 1 and not isinstance(model, DistributedDataParallel):
            raise ValueError(
                "the model is not wrapped for the allreduce strategy, so workers would train apart without "
                "averaging gradients: pass the model and optimizer that `job.prepare(model, optimizer)` returned"
            )

    def comm_seconds(self) -> float:
        """Seconds during which a gradient all-reduce was in flight, so far (see the module docstring).

        Read it before and after a step; the difference is that step's communication time. After
        ``backward()`` returns every bucket has completed, so the difference is final then.
        """
        with self._lock:
            if self._in_flight:
                return self._total + (time.perf_counter() - self._busy_since)
            return self._total

    # -- the comm hook ----------------------------------------------------------------------------

    def allreduce_hook(self, process_group, bucket):
        """DDP's comm hook (``register_comm_hook``): DDP's default all-reduce, timed."""
        # No annotations: DDP compares them with dist.GradBucket / Future[Tensor] by identity, and under
        # `from __future__ import annotations` they would be strings and rejected.
        # The arithmetic is DDP's default hook: divide first (no overflow in fp16), then sum in place.
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        self._started()
        try:
            with collective_guard(self._job, "gradient all-reduce"):
                future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        except BaseException:
            self._finished()
            raise

        def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            try:
                with collective_guard(self._job, "gradient all-reduce"):
                    return fut.value()[0]
            finally:
                self._finished()

        return future.then(done)

    def _started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def _finished(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._total += time.perf_counter() - self._busy_since
