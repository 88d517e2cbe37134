"""Element structures: flatten, stack, and encode them without pickle.

An element is a numpy array, a numpy scalar, a Python scalar (int, float, bool, None, str), `bytes`,
or a tuple / list / dict of elements. Two encodings exist, for two jobs:

- `to_json` / `from_json`: a JSON-serialisable form, used in iterator state (shuffle buffers,
  in-flight work), where states must survive a round trip through a checkpoint file.
- `pack` / `unpack`: a small JSON header plus one contiguous byte buffer holding every array's
  raw bytes, used to hand elements and whole batches between the pipeline's own processes
  (through pipes and shared memory) without pickling them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from conveyor.fileio import bytes_from_json, bytes_to_json

Element = Any

_SCALARS = (int, float, bool, str, type(None))


# --------------------------------------------------------------------------- JSON form


def to_json(x: Element) -> Any:
    """Encode an element as JSON-serialisable data (see `from_json`)."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, float, str)):
        return x
    if isinstance(x, bytes):
        return {"b": bytes_to_json(x)}
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        arr = np.asarray(x)
        if arr.dtype == object:
            return {"ob": [to_json(v) for v in arr.ravel().tolist()], "shape": list(arr.shape)}
        arr = _contiguous(arr)
        out = {"nd": bytes_to_json(arr.tobytes()), "dtype": arr.dtype.str,
               "shape": list(arr.shape)}
        if isinstance(x, np.generic):
            out["scalar"] = True
        return out
    if isinstance(x, tuple):
        return {"t": [to_json(v) for v in x]}
    if isinstance(x, list):
        return {"l": [to_json(v) for v in x]}
    if isinstance(x, dict):
        return {"d": [[k, to_json(v)] for k, v in x.items()]}
    raise TypeError(
        f"cannot save an element of type {type(x).__name__} in iterator state: elements must be numpy "
        f"arrays, scalars, bytes, str, or tuples/lists/dicts of them"
    )


def _contiguous(arr: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray turns 0-d arrays into 1-d ones: only call it when a copy is needed.
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def from_json(obj: Any) -> Element:
    """Decode the output of `to_json`."""
    if not isinstance(obj, dict):
        return obj
    if "b" in obj:
        return bytes_from_json(obj["b"])
    if "nd" in obj:
        arr = np.frombuffer(bytes_from_json(obj["nd"]), dtype=np.dtype(obj["dtype"]))
        arr = arr.reshape(obj["shape"]).copy()
        return arr[()] if obj.get("scalar") else arr
    if "ob" in obj:
        flat = np.empty(len(obj["ob"]), dtype=object)
        flat[:] = [from_json(v) for v in obj["ob"]]
        return flat.reshape(obj["shape"])
    if "t" in obj:
        return tuple(from_json(v) for v in obj["t"])
    if "l" in obj:
        return [from_json(v) for v in obj["l"]]
    if "d" in obj:
        return {k: from_json(v) for k, v in obj["d"]}
    raise ValueError(f"not an encoded element: {str(obj)[:80]}")


# --------------------------------------------------------------------------- structure


def flatten(x: Element) -> tuple[Any, list]:
    """Split an element into a structure description and its list of leaves."""
    if isinstance(x, (tuple, list)):
        specs, leaves = _flatten_each(x)
        return ("t" if isinstance(x, tuple) else "l", specs), leaves
    if isinstance(x, dict):
        specs, leaves = _flatten_each(x.values())
        return ("d", list(x), specs), leaves
    return None, [x]


def _flatten_each(items: Any) -> tuple[list, list]:
    specs, leaves = [], []
    for v in items:
        s, lv = flatten(v)
        specs.append(s)
        leaves.extend(lv)
    return specs, leaves


def unflatten(spec: Any, leaves: list) -> Element:
    it = iter(leaves)
    out = _build(spec, it)
    return out


def _build(spec, it):
    if spec is None:
        return next(it)
    kind = spec[0]
    if kind == "t":
        return tuple(_build(s, it) for s in spec[1])
    if kind == "l":
        return [_build(s, it) for s in spec[1]]
    return {k: _build(s, it) for k, s in zip(spec[1], spec[2], strict=True)}


def stack(elements: list[Element]) -> Element:
    """Stack a list of same-structured elements component-wise (what `batch` does).

    Numbers and arrays become one numpy array with a new leading axis; `bytes` and `str` become a
    1-D numpy object array, like a string tensor.
    """
    spec, columns = _columns(elements)
    return unflatten(spec, [_stack_column(c) for c in columns])


def _columns(elements: list[Element]) -> tuple[Any, list[list]]:
    """The shared structure of `elements` and, per leaf position, the list of leaves."""
    if not elements:
        raise ValueError("cannot stack an empty list of elements")
    spec, first = flatten(elements[0])
    columns: list[list] = [[leaf] for leaf in first]
    for i, el in enumerate(elements[1:], start=1):
        s, leaves = flatten(el)
        if s != spec or len(leaves) != len(columns):
            raise ValueError(
                f"cannot batch elements of different structure: element 0 is {_describe(elements[0])} but "
                f"element {i} is {_describe(el)}"
            )
        for col, leaf in zip(columns, leaves, strict=True):
            col.append(leaf)
    return spec, columns


def _is_string_column(col: list) -> bool:
    return isinstance(col[0], (bytes, str))


def _check_same_shape(col: list) -> None:
    shape = col[0].shape
    for v in col:
        if not isinstance(v, np.ndarray) or v.shape != shape:
            got = getattr(v, "shape", type(v).__name__)
            raise ValueError(f"cannot batch arrays of different shapes {shape} and {got}; resize them in map() first")


def _stack_column(col: list) -> np.ndarray:
    if _is_string_column(col):
        out = np.empty(len(col), dtype=object)
        out[:] = col
        return out
    if isinstance(col[0], np.ndarray):
        _check_same_shape(col)
        return np.stack(col)
    return np.asarray(col)


def stack_into(elements: list[Element], allocate) -> int:
    """`pack_into(stack(elements))` without the intermediate batch: each array column is stacked
    straight into the target buffer, which `allocate(nbytes)` returns (a shared-memory slot).

    For large batches this saves a full copy of the batch; the layout is the one `unpack` reads.
    Returns the number of bytes written.
    """
    spec, columns = _columns(elements)
    metas, plans = [], []
    for col in columns:
        if _is_string_column(col):
            metas.append(["o", [len(col)], [_obj_leaf(v) for v in col]])
            continue
        if isinstance(col[0], np.ndarray):
            _check_same_shape(col)
            dtype, shape, source = col[0].dtype, (len(col), *col[0].shape), col
            if dtype.kind == "O":
                metas.append(["o", list(shape), [_obj_leaf(v) for v in np.stack(col).ravel().tolist()]])
                continue
        else:
            source = np.asarray(col)
            dtype, shape = source.dtype, source.shape
        nbytes = int(np.prod(shape)) * dtype.itemsize
        metas.append(["a", dtype.str, list(shape), nbytes, False])
        plans.append((source, dtype, shape, nbytes))
    header = json.dumps([_spec_json(spec), metas], separators=(",", ":")).encode()
    total = _LEN.size + len(header)
    for plan in plans:
        total = _align(total) + plan[3]
    target = allocate(total)
    _LEN.pack_into(target, 0, len(header))
    pos = _LEN.size
    target[pos:pos + len(header)] = header
    pos += len(header)
    for source, dtype, shape, nbytes in plans:
        pos = _align(pos)
        dest = np.frombuffer(target, dtype=dtype, count=int(np.prod(shape)), offset=pos).reshape(shape)
        if isinstance(source, list):
            np.stack(source, out=dest)
        else:
            dest[...] = source
        pos += nbytes
    return pos


def unstack(batch: Element) -> list[Element]:
    """Split a batched element along its leading axis (what `unbatch` does)."""
    spec, leaves = flatten(batch)
    if not leaves:
        return []
    arrays = [np.asarray(leaf) if not isinstance(leaf, np.ndarray) else leaf for leaf in leaves]
    if any(a.ndim == 0 for a in arrays):
        raise ValueError("unbatch needs every component to have a leading (batch) dimension")
    n = len(arrays[0])
    for a in arrays:
        if len(a) != n:
            raise ValueError("unbatch needs every component to have the same leading dimension")
    out = []
    for i in range(n):
        row = [a[i] for a in arrays]
        out.append(unflatten(spec, row))
    return out


def _describe(x: Element) -> str:
    spec, leaves = flatten(x)
    return f"{spec} with {len(leaves)} component(s)"


# --------------------------------------------------------------------------- binary form

_LEN = struct.Struct("<I")
_ALIGN = 64


def pack(x: Element) -> tuple[bytes, list[memoryview]]:
    """Encode an element as (header, buffers): the header is JSON, the buffers raw array bytes.

    `packed_size` + `pack_into` write the same layout into one pre-allocated buffer (shared
    memory), which is how batches leave the pipeline's worker processes.
    """
    spec, leaves = flatten(x)
    metas, bufs = [], []
    for leaf in leaves:
        if isinstance(leaf, bytes):
            metas.append(["b", len(leaf)])
            bufs.append(memoryview(leaf))
        elif isinstance(leaf, (np.ndarray, np.generic)) and np.asarray(leaf).dtype != object:
            arr = _contiguous(np.asarray(leaf))
            metas.append(["a", arr.dtype.str, list(arr.shape), arr.nbytes, isinstance(leaf, np.generic)])
            bufs.append(memoryview(arr).cast("B") if arr.nbytes else memoryview(b""))
        elif isinstance(leaf, np.ndarray):  # object arrays: strings of a batched bytes feature
            metas.append(["o", list(leaf.shape), [_obj_leaf(v) for v in leaf.ravel().tolist()]])
        elif isinstance(leaf, _SCALARS):
            metas.append(["s", leaf])
        else:
            raise TypeError(f"cannot pass an element of type {type(leaf).__name__} between processes")
    header = json.dumps([_spec_json(spec), metas], separators=(",", ":")).encode()
    return header, bufs


def _obj_leaf(v):
    if isinstance(v, bytes):
        return {"b": bytes_to_json(v)}
    if isinstance(v, _SCALARS):
        return v
    raise TypeError(f"cannot pass an object array holding {type(v).__name__} between processes")


def _spec_json(spec):
    if spec is None:
        return None
    if spec[0] == "d":
        return ["d", spec[1], [_spec_json(s) for s in spec[2]]]
    return [spec[0], [_spec_json(s) for s in spec[1]]]


def _spec_from_json(j):
    if j is None:
        return None
    if j[0] == "d":
        return ("d", j[1], [_spec_from_json(s) for s in j[2]])
    return (j[0], [_spec_from_json(s) for s in j[1]])


def _align(pos: int) -> int:
    """Buffers start on 64-byte boundaries, so arrays viewing a page-aligned slot are aligned."""
    return (pos + _ALIGN - 1) & ~(_ALIGN - 1)


def packed_size(header: bytes, bufs: list[memoryview]) -> int:
    pos = _LEN.size + len(header)
    for b in bufs:
        pos = _align(pos) + b.nbytes
    return pos


def pack_into(target: memoryview, header: bytes, bufs: list[memoryview]) -> int:
    """Write `[u32 header length][header]` then each buffer at the next 64-byte boundary into
    `target`; return the bytes written."""
    _LEN.pack_into(target, 0, len(header))
    pos = _LEN.size
    target[pos:pos + len(header)] = header
    pos += len(header)
    for b in bufs:
        pos = _align(pos)
        n = b.nbytes
        target[pos:pos + n] = b
        pos += n
    return pos


def pack_bytes(x: Element) -> bytes:
    header, bufs = pack(x)
    out = bytearray(packed_size(header, bufs))
    pack_into(memoryview(out), header, bufs)
    return bytes(out)


def unpack(source: memoryview | bytes, copy: bool = True) -> Element:
    """Decode what `pack_into` wrote. With copy=False arrays are views into `source` (copied only where
    `source` does not start aligned for their dtype)."""
    src = memoryview(source)
    (hlen,) = _LEN.unpack_from(src, 0)
    pos = _LEN.size + hlen

    def take(nbytes: int) -> memoryview:
        nonlocal pos
        start = _align(pos)
        pos = start + nbytes
        return src[start:pos]

    return _decode(bytes(src[_LEN.size:_LEN.size + hlen]), take, copy)


def unpack_parts(header: memoryview | bytes, bufs: Sequence[memoryview | bytes], copy: bool = True) -> Element:
    """Decode what `pack` returned, its header and each buffer received apart (one frame each)."""
    parts = iter(bufs)

    def take(nbytes: int) -> memoryview:
        buf = memoryview(next(parts, b"")).cast("B")
        if buf.nbytes != nbytes:
            raise ValueError(f"an element's buffer has {buf.nbytes} bytes where its header says {nbytes}")
        return buf

    return _decode(bytes(header), take, copy)


def _decode(header: bytes, take: Callable[[int], memoryview], copy: bool) -> Element:
    spec_j, metas = json.loads(header)
    leaves = []
    for m in metas:
        kind = m[0]
        if kind == "b":
            leaves.append(bytes(take(m[1])))
        elif kind == "a":
            _, dtype, shape, nbytes, is_scalar = m
            arr = np.frombuffer(take(nbytes), dtype=np.dtype(dtype)).reshape(shape)
            if copy or arr.ctypes.data % arr.dtype.alignment:  # a view must be aligned (torch.from_numpy)
                arr = arr.copy()
            leaves.append(arr[()] if is_scalar else arr)
        elif kind == "o":
            flat = np.empty(len(m[2]), dtype=object)
            flat[:] = [from_json(v) for v in m[2]]
            leaves.append(flat.reshape(m[1]))
        else:
            leaves.append(m[1])
    return unflatten(_spec_from_json(spec_j), leaves)
