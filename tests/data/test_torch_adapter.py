"""torch_adapter: tensors with structure and dtype kept, no copies, DataLoader workers, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conveyor.data import Dataset, StateMismatchError
from conveyor.data.torch_adapter import as_torch_dataset, to_tensors, to_torch


def test_structure_and_dtypes_are_kept():
    element = {
        "image": np.zeros((2, 3), np.uint8),
        "pair": (np.arange(3, dtype=np.int32), np.ones(2, np.float16)),
        "mask": np.array([True, False]),
        "names": np.array([b"a", b"bc"], dtype=object),
        "scalar": np.float32(1.5),
        "count": 7,
        "ratio": 0.25,
        "ok": True,
        "raw": b"\x00\x01",
        "text": "hi",
        "nested": [np.int64(3), None],
    }
    out = to_tensors(element)
    assert list(out) == list(element)
    assert out["image"].dtype == torch.uint8 and out["image"].shape == (2, 3)
    assert isinstance(out["pair"], tuple)
    assert out["pair"][0].dtype == torch.int32 and out["pair"][1].dtype == torch.float16
    assert out["mask"].dtype == torch.bool
    assert out["names"] == [b"a", b"bc"]
    assert out["scalar"].dim() == 0 and out["scalar"].dtype == torch.float32 and out["scalar"].item() == 1.5
    assert out["count"].dtype == torch.int64 and out["count"].dim() == 0
    assert out["ratio"].dtype == torch.float64
    assert out["ok"].dtype == torch.bool
    assert out["raw"] == b"\x00\x01" and out["text"] == "hi"
    assert isinstance(out["nested"], list) and out["nested"][0].item() == 3 and out["nested"][1] is None


def test_numpy_arrays_are_shared_not_copied():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = to_tensors(arr)
    assert t.data_ptr() == arr.__array_interface__["data"][0]
    t[0, 0] = 42
    assert arr[0, 0] == 42


def test_awkward_arrays_are_copied_safely():
    flipped = np.arange(4)[::-1]
    assert to_tensors(flipped).tolist() == [3, 2, 1, 0]
    frozen = np.arange(3)
    frozen.flags.writeable = False
    t = to_tensors(frozen)
    assert t.data_ptr() != frozen.__array_interface__["data"][0]
    assert to_tensors(np.arange(3, dtype=">i4")).tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match="set"):
        to_tensors({1, 2})


def _ds(n=20):
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    return Dataset.from_tensor_slices({"x": x, "y": np.arange(n)}).batch(3)


def test_to_torch_cpu_yields_tensors():
    batches = list(to_torch(_ds()))
    assert len(batches) == 7
    assert isinstance(batches[0]["x"], torch.Tensor) and batches[0]["x"].shape == (3, 2)
    assert torch.cat([b["y"] for b in batches]).tolist() == list(range(20))


def _stream(it):
    return [b["y"].tolist() for b in it]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3, 6, 7])
def test_state_dict_round_trip(k, lookahead):
    def make():
        it = to_torch(_ds().prefetch(2))
        it._lookahead = lookahead  # exercise the one-batch-ahead path on a CPU-only machine
        return it

    reference = _stream(make())
    it = make()
    head = [next(it)["y"].tolist() for _ in range(k)]
    state = json.loads(json.dumps(it.state_dict()))
    assert len(state["pending"]) == (1 if lookahead and 0 < k < 7 else 0)
    rest = _stream(it)
    resumed = make()
    resumed.load_state_dict(state)
    assert _stream(resumed) == rest
    assert head + rest == reference


def test_lookahead_on_another_device_keeps_the_count():
    it = to_torch(_ds(), device="meta")  # a device without data: checks the look-ahead bookkeeping
    first = next(it)
    assert first["x"].device.type == "meta"
    state = it.state_dict()
    assert len(state["pending"]) == 1
    resumed = to_torch(_ds(), device="meta")
    resumed.load_state_dict(state)
    assert [b["x"].shape[0] for b in resumed] == [3, 3, 3, 3, 3, 2]
    assert it.stats()["to_torch"]["lookahead"] is True


def test_lookahead_error_comes_after_the_batch_before_it():
    def source():
        yield np.zeros(2)
        raise KeyError("second batch")

    it = to_torch(source(), device="meta")
    assert next(it).shape == (2,)
    with pytest.raises(KeyError, match="second batch"):
        next(it)


def test_plain_iterator_state_loads_and_foreign_state_is_refused():
    inner = iter(_ds())
    next(inner)
    it = to_torch(_ds())
    it.load_state_dict(json.loads(json.dumps(inner.state_dict())))
    assert next(it)["y"].tolist() == [3, 4, 5]
    with pytest.raises(StateMismatchError):
        it.load_state_dict({"format": "something else"})
    with pytest.raises(TypeError, match="cannot save"):
        to_torch(iter([1, 2])).state_dict()


def test_stats_include_the_pipeline_stages():
    it = to_torch(_ds())
    next(it)
    stats = it.stats()
    assert stats["stages"] and stats["to_torch"]["elements"] == 1


def test_pin_memory_without_cuda_warns_and_converts():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning really happens")
    with pytest.warns(UserWarning, match="pin_memory"):
        it = to_torch(_ds(), pin_memory=True)
    assert next(it)["x"].shape == (3, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_batches_reach_the_gpu_on_a_side_stream_equal_to_the_cpu_ones():
    ds = Dataset.range(64).map(lambda i: {"x": np.full((4, 3), i, np.float32), "y": np.int64(i)}).batch(8)
    expected = list(to_torch(ds))
    it = to_torch(ds, device="cuda", pin_memory=True)
    got = list(it)
    assert len(got) == len(expected) == 8
    for g, e in zip(got, expected, strict=True):
        assert g["x"].device == torch.device("cuda", 0) and g["y"].device == torch.device("cuda", 0)
        assert torch.equal(g["x"].cpu(), e["x"]) and torch.equal(g["y"].cpu(), e["y"])
    it.close()


def _ids(loader):
    out = []
    for batch in loader:
        out.extend(int(v) for v in batch.reshape(-1))
    return out


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_dataloader_workers_yield_every_element_once(num_workers, persistent):
    ds = Dataset.range(40).shuffle(16).map(lambda x: np.int64(x))  # unseeded: workers must still agree
    loader = DataLoader(as_torch_dataset(ds), batch_size=4, num_workers=num_workers,
                        persistent_workers=persistent)
    epochs = [_ids(loader) for _ in range(2)]
    for ids in epochs:
        assert sorted(ids) == list(range(40))
    assert epochs[0] != epochs[1]  # reshuffled each epoch


def test_dataloader_with_a_per_worker_pipeline():
    def make(worker, workers):
        return Dataset.range(30).shard(workers, worker).batch(5)

    loader = DataLoader(as_torch_dataset(make), batch_size=None, num_workers=2)
    assert sorted(_ids(loader)) == list(range(30))
    with pytest.raises(TypeError, match="Dataset"):
        as_torch_dataset(42)
