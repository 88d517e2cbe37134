"""Splitting a model into pipeline stages: balance, names, the start-up table and every bad split's error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.strategies.pipeline.runner import check_schedule, schedule_class
from conveyor.strategies.pipeline.split import (
    SplitError,
    check_microbatches,
    default_microbatches,
    meta_copy,
    plan_split,
)


def mlp(widths=(4, 64, 64, 2)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_stage_count_balances_parameter_bytes() -> None:
    # sizes in floats: 0:[10x10] 1:[10x10] 2:[10x10] 3:[10x30]: the heavy last layer stands alone
    model = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False),
                          nn.Linear(10, 10, bias=False), nn.Linear(10, 30, bias=False))
    assert plan_split(model, stages=2).stages == (("0", "1", "2"), ("3",))
    assert plan_split(model, stages=4).stages == (("0",), ("1",), ("2",), ("3",))
    assert plan_split(model, stages=1).stages == (("0", "1", "2", "3"),)


def test_split_points_cut_before_names_and_open_nested_sequentials() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), nn.Linear(4, 2))
    assert plan_split(model, split_points=["1"]).stages == (("0",), ("1", "2"))
    assert plan_split(model, split_points=["1.2", "2"], stages=3).stages == (("0", "1.0", "1.1"), ("1.2",), ("2",))


def test_stage_modules_compose_to_the_model_and_speak_its_key_names() -> None:
    torch.manual_seed(0)
    model = mlp()
    plan = plan_split(model, stages=3)
    stages = [plan.stage_module(model, i) for i in range(3)]
    x = torch.randn(5, 4)
    y = x
    for stage in stages:
        y = stage(y)
    assert torch.equal(y, model(x))
    keys = [k for s in stages for k in s.model_state_dict()]
    assert sorted(keys) == sorted(model.state_dict())
    twin = plan.stage_module(mlp(), 2)
    twin.load_model_state_dict(stages[2].model_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), stages[2].parameters(), strict=True))
    with pytest.raises(KeyError, match="does not match"):
        twin.load_model_state_dict(stages[1].model_state_dict())


def test_meta_copy_gives_shapes_without_touching_the_model() -> None:
    model = mlp()
    copy = meta_copy(model)
    assert copy(torch.empty(7, 4, device="meta")).shape == (7, 2)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(p.device.type == "meta" for p in copy.parameters())


def test_the_start_up_table_names_layers_bytes_and_activations() -> None:
    model = mlp()
    plan = plan_split(model, stages=2)
    table = plan.describe(model, [1024, 2048])
    assert "stage" in table and "parameters" in table and "1.0 KiB" in table and "2.0 KiB" in table
    assert "?" in plan.describe(model)
    assert plan.signature() == [list(s) for s in plan.stages]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stages": 9}, r"--stages 9 but the model has 5 layer\(s\).*use --stages 5 or fewer"),
    ({"stages": 0}, r"stages = 0; expected a whole number >= 1"),
    ({"split_points": ["nope"]}, r"split point 'nope' is not a layer of the model; the layers you can cut before"),
    ({"split_points": ["0"]}, r"leave the first stage empty"),
    ({"split_points": ["2", "2"]}, r"leave the stage after '2' empty"),
    ({"split_points": ["4", "2"]}, r"leave the stage after '4' empty"),
    ({"split_points": []}, r"name at least one layer"),
    ({"split_points": ["2"], "stages": 3}, r"--stages 3 but 1 split point\(s\) \['2'\] make 2 stages"),
    ({}, r"needs a split: --stages S"),
])
def test_every_bad_split_names_the_value_and_the_fix(kwargs, message) -> None:
    with pytest.raises(SplitError, match=message):
        plan_split(mlp(), **kwargs)


def test_a_stage_count_alone_cannot_cut_a_model_that_is_not_sequential() -> None:
    class Net(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(SplitError, match=r"--stages 2 alone cuts an nn.Sequential between its layers, and the model is "
                                         r"a Net.*name where each later stage begins instead, as split points "
                                         r"\(conveyor run --split blocks.2,head, or job.prepare"):
        plan_split(Net(), stages=2)


def test_a_batch_must_cut_into_equal_microbatches() -> None:
    assert check_microbatches(32, 4) == 8
    with pytest.raises(SplitError, match=r"a batch of 30 sample\(s\) cannot be cut into --microbatches 4 .*"
                                         r"multiple of 4 \(e.g. 28 or 32\), or --microbatches 3.*drop_remainder"):
        check_microbatches(30, 4)
    with pytest.raises(SplitError, match=r"a batch of 2 sample\(s\).*--microbatches 2"):
        check_microbatches(2, 4)


def test_1f1b_with_fewer_microbatches_than_stages_is_refused_naming_the_flags() -> None:
    """torch's own refusal came at the first step, naming no flag (found by --microbatches 1 on 2 stages)."""
    check_schedule(schedule_class("1f1b"), 2, 2)
    check_schedule(schedule_class("gpipe"), 1, 2)  # GPipe runs any number
    with pytest.raises(SplitError, match=r"--schedule 1f1b on 2 stages needs 2 microbatches or more per batch "
                                         r"\(--microbatches 1\): give --microbatches 2 or more, .*--schedule gpipe"):
        check_schedule(schedule_class("1f1b"), 1, 2)
    with pytest.raises(SplitError, match=r"on 3 stages .*\(a batch of 7 cut into 1\)"):  # a fitted count
        check_schedule(schedule_class("1f1b"), default_microbatches(3, 7), 3, 7)


@pytest.mark.parametrize(("stages", "batch", "expected"), [
    (3, 32, 4),  # the README's digits on 3 stages: 2 x 3 = 6 does not divide 32 (issue 22, defect 7)
    (2, 32, 4), (4, 32, 8), (2, 8, 4),  # 2 per stage wherever that divides the batch
    (3, 7, 1), (2, 3, 3), (3, 30, 6),
    (3, None, 6),  # no batch seen yet (an evaluation first): 2 per stage
])
def test_the_default_microbatches_cut_the_batch_into_equal_parts(stages, batch, expected) -> None:
    chosen = default_microbatches(stages, batch)
    assert chosen == expected
    if batch is not None:
        assert check_microbatches(batch, chosen) == batch // chosen


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_the_stage_optimizer_is_the_same_class_and_hyperparameters_over_the_stage(cls) -> None:
    from conveyor.strategies.pipeline.strategy import _stage_optimizer

    model = mlp()
    optimizer = cls(model.parameters(), lr=0.01, weight_decay=0.1)  # AdamW records a default AdamW() refuses
    stage = _stage_optimizer(optimizer, model[2])
    assert type(stage) is cls and [len(g["params"]) for g in stage.param_groups] == [2]
    assert {k: v for k, v in stage.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
