"""Split points for a model that is not an nn.Sequential: torch traces its forward and cuts the graph.

    split = TracedSplit(model, plan)                      # plan = plan_split(model, split_points=["blocks.2"])
    pipe = split.trace(example_microbatch, training=True)  # torch's Pipe: one graph module per stage, checked
    module = TracedStage(model)                           # what job.prepare returns
    runner = TracedRunner(module, split, index, group, device, microbatches=4, schedule="1f1b", adopted=fn)

``torch.distributed.pipelining.pipeline`` marks where each split point's call begins, ``torch.export``
traces the forward on a meta-device copy of the model (no memory, no arithmetic) and the graph is cut
at the marks. A stage's graph module keeps the model's qualified names for the parameters and buffers
it uses, so its checkpoint part speaks the whole model's names, as a Sequential stage's does. Tracing
needs an example microbatch, which only the first batch gives: until then ``job.prepare``'s module
holds the whole model and its optimizer every parameter. At the first batch every process traces (the
same model and shapes give the same graph on every rank), keeps its stage's tensors (the others go to
the meta device, the optimizer forgets them) and runs torch's traced ``_PipelineStage``, whose shapes
come from the trace, so nothing is pickled. An exported graph holds for one input shape and one
train/eval mode: each batch size and mode is traced once, and every trace's stage uses the same tensors.
Refused, naming the fix: a split point forward never calls or calls twice, points out of forward order,
an empty stage, a parameter two stages use (tied weights would train as two copies), a tensor that
skips a stage, and a forward torch.export cannot trace (its own message is quoted).
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.distributed.pipelining._IR import Pipe, _modify_graph_op_device
from torch.distributed.pipelining.stage import _PipelineStage

from conveyor.strategies.pipeline.runner import StageRunner, _Clock, _Timed
from conveyor.strategies.pipeline.split import SplitError, TracedPlan, describe_stages, meta_copy

__all__ = ["TracedRunner", "TracedSplit", "TracedStage", "attach_tensors", "keep_stage", "stage_nodes", "stage_rows"]

_QUOTED_LINES = 8  # of torch.export's own message, in the error that explains it


class TracedSplit:
    """Traces of ``model`` cut at ``plan``'s split points, each checked to make a pipeline conveyor runs."""

    def __init__(self, model: nn.Module, plan: TracedPlan) -> None:
        self.plan = plan
        self.model_name = type(model).__name__
        self._meta = meta_copy(model)

    def trace(self, example: torch.Tensor, training: bool) -> Pipe:
        """torch's Pipe for microbatches like ``example`` (meta device), the model in train or eval mode."""
        model = copy.deepcopy(self._meta).train(training)  # pipeline() rewires the split points' forward
        calls: list[str] = []
        for point in self.plan.points:
            model.get_submodule(point).register_forward_pre_hook(lambda _m, _a, p=point: calls.append(p))
        try:
            with warnings.catch_warnings():  # torch's own deprecation notice, raised inside pipeline() on every trace
                warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
                pipe = pipeline(model, (example,), split_spec=dict.fromkeys(self.plan.points, SplitPoint.BEGINNING))
        except Exception as err:
            raise SplitError(self._untraceable(err, example)) from err
        self._check_calls(model, calls)
        self._check_stages(pipe)
        return pipe

    def _untraceable(self, err: BaseException, example: torch.Tensor) -> str:
        cause = err.__cause__ or err  # pipeline() wraps export's error in a generic one of its own
        lines = str(cause).strip().splitlines()
        quoted = "\n".join(f"    {line}" for line in lines[:_QUOTED_LINES])
        more = f"\n    … ({len(lines) - _QUOTED_LINES} more lines in the chained exception)" \
            if len(lines) > _QUOTED_LINES else ""
        return (f"torch.export cannot trace {self.model_name} (split points {list(self.plan.points)}, a microbatch "
                f"of shape {tuple(example.shape)}, {example.dtype}), and a split of a model that is not an "
                f"nn.Sequential is cut from that trace. torch.export said:\n  {type(cause).__name__}:\n{quoted}{more}"
                f"\n  The forward must run the same tensor operations whatever the values (no Python `if` on a "
                f"tensor, no .item()): rewrite that part (torch.where, torch.cond), or write the model as an "
                f"nn.Sequential and cut it with --stages")

    def _check_calls(self, model: nn.Module, calls: list[str]) -> None:
        points = list(self.plan.points)
        for point in points:
            count = calls.count(point)
            if count == 0:
                module = model.get_submodule(point)
                hint = f" (a {type(module).__name__} is iterated, not called: name an entry, e.g. " \
                       f"'{point}.0')" if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else ""
                raise SplitError(f"split point {point!r} is never called by {self.model_name}.forward, so no stage "
                                 f"can begin there{hint}: name a module that forward calls")
            if count > 1:
                raise SplitError(f"split point {point!r} is called {count} times by {self.model_name}.forward, and "
                                 f"a stage would begin at each call: name a module that forward calls once")
        if calls != points:
            raise SplitError(f"split points {points} are not in the order {self.model_name}.forward calls them "
                             f"({calls}): name them in that order, --split {','.join(calls)}")

    def _check_stages(self, pipe: Pipe) -> None:
        nodes, points = stage_nodes(pipe), list(self.plan.points)
        if len(nodes) != self.plan.num_stages:
            raise SplitError(f"split points {points} leave a stage with nothing to compute (the trace has "
                             f"{len(nodes)} stage(s), not {self.plan.num_stages}): do not name the first module "
                             f"forward calls, nor two modules with no computation between their calls")
        index = {node.name: i for i, node in enumerate(nodes)}
        for uses in pipe.replicated_params:
            stages = sorted(index[name] for name in uses)
            raise SplitError(f"parameter {sorted(set(uses.values()))} is used by stages {stages} (tied weights?): "
                             f"each stage would train its own copy. Move the split points so that one stage holds "
                             f"every use, or untie it")
        begins = ["the input", *points]
        for i, node in enumerate(nodes):
            for source in {_source(arg) for arg in node.all_input_nodes}:
                if source.op == "placeholder" and i > 0:
                    raise SplitError(f"stage {i} (from {begins[i]!r}) uses the model's input {source.name!r}, which "
                                     f"only the first stage receives: move split point {begins[i]!r} after its last "
                                     f"use, or compute what needs it in the first stage")
                if source.op == "call_module" and index[source.name] != i - 1:
                    j = index[source.name]
                    raise SplitError(f"stage {i} (from {begins[i]!r}) uses a tensor computed in stage {j} (from "
                                     f"{begins[j]!r}), skipping the stage(s) between, and stages here pass tensors "
                                     f"to the next stage only: move or drop split points so that a tensor forward "
                                     f"reuses later (a long skip connection, a mask) is not used past the next stage")
        output = next(n for n in pipe.split_gm.graph.nodes if n.op == "output")
        for source in {_source(arg) for arg in output.all_input_nodes}:
            if source is not nodes[-1]:
                raise SplitError(f"{self.model_name}.forward returns a tensor computed before the last stage, and the "
                                 f"loss is computed on the last stage's outputs alone: return only what the last "
                                 f"stage computes")


def stage_nodes(pipe: Pipe) -> list[fx.Node]:
    """The stages' calls in the pipe's root graph, in order (their targets can skip numbers)."""
    return [node for node in pipe.split_gm.graph.nodes if node.op == "call_module"]


def stage_rows(pipe: Pipe) -> list[tuple[list[str], int, int]]:
    """Each stage's (modules it calls, parameter bytes, bytes of its outputs for one microbatch)."""
    rows = []
    for node in stage_nodes(pipe):
        graph = pipe.split_gm.get_submodule(node.target)
        calls = [n.target.split("@")[0] for n in graph.graph.nodes if n.op == "call_module"]  # "@1": a second call
        size = sum(p.numel() * p.element_size() for p in graph.parameters())
        output = next(n for n in graph.graph.nodes if n.op == "output")
        values = [n.meta.get("val") for n in output.all_input_nodes]
        acts = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        rows.append((list(dict.fromkeys(calls)), size, acts))
    return rows


def _source(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node


class TracedStage(nn.Module):
    """What ``job.prepare`` returns for a traced split: the whole model (``whole``) until the first batch,
    then this process's stage (``graph``: the traced graph module, holding the model's own tensors)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.whole = model
        self.layer_names: list[str] = []
        self._keys = set(model.state_dict())

    @property
    def adopted(self) -> bool:
        return "graph" in self._modules

    def adopt(self, graph: nn.Module, layer_names: Sequence[str]) -> None:
        del self.whole
        self.graph = graph
        self.layer_names = list(layer_names)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_adopted("run")
        return self.graph(*args, **kwargs)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state under the whole model's key names (non-persistent buffers left out, as there)."""
        self._check_adopted("checkpoint")
        return {k: v for k, v in self.graph.state_dict().items() if k in self._keys}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a state saved by :meth:`model_state_dict` (strict), in place: every trace shares the tensors."""
        mine = self.model_state_dict()
        if set(mine) != set(state):
            missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise KeyError(f"stage state does not match the stage's modules {self.layer_names}: missing "
                           f"{missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for key, value in state.items():
                mine[key].copy_(value)

    def _check_adopted(self, what: str) -> None:
        if not self.adopted:
            raise RuntimeError(f"this pipeline stage cannot {what} before its first batch, which decides what it "
                               f"holds (the split is traced then): train through job.train_step or the Trainer")


class _TimedTracedStage(_Timed, _PipelineStage):
    """torch's traced-frontend stage (shapes from the trace) timed on ``clock``."""

    def __init__(self, *args: Any, clock: _Clock, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = clock


class TracedRunner(StageRunner):
    """A :class:`StageRunner` whose stage is cut from a trace per batch size and mode (module docstring).
    ``adopted()`` is called once, when the first batch has decided which tensors are this stage's."""

    def __init__(self, module: TracedStage, split: TracedSplit, index: int, group: Any, device: torch.device, *,
                 microbatches: int | None, schedule: str, adopted: Callable[[], None]) -> None:
        super().__init__(module, None, split.plan, index, group, device, microbatches=microbatches,
                         schedule=schedule)
        self.split, self._adopted = split, adopted
        self._tensors: dict[str, torch.Tensor] | None = None
        self._rows: dict[tuple, list[tuple[list[str], int, int]]] = {}

    @property
    def ready(self) -> bool:
        return self._tensors is not None

    def _key(self, n: int, training: bool) -> tuple:
        return (n, training, self.module.training)  # the exported graph bakes the mode in (dropout, batch norm)

    def _stage(self, x: torch.Tensor, training: bool) -> Any:
        pipe = self.split.trace(x, self.module.training)
        graph = pipe.split_gm.get_submodule(stage_nodes(pipe)[self.index].target)
        self._rows[(tuple(x.shape), self.module.training)] = rows = stage_rows(pipe)
        if self._tensors is None:
            self._tensors = keep_stage(self.module.whole, _tensor_names(graph), self.device)
            attach_tensors(graph, self._tensors)
            self.module.adopt(graph, rows[self.index][0])
            self._adopted()
        attach_tensors(graph, self._tensors)
        _modify_graph_op_device(graph, self.device)  # factory calls (torch.zeros(..., device=)) say meta
        return _TimedTracedStage(graph, self.index, pipe.info(), self.device, self.group, clock=self.clock)

    def table(self, inputs: torch.Tensor) -> str:
        self._schedule(inputs, training=True)
        shape = tuple(inputs[: max(1, len(inputs) // self.microbatches)].shape)
        return describe_stages(self._rows[(shape, self.module.training)])

    def layers(self) -> list[list[str]]:
        rows = next(iter(self._rows.values()), None)
        if rows is None:  # never ran a batch
            return [[f"{name}.."] for name in ("input", *self.plan.points)]
        return [list(names) for names, _, _ in rows]


def _tensor_names(graph: nn.Module) -> set[str]:
    return {name for name, _ in graph.named_parameters(remove_duplicate=False)} | \
        {name for name, _ in graph.named_buffers(remove_duplicate=False)}


def _slots(module: nn.Module) -> list[tuple[dict, str, str, torch.Tensor]]:
    """Every (registry, key, qualified name, tensor) of ``module``'s parameters and buffers, once per registry."""
    slots, seen = [], set()
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for registry in (mod._parameters, mod._buffers):
            for key, tensor in registry.items():
                if tensor is not None and (id(registry), key) not in seen:
                    seen.add((id(registry), key))
                    slots.append((registry, key, f"{prefix}.{key}" if prefix else key, tensor))
    return slots


def keep_stage(model: nn.Module, names: set[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Move the tensors ``names`` name (under any of their names) to ``device`` and every other one of ``model`` to
    the meta device, as the Sequential path does with the other stages; this stage's tensors by every name."""
    slots = _slots(model)
    keep = {id(tensor) for _, _, name, tensor in slots if name in names}
    moved: dict[int, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for registry, key, name, tensor in slots:
        if id(tensor) not in moved:
            moved[id(tensor)] = _moved(tensor, device if id(tensor) in keep else torch.device("meta"))
        registry[key] = moved[id(tensor)]
        if id(tensor) in keep:
            kept[name] = moved[id(tensor)]
    return kept


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "meta":
        empty = torch.empty_like(tensor, device="meta")
        return nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    if isinstance(tensor, nn.Parameter):
        tensor.data = tensor.data.to(device)  # the same Parameter: the optimizer refers to it
        return tensor
    return tensor.to(device)


def attach_tensors(graph: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point a traced stage's parameters and buffers (meta) at this process's tensors of the same names."""
    for registry, key, name, _ in _slots(graph):
        if name not in tensors:
            raise SplitError(f"the traced stage holds {name!r}, which is no parameter or buffer of the model by that "
                             f"name, so it cannot be given the model's values: register the tensor the forward uses "
                             f"on the module that uses it (register_buffer, nn.Parameter)")
        registry[key] = tensors[name]
    for prefix, mod in graph.named_modules():
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise SplitError(f"the traced stage keeps the tensor attribute {prefix + '.' if prefix else ''}{attr} "
                                 f"on the meta device: a tensor the forward uses that is not a parameter or buffer "
                                 f"of the model; register it (self.register_buffer(name, tensor))")
