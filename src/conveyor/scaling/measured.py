"""What one worker of a measured run costs per step: the scaling model's input, read from summary.json.

    measured = load_measured("runs/cifar10/summary.json")     # or a run folder
    measured = measured_from_summary(summary_dict, source="...", overrides={"batch_size": 256})

Reads ``step_breakdown`` (median seconds per phase) and the ``scaling`` block the trainer writes
(``conveyor.train.scaling_figures``). `overrides` replace or supply ``batch_size``, ``gradient_bytes``,
``parameter_bytes`` and ``input_core_seconds_per_batch``. A run of one worker gives the compute time
directly; an ``allreduce`` run of several has its exposed communication taken out again (with the same
overlap rule the model predicts with). Other strategies' multi-worker runs mix communication into
phases the model cannot separate and are refused. Missing or wrong fields raise ScalingInputError
naming the file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conveyor.scaling.errors import ScalingInputError

__all__ = ["OVERRIDABLE", "Measured", "load_measured", "measured_from_summary"]

OVERRIDABLE = ("batch_size", "gradient_bytes", "parameter_bytes", "input_core_seconds_per_batch")
_OLD = "it was written by a conveyor without the scaling block: train again with this version"


@dataclasses.dataclass(frozen=True)
class Measured:
    """One worker's step on the measured device, in seconds and bytes.

    `compute` is forward + backward without communication; `overhead` is the rest of the step outside
    the marked phases (the loop's own work); `input_core_seconds` is the input pipeline's cost of one
    batch on one core (None: not measured, treated as free).
    """

    batch_size: float
    compute: float
    optimizer: float
    overhead: float
    gradient_bytes: float
    parameter_bytes: float
    input_core_seconds: float | None = None
    step: float = 0.0
    world_size: int = 1
    strategy: str = "local"
    source: str = ""

    def samples_per_second(self) -> float:
        """The measured run's per-worker rate from its median step (0.0 when unknown)."""
        return self.batch_size / self.step if self.step > 0 else 0.0


def _field(tree: Mapping[str, Any], path: str, source: str, hint: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ScalingInputError(f"{source}: missing '{path}' ({hint})")
        node = node[part]
    return node


def _number(value: Any, path: str, source: str, *, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ScalingInputError(f"{source}: '{path}' is {value!r}; expected a {kind} number")
    return float(value)


def _scaling_value(summary: Mapping[str, Any], key: str, source: str, overrides: Mapping[str, Any],
                   *, optional: bool = False) -> float | None:
    if overrides.get(key) is not None:
        return _number(overrides[key], key, "the command line", positive=key != "input_core_seconds_per_batch")
    flag = "--" + key.replace("_", "-").replace("-per-batch", "")
    block = summary.get("scaling")
    if not isinstance(block, Mapping) or (key not in block and not optional):
        raise ScalingInputError(f"{source}: missing 'scaling.{key}' ({_OLD}, or give {flag})")
    value = block.get(key)
    if value is None:
        if optional:
            return None
        raise ScalingInputError(f"{source}: 'scaling.{key}' was not measured in this run; give {flag}")
    return _number(value, f"scaling.{key}", source, positive=not optional)


def measured_from_summary(summary: Mapping[str, Any], *, source: str = "summary.json",
                          overrides: Mapping[str, Any] | None = None, overlap: float = 0.5,
                          backward_fraction: float = 2 / 3) -> Measured:
    """The Measured step of `summary` (a parsed summary.json; module docstring)."""
    overrides = overrides or {}
    if not isinstance(summary, Mapping):
        raise ScalingInputError(f"{source}: expected a JSON object (a run's summary.json)")
    hint = "this is not a conveyor run's summary.json, or it is damaged: point at <output-dir>/summary.json"
    world = _field(summary, "world_size", source, hint)
    strategy = str(_field(summary, "strategy", source, hint))
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ScalingInputError(f"{source}: 'world_size' is {world!r}; expected a positive whole number")
    phases = {p: _number(_field(summary, f"step_breakdown.{p}", source, hint), f"step_breakdown.{p}", source)
              for p in ("input_wait", "forward_backward", "communication", "optimizer", "total")}
    if phases["total"] <= 0 or phases["forward_backward"] <= 0:
        raise ScalingInputError(f"{source}: the run has no timed step (step_breakdown.total is {phases['total']}); "
                                f"predict from a run that trained at least a few steps")
    if world > 1 and strategy != "allreduce":
        raise ScalingInputError(f"{source}: a {strategy} run of {world} workers mixes communication into phases the "
                                f"model cannot separate; predict from a run of one worker (conveyor run -n 1) or an "
                                f"allreduce run")
    compute = phases["forward_backward"]
    if world > 1:
        compute = compute_without_communication(compute, phases["communication"], overlap, backward_fraction)
    values = {k: _scaling_value(summary, k, source, overrides, optional=k == "input_core_seconds_per_batch")
              for k in OVERRIDABLE}
    overhead = max(0.0, phases["total"] - phases["input_wait"] - phases["forward_backward"] - phases["optimizer"])
    return Measured(batch_size=values["batch_size"], compute=compute, optimizer=phases["optimizer"], overhead=overhead,
                    gradient_bytes=values["gradient_bytes"], parameter_bytes=values["parameter_bytes"],
                    input_core_seconds=values["input_core_seconds_per_batch"], step=phases["total"], world_size=world,
                    strategy=strategy, source=source)


def compute_without_communication(forward_backward: float, communication: float, overlap: float,
                                  backward_fraction: float) -> float:
    """The compute time c with forward_backward = c + exposed(communication, backward_fraction x c, overlap).

    The exposed part grows with c nowhere faster than c itself, so the solution is unique: first
    assume the overlap limit binds, then the backward-length limit.
    """
    c = forward_backward - (1 - overlap) * communication
    if overlap * communication <= backward_fraction * c:
        return max(c, 1e-12)
    return max((forward_backward - communication) / (1 - backward_fraction), 1e-12)


def load_measured(path: str | Path, **kwargs: Any) -> Measured:
    """The Measured step of the summary.json at `path` (or in the run folder `path`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    text = path.read_text(encoding="utf-8")
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScalingInputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); point at a run's "
                                f"summary.json") from None
    return measured_from_summary(summary, source=str(path), **kwargs)
