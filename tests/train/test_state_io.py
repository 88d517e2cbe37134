"""state_io: state trees ↔ safetensors + JSON without pickle, and RNG capture/restore."""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from conveyor.train.state_io import (
    flatten_state,
    load_tensors,
    rng_from_json,
    rng_state,
    rng_to_json,
    save_tensors,
    set_rng_state,
    unflatten_state,
)


def file_round_trip(tree, tmp_path, name="t"):
    """What a checkpoint does: tensors through a safetensors file, the rest through JSON text."""
    tensors, meta = flatten_state(tree)
    text = json.dumps(meta, allow_nan=False)  # strict JSON: no NaN/Infinity tokens
    save_tensors(tmp_path / f"{name}.safetensors", tensors)
    loaded, _ = load_tensors(tmp_path / f"{name}.safetensors")
    return unflatten_state(loaded, json.loads(text))


def assert_tree_equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_mixed_tree_round_trips_through_files(tmp_path):
    tree = {
        "state": {0: {"momentum_buffer": torch.arange(6.0).reshape(2, 3)}, 7: {"step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 7], "foreach": None, "fused": False}],
        "odd floats": [math.inf, -math.inf, math.nan, 1e-300],
        "text": "ünïcode",
        "blob": b"\x00\xffbytes",
        "np": {"arr": np.arange(5, dtype=np.int16), "f": np.float32(1.5), "b": np.bool_(True)},
        "__tensor__": "a user key that looks like a tag",
        "mixed keys": {1: "one", "1": "string one", None: 0, 2.5: "float", False: "bool"},
        "empty": {"list": [], "dict": {}, "tensor": torch.zeros(0, 3)},
        "dtypes": [
            torch.ones(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8)
        ],
    }
    back = file_round_trip(tree, tmp_path)
    assert_tree_equal(tree, back)
    assert list(back["state"]) == [0, 7]  # int keys come back as ints, in order
    assert isinstance(back["param_groups"][0]["betas"], tuple)


def test_model_state_dict_keeps_its_names_and_metadata(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    sd = model.state_dict()
    tensors, _ = flatten_state(sd)
    assert list(tensors) == list(sd)  # model.safetensors is readable by any safetensors tool
    back = file_round_trip(sd, tmp_path)
    assert isinstance(back, OrderedDict) and back._metadata == sd._metadata
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(back)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values(), strict=True))


def test_colliding_paths_get_distinct_tensor_names(tmp_path):
    tree = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    tensors, _ = flatten_state(tree)
    assert len(tensors) == 2
    assert_tree_equal(tree, file_round_trip(tree, tmp_path))


def test_unsupported_values_are_refused_with_their_path():
    with pytest.raises(TypeError, match=r"param_groups\.0\.fn"):
        flatten_state({"param_groups": [{"fn": lambda: 0}]})
    with pytest.raises(TypeError, match="to_dense"):
        flatten_state({"w": torch.eye(2).to_sparse()})
    with pytest.raises(TypeError, match="object"):
        flatten_state({"x": np.array(["a", None], dtype=object)})


def test_foreign_or_incomplete_meta_is_refused():
    tensors, meta = flatten_state({"w": torch.ones(1)})
    with pytest.raises(ValueError, match="missing"):
        unflatten_state({}, meta)
    with pytest.raises(ValueError, match="version"):
        unflatten_state(tensors, {**meta, "version": 99})
    with pytest.raises(ValueError, match="not a conveyor.state"):
        unflatten_state(tensors, {"tree": {}})



@pytest.mark.parametrize("tree", [
    {"__dict__": 5}, {"__dict__": [[1]]}, {"__dict__": [[[], 1]]}, {"__tensor__": ["w"]}, {"__float__": 3},
    {"__npscalar__": "nope", "value": 1}, {"__npscalar__": "float32", "value": "x"}, {"__npscalar__": "float32"},
    {"__bytes__": "@@"}, {"__bytes__": 7}, {"__tuple__": 1}, {"__float__": "one"}, {"__dict__": [], "_metadata": 1},
])
def test_malformed_meta_is_a_value_error(tree):
    """Meta comes from a file: whatever its shape, reading it fails with ValueError, never TypeError or KeyError."""
    with pytest.raises(ValueError, match="tree"):
        unflatten_state({"w": torch.ones(1)}, {"format": "conveyor.state", "version": 1, "tree": tree})
    with pytest.raises(ValueError, match="tree"):
        unflatten_state({}, {"format": "conveyor.state", "version": 1})

def test_save_tensors_handles_what_safetensors_refuses(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    emb = nn.Parameter(torch.randn(5, 2))
    tensors = {
        "transposed": base.t(),  # non-contiguous
        "view_a": base[0],  # shares base's storage ...
        "base": base,
        "view_b": base[1:],  # ... and so does this
        "tied_1": emb,  # the same parameter twice, as tied weights appear in a state_dict
        "tied_2": emb,
        "scalar": torch.tensor(7, dtype=torch.int32),
    }
    save_tensors(tmp_path / "x.safetensors", tensors, {"k": "v"})
    back, metadata = load_tensors(tmp_path / "x.safetensors")
    assert metadata["k"] == "v"
    for k, t in tensors.items():
        assert torch.equal(back[k], t.detach()), k
    back["tied_1"].add_(1)  # loaded tensors are independent
    assert not torch.equal(back["tied_1"], back["tied_2"])


def _draws():
    return (
        [random.random(), random.gauss(0, 1), random.randrange(1000)],
        np.concatenate([np.random.rand(3), np.random.standard_normal(3)]).tolist(),
        torch.randn(4).tolist(),
    )


def test_rng_round_trip_through_files(tmp_path):
    random.gauss(0, 1)  # leave a cached gaussian in both Python's and numpy's generators
    np.random.standard_normal()
    state = rng_state()
    expected = _draws()
    _draws()  # move every generator on
    set_rng_state(file_round_trip(state, tmp_path, "rng"))
    assert _draws() == expected
    tensors, meta = flatten_state(state)
    assert tensors["torch"].dtype == torch.uint8
    assert meta["tree"]["numpy"]["bit_generator"] == "MT19937"


def test_partial_rng_state_leaves_other_generators_alone():
    random.seed(1)
    torch.manual_seed(2)
    state = rng_state()
    a = (random.random(), torch.rand(1).item())
    set_rng_state({"torch": state["torch"]})
    assert torch.rand(1).item() == a[1]
    assert random.random() != a[0]


def test_bytes_keep_their_json_form():
    """Checkpoints and data states written before the shared codec (conveyor.fileio) still load: same base64."""
    import base64

    _, meta = flatten_state({"blob": b"\x00\xff"})
    assert meta["tree"] == {"blob": {"__bytes__": "AP8="}}
    assert unflatten_state({}, meta) == {"blob": b"\x00\xff"}

    state = rng_state()
    as_json = rng_to_json(state)
    assert as_json["torch"] == base64.b64encode(state["torch"].numpy().tobytes()).decode("ascii")
    assert torch.equal(rng_from_json(as_json)["torch"], state["torch"])
