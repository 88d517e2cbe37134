"""Re-splitting the parameter servers' shards over another number of servers (resume with --ps Q after --ps P).

    shards = [(tensors, meta), ...]          # what each of the P servers saved: ServerOptimizer.state_dict()
    states = reshard(shards, placement)      # [(tensors, meta)] for each server of `placement` (Q of them)
    client.load_state([(meta, tensors) for tensors, meta in states])

A shard holds its pieces' flat values (``param/<piece key>``), their optimizer state (``state/<key>/<name>``:
per-element tensors such as Adam's moments, and per-piece scalars such as ``step``) and JSON meta.
`reshard` joins every parameter's pieces back into one flat tensor per value and per-element state,
then cuts them as `placement` (``sharding.place`` for Q servers) cuts them: a plain copy of every
element, so the restored servers hold bit for bit what was saved. A per-piece scalar (``step``) goes
to each new piece from the old pieces it overlaps; where those disagree (ps-async may save while one
server has applied a push that another has not) the new piece cannot hold both, and the re-split is
refused naming the parameter, the values and the fix, as are shards that do not tile this model's
parameters or disagree on the optimizer. Pure: no I/O (the checkpoint item reads the parts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.errors import ConveyorError
from conveyor.strategies.ps.sharding import Placement, parse_piece_key

__all__ = ["ReshardError", "reshard"]

Shard = tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]


class ReshardError(ConveyorError, ValueError):
    """The saved shards cannot be re-split onto this job's servers; the message names why and the fix."""

    usage_error = True  # a restart meets the same shards again


@dataclass
class _OldPiece:
    start: int
    stop: int
    scalars: dict[str, Any] = field(default_factory=dict)  # per-piece state: 0-dim tensors and JSON values


@dataclass
class _Whole:
    """One parameter as the old shards held it: its flat values and per-element state joined, its old pieces."""

    values: torch.Tensor
    elementwise: dict[str, torch.Tensor]
    pieces: list[_OldPiece]


def reshard(shards: Sequence[Shard], placement: Placement) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The state of each server of `placement`, from the `(tensors, meta)` every old server saved, in its order."""
    if not shards:
        raise ReshardError("no parameter-server shards to re-split: the checkpoint lists none")
    first = shards[0][1]
    for index, (_, meta) in enumerate(shards):
        for key in ("format", "version", "spec", "hyperparameters"):
            if meta.get(key) != first.get(key):
                raise ReshardError(f"the shards of ps:0 and ps:{index} disagree on their optimizer's {key}: they are "
                                   f"not one job's checkpoint; resume from another step or start over with "
                                   f"--no-resume")
    wholes = _join(shards, placement)
    out = []
    for server in range(placement.num_servers):
        tensors: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {}
        keys = []
        for piece in placement.pieces_for(server):
            whole = wholes[piece.param]
            keys.append(piece.key)
            tensors[f"param/{piece.key}"] = whole.values[piece.start:piece.stop].clone()
            entry: dict[str, Any] = {"tensors": [], "values": {}}
            for name, flat in whole.elementwise.items():
                tensors[f"state/{piece.key}/{name}"] = flat[piece.start:piece.stop].clone()
                entry["tensors"].append(name)
            for name, value in _scalars(piece.param, whole, piece.start, piece.stop).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{piece.key}/{name}"] = value.clone()
                    entry["tensors"].append(name)
                else:
                    entry["values"][name] = value
            if entry["tensors"] or entry["values"]:
                state[piece.key] = entry
        out.append((tensors, {**first, "pieces": keys, "state": state}))
    return out


def _join(shards: Sequence[Shard], placement: Placement) -> dict[str, _Whole]:
    """Every parameter of `placement` from the old shards' pieces, checked to tile it exactly once."""
    found: dict[str, list[tuple[int, int, Mapping[str, torch.Tensor], Mapping[str, Any]]]] = {}
    for tensors, meta in shards:
        for key in meta.get("pieces", []):
            param, start, stop = parse_piece_key(key)
            found.setdefault(param, []).append((start, stop, tensors, {"key": key, **meta["state"].get(key, {})}))
    mine = {p.name for p in placement.params}
    if found.keys() != mine:
        raise ReshardError(f"the shards hold other parameters than this model (not in the checkpoint: "
                           f"{sorted(mine - found.keys())[:3]}, not in this model: {sorted(found.keys() - mine)[:3]}): "
                           f"run the model that wrote it, or start over with --no-resume")
    return {p.name: _whole(p.name, p.numel, sorted(found[p.name], key=lambda x: x[0])) for p in placement.params}


def _whole(param: str, numel: int, pieces: list[tuple[int, int, Mapping[str, torch.Tensor], Mapping[str, Any]]]
           ) -> _Whole:
    values, elementwise, old, expected = [], {}, [], 0
    names = tuple(pieces[0][3].get("tensors", []))
    for start, stop, tensors, entry in pieces:
        if start != expected:
            raise ReshardError(f"the saved pieces of {param!r} do not tile its {numel} elements (a gap or overlap "
                               f"at element {expected}): the step is damaged; resume from another step")
        if tuple(entry.get("tensors", [])) != names:
            raise ReshardError(f"the saved pieces of {param!r} hold different optimizer state ({list(names)} and "
                               f"{entry.get('tensors', [])}): the servers had applied different numbers of updates "
                               f"to them (ps-async saves while pushes are in flight), or the step is damaged. "
                               f"Resume with the number of ps tasks that wrote it, from another step, or start over "
                               f"with --no-resume")
        values.append(_flat(tensors, f"param/{entry['key']}", stop - start))
        piece = _OldPiece(start, stop, dict(entry.get("values", {})))
        for name in names:
            tensor = tensors.get(f"state/{entry['key']}/{name}")
            if not isinstance(tensor, torch.Tensor):
                raise ReshardError(f"the checkpoint has no tensor 'state/{entry['key']}/{name}': the step is damaged")
            if tensor.dim() == 0:
                piece.scalars[name] = tensor
            else:
                elementwise.setdefault(name, []).append(_flat(tensors, f"state/{entry['key']}/{name}", stop - start))
        old.append(piece)
        expected = stop
    if expected != numel:
        raise ReshardError(f"the saved pieces of {param!r} cover {expected} of its {numel} elements: another model's "
                           f"checkpoint, or a damaged step")
    return _Whole(torch.cat(values), {k: torch.cat(v) for k, v in elementwise.items()}, old)


def _flat(tensors: Mapping[str, torch.Tensor], key: str, numel: int) -> torch.Tensor:
    tensor = tensors.get(key)
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != numel:
        got = tensor.numel() if isinstance(tensor, torch.Tensor) else "none"
        raise ReshardError(f"checkpoint tensor {key!r} has {got} elements, its piece {numel}: the step is damaged")
    return tensor.reshape(-1)


def _scalars(param: str, whole: _Whole, start: int, stop: int) -> dict[str, Any]:
    """The per-piece state of new piece [start, stop) of `param`: the overlapping old pieces' value, all alike."""
    overlapping = [p for p in whole.pieces if p.start < stop and start < p.stop] or whole.pieces[:1]
    out = {}
    for name, value in overlapping[0].scalars.items():
        others = [p.scalars.get(name) for p in overlapping[1:]]
        if any(not _same(value, other) for other in others):
            seen = [_show(p.scalars.get(name)) for p in overlapping]
            raise ReshardError(f"the saved pieces of {param!r} hold different {name!r} ({', '.join(seen)}): the "
                               f"servers had applied different numbers of updates to them when the step was saved "
                               f"(ps-async saves while pushes are in flight), and a piece cut across them for this "
                               f"number of ps tasks cannot keep both. Resume with the number of ps tasks that wrote "
                               f"it, from another step, or start over with --no-resume")
        out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _show(value: Any) -> str:
    return repr(value.item()) if isinstance(value, torch.Tensor) else repr(value)
