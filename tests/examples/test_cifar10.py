"""The CIFAR-10 example, tiny: a few steps on generated data, a few on a converted archive, the hint without data.

One process each (the strategies are the launcher's and tested there); small batches, so `make test`
stays quick on two cores.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conveyor.cli.main import main as conveyor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "cifar10" / "train.py"
TINY = ["--batch-size", "8", "--max-steps", "2", "--log-every", "1"]


def _example():
    spec = importlib.util.spec_from_file_location("cifar10_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONVEYOR_DATA_DIR": str(tmp_path / "data"), "CONVEYOR_OUTPUT_DIR": str(tmp_path / "out"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240,
                          env=env, cwd=tmp_path)


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "summary.json").read_text())


def _binary_archive(path: Path, per_batch: int = 8) -> Path:
    """A cifar-10-binary.tar.gz in the official layout, with a few records per batch."""
    rng = np.random.default_rng(0)
    with tarfile.open(path, "w:gz") as tar:
        names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin", "batches.meta.txt"]
        for name in names:
            if name.endswith(".txt"):
                data = "\n".join(f"class{i}" for i in range(10)).encode()
            else:
                labels = rng.integers(0, 10, (per_batch, 1), dtype=np.uint8)
                data = np.concatenate([labels, rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)], 1).tobytes()
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_decode_reads_png_and_tensorflows_raw_planes():
    example = _example()
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    assert (example.decode(buf.getvalue()) == image).all()
    assert (example.decode(image.transpose(2, 0, 1).tobytes()) == image).all()
    with pytest.raises(ValueError, match="neither a PNG nor the 3,072 raw bytes"):
        example.decode(b"\x00" * 100)


def test_augment_is_a_window_of_the_padded_image_maybe_flipped():
    example = _example()
    image = (np.arange(32 * 32 * 3).reshape(32, 32, 3) % 251 + 1).astype(np.uint8)  # no zeros: padding shows
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
    windows = {(y, x, flip): (padded[y:y + 32, x:x + 32][:, ::-1] if flip else padded[y:y + 32, x:x + 32]).tobytes()
               for y in range(9) for x in range(9) for flip in (False, True)}
    np.random.seed(0)
    seen = set()
    for _ in range(64):
        out = example.augment(image)
        assert out.shape == (32, 32, 3)
        matches = {key for key, window in windows.items() if window == out.tobytes()}
        assert matches, "not a window of the padded image"
        seen |= matches
    assert {flip for _, _, flip in seen} == {False, True}
    assert len({(y, x) for y, x, _ in seen}) > 10
    assert example.normalise(image).shape == (3, 32, 32)


def test_resnet20_is_a_sequential_of_blocks_with_the_papers_size():
    example = _example()
    import torch

    model = example.ResNet(3, 10)
    assert isinstance(model, torch.nn.Sequential) and len(model) == 11
    assert 260_000 < sum(p.numel() for p in model.parameters()) < 280_000  # He et al.: 0.27M
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Three synthetic runs of 6 steps, seeds 3, 3 and 4, by name; shared by the smoke test and the seed test."""
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        folder = tmp_path_factory.mktemp(f"seed-{name}")
        runs[name] = folder, _run(folder, "--synthetic", "--synthetic-size", "64", "--batch-size", "8", "--max-steps",
                                  "6", "--log-every", "1", "--seed", str(seed))
    return runs


@pytest.mark.slow
@pytest.mark.timeout(600)  # builds the three seeded runs when it runs first
def test_synthetic_smoke_run(seeded):
    tmp_path, run = seeded["a"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = _summary(tmp_path)
    assert summary["steps"] == 6 and summary["strategy"] == "local"
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    assert "test accuracy" in run.stdout


def _losses(seeded, name: str) -> list[float]:
    folder, run = seeded[name]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("event") == "train"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_seed_reaches_the_augmentation_two_runs_with_one_seed_are_identical(seeded):
    """--seed reaches the shuffle and the map workers' crops and flips (conveyor.data.set_seed), not only the
    model's initial weights: two runs with one seed see the same batches, step for step."""
    first, again, other = (_losses(seeded, name) for name in ("a", "b", "c"))
    assert len(first) == 6 and first == again
    assert other != first


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trains_on_a_converted_archive_and_says_how_to_get_one(tmp_path):
    run = _run(tmp_path, *TINY)
    assert run.returncode != 0
    folder = tmp_path / "data" / "cifar10"
    assert "curl -LO https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in run.stderr, run.stderr[-3000:]
    assert f"conveyor data convert cifar-10-binary.tar.gz {folder} --shards 8" in run.stderr
    assert "--synthetic" in run.stderr

    archive = _binary_archive(tmp_path / "cifar-10-binary.tar.gz")
    assert conveyor(["data", "convert", str(archive), str(folder), "--shards", "2"]) == 0
    run = _run(tmp_path, *TINY)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert _summary(tmp_path)["steps"] == 2
