"""Fuzz target: decode_example / parse_single_example, differential against protobuf's own
decoding of the same bytes (the values protobuf's containers hold) as the oracle.

Where protobuf parses ``data`` as a tf.train.Example, conveyor must return the same features
with the same values (floats bit for bit, except that any NaN matches any NaN); where protobuf
refuses it, conveyor must raise DecodeError, its documented error for bytes that are not an
Example.

The first byte says how deep the rest goes: 0 a whole Example; 1 a Feature, 2 a FloatList, 3 an
Int64List, each wrapped (by hand, so its bytes stay exactly as given) as the feature "f" of an
Example. Without that, the mutator must fix up three nested lengths to put an odd field inside a
FloatList, and in a minute of fuzzing it does not.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from conveyor.data.records import (
    Example,
    FixedLenFeature,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_single_example,
)

EXPECTED = (DecodeError,)

_DTYPE = {"bytes_list": "string", "int64_list": "int64", "float_list": "float32"}



def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _varint(len(body)) + body


def _example(data: bytes) -> bytes:
    """The Example that ``data`` stands for (see the module docstring)."""
    mode, body = (data[0], data[1:]) if data else (0, b"")
    if mode == 0:
        return body
    if mode == 2:
        body = _field(0x12, body)  # Feature.float_list
    elif mode == 3:
        body = _field(0x1A, body)  # Feature.int64_list
    entry = _field(0x0A, b"f") + _field(0x12, body)  # map entry: key, value
    return _field(0x0A, _field(0x0A, entry))  # Example.features, Features.feature


_FLOATS = np.arange(16, dtype="<f4").tobytes()
_FLOAT_LIST = b"\x0a\x40" + _FLOATS
SEEDS = [
    b"\x00" + encode_example({"img": np.arange(20, dtype=np.float32), "label": 7, "name": b"abc"}),
    b"\x00" + encode_example({"f": [1.5, -0.0, float("inf")], "i": np.arange(-3, 30), "s": [b"", b"x" * 30]}),
    b"\x00" + encode_example({"big": np.linspace(-1, 1, 300, dtype=np.float32)}),
    b"\x01" + _field(0x12, _FLOAT_LIST),
    b"\x02" + _FLOAT_LIST,
    b"\x02" + _FLOAT_LIST + b"\x10\x05",  # the issue's: a field FloatList does not know, after the values
    b"\x02" + b"".join(b"\x0d" + _FLOATS[i : i + 4] for i in range(0, 64, 4)),  # unpacked
    b"\x03" + _field(0x0A, b"".join(_varint(i) for i in range(40))),
    b"",
]


def _oracle(feature) -> tuple[str | None, list]:
    kind = feature.WhichOneof("kind")
    return kind, ([] if kind is None else list(getattr(feature, kind).value))


def _same(kind: str | None, want: list, got) -> bool:
    if kind is None or kind == "bytes_list":
        return list(got) == want and all(type(v) is bytes for v in got)
    if kind == "int64_list":
        return got.dtype == np.int64 and got.shape == (len(want),) and got.tolist() == want
    expected = np.array(want, dtype=np.float32)
    if got.dtype != np.float32 or got.shape != expected.shape:
        return False
    same_bits = got.view(np.uint32) == expected.view(np.uint32)
    return bool(np.all(same_bits | (np.isnan(got) & np.isnan(expected))))


def _specs(oracle: dict) -> tuple[dict, dict]:
    """A FixedLen spec of each feature's exact size (shape [] for one value) and a VarLen spec."""
    fixed, varlen = {}, {}
    for key, (kind, values) in oracle.items():
        dtype = _DTYPE.get(kind, "float32")
        varlen[key] = VarLenFeature(dtype)
        if kind is not None:
            fixed[key] = FixedLenFeature([] if len(values) == 1 else [len(values)], dtype)
    return fixed, varlen


def target(data: bytes) -> None:
    data = _example(data)
    try:
        example = Example.FromString(data)
    except DecodeError:
        try:
            decode_example(data)
        except DecodeError:
            pass
        else:
            raise AssertionError("protobuf refuses these bytes but decode_example accepted them") from None
        raise
    oracle = {key: _oracle(f) for key, f in example.features.feature.items()}
    decoded = decode_example(data)
    assert decoded.keys() == oracle.keys(), (decoded.keys(), oracle.keys())
    for key, (kind, want) in oracle.items():
        assert _same(kind, want, decoded[key]), (key, kind, want, decoded[key])
    fixed, varlen = _specs(oracle)
    parsed = parse_single_example(data, fixed)
    for key, spec in fixed.items():
        kind, want = oracle[key]
        got = parsed[key]
        if spec.shape == ():
            got = [got] if kind == "bytes_list" else got.reshape(1)
        assert _same(kind, want, got), (key, kind, want, parsed[key])
    parsed = parse_single_example(data, varlen)
    for key, (kind, want) in oracle.items():
        assert _same(kind, want, parsed[key]), (key, kind, want, parsed[key])
