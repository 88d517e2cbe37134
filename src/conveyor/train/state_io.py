"""PyTorch state as files without pickle: tensors go to safetensors, everything else to JSON.

    tensors, meta = flatten_state(optimizer.state_dict())
    save_tensors("optimizer.safetensors", tensors)             # raw tensor bytes, no code
    Path("optimizer.json").write_text(json.dumps(meta))          # the tree, tensors as references
    ...
    tensors, _ = load_tensors("optimizer.safetensors")
    optimizer.load_state_dict(unflatten_state(tensors, json.loads(Path("optimizer.json").read_text())))

`meta` is strict JSON that round-trips exactly (int keys, tuples, non-finite floats, numpy scalars and
bytes are tagged); tensor names are the tree's key paths, so a model's `model.safetensors` loads with
any safetensors tool. `rng_state` / `set_rng_state` capture every RNG the same way. Why no pickle and
the tags: `docs/training.md`, "State without pickle".
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from safetensors.torch import save_file

from conveyor.fileio import bytes_from_json, bytes_to_json, umask_mode

STATE_FORMAT = "conveyor.state"
STATE_VERSION = 1

_TAGS = ("__tensor__", "__ndarray__", "__dict__", "__tuple__", "__float__", "__npscalar__", "__bytes__")


# ---------------------------------------------------------------------------------------------------------------------
# state trees


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a state tree into `(tensors, meta)`: a flat name→tensor dict and a strict-JSON description.

    Accepts nested dicts/lists/tuples of tensors, numpy arrays and scalars, ints, floats, bools, None,
    str and bytes. Anything else raises `TypeError` naming where it sits, because silently dropping
    or stringifying it would make a checkpoint that resumes differently from the run that wrote it.
    The tensors are returned as given (no copy); `save_tensors` prepares them for disk.
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, (), tensors)
    return tensors, {"format": STATE_FORMAT, "version": STATE_VERSION, "tree": tree}


def unflatten_state(tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Any:
    """Rebuild the tree `flatten_state` split: the inverse of `flatten_state`.

    Dicts come back as dicts (an `OrderedDict` with its `_metadata` where the original had one, as
    a module's `state_dict()` does), int keys as ints, tuples as tuples. Raises `ValueError` if
    `meta` is from another format or version or references a tensor that `tensors` lacks.
    """
    if not isinstance(meta, Mapping) or meta.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} description (format={_get(meta, 'format')!r})")
    if meta.get("version") != STATE_VERSION:
        raise ValueError(
            f"{STATE_FORMAT} version {meta.get('version')!r} is not supported (this conveyor reads version "
            f"{STATE_VERSION}); load it with the conveyor version that wrote it"
        )
    if "tree" not in meta:
        raise ValueError(f"{STATE_FORMAT} description without a tree")
    try:
        return _decode(meta["tree"], tensors)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        # meta comes from a file: whatever shape it has, the caller gets one error type to name the file by
        raise ValueError(f"{STATE_FORMAT} tree is malformed: {e}") from e


def _get(meta: Any, key: str) -> Any:
    return meta.get(key) if isinstance(meta, Mapping) else type(meta).__name__


def _name(path: tuple[str, ...], tensors: Mapping[str, Any]) -> str:
    base = ".".join(path) or "tensor"
    name, n = base, 1
    while name in tensors:  # {"a.b": x, "a": {"b": y}} would collide; the meta records the exact name
        n += 1
        name = f"{base}#{n}"
    return name


def _where(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


def _encode(x: Any, path: tuple[str, ...], tensors: dict[str, Any]) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{_where(path)}: {x.layout} tensors cannot be stored in safetensors; call .to_dense()")
        name = _name(path, tensors)
        tensors[name] = x
        return {"__tensor__": name}
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biufc":
            raise TypeError(f"{_where(path)}: numpy arrays of dtype {x.dtype} cannot be stored without pickle")
        name = _name(path, tensors)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(x))
        return {"__ndarray__": name}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)  # IntEnum and friends become plain ints
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"__float__": repr(float(x))}
    if isinstance(x, np.generic):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"{_where(path)}: numpy scalars of dtype {x.dtype} cannot be stored without pickle")
        return {"__npscalar__": x.dtype.name, "value": _encode(x.item(), path, tensors)}
    if isinstance(x, (bytes, bytearray)):
        return {"__bytes__": bytes_to_json(x)}
    if isinstance(x, Mapping):
        return _encode_dict(x, path, tensors)
    if isinstance(x, tuple):  # includes torch.Size and named tuples (those come back as plain tuples)
        return {"__tuple__": [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(x)]
    raise TypeError(
        f"{_where(path)}: a {type(x).__module__}.{type(x).__qualname__} cannot be stored in a checkpoint without "
        f"pickle; convert it to tensors, numbers, strings, lists or dicts in the state_dict that produces it"
    )


def _encode_dict(d: Mapping[Any, Any], path: tuple[str, ...], tensors: dict[str, Any]) -> Any:
    plain = all(isinstance(k, str) and not k.startswith("__") for k in d)
    attrs = getattr(d, "_metadata", None)  # nn.Module.state_dict() keeps per-module versions here
    if plain and attrs is None:
        return {k: _encode(v, (*path, k), tensors) for k, v in d.items()}
    for k in d:
        if not isinstance(k, (str, int, float, bool, type(None))):
            raise TypeError(f"{_where(path)}: dict key {k!r} of type {type(k).__name__} cannot be stored in JSON")
    items = [[_encode(k, path, {}), _encode(v, (*path, str(k)), tensors)] for k, v in d.items()]
    out: dict[str, Any] = {"__dict__": items}
    if isinstance(attrs, Mapping):
        out["_metadata"] = _encode(dict(attrs), (*path, "_metadata"), tensors)
    return out


def _decode(x: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    tag = next((t for t in _TAGS if t in x), None)
    if tag is None:
        return {k: _decode(v, tensors) for k, v in x.items()}
    if tag in ("__tensor__", "__ndarray__"):
        name = x[tag]
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is described but missing from the tensor file")
        t = tensors[name]
        return t.numpy() if tag == "__ndarray__" else t
    if tag == "__dict__":
        items = [(_decode(k, tensors), _decode(v, tensors)) for k, v in x["__dict__"]]
        if "_metadata" not in x:
            return dict(items)
        d = OrderedDict(items)
        d._metadata = _decode(x["_metadata"], tensors)  # type: ignore[attr-defined]
        if not isinstance(d._metadata, dict):  # type: ignore[attr-defined]
            raise ValueError(f"_metadata is a {type(x['_metadata']).__name__}, not a dict")
        return d
    if tag == "__tuple__":
        if not isinstance(x["__tuple__"], list):
            raise ValueError(f"__tuple__ holds a {type(x['__tuple__']).__name__}, not a list")
        return tuple(_decode(v, tensors) for v in x["__tuple__"])
    if tag == "__float__":
        if x["__float__"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"__float__ holds {x['__float__']!r}, not 'nan', 'inf' or '-inf'")
        return float(x["__float__"])
    if tag == "__npscalar__":
        dtype, value = np.dtype(x["__npscalar__"]), _decode(x["value"], tensors)
        if dtype.kind not in "biuf" or isinstance(value, str) or not isinstance(value, (bool, int, float)):
            raise ValueError(f"__npscalar__ {x['__npscalar__']!r} with value {value!r}")
        return dtype.type(value)
    return bytes_from_json(x["__bytes__"])  # "__bytes__"


# ---------------------------------------------------------------------------------------------------------------------
# safetensors files


def save_tensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write `tensors` to a safetensors file at `path` (overwriting it; atomicity is the caller's job).

    safetensors refuses what a live state_dict routinely holds, so this prepares each tensor first:
    detached, moved to CPU, made contiguous, and cloned when its storage is already used by another
    tensor in the file (tied weights, views of one buffer). The file then holds independent copies;
    `load_state_dict` copies them back into the model's own (still tied) parameters.
    """
    save_file(_prepared(tensors), str(path), metadata=dict(metadata) if metadata else None)
    os.chmod(path, umask_mode())  # safetensors writes a 0600 temp file and renames it (see conveyor.fileio)


def state_to_bytes(state: Any) -> tuple[bytes, bytes]:
    """A state tree as (safetensors bytes, JSON bytes): a checkpoint part another task writes with `save_part`."""
    tensors, meta = flatten_state(state)
    return safetensors_save(_prepared(tensors)), json.dumps(meta, sort_keys=True).encode()


def state_from_bytes(tensor_bytes: bytes, json_bytes: bytes) -> Any:
    """The inverse of `state_to_bytes` (tensors on the CPU). Never executes anything from the bytes."""
    return unflatten_state(safetensors_load(tensor_bytes), json.loads(json_bytes))


def _prepared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` as safetensors accepts them (see `save_tensors`)."""
    seen: set[tuple[int, int]] = set()
    prepared: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() > 0:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key in seen:
                t = t.clone()
            else:
                seen.add(key)
        prepared[name] = t
    return prepared


def load_tensors(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file: `(tensors, header metadata)`. Never executes anything from the file."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, metadata


# ---------------------------------------------------------------------------------------------------------------------
# random number generators


def rng_state() -> dict[str, Any]:
    """Capture the Python, numpy (global), torch CPU and (if available) CUDA generators.

    The result is a state tree for `flatten_state`: Python's and numpy's states as JSON-able
    numbers, torch's as uint8 tensors (they are opaque byte blobs in torch's own layout).
    """
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    if np_state["bit_generator"] != "MT19937":  # the legacy global generator is always MT19937
        raise TypeError(f"numpy's global generator is {np_state['bit_generator']}, expected MT19937")
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": "MT19937",
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` captured; generators missing from `state` are left alone.

    CUDA states are restored for as many devices as both the saved state and this machine have: a
    job resumed on fewer or more GPUs cannot reproduce the old per-device streams anyway.
    """
    if "python" in state:
        p = state["python"]
        random.setstate((int(p["version"]), tuple(int(v) for v in p["internal"]), p["gauss_next"]))
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": n["bit_generator"],
                "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": int(n["pos"])},
                "has_gauss": int(n["has_gauss"]),
                "gauss": float(n["gauss"]),
            }
        )
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8, device="cpu").clone())
    if state.get("cuda") and torch.cuda.is_available():
        for i, s in enumerate(list(state["cuda"])[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(s, dtype=torch.uint8, device="cpu").clone(), i)


def rng_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """`rng_state()` as plain JSON (a worker's data state carries it): torch's byte blobs in base64."""
    return _map_blobs(state, _b64)


def rng_from_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """Undo `rng_to_json`: a state for `set_rng_state`."""
    return _map_blobs(state, _blob)


def _map_blobs(state: Mapping[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """`state` with torch's and CUDA's generator states passed through `convert`; Python's and numpy's as they are."""
    out = {k: v for k, v in state.items() if k in ("python", "numpy")}
    out["torch"] = convert(state["torch"])
    if "cuda" in state:
        out["cuda"] = [convert(s) for s in state["cuda"]]
    return out


def _b64(t: torch.Tensor) -> str:
    return bytes_to_json(t.cpu().numpy().tobytes())


def _blob(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes_from_json(s)), dtype=torch.uint8)
