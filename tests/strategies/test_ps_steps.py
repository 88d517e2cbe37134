"""A worker's per-step state alone (no sockets): what a step pushes, computed on which versions, and what the
next step starts from."""

from __future__ import annotations

import torch

from conveyor.strategies.ps.buckets import GradientBuckets
from conveyor.strategies.ps.sharding import place
from conveyor.strategies.ps.steps import StepState


def test_a_steps_pushes_say_its_number_and_the_versions_its_values_were_read_at() -> None:
    placement = place([("w", (4, 8), torch.float32), ("b", (8,), torch.float32)], 2, 32)
    step = StepState(5, [3, 4], GradientBuckets(2, bucket_bytes=1 << 20))
    grad = torch.ones(4, 8)
    step.add("w", placement.split("w", grad))
    grad.add_(1)  # accumulation changes the grad in place: the step keeps the values it was given
    assert step.pushed == {"w"} and not step.buckets.full
    pushes = step.take_pushes(rank=1)
    assert sorted(server for server, _ in pushes) == sorted({p.server for p in placement.pieces_of("w")})
    for server, push in pushes:
        assert (push.rank, push.step, push.read) == (1, 5, [3, 4][server])
        assert all(bool((g == 1).all()) for g in push.grads)
    assert len(step.keep) == sum(len(push.grads) for _, push in pushes)  # alive until the pushes are answered
    assert step.take_pushes(rank=1) == []  # the bucket emptied


def test_the_next_step_reads_where_this_one_did_until_its_pull_lands_and_starts_empty() -> None:
    step = StepState(2, [7, 9], GradientBuckets(2, bucket_bytes=0))
    step.add("b", [])
    nxt = step.next()
    assert (nxt.number, nxt.read, nxt.pushed, nxt.in_flight, nxt.keep) == (3, [7, 9], set(), [], [])
    assert nxt.buckets is not step.buckets and nxt.buckets.bucket_bytes == 0
    nxt.read[0] = 8  # the pull for step 3 landed
    assert step.read == [7, 9]
