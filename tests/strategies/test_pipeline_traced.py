"""Split points for models that are not an nn.Sequential: the trace, the stages it gives, and every refusal.

One process, meta-device traces (the multi-process numbers: tests/strategies/test_pipeline.py, kind "traced").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._IR import _modify_graph_op_device

from conveyor.strategies.pipeline.split import SplitError, TracedPlan, plan_split
from conveyor.strategies.pipeline.strategy import PipelineStrategy
from conveyor.strategies.pipeline.traced import (
    TracedSplit,
    TracedStage,
    attach_tensors,
    keep_stage,
    stage_nodes,
    stage_rows,
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Branchy(Net):
    def forward(self, x):
        x = self.embed(x)
        if x.sum() > 0:  # a Python branch on a value: torch.export cannot trace it
            x = self.blocks[0](x)
        return self.head(self.norm(self.blocks[1](x)))


class CallsTwice(Net):
    def forward(self, x):
        x = self.blocks[0](self.blocks[0](self.embed(x)))
        return self.head(self.norm(self.blocks[1](x)))


class LongSkip(Net):
    def forward(self, x):
        first = h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h + first))


class Tied(Net):
    def __init__(self) -> None:
        super().__init__(width=4)
        self.out = nn.Linear(4, 4)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(self.blocks[0](self.embed(x)))


def test_a_skip_connection_across_one_cut_is_two_tensors_to_the_next_stage() -> None:
    pipe = trace(LongSkip(), ["blocks.2"])  # the embedding's output goes to stage 1 beside the blocks' output
    assert len(stage_nodes(pipe)) == 2 and len(list(stage_nodes(pipe)[1].all_input_nodes)) == 2


def trace(model: nn.Module, points: list[str], training: bool = True):
    split = TracedSplit(model, plan_split(model, split_points=points))
    return split.trace(torch.empty(2, 4, device="meta"), training)


def test_split_points_of_a_model_with_its_own_forward_make_a_traced_plan() -> None:
    plan = plan_split(Net(), split_points=["blocks.2", "head"], stages=3)
    assert plan == TracedPlan(("blocks.2", "head")) and plan.num_stages == 3
    assert plan.signature() == {"split_points": ["blocks.2", "head"]}
    assert plan.short() == "input.. | blocks.2.. | head.."


def test_the_traced_stages_keep_the_models_names_and_compose_to_its_forward() -> None:
    torch.manual_seed(0)
    model = Net()
    pipe = trace(model, ["blocks.2", "head"])
    rows = stage_rows(pipe)
    assert [layers for layers, _, _ in rows] == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm"],
                                                 ["head"]]
    assert [acts for _, _, acts in rows] == [2 * 8 * 4, 2 * 8 * 4, 2 * 1 * 4]  # float32 outputs of a 2-row microbatch
    assert sum(size for _, size, _ in rows) == sum(p.numel() * 4 for p in model.parameters())
    graphs = [pipe.split_gm.get_submodule(node.target) for node in stage_nodes(pipe)]
    names = [sorted(graph.state_dict()) for graph in graphs]
    assert sorted(sum(names, [])) == sorted(model.state_dict())  # each tensor in one stage, under its own name
    real = dict(model.named_parameters()) | dict(model.named_buffers())
    for graph in graphs:
        attach_tensors(graph, real)
    x = torch.randn(5, 4)  # another batch size than the trace's: these graphs bake no batch size in
    y = x
    for graph in graphs:
        y = graph(y)
    assert torch.equal(y, model(x))


class Positions(nn.Module):
    """Token ids in; positions made in forward on the input's device (meta while tracing)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(10, 8), nn.Embedding(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_tensors_made_in_forward_on_the_inputs_device_are_made_on_the_stages() -> None:
    model = Positions()
    pipe = TracedSplit(model, plan_split(model, split_points=["blocks.1"])).trace(
        torch.zeros(2, 6, dtype=torch.long, device="meta"), training=True)
    graphs = [pipe.split_gm.get_submodule(node.target) for node in stage_nodes(pipe)]
    real = dict(model.named_parameters())
    for graph in graphs:
        attach_tensors(graph, real)
        _modify_graph_op_device(graph, torch.device("cpu"))  # as TracedRunner does: the trace said "meta"
    x = torch.randint(0, 10, (3, 6))
    assert torch.equal(graphs[1](graphs[0](x)), model(x))


def test_a_stage_keeps_its_tensors_and_the_rest_go_to_the_meta_device() -> None:
    torch.manual_seed(0)
    model, twin = Net(), Net()
    pipe = trace(model, ["blocks.2"])
    graph = pipe.split_gm.get_submodule(stage_nodes(pipe)[1].target)
    stage = TracedStage(model)
    weight = model.head.weight
    kept = keep_stage(model, {n for n, _ in graph.named_parameters()}, torch.device("cpu"))
    attach_tensors(graph, kept)
    stage.adopt(graph, ["blocks.2", "blocks.3", "norm", "head"])
    assert model.head.weight is weight and model.embed.weight.is_meta and not model.blocks[2].fc.weight.is_meta
    assert any(p is weight for p in stage.parameters()) and not any(p.is_meta for p in stage.parameters())
    state = stage.model_state_dict()
    assert sorted(state) == sorted(k for k in model.state_dict() if not k.startswith(("embed.", "blocks.0.",
                                                                                        "blocks.1.")))
    stage.load_model_state_dict({k: v for k, v in twin.state_dict().items() if k in state})
    assert torch.equal(weight, twin.head.weight)  # in place: the same tensor, now the twin's values
    with pytest.raises(KeyError, match="does not match the stage's modules"):
        stage.load_model_state_dict({"embed.weight": twin.embed.weight})


@pytest.mark.parametrize(("model", "kwargs", "message"), [
    (Net, {}, r"a split without split points cuts an nn.Sequential"),
    (Net, {"split_points": ["blocks.9"]}, r"split point 'blocks.9' is not a submodule of the model \(a Net\); its "
                                          r"submodules are embed, blocks, blocks.0"),
    (Net, {"split_points": ["head", "head"]}, r"split point 'head' is named twice"),
    (Net, {"split_points": []}, r"name at least one layer"),
])
def test_bad_split_points_are_refused_by_name(model, kwargs, message) -> None:
    with pytest.raises(SplitError, match=message):
        plan_split(model(), **kwargs)


@pytest.mark.parametrize(("model", "points", "message"), [
    (Net, ["blocks"], r"'blocks' is never called by Net.forward.*a ModuleList is iterated, not called: name an "
                      r"entry, e.g. 'blocks.0'"),
    (Net, ["head", "blocks.2"], r"not in the order Net.forward calls them \(\['blocks.2', 'head'\]\): name them in "
                                r"that order, --split blocks.2,head"),
    (Net, ["embed"], r"leave a stage with nothing to compute \(the trace has 1 stage\(s\), not 2\)"),
    (CallsTwice, ["blocks.0"], r"'blocks.0' is called 2 times by CallsTwice.forward"),
    (Tied, ["blocks.0"], r"parameter \['embed.weight', 'out.weight'\] is used by stages \[0, 1\] \(tied weights\?\)"),
    (LongSkip, ["blocks.1", "blocks.3"], r"stage 2 \(from 'blocks.3'\) uses a tensor computed in stage 0 \(from "
                                         r"'the input'\), skipping the stage\(s\) between"),
    (Branchy, ["blocks.1"], r"(?s)torch.export cannot trace Branchy \(split points \['blocks.1'\], a microbatch "
                            r"of shape \(2, 4\), torch.float32\).*torch.export said:\n  \w+:\n    Could not guard on "
                            r"data-dependent expression.*no Python `if` on a tensor"),
])
def test_splits_the_trace_refuses_name_the_problem_and_the_fix(model, points, message) -> None:
    with pytest.raises(SplitError, match=message) as info:
        trace(model(), points)
    if model is Branchy:
        assert info.value.__cause__ is not None  # torch's own exception stays chained


def test_a_checkpoint_of_another_split_is_refused_naming_both_splits() -> None:
    strategy = PipelineStrategy(stages=2, schedule="1f1b")
    strategy.plan, strategy.module = TracedPlan(("blocks.2",)), TracedStage(Net())

    def restore(split):
        header = {"format": "conveyor.pipeline.stages", "split": split}
        saved = SimpleNamespace(tree=lambda name: header, part_tree=lambda name: pytest.fail("read " + name))
        strategy.checkpoint_items(strategy.module, None)["optimizer"].restore("optimizer", saved)

    with pytest.raises(ValueError, match=r"written with the split \[0 \| 1\] \(2 stages\) and this job splits "
                                         r"\[input.. \| blocks.2..\] \(2 stages\): resume with the split that wrote "
                                         r"it \(--stages 2, or --split naming"):
        restore([["0"], ["1"]])
    with pytest.raises(ValueError, match=r"written with the split \[input.. \| blocks.1.. \| head..\] \(3 stages\).*"
                                         r"\(--split blocks.1,head\)"):
        restore({"split_points": ["blocks.1", "head"]})
    with pytest.raises(ValueError, match=r"Why: each stage's part holds the parameters and optimizer state of that "
                                         r"stage's layers only.*the number of replicas may change, the split may not"):
        restore([["0"], ["1"]])


def test_a_checkpoint_of_other_replicas_with_the_same_split_is_loaded_by_every_replica(capsys) -> None:
    strategy = PipelineStrategy(stages=2, schedule="1f1b")
    strategy.plan, strategy.module = TracedPlan(("blocks.2",)), TracedStage(Net())
    strategy._job = SimpleNamespace(is_chief=True)
    strategy.replicas, strategy.replica, strategy.stage = 3, 2, 1  # the last replica's second stage, of 3
    loaded = []
    strategy._load_part = lambda state, optimizer: loaded.append(state)
    part = {"stage": 1, "model": {"blocks.2.weight": torch.ones(2)}, "optimizer": {"state": {}}}
    header = {"format": "conveyor.pipeline.stages", "split": {"split_points": ["blocks.2"]},
              "stages": ["stage-0", "stage-1"], "replicas": 2}  # written by 2 replicas
    saved = SimpleNamespace(step=40, tree=lambda name: header,
                            part_tree=lambda name: part if name == "stage-1" else pytest.fail("read " + name))
    strategy.checkpoint_items(strategy.module, None)["optimizer"].restore("optimizer", saved)
    assert loaded == [part]
    assert "resumed step 40, written by 2 pipeline replica(s), on 3: every replica loads its stage's part (split " \
           "[input.. | blocks.2..] unchanged)" in capsys.readouterr().err
