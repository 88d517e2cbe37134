"""Where a model is cut into pipeline stages: by named split points, or by a stage count balanced by bytes.

    plan = plan_split(model, stages=2)                         # an nn.Sequential, balanced by parameter bytes
    plan = plan_split(model, split_points=["blocks.4", "head"])  # cut before these layers (torchtitan style)
    stage = plan.stage_module(model, index)                     # the layers of stage `index`, run in order
    print(plan.describe(activation_bytes))                      # the start-up table

An ``nn.Sequential`` (nested ones are fine) is cut between its layers: its forward is the layers one
after another, so the activation that crosses a cut is the output of the layer before. A split point
names a layer by its ``named_modules`` name; naming a layer inside a nested Sequential (``"blocks.4"``)
opens it. A stage count opens nothing: the top-level layers are grouped into that many contiguous
stages so that the largest stage's parameter bytes are as small as they can be (linear partition).

Any other model is cut by split points only, giving a :class:`TracedPlan`: each names a module whose
call in forward begins a stage. Nothing can be read off the module tree, so ``traced.py`` cuts the
traced computation at the first batch. Every bad split raises :class:`SplitError` naming the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.fileio import format_bytes

__all__ = ["SplitError", "SplitPlan", "StageModule", "TracedPlan", "check_microbatches", "default_microbatches",
           "describe_stages", "meta_copy", "plan_from_signature", "plan_split"]


class SplitError(ValueError):
    """A split that cannot work: more stages than layers, an unknown name, an empty stage, a bad batch."""

    usage_error = True  # a restart meets it again: `conveyor run` does not retry it


@dataclass(frozen=True)
class SplitPlan:
    """The layers (dotted names, in forward order) of each stage."""

    stages: tuple[tuple[str, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def signature(self) -> list[list[str]]:
        """The split as JSON (written into checkpoints and compared on resume)."""
        return [list(names) for names in self.stages]

    def short(self) -> str:
        """One line naming the split: "[0..2 | 3..5]" style, by the first and last layer of each stage."""
        return " | ".join(n[0] if len(n) == 1 else f"{n[0]}..{n[-1]}" for n in self.stages)

    def stage_module(self, model: nn.Module, index: int) -> StageModule:
        """Stage ``index``'s layers of ``model`` (the same module objects, not copies)."""
        modules = dict(model.named_modules())
        return StageModule([(name, modules[name]) for name in self.stages[index]])

    def describe(self, model: nn.Module, activation_bytes: Sequence[int] | None = None) -> str:
        """The start-up table: each stage's layers, parameter bytes and (when known) activation bytes."""
        modules = dict(model.named_modules())
        return describe_stages([(names, sum(_param_bytes(modules[n]) for n in names),
                                 None if activation_bytes is None else activation_bytes[i])
                                for i, names in enumerate(self.stages)])

    def resume_flags(self) -> str:
        """The flags that cut a model this way again (named in the refusal of another split's checkpoint)."""
        return f"--stages {self.num_stages}, or --split naming the first layer of each later stage"


@dataclass(frozen=True)
class TracedPlan:
    """Split points of a model that is not an nn.Sequential: stage ``i > 0`` begins where forward calls
    ``points[i - 1]``. What each stage holds is known once the model is traced (``traced.TracedSplit``)."""

    points: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.points) + 1

    def signature(self) -> dict[str, list[str]]:
        """The split as JSON (written into checkpoints and compared on resume): the points themselves."""
        return {"split_points": list(self.points)}

    def short(self) -> str:
        """One line naming the split: "input.. | blocks.2.. | head.." (where each stage begins)."""
        return " | ".join(f"{name}.." for name in ("input", *self.points))

    def resume_flags(self) -> str:
        return "--split " + ",".join(self.points)


def plan_from_signature(signature: object) -> SplitPlan | TracedPlan:
    """The plan a checkpoint's ``split`` entry (a plan's :meth:`signature`) describes."""
    if isinstance(signature, dict):
        return TracedPlan(tuple(signature["split_points"]))
    return SplitPlan(tuple(tuple(names) for names in signature))


def describe_stages(rows: Sequence[tuple[Sequence[str], int, int | None]]) -> str:
    """The start-up table from each stage's (layers, parameter bytes, activation bytes per microbatch or None)."""
    table = [("stage", "layers", "parameters", "activations / microbatch")]
    for i, (names, size, act) in enumerate(rows):
        table.append((str(i), _layer_list(names), format_bytes(size), "?" if act is None else format_bytes(act)))
    widths = [max(len(r[c]) for r in table) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return "pipeline split:\n" + "\n".join("  " + line for line in lines)


class StageModule(nn.Module):
    """A stage: its layers, applied in order. ``layer_names`` are their names in the whole model, and
    :meth:`model_state_dict` / :meth:`load_model_state_dict` speak those names (checkpoints do)."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.layer_names = [name for name, _ in layers]
        self.layers = nn.ModuleList(module for _, module in layers)

    def forward(self, x):  # noqa: D102 - the layers in order, as nn.Sequential
        for layer in self.layers:
            x = layer(x)
        return x

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state under the whole model's key names (``blocks.4.weight``)."""
        return {self._model_key(k): v for k, v in self.state_dict().items()}

    def model_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under the whole model's names (what ``--shard-stages`` shards)."""
        return {self._model_key(k): p for k, p in self.named_parameters()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a state saved by :meth:`model_state_dict` (strict: every key, nothing more)."""
        mine = {self._model_key(k): k for k in self.state_dict()}
        if set(mine) != set(state):
            missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise KeyError(f"stage state does not match the stage's layers {self.layer_names}: missing {missing[:5]}, "
                           f"unexpected {extra[:5]}")
        self.load_state_dict({mine[k]: v for k, v in state.items()})

    def _model_key(self, key: str) -> str:
        _, index, rest = key.split(".", 2)
        return f"{self.layer_names[int(index)]}.{rest}"


def plan_split(model: nn.Module, *, stages: int | None = None,
               split_points: Sequence[str] | None = None) -> SplitPlan | TracedPlan:
    """The split of ``model`` (module docstring): by ``split_points`` or into ``stages`` balanced stages.

    With both, they must agree (``len(split_points) + 1 == stages``). A model that is not an
    ``nn.Sequential`` takes split points only, and gets a :class:`TracedPlan`.
    """
    if split_points is not None:
        points = list(split_points)
        if stages is not None and len(points) + 1 != stages:
            raise SplitError(f"--stages {stages} but {len(points)} split point(s) {points} make {len(points) + 1} "
                             f"stages: give {stages - 1} split point(s), or --stages {len(points) + 1}")
        if not points:
            raise SplitError("split = []: name at least one layer to cut before (or use --stages 1 for no pipeline)")
        return _by_names(model, points) if isinstance(model, nn.Sequential) else _traced(model, points)
    if not isinstance(model, nn.Sequential):
        given = f"--stages {stages} alone" if stages is not None else "a split without split points"
        raise SplitError(f"{given} cuts an nn.Sequential between its layers, and the model is a "
                         f"{type(model).__name__}, whose forward decides the order: name where each later stage "
                         f"begins instead, as split points (conveyor run --split blocks.2,head, or job.prepare(model, "
                         f"optimizer, split=['blocks.2', 'head'])), or write the model as an nn.Sequential")
    if stages is None:
        raise SplitError("the pipeline strategy needs a split: --stages S (conveyor run) or "
                         "job.prepare(model, optimizer, split=[...names to cut before...])")
    return _by_count(model, stages)


def _traced(model: nn.Module, points: list[str]) -> TracedPlan:
    """Split points of a model that is not an nn.Sequential, checked by name (the trace checks the rest)."""
    modules = dict(model.named_modules())
    for i, point in enumerate(points):
        if point in points[:i]:
            raise SplitError(f"split point {point!r} is named twice in {points}: name each module once, in the "
                             f"order forward calls them")
        if not point or point not in modules:
            names = [n for n in modules if n]
            raise SplitError(f"split point {point!r} is not a submodule of the model (a {type(model).__name__}); "
                             f"its submodules are {_layer_list(names)}: name the module whose call in forward begins "
                             f"each later stage, by its named_modules name")
    return TracedPlan(tuple(points))


def _by_count(model: nn.Sequential, stages: int) -> SplitPlan:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise SplitError(f"stages = {stages!r}; expected a whole number >= 1 (--stages S)")
    layers = list(model.named_children())
    if stages > len(layers):
        raise SplitError(f"--stages {stages} but the model has {len(layers)} layer(s) "
                         f"({_layer_list([n for n, _ in layers])}): use --stages {len(layers)} or fewer, or split "
                         f"inside a nested nn.Sequential by naming split points (split=['blocks.4', ...])")
    bounds = _balanced_bounds([_param_bytes(m) for _, m in layers], stages)
    names = [n for n, _ in layers]
    return SplitPlan(tuple(tuple(names[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)))


def _balanced_bounds(sizes: list[int], parts: int) -> list[int]:
    """Cut ``sizes`` into ``parts`` contiguous non-empty runs minimising the largest sum; the run boundaries."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest largest-run sum of sizes[:i] in k runs; cut[k][i]: where the last run starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def _by_names(model: nn.Sequential, points: list[str]) -> SplitPlan:
    layers = _opened_layers(model, points)
    index = {name: i for i, name in enumerate(layers)}
    cuts = []
    for point in points:
        if point not in index:
            raise SplitError(f"split point {point!r} is not a layer of the model; the layers you can cut before "
                             f"are {_layer_list(layers)} (a name inside a nested nn.Sequential opens it)")
        cuts.append(index[point])
    for before, after, name in zip([0, *cuts], [*cuts, len(layers)], [None, *points], strict=True):
        if after <= before:
            what = f"the stage after {name!r}" if name else "the first stage"
            raise SplitError(f"split points {points} leave {what} empty: name each layer once, in forward "
                             f"order, and not the model's first layer ({layers[0]!r})")
    bounds = [0, *cuts, len(layers)]
    return SplitPlan(tuple(tuple(layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)))


def _opened_layers(model: nn.Sequential, points: list[str]) -> list[str]:
    """The model's layers in forward order, with every nested Sequential a point lies inside opened up."""
    opened = {p.rsplit(".", i)[0] for p in points for i in range(1, p.count(".") + 1)}

    def walk(module: nn.Module, prefix: str) -> list[str]:
        out = []
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in opened and isinstance(child, nn.Sequential):
                out += walk(child, full + ".")
            else:
                out.append(full)
        return out

    return walk(model, "")


def default_microbatches(stages: int, batch: int | None = None) -> int:
    """The microbatches of a step when ``--microbatches`` is not given: 2 per stage (GPipe's bubble
    (S-1)/(M+S-1) is then under a third), or, for a ``batch`` that 2 S does not divide, the largest count
    below it that does, so that the batch cuts into equal microbatches (32 samples on 3 stages: 4)."""
    target = 2 * stages
    if batch is None or batch < 1:
        return target
    return next(m for m in range(min(target, batch), 0, -1) if batch % m == 0)


def check_microbatches(batch: int, microbatches: int) -> int:
    """The microbatch size of a ``batch`` cut into ``microbatches`` equal parts; SplitError when it cannot be."""
    if batch % microbatches == 0 and batch >= microbatches:
        return batch // microbatches
    lower = batch - batch % microbatches
    sizes = f"{lower} or {lower + microbatches}" if lower else f"{microbatches}"
    divisors = [m for m in range(min(batch, microbatches), 0, -1) if batch % m == 0][:1]
    raise SplitError(
        f"a batch of {batch} sample(s) cannot be cut into --microbatches {microbatches} equal microbatches: use a "
        f"batch size that is a multiple of {microbatches} (e.g. {sizes}), or --microbatches {divisors[0]}; if only an "
        f"epoch's last batch is smaller, batch(..., drop_remainder=True)")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device: its forward gives every
    shape without memory or arithmetic (how each stage learns what crosses each cut)."""
    memo = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _layer_list(names: Sequence[str], limit: int = 6) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:3]) + f", … ({len(names) - 5} more), " + ", ".join(names[-2:])


