"""The whole model of one checkpoint step as a list of tensors read one at a time, whatever strategy wrote it.

    entries = model_entries(folder)          # [Entry(name, shape, dtype, nbytes, load), ...] in the model's order
    tensor = entries[0].load()               # read from the step's files now, not before

Each strategy's layout joined back to the model's own parameter names: the chief's ``model`` tree
(local, allreduce); the parameter servers' shards ``ps-<i>`` joined piece by piece in the placement's
element ranges (``param/<name>[start:stop]``), shaped as the chief's tree and cast to its dtype, the
buffers from that tree; the pipeline's ``stage-<i>`` parts (already under whole-model names; with
``--shard-stages`` each stage's ``stage-<i>-shard-<r>`` chunks joined as fsdp's); every fsdp rank's dim-0
chunks concatenated in rank order. Nothing is read until ``load`` is called, so an
export holds at most one shard of its output and one tensor of the step. The folder is trusted only
as far as its manifest: callers check it (sha256s) first; a layout that does not join raises
``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from conveyor.train.checkpoint.read import CheckpointError, damaged, part_path, read_manifest
from conveyor.train.state_io import unflatten_state

__all__ = ["Entry", "model_entries", "tree_header"]

# safetensors' dtype names (its header) to torch's: the size of a tensor is known before it is read
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


@dataclass(frozen=True)
class Entry:
    """One tensor of the model: its name, shape and dtype now, its values when ``load()`` is called."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Ref:
    """Tensor ``key`` of safetensors file ``path``, read only by ``load``."""

    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def load(self) -> torch.Tensor:
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(self.key)

    def entry(self, name: str) -> Entry:
        return Entry(name, self.shape, self.dtype, self.load)


def _refs(folder: Path, name: str) -> dict[str, _Ref]:
    """Every tensor of ``<name>`` in step ``folder`` by key, from the file's header alone."""
    path = part_path(folder, name)
    refs = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            piece = f.get_slice(key)
            dtype = _DTYPES.get(piece.get_dtype())
            if dtype is None:
                raise damaged(folder, path, f"tensor {key!r} has dtype {piece.get_dtype()}, which export cannot read")
            refs[key] = _Ref(path, key, tuple(piece.get_shape()), dtype)
    return refs


def _tree(folder: Path, name: str) -> Any:
    """State tree ``name`` (``<name>.json`` + ``<name>.safetensors``) with a `_Ref` where each tensor is."""
    meta_path = part_path(folder, f"{name}.json")
    try:
        return unflatten_state(_refs(folder, f"{name}.safetensors"), json.loads(meta_path.read_bytes()))
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(folder, meta_path, f"not a state tree ({e})") from e


def tree_header(folder: Path, name: str) -> Any:
    """Tree ``name`` of the step, tensors left unread (None: the step has no such tree): headers, shapes."""
    parts = read_manifest(folder)["parts"]
    return _tree(folder, name) if f"{name}.json" in parts and f"{name}.safetensors" in parts else None


def model_entries(folder: Path) -> list[Entry]:
    """The whole model stored in step ``folder`` (module docstring), in the model's order."""
    fsdp = tree_header(folder, "fsdp")
    if isinstance(fsdp, dict) and fsdp.get("format") == "conveyor.fsdp.shards":
        return _fsdp(folder, fsdp)
    header = tree_header(folder, "optimizer")
    if isinstance(header, dict) and header.get("format") == "conveyor.pipeline.stages":
        if header.get("shards"):  # --shard-stages: each stage's fsdp shards, joined stage by stage
            return [entry for i, base in enumerate(header["stages"]) for entry in _fsdp(folder, {
                "parts": [f"{base}-shard-{r}" for r in range(int(header["shards"]))], "sharded": header["sharded"][i]})]
        return [ref.entry(k) for part in header["stages"] for k, ref in _model(folder, part, part).items()]
    model = _model(folder, "model", "the chief's model tree")
    if isinstance(header, dict) and isinstance(header.get("shards"), list):
        return _ps(folder, model, header["shards"])
    return [ref.entry(k) for k, ref in model.items()]


def _model(folder: Path, name: str, what: str) -> dict[str, _Ref]:
    tree = tree_header(folder, name)
    if isinstance(tree, dict) and name != "model":
        tree = tree.get("model")
    if not isinstance(tree, dict) or not all(isinstance(v, _Ref) for v in tree.values()):
        trees = sorted(n[: -len(".json")] for n in read_manifest(folder)["parts"] if n.endswith(".json"))
        raise CheckpointError(f"checkpoint {folder} holds no model in {what} (it holds {trees}): it was not written "
                              f"by a conveyor Trainer's strategy, so export cannot tell the model's tensors")
    return tree


def _fsdp(folder: Path, header: dict[str, Any]) -> list[Entry]:
    """FSDP2 cuts each sharded tensor into dim-0 chunks, rank r holding chunk r (``torch.chunk``; later ranks may
    hold none): the chunks in rank order concatenate to it. The rest (buffers) is rank 0's."""
    ranks = [_model(folder, part, part) for part in header["parts"]]
    entries = []
    for name, ref in ranks[0].items():
        if name not in header["sharded"]:
            entries.append(ref.entry(name))
            continue
        chunks = [r[name] for r in ranks if name in r]
        shape = tuple(int(n) for n in header["sharded"][name])
        if sum(c.shape[0] if c.shape else 0 for c in chunks) != (shape[0] if shape else 0):
            raise damaged(folder, chunks[0].path, f"the fsdp shards of {name} do not join to the {list(shape)} "
                                                  f"the header says")
        entries.append(Entry(name, shape, ref.dtype, lambda cs=chunks: torch.cat([c.load() for c in cs], dim=0)))
    return entries


def _ps(folder: Path, model: dict[str, _Ref], shards: list[str]) -> list[Entry]:
    """The servers' parameters (the truth of a ps job: a resumed worker pulls them), joined by the placement's
    element ranges; the chief's tree gives their shapes and dtypes, and the buffers the servers do not hold."""
    from conveyor.strategies.ps.sharding import parse_piece_key

    pieces: dict[str, list[tuple[int, int, _Ref]]] = {}
    for shard in (s for s in shards if s.endswith(".safetensors")):
        for key, ref in _refs(folder, shard).items():
            if key.startswith("param/"):
                param, start, stop = parse_piece_key(key[len("param/"):])
                pieces.setdefault(param, []).append((start, stop, ref))
    entries = []
    for name, ref in model.items():
        own = sorted(pieces.pop(name, []), key=lambda p: p[0])
        if not own:
            entries.append(ref.entry(name))
            continue
        numel, end = math.prod(ref.shape), 0
        for start, stop, piece in own:
            if start != end:
                raise damaged(folder, piece.path, f"the pieces of {name} leave elements {end}..{start} out")
            end = stop
        if end != numel:
            raise damaged(folder, own[-1][2].path, f"the pieces of {name} cover {end} of its {numel} elements")
        entries.append(Entry(name, ref.shape, ref.dtype, lambda own=own, ref=ref: torch.cat(
            [p.load().reshape(-1) for _, _, p in own]).to(ref.dtype).reshape(ref.shape)))
    if pieces:
        raise CheckpointError(f"checkpoint {folder}: the ps shards hold {sorted(pieces)[:5]}, which the chief's model "
                              f"tree lacks: the step mixes two models")
    return entries
