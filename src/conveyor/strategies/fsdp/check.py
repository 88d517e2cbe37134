"""The start-up check that FSDP averages gradients on the backend in use, run by every job start.

    check_gradients_averaged(job, mesh)   # collective; GradientAverageError where gradients are not averaged

One tiny known-gradient step: a ``Linear(1, W)`` with all weights 1, sharded one row per rank of the
mesh (all ranks for ``--strategy fsdp``; a stage's replicas for ``--shard-stages``); mesh rank r feeds
``r + 1``, so every weight's gradient is ``r + 1`` on rank r and the average over W ranks is ``(W + 1) / 2``.
An older torch on gloo (2.8-era; pytorch#162338) summed instead, ``W (W + 1) / 2``: training would then
run with a W-times learning rate, silently. With one process there is nothing to
average and the check is skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from conveyor.comm.process_group import collective_guard
from conveyor.errors import ConveyorError

__all__ = ["GradientAverageError", "check_gradients_averaged"]


class GradientAverageError(ConveyorError, RuntimeError):
    """FSDP's gradients are not averaged over the ranks on this torch and backend; the message says what to do."""

    usage_error = True  # the same torch meets it again on a restart


def _probe_gradient(job: Any, mesh: Any) -> torch.Tensor:
    """This rank's shard of the probe's gradient after one step (a seam: the tests make it a sum, as
    pytorch#162338's torch gave, to see the check fail)."""
    world, rank = int(mesh.size()), int(mesh.get_local_rank())
    probe = nn.Linear(1, world, bias=False).to(job.device)
    with torch.no_grad():
        probe.weight.fill_(1.0)
    fully_shard(probe, mesh=mesh)
    x = torch.full((1, 1), float(rank + 1), device=job.device)
    with collective_guard(job, "FSDP gradient-average check"):
        probe(x).sum().backward()
    return probe.weight.grad.to_local().detach().float().cpu()  # this rank's row


def check_gradients_averaged(job: Any, mesh: Any) -> None:
    """Raise :class:`GradientAverageError` unless one known-gradient step of FSDP averages over the ranks."""
    world = int(mesh.size())
    if world < 2:
        return
    got = _probe_gradient(job, mesh)
    mean, total = (world + 1) / 2, world * (world + 1) / 2
    if got.numel() and torch.allclose(got, torch.full_like(got, mean)):
        return
    backend = torch.distributed.get_backend(mesh.get_group())
    seen = "summed them" if got.numel() and torch.allclose(got, torch.full_like(got, total)) else \
        f"gave {got.flatten().tolist()}"
    raise GradientAverageError(
        f"FSDP does not average gradients over the {world} ranks with torch {torch.__version__} on {backend}: a "
        f"known-gradient step expected {mean:g} and {seen} (pytorch#162338), so training would run with a "
        f"{world}x learning rate. Install a newer torch (conveyor is tested with 2.13, which averages), or "
        f"use --strategy allreduce on this one")
