"""``tf.train.Example`` encoding and TensorFlow-style parsing into numpy.

Features have one of three kinds (bytes, int64, float32) and are always flat lists; shapes exist
only in the parsing spec (``FixedLenFeature``), as in TensorFlow. Decoding returns numpy arrays
because that is what the rest of the pipeline batches; strings stay ``bytes`` since their
encoding is the user's business.

``parse_single_example`` runs once per record, so it avoids numpy where a Python object is the
answer (a single string) and takes the packed bytes of large float lists directly instead of
iterating over protobuf containers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._proto import Example, Feature

__all__ = [
    "FixedLenFeature",
    "VarLenFeature",
    "decode_example",
    "encode_example",
    "parse_example",
    "parse_single_example",
]

_KIND = {"string": "bytes_list", "int64": "int64_list", "float32": "float_list"}
_NP_DTYPE = {"string": np.dtype(object), "int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}
_KIND_NAME = {"bytes_list": "string", "int64_list": "int64", "float_list": "float32"}
_DTYPE_ALIASES = {
    "string": "string",
    "bytes": "string",
    "str": "string",
    "int64": "int64",
    "int": "int64",
    "float32": "float32",
    "float": "float32",
}
_PACKED_MIN = 16  # from this many floats on, move packed bytes instead of Python floats


def _normalize_dtype(dtype: Any) -> str:
    """Map user spellings of the three Example dtypes to "string", "int64" or "float32"."""
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype)
    elif dtype is bytes or dtype is str:
        name = "string"
    else:
        try:
            np_dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            np_dtype = None
        name = {np.dtype(np.int64): "int64", np.dtype(np.float32): "float32", np.dtype(object): "string"}.get(
            np_dtype
        )
        if name is None and np_dtype is not None and np_dtype.kind == "S":
            name = "string"
    if name is None:
        raise ValueError(
            f"unsupported feature dtype {dtype!r}: tf.train.Example holds only 'string' (bytes), "
            f"'int64' and 'float32'"
        )
    return name


def _prepare_default(default_value: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """Convert a FixedLenFeature default once, so parsing only copies it."""
    size = math.prod(shape)
    if dtype == "string":
        values = np.asarray(default_value, dtype=object).reshape(-1)
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        if not all(isinstance(v, bytes) for v in values):
            raise ValueError(
                f"default_value for a 'string' feature must hold bytes or str, got {default_value!r}"
            )
        arr = np.empty(len(values), dtype=object)
        arr[:] = values
    else:
        arr = np.asarray(default_value, dtype=_NP_DTYPE[dtype]).reshape(-1)
    if arr.size == 1 and size != 1:
        arr = np.repeat(arr, size)
    if arr.size != size:
        raise ValueError(f"default_value has {arr.size} values but shape {list(shape)} needs {size}")
    if dtype == "string" and shape == ():
        return arr[0]
    return arr.reshape(shape)


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
    """A feature with exactly ``prod(shape)`` values in every Example, returned with ``shape``.

    Mirrors ``tf.io.FixedLenFeature``. ``default_value`` is used when the feature is absent; a
    single value is broadcast to the shape. Without a default, an absent feature is an error.
    """

    shape: Sequence[int]
    dtype: Any
    default_value: Any = None
    _default: Any = dataclasses.field(init=False, repr=False, compare=False, default=None)
    _size: int = dataclasses.field(init=False, repr=False, compare=False, default=1)

    def __post_init__(self) -> None:
        if isinstance(self.shape, int):
            shape: tuple[int, ...] = (self.shape,)
        else:
            try:
                shape = tuple(int(d) for d in self.shape)
            except (TypeError, ValueError):
                raise ValueError(
                    f"FixedLenFeature shape must be a list of ints, got {self.shape!r}"
                ) from None
        if any(d < 0 for d in shape):
            raise ValueError(f"FixedLenFeature shape must not have negative dimensions, got {list(shape)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "_size", math.prod(shape))
        object.__setattr__(self, "dtype", _normalize_dtype(self.dtype))
        if self.default_value is not None:
            object.__setattr__(self, "_default", _prepare_default(self.default_value, shape, self.dtype))


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
    """A feature with any number of values, returned as a 1-D array (``tf.io.VarLenFeature``).

    TensorFlow returns a SparseTensor; a flat array per example carries the same information.
    """

    dtype: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _normalize_dtype(self.dtype))


FeatureSpec = FixedLenFeature | VarLenFeature

# ---------------------------------------------------------------------------------------------
# Encoding


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _set_floats(feature, values: np.ndarray) -> None:
    """Fill a float_list; large arrays go in as packed little-endian bytes (no per-float work)."""
    flat = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
    float_list = feature.float_list
    if flat.size >= _PACKED_MIN:
        payload = flat.tobytes()
        float_list.MergeFromString(b"\x0a" + _varint(len(payload)) + payload)
    else:
        float_list.SetInParent()
        float_list.value.extend(flat.tolist())


def _set_array(feature, key: str, arr: np.ndarray) -> None:
    kind = arr.dtype.kind
    if kind in "iub":
        feature.int64_list.SetInParent()
        feature.int64_list.value.extend(arr.reshape(-1).tolist())
    elif kind == "f":
        _set_floats(feature, arr)
    elif kind in "SUO":
        _set_strings(feature, key, arr.reshape(-1).tolist())
    else:
        raise TypeError(f"feature {key!r}: numpy dtype {arr.dtype} cannot go in a tf.train.Example")


def _set_strings(feature, key: str, values: list) -> None:
    out = []
    for v in values:
        if isinstance(v, bytes):
            out.append(v)
        elif isinstance(v, str):
            out.append(v.encode("utf-8"))
        else:
            raise TypeError(f"feature {key!r}: cannot mix {type(v).__name__} values into a bytes_list")
    feature.bytes_list.SetInParent()
    feature.bytes_list.value.extend(out)


def _set_list(feature, key: str, values: Sequence) -> None:
    if len(values) == 0:
        raise ValueError(
            f"feature {key!r} is an empty list, whose kind cannot be known; pass a typed empty numpy "
            f"array instead, e.g. np.zeros(0, np.int64), np.zeros(0, np.float32) or "
            f"np.array([], dtype=object)"
        )
    first = values[0]
    if isinstance(first, (bytes, str)):
        _set_strings(feature, key, list(values))
        return
    has_float = False
    for v in values:
        if isinstance(v, (float, np.floating)):
            has_float = True
        elif not isinstance(v, (int, np.integer, np.bool_)):
            raise TypeError(
                f"feature {key!r}: list element of type {type(v).__name__} is not bytes, str, int or float "
                f"(nested data must be a numpy array, which is flattened)"
            )
    if has_float:
        _set_floats(feature, np.asarray(values, dtype=np.float32))
    else:
        feature.int64_list.SetInParent()
        feature.int64_list.value.extend([int(v) for v in values])


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize a dict to a ``tf.train.Example``.

    ``bytes``/``str`` (and lists of them) become a bytes_list (str as UTF-8); ints, bools and
    integer arrays an int64_list; floats and float arrays a float_list (stored as float32);
    numpy arrays of bytes/str/object a bytes_list. Arrays are flattened row-major, because an
    Example has no shapes. Map entries are written in key order, so equal dicts give equal bytes.
    """
    example = Example()
    fmap = example.features.feature
    for key, value in features.items():
        if not isinstance(key, str):
            raise TypeError(f"feature names must be str, got {key!r}")
        feature = fmap[key]
        if isinstance(value, (bytes, str)):
            _set_strings(feature, key, [value])
        elif isinstance(value, (bool, int, np.integer, np.bool_)):
            feature.int64_list.value.append(int(value))
        elif isinstance(value, (float, np.floating)):
            feature.float_list.value.append(float(value))
        elif isinstance(value, np.ndarray):
            _set_array(feature, key, value)
        elif isinstance(value, (list, tuple)):
            _set_list(feature, key, value)
        elif isinstance(value, Feature):
            feature.CopyFrom(value)
        else:
            raise TypeError(
                f"feature {key!r}: cannot encode a {type(value).__name__}; use bytes, str, int, float, "
                f"a list of one of those, or a numpy array"
            )
    return example.SerializeToString(deterministic=True)


# ---------------------------------------------------------------------------------------------
# Decoding


def _floats(float_list, n: int) -> np.ndarray:
    """The ``n`` values of a FloatList as float32.

    Fast path: re-serialised, a FloatList is normally just ``tag, length, packed floats``, so the
    values are the last ``4n`` bytes. Re-serialising normalises unpacked values and split packed
    runs, but keeps fields the schema does not know (after the values), so the bytes are trusted
    only when they are exactly as long as that canonical form: the packed field is always there,
    and anything else would add bytes. Unknown fields are dropped and the bytes looked at again
    (the message was parsed for this call alone); failing that, protobuf's own values are used.
    """
    if n >= _PACKED_MIN:
        size = 4 * n
        header = 1 + (size.bit_length() + 6) // 7  # tag byte + varint(size)
        raw = float_list.SerializeToString()
        if len(raw) != header + size:
            float_list.DiscardUnknownFields()
            raw = float_list.SerializeToString()
        if len(raw) == header + size and raw[0] == 0x0A:
            return np.frombuffer(raw, "<f4", count=n, offset=header).astype(np.float32)
    return np.fromiter(float_list.value, np.float32, n)


def _values(feature, kind: str) -> np.ndarray | list[bytes]:
    """All values of one feature: int64/float32 arrays, or a list of bytes."""
    if kind == "bytes_list":
        return list(feature.bytes_list.value)
    if kind == "int64_list":
        values = feature.int64_list.value
        return np.fromiter(values, np.int64, len(values))
    return _floats(feature.float_list, len(feature.float_list.value))


def decode_example(serialized: bytes) -> dict[str, np.ndarray | list[bytes]]:
    """Decode every feature of an Example without a spec.

    int64 features become ``np.int64`` arrays, floats ``np.float32`` arrays, bytes a list of
    ``bytes``; a feature with no kind set decodes to an empty list. Bytes that are not an Example
    raise ``google.protobuf.message.DecodeError``.
    """
    out: dict[str, np.ndarray | list[bytes]] = {}
    for key, feature in Example.FromString(serialized).features.feature.items():
        kind = feature.WhichOneof("kind")
        out[key] = [] if kind is None else _values(feature, kind)
    return out


def _object_array(values) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr


def _kind_error(key: str, dtype: str, kind: str) -> ValueError:
    actual = _KIND_NAME[kind]
    return ValueError(f"Feature {key!r}: expected dtype {dtype} but the Example holds {actual} values")


def _fixed(key: str, spec: FixedLenFeature, feature) -> Any:
    dtype = spec.dtype
    kind = None if feature is None else feature.WhichOneof("kind")
    if kind is None:  # absent, or present with no kind set: TensorFlow treats both as missing
        if spec.default_value is None:
            raise ValueError(f"Feature {key!r} is required but missing and has no default_value")
        default = spec._default
        return default if isinstance(default, bytes) else default.copy()
    if kind != _KIND[dtype]:
        raise _kind_error(key, dtype, kind)
    shape = spec.shape
    if kind == "bytes_list":
        values = feature.bytes_list.value
    elif kind == "int64_list":
        values = feature.int64_list.value
    else:
        values = feature.float_list.value
    n = len(values)
    size = spec._size
    if n != size:
        raise ValueError(
            f"Feature {key!r}: expected {size} values for shape {list(shape)} but the Example has {n}"
        )
    if kind == "bytes_list":
        return values[0] if shape == () else _object_array(values).reshape(shape)
    if shape == ():
        return np.array(values[0], dtype=_NP_DTYPE[dtype])
    if kind == "int64_list":
        arr = np.fromiter(values, np.int64, n)
    else:
        arr = _floats(feature.float_list, n)
    return arr.reshape(shape)


def _varlen(key: str, spec: VarLenFeature, feature) -> np.ndarray:
    dtype = spec.dtype
    kind = None if feature is None else feature.WhichOneof("kind")
    if kind is None:
        return np.empty(0, dtype=_NP_DTYPE[dtype])
    if kind != _KIND[dtype]:
        raise _kind_error(key, dtype, kind)
    if kind == "bytes_list":
        return _object_array(feature.bytes_list.value)
    return _values(feature, kind)


def parse_single_example(serialized: bytes, features: Mapping[str, FeatureSpec]) -> dict[str, Any]:
    """Parse one serialized Example by a spec, like ``tf.io.parse_single_example``.

    FixedLenFeature gives an array of exactly its shape (0-d for shape ``[]``; a scalar string is
    returned as ``bytes``, other string shapes as object arrays of bytes). VarLenFeature gives a
    1-D array (object array of bytes for strings), empty when absent. Features in the Example but
    not in the spec are ignored. Raises ValueError, naming the feature, for a missing required
    feature, a wrong value count or a wrong kind; bytes that are not an Example raise
    ``google.protobuf.message.DecodeError``.
    """
    fmap = Example.FromString(serialized).features.feature
    out: dict[str, Any] = {}
    get = fmap.get
    for key, spec in features.items():
        if isinstance(spec, FixedLenFeature):
            out[key] = _fixed(key, spec, get(key))
        elif isinstance(spec, VarLenFeature):
            out[key] = _varlen(key, spec, get(key))
        else:
            raise TypeError(
                f"spec for feature {key!r} must be FixedLenFeature or VarLenFeature, got {spec!r}"
            )
    return out


def parse_example(serialized: Sequence[bytes], features: Mapping[str, FeatureSpec]) -> dict[str, Any]:
    """Parse a batch of Examples: FixedLen results stacked on a new first axis, VarLen as lists.

    A FixedLen string feature of shape ``[]`` stacks into a 1-D object array of bytes.
    """
    parsed = [parse_single_example(s, features) for s in serialized]
    out: dict[str, Any] = {}
    for key, spec in features.items():
        column = [p[key] for p in parsed]
        if isinstance(spec, VarLenFeature):
            out[key] = column
        elif spec.dtype == "string":
            arr = np.empty((len(column), *spec.shape), dtype=object)
            for i, v in enumerate(column):
                arr[i] = v
            out[key] = arr
        else:
            out[key] = np.stack(column) if column else np.empty((0, *spec.shape), dtype=_NP_DTYPE[spec.dtype])
    return out
