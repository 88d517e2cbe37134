"""tf.train.Example encoding, decoding and spec-driven parsing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.data.records import (
    Example,
    Feature,
    FixedLenFeature,
    SequenceExample,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_example,
    parse_single_example,
)

# docs/tfdata-semantics.md §15: Example{"a": int64_list [1]}
VECTOR = bytes.fromhex("0a 0c 0a 0a 0a 01 61 12 05 1a 03 0a 01 01")


def _example(key: bytes, feature: bytes) -> bytes:
    """Hand-encode Example{features{feature{key: <feature bytes>}}} (lengths < 128)."""
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    return b"\x0a" + bytes([len(features)]) + features


def test_hand_encoded_vector():
    assert _example(b"a", bytes.fromhex("1a 03 0a 01 01")) == VECTOR
    for value in ([1], 1, np.array([1]), np.int64(1), True, (1,)):
        assert encode_example({"a": value}) == VECTOR
    assert decode_example(VECTOR)["a"].tolist() == [1]


def test_unpacked_repeated_scalars_are_accepted():
    unpacked_ints = bytes.fromhex("1a 06 08 01 08 02 08 7f")  # Int64List value=1,2,127 one by one
    decoded = decode_example(_example(b"a", unpacked_ints))["a"]
    assert decoded.dtype == np.int64 and decoded.tolist() == [1, 2, 127]
    floats = np.array([1.5, -2.0], "<f4").tobytes()
    unpacked_floats = b"\x12\x0a" + b"\x0d" + floats[:4] + b"\x0d" + floats[4:]
    decoded = decode_example(_example(b"f", unpacked_floats))["f"]
    assert decoded.dtype == np.float32 and decoded.tolist() == [1.5, -2.0]
    spec = {"f": FixedLenFeature([2], "float32")}
    assert parse_single_example(_example(b"f", unpacked_floats), spec)["f"].tolist() == [1.5, -2.0]


def test_messages_interoperate_with_encoder():
    ex = Example.FromString(encode_example({"s": "héllo", "n": [-1, 2**62], "x": 0.25}))
    fmap = ex.features.feature
    assert list(fmap["s"].bytes_list.value) == ["héllo".encode()]
    assert list(fmap["n"].int64_list.value) == [-1, 2**62]
    assert list(fmap["x"].float_list.value) == [0.25]
    feature = Feature()
    feature.int64_list.value.extend([4, 5])
    assert decode_example(encode_example({"k": feature}))["k"].tolist() == [4, 5]
    seq = SequenceExample()
    seq.feature_lists.feature_list["frames"].feature.add().bytes_list.value.append(b"f0")
    again = SequenceExample.FromString(seq.SerializeToString())
    assert again.feature_lists.feature_list["frames"].feature[0].bytes_list.value[0] == b"f0"


def test_encoding_is_deterministic_in_key_order():
    a = encode_example({"b": 1, "a": b"x", "c": [0.5, 1.5]})
    b = encode_example({"c": [0.5, 1.5], "a": b"x", "b": 1})
    assert a == b


def test_encode_kinds_and_decode_types():
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    floats = np.linspace(0, 1, 40, dtype=np.float64).reshape(4, 10)  # large enough for packed bytes
    decoded = decode_example(
        encode_example(
            {
                "bytes": b"\x00\xff",
                "str": "text",
                "strs": ["a", b"b"],
                "flag": False,
                "np_int": np.int32(-3),
                "float": 2.5,
                "np_float": np.float16(0.5),
                "mixed_numbers": [1, 2.5],
                "image": image,
                "floats": floats,
                "np_bytes": np.array([b"x", b"yz"]),
                "np_str": np.array(["p", "q"]),
                "np_obj": np.array([b"o", "u"], dtype=object),
                "empty_int": np.zeros(0, np.int64),
                "empty_float": np.zeros((0, 3), np.float32),
                "empty_bytes": np.array([], dtype=object),
            }
        )
    )
    assert decoded["bytes"] == [b"\x00\xff"]
    assert decoded["str"] == [b"text"]
    assert decoded["strs"] == [b"a", b"b"]
    assert decoded["flag"].tolist() == [0]
    assert decoded["np_int"].tolist() == [-3]
    assert decoded["float"].dtype == np.float32 and decoded["float"].tolist() == [2.5]
    assert decoded["np_float"].tolist() == [0.5]
    assert decoded["mixed_numbers"].dtype == np.float32 and decoded["mixed_numbers"].tolist() == [1.0, 2.5]
    assert decoded["image"].dtype == np.int64 and decoded["image"].tolist() == list(range(12))
    np.testing.assert_array_equal(decoded["floats"], floats.astype(np.float32).reshape(-1))
    assert decoded["np_bytes"] == [b"x", b"yz"]
    assert decoded["np_str"] == [b"p", b"q"]
    assert decoded["np_obj"] == [b"o", b"u"]
    assert decoded["empty_int"].dtype == np.int64 and decoded["empty_int"].size == 0
    assert decoded["empty_float"].dtype == np.float32 and decoded["empty_float"].size == 0
    assert decoded["empty_bytes"] == []


def test_encode_refuses_what_it_cannot_type():
    with pytest.raises(ValueError, match="typed empty numpy array"):
        encode_example({"e": []})
    with pytest.raises(TypeError, match="'thing'"):
        encode_example({"thing": object()})
    with pytest.raises(TypeError, match="'d'"):
        encode_example({"d": {"nested": 1}})
    with pytest.raises(TypeError, match="'mix'"):
        encode_example({"mix": [b"a", 1]})
    with pytest.raises(TypeError, match="'nest'"):
        encode_example({"nest": [[1, 2], [3, 4]]})
    with pytest.raises(TypeError, match="'c'"):
        encode_example({"c": np.array([1 + 2j])})
    with pytest.raises(TypeError, match="str"):
        encode_example({1: b"x"})


@settings(max_examples=40, deadline=None)
@given(
    ints=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=1, max_size=20),
    floats=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=40),
    blobs=st.lists(st.binary(max_size=20), min_size=1, max_size=5),
)
def test_property_encode_decode_round_trip(ints, floats, blobs):
    decoded = decode_example(encode_example({"i": ints, "f": np.array(floats, np.float32), "b": blobs}))
    assert decoded["i"].tolist() == ints
    assert decoded["f"].tolist() == floats
    assert decoded["b"] == blobs


# --- parse_single_example ------------------------------------------------------------------------


RECORD = encode_example(
    {
        "label": 7,
        "weight": 0.5,
        "name": "cat",
        "grid": np.arange(6).reshape(2, 3),
        "vec": np.arange(20, dtype=np.float32),
        "tags": [b"a", b"bb"],
        "extra": 1,
    }
)


def test_fixed_len_scalars_and_shapes():
    out = parse_single_example(
        RECORD,
        {
            "label": FixedLenFeature([], "int64"),
            "weight": FixedLenFeature((), np.float32),
            "name": FixedLenFeature([], "string"),
            "grid": FixedLenFeature([2, 3], np.int64),
            "vec": FixedLenFeature([4, 5], "float"),
            "tags": FixedLenFeature([2], "bytes"),
        },
    )
    assert set(out) == {"label", "weight", "name", "grid", "vec", "tags"}
    assert out["label"].shape == () and out["label"].dtype == np.int64 and out["label"] == 7
    assert out["weight"].shape == () and out["weight"].dtype == np.float32 and out["weight"] == 0.5
    assert out["name"] == b"cat" and type(out["name"]) is bytes
    np.testing.assert_array_equal(out["grid"], np.arange(6).reshape(2, 3))
    assert out["vec"].dtype == np.float32 and out["vec"].shape == (4, 5)
    np.testing.assert_array_equal(out["vec"].reshape(-1), np.arange(20))
    out["vec"][0, 0] = 99  # results are writable, independent arrays
    assert out["tags"].dtype == object and out["tags"].tolist() == [b"a", b"bb"]


def test_fixed_len_defaults():
    spec = {
        "missing_scalar": FixedLenFeature([], "int64", default_value=-1),
        "broadcast": FixedLenFeature([2, 2], "float32", default_value=1.5),
        "full": FixedLenFeature([3], "int64", default_value=[1, 2, 3]),
        "reshaped": FixedLenFeature([2, 2], "int64", default_value=[1, 2, 3, 4]),
        "text": FixedLenFeature([], "string", default_value="none"),
        "texts": FixedLenFeature([2], "string", default_value=[b"p", "q"]),
        "label": FixedLenFeature([], "int64", default_value=0),  # present: default unused
    }
    out = parse_single_example(RECORD, spec)
    assert out["missing_scalar"].shape == () and out["missing_scalar"] == -1
    assert out["broadcast"].dtype == np.float32 and out["broadcast"].tolist() == [[1.5, 1.5], [1.5, 1.5]]
    assert out["full"].tolist() == [1, 2, 3]
    assert out["reshaped"].tolist() == [[1, 2], [3, 4]]
    assert out["text"] == b"none"
    assert out["texts"].tolist() == [b"p", b"q"]
    assert out["label"] == 7
    out["full"][0] = 100  # must not leak into the next record's default
    assert parse_single_example(RECORD, spec)["full"].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="needs 4"):
        FixedLenFeature([2, 2], "int64", default_value=[1, 2, 3])


def test_fixed_len_errors_name_the_feature():
    with pytest.raises(ValueError, match="Feature 'x' is required but missing and has no default_value"):
        parse_single_example(RECORD, {"x": FixedLenFeature([], "int64")})
    with pytest.raises(ValueError, match=r"'grid'.*expected 4 .*has 6") as info:
        parse_single_example(RECORD, {"grid": FixedLenFeature([4], "int64")})
    assert "[4]" in str(info.value)
    with pytest.raises(ValueError, match=r"'tags'.*expected 1 .*has 2"):
        parse_single_example(RECORD, {"tags": FixedLenFeature([], "string")})
    with pytest.raises(ValueError, match=r"'name'.*int64.*string"):
        parse_single_example(RECORD, {"name": FixedLenFeature([], "int64")})
    with pytest.raises(ValueError, match=r"'label'.*float32.*int64"):
        parse_single_example(RECORD, {"label": VarLenFeature("float32")})
    with pytest.raises(TypeError, match="'label'"):
        parse_single_example(RECORD, {"label": "int64"})


def test_var_len():
    out = parse_single_example(
        RECORD,
        {
            "grid": VarLenFeature("int64"),
            "vec": VarLenFeature(np.float32),
            "tags": VarLenFeature("string"),
            "nothing": VarLenFeature("int64"),
            "no_text": VarLenFeature("string"),
        },
    )
    assert out["grid"].dtype == np.int64 and out["grid"].tolist() == list(range(6))
    assert out["vec"].dtype == np.float32 and out["vec"].tolist() == list(range(20))
    assert out["tags"].dtype == object and out["tags"].tolist() == [b"a", b"bb"]
    assert out["nothing"].dtype == np.int64 and out["nothing"].shape == (0,)
    assert out["no_text"].dtype == object and out["no_text"].shape == (0,)


def test_feature_present_without_kind_counts_as_missing():
    record = _example(b"k", b"")
    assert parse_single_example(record, {"k": FixedLenFeature([], "int64", default_value=5)})["k"] == 5
    assert parse_single_example(record, {"k": VarLenFeature("float32")})["k"].size == 0
    assert decode_example(record) == {"k": []}


@pytest.mark.parametrize("dtype", ["int32", "float64", "uint8", np.int32, 3, "STRING"])
def test_unsupported_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="int64"):
        FixedLenFeature([], dtype)
    with pytest.raises(ValueError, match="float32"):
        VarLenFeature(dtype)


def test_specs_normalise_and_compare():
    assert FixedLenFeature([2], "float") == FixedLenFeature((2,), np.float32)
    assert FixedLenFeature(3, bytes).shape == (3,)
    assert VarLenFeature(np.int64) == VarLenFeature("int64")
    with pytest.raises(ValueError, match="negative"):
        FixedLenFeature([-1], "int64")
    with pytest.raises(ValueError, match="shape"):
        FixedLenFeature(["a"], "int64")
    with pytest.raises(AttributeError):
        VarLenFeature("int64").dtype = "float32"


def test_parse_example_batches():
    records = [encode_example({"x": [i, i + 1], "s": f"r{i}", "v": list(range(i))}) for i in range(1, 4)]
    spec = {
        "x": FixedLenFeature([2], "int64"),
        "s": FixedLenFeature([], "string"),
        "v": VarLenFeature("int64"),
    }
    out = parse_example(records, spec)
    assert out["x"].shape == (3, 2) and out["x"].tolist() == [[1, 2], [2, 3], [3, 4]]
    assert out["s"].dtype == object and out["s"].tolist() == [b"r1", b"r2", b"r3"]
    assert [v.tolist() for v in out["v"]] == [[0], [0, 1], [0, 1, 2]]
    empty = parse_example([], {"x": FixedLenFeature([2], "int64")})
    assert empty["x"].shape == (0, 2)


def test_matches_tensorflow_example_encoding():
    tf = pytest.importorskip("tensorflow")
    values = {"a": [1], "b": b"xyz", "c": [0.25, 0.5], "d": np.arange(5)}
    ours = encode_example(values)
    theirs = tf.train.Example(
        features=tf.train.Features(
            feature={
                "a": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
                "b": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"xyz"])),
                "c": tf.train.Feature(float_list=tf.train.FloatList(value=[0.25, 0.5])),
                "d": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(5)))),
            }
        )
    ).SerializeToString(deterministic=True)
    assert ours == theirs
    assert (
        encode_example({"a": [1]})
        == tf.train.Example(
            features=tf.train.Features(
                feature={"a": tf.train.Feature(int64_list=tf.train.Int64List(value=[1]))}
            )
        ).SerializeToString()
    )
    parsed = tf.io.parse_single_example(ours, {"d": tf.io.FixedLenFeature([5], tf.int64)})
    assert parsed["d"].numpy().tolist() == list(range(5))
