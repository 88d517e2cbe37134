"""The parameter servers' update rules alone (no sockets, no optimizer): what each applies when, what it
holds back, and the staleness bound."""

from __future__ import annotations

import pytest
import torch

from conveyor.strategies.ps.rules import AsyncRule, SspRule, SyncRule, make_rule


def grads(value: float, keys=("a", "b")) -> dict[str, torch.Tensor]:
    return {k: torch.full((3,), value) for k in keys}


def test_make_rule_names_each_mode_and_refuses_others() -> None:
    assert isinstance(make_rule("sync", 2), SyncRule) and isinstance(make_rule("async", 2), AsyncRule)
    rule = make_rule("ssp", 2, staleness=3)
    assert isinstance(rule, SspRule) and rule.bound == 3 and rule.name == "ssp"
    with pytest.raises(ValueError, match="expected 'sync', 'async' or 'ssp'"):
        make_rule("hogwild", 2)
    with pytest.raises(ValueError, match=">= 0"):
        SspRule(2, -1)


def test_sync_holds_every_push_until_all_workers_committed_then_applies_the_rank_ordered_mean_once() -> None:
    rule = SyncRule(2)
    assert rule.push(1, 0, 0, grads(3.0)) is None and rule.push(0, 0, 0, grads(1.0)) is None
    assert rule.push(0, 0, 0, grads(5.0, keys=("a",))) is None  # a second push of a piece replaces the first
    assert rule.commit(0, 0, 0, order=["a", "b"]) is None  # worker 1 has not committed
    assert not rule.ready(1) and rule.ready(0) and rule.version == 0
    applied = rule.commit(1, 0, 0, order=["b", "a"])
    assert list(applied) == ["b", "a"]  # in the order given, whatever the arrival order
    assert torch.equal(applied["a"], torch.full((3,), 4.0)) and torch.equal(applied["b"], torch.full((3,), 2.0))
    assert rule.version == 1 and rule.ready(1) and not rule.ready(2)
    assert rule.clocks.clock == [1, 1] and rule.clocks.total == 2
    assert rule.staleness == {0: 2}  # per commit
    with pytest.raises(ValueError, match="already applied"):
        rule.push(0, 0, 0, grads(1.0))


def test_sync_gives_a_worker_without_a_piece_a_zero_gradient_and_a_step_without_pushes_an_empty_update() -> None:
    rule = SyncRule(2)
    rule.push(0, 0, 0, grads(2.0, keys=("a",)))
    rule.commit(0, 0, 0, order=["a", "b"])
    applied = rule.commit(1, 0, 0, order=["a", "b"])
    assert list(applied) == ["a"] and torch.equal(applied["a"], torch.full((3,), 1.0))
    rule.commit(0, 1, 1, order=["a"])
    assert rule.commit(1, 1, 1, order=["a"]) == {} and rule.version == 2  # an update, of nothing


def test_async_applies_every_push_on_arrival_and_answers_every_pull() -> None:
    rule = AsyncRule(2)
    g = grads(1.0)
    assert rule.push(0, 5, 2, g) is g
    assert rule.commit(0, 5, 2, order=["a", "b"]) is None  # a commit only moves the clock
    assert rule.clocks.clock == [6, 0] and rule.version == 0
    assert rule.ready(1000)
    assert rule.staleness == {3: 1}  # per push: step - read


def test_ssp_answers_a_pull_up_to_k_steps_ahead_of_the_slowest_worker_and_holds_it_beyond() -> None:
    rule = SspRule(3, bound=2)
    for step in range(3):
        assert rule.push(0, step, 0, grads(1.0)) is not None  # pushes are applied on arrival, as async
        rule.commit(0, step, 0, order=["a"])
    rule.commit(1, 0, 0, order=["a"])
    assert rule.clocks.clock == [3, 1, 0] and rule.version == 0
    assert rule.ready(2) and not rule.ready(3)  # the slowest (worker 2) is at 0: K = 2 steps ahead at most
    rule.commit(2, 0, 0, order=["a"])
    assert rule.ready(3) and not rule.ready(4)  # now the slowest is at 1
    assert rule.staleness == {0: 1, 1: 1, 2: 1}


def test_ssp_a_worker_that_is_done_bounds_nobody() -> None:
    rule = SspRule(2, bound=0)
    rule.commit(0, 0, 0, order=[])
    assert not rule.ready(1)  # worker 1 is at 0
    rule.clocks.done.add(1)
    assert rule.ready(1) and not rule.ready(2)  # worker 0 is now the slowest still training
    rule.clocks.done.add(0)
    assert rule.ready(50)


def test_ssp_once_the_commits_reach_the_announced_plan_no_pull_waits() -> None:
    # The ps-ssp final-evaluation stall (K = 1, the workers stop at 5 steps together): worker 0's commit of
    # its step 1 reaches the plan, so worker 0 stops; worker 1, whose last reply still said 4, trains one
    # more step and pulls for step 4 behind its commit, two steps ahead of worker 0 -- which will never
    # commit again. That pull must be answered, not held until the job's timeout.
    rule = SspRule(2, bound=1)
    rule.clocks.announce(0, 5)
    rule.clocks.announce(1, 5)
    for rank, step in ((1, 0), (0, 0), (1, 1), (1, 2)):
        rule.commit(rank, step, 0, order=[])
    assert rule.clocks.total == 4 and not rule.ready(3)  # 3 - 1 > K: held while worker 0 trains
    rule.commit(0, 1, 0, order=[])
    assert not rule.clocks.training(0) and rule.ready(3)
    rule.commit(1, 3, 1, order=[])
    assert rule.clocks.clock == [2, 4] and rule.ready(4)  # 4 - 2 > K, but nobody will ever commit again


def test_ssp_a_worker_that_reached_its_own_smaller_plan_bounds_nobody() -> None:
    # Workers work out their totals from their own shards: worker 0 stops at 4, worker 1 goes on to 8.
    rule = SspRule(2, bound=0)
    rule.clocks.announce(0, 4)
    rule.clocks.announce(1, 8)
    for step in range(2):
        rule.commit(0, step, 0, order=[])
        rule.commit(1, step, 0, order=[])
    assert rule.clocks.plan == 8 and not rule.clocks.training(0) and rule.clocks.training(1)
    rule.commit(1, 2, 0, order=[])
    assert rule.ready(3) and not rule.ready(4)  # worker 1 is bounded by itself only
    rule.commit(1, 3, 0, order=[])
    rule.commit(1, 4, 0, order=[])
    assert rule.clocks.total == 7 and rule.clocks.training(1)
    rule.commit(1, 5, 0, order=[])
    assert not rule.clocks.training(1) and rule.clocks.slowest_training() is None and rule.ready(100)


def test_a_worker_that_announced_nothing_stops_at_the_largest_plan() -> None:
    rule = SspRule(3, bound=0)
    rule.clocks.announce(0, 3)
    rule.clocks.announce(1, 6)
    assert rule.clocks.plan == 6
    for step in range(3):
        rule.commit(2, step, 0, order=[])
    assert rule.clocks.training(2) and not rule.clocks.training(0) and rule.clocks.training(1)
