"""The input-pipeline benchmark's workloads: per-record functions, the `Workload` table, and the
generation of their TFRecord shards (cached by a manifest). Used by `pipeline.py` and the case studies.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from conveyor.data import FixedLenFeature, parse_single_example
from conveyor.data.convert import convert_arrays

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by file path
from machine import now_iso  # noqa: E402

GENERATOR_VERSION = 1

# ---------------------------------------------------------------------------------------------
# Per-record functions: one plain Python function per workload, identical for every contender.
# Random augmentation uses the global numpy RNG: conveyor reseeds it per chunk in its workers,
# DataLoader seeds it in each of its workers.
# ---------------------------------------------------------------------------------------------

FEATURES = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")}

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def cifar_fn(record: bytes) -> tuple[np.ndarray, np.int64]:
    """Parse, decode a 32x32 JPEG, pad 4 + random crop 32x32, random flip, normalise, CHW."""
    ex = parse_single_example(record, FEATURES)
    img = np.asarray(Image.open(io.BytesIO(ex["image"])).convert("RGB"))
    img = np.pad(img, ((4, 4), (4, 4), (0, 0)), mode="constant")
    top, left = np.random.randint(0, 9, size=2)
    img = img[top:top + 32, left:left + 32]
    if np.random.rand() < 0.5:
        img = img[:, ::-1]
    img = (img.astype(np.float32) / 255 - CIFAR_MEAN) / CIFAR_STD
    return np.ascontiguousarray(img.transpose(2, 0, 1)), np.int64(ex["label"])


def chexnet_fn(record: bytes) -> tuple[np.ndarray, np.int64]:
    """Parse, decode a 256x256 JPEG, random crop 224x224, random flip, normalise, CHW."""
    ex = parse_single_example(record, FEATURES)
    img = np.asarray(Image.open(io.BytesIO(ex["image"])).convert("RGB"))
    top = np.random.randint(0, img.shape[0] - 224 + 1)
    left = np.random.randint(0, img.shape[1] - 224 + 1)
    img = img[top:top + 224, left:left + 224]
    if np.random.rand() < 0.5:
        img = img[:, ::-1]
    img = (img.astype(np.float32) / 255 - IMAGENET_MEAN) / IMAGENET_STD
    return np.ascontiguousarray(img.transpose(2, 0, 1)), np.int64(ex["label"])


# ---------------------------------------------------------------------------------------------
# Workloads and their generation
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    num_images: int
    num_shards: int
    image_size: int
    crop: int                 # output is (3, crop, crop) float32
    batch_size: int
    fn: Callable[[bytes], tuple[np.ndarray, np.int64]]
    records: int              # records per measurement (default)
    memory_shards: int        # shards read by the 5-epoch memory run (a subset keeps it short)
    num_classes: int = 10
    seed: int = 0
    quality: int = 90
    goal_vs_dataloader: float = 1.3

    def generator_params(self) -> dict[str, Any]:
        return {"generator_version": GENERATOR_VERSION, "workload": self.name, "num_images": self.num_images,
                "num_shards": self.num_shards, "image_size": self.image_size, "num_classes": self.num_classes,
                "seed": self.seed, "quality": self.quality}

    def describe(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fn"] = self.fn.__name__
        return d


WORKLOADS: dict[str, Workload] = {
    "cifar": Workload("cifar", 50_000, 16, 32, 32, 128, cifar_fn, records=20_000, memory_shards=4,
                      num_classes=10, seed=1, goal_vs_dataloader=1.3),
    "chexnet": Workload("chexnet", 3_000, 8, 256, 224, 32, chexnet_fn, records=1_500, memory_shards=4,
                        num_classes=14, seed=2, goal_vs_dataloader=1.1),
}
QUICK_WORKLOADS: dict[str, Workload] = {
    "cifar": Workload("cifar-quick", 8_000, 16, 32, 32, 128, cifar_fn, records=3_000, memory_shards=4,
                      num_classes=10, seed=3, goal_vs_dataloader=1.3),
    "chexnet": Workload("chexnet-quick", 800, 8, 256, 224, 32, chexnet_fn, records=400, memory_shards=4,
                        num_classes=14, seed=4, goal_vs_dataloader=1.1),
}


def make_images(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """`n` uint8 RGB images: per channel a random linear ramp in x and y plus a low-frequency sine,
    plus Gaussian noise (sigma 8). Smooth enough to compress like photos, never flat."""
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    x = t[None, None, :, None] - 0.5
    y = t[None, :, None, None] - 0.5

    def u(lo: float, hi: float, shape: tuple[int, ...]) -> np.ndarray:
        return rng.uniform(lo, hi, size=shape).astype(np.float32)

    base = u(60, 190, (n, 1, 1, 3))
    gx, gy = u(-90, 90, (n, 1, 1, 3)), u(-90, 90, (n, 1, 1, 3))
    amp = u(5, 40, (n, 1, 1, 3))
    fx, fy = u(0.3, 2.5, (n, 1, 1, 1)), u(0.3, 2.5, (n, 1, 1, 1))
    phase = u(0, 2 * np.pi, (n, 1, 1, 3))
    img = base + gx * x + gy * y + amp * np.sin(2 * np.pi * (fx * x + fy * y) + phase)
    img += 8.0 * rng.standard_normal((n, size, size, 3), dtype=np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _manifest_ok(folder: Path, wl: Workload) -> dict | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("params") != wl.generator_params():
        return None
    for shard in manifest.get("shards", []):
        path = folder / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            return None
    if sum(s["records"] for s in manifest.get("shards", [])) != wl.num_images:
        return None
    return manifest


def _write_shards(wl: Workload, folder: Path, progress: bool) -> dict[str, Any]:
    """Generate the images chunk by chunk into a memory-mapped array (the largest workload is 590 MB of
    pixels), then let `conveyor.data.convert_arrays` encode the JPEGs and deal the rows round-robin
    over the shards; return the manifest."""
    rng = np.random.default_rng(wl.seed)
    size = wl.image_size
    images = np.lib.format.open_memmap(folder / "images.npy", mode="w+", dtype=np.uint8,
                                       shape=(wl.num_images, size, size, 3))
    labels = np.empty(wl.num_images, dtype=np.int64)
    chunk = max(1, (1 << 20) // (size * size))  # ~1 M pixels per numpy chunk
    t0 = time.perf_counter()
    for start in range(0, wl.num_images, chunk):
        n = min(chunk, wl.num_images - start)
        images[start:start + n] = make_images(rng, n, size)
        labels[start:start + n] = rng.integers(0, wl.num_classes, size=n)
    summary = convert_arrays({"image": images, "label": labels}, folder, wl.num_shards, image_keys=("image",),
                             image_format="jpeg", quality=wl.quality, progress=progress, source=wl.name)
    del images
    (folder / "images.npy").unlink()
    shards = summary["splits"]["train"]["shards"]
    return {"params": wl.generator_params(), "generated": now_iso(),
            "generation_seconds": round(time.perf_counter() - t0, 2),
            "shards": [{**s, "bytes": (folder / s["file"]).stat().st_size} for s in shards]}


def generate_workload(wl: Workload, data_root: Path, progress: bool = True) -> tuple[list[str], dict]:
    """The workload's shard files (sorted) and manifest, generating them unless already cached."""
    folder = Path(data_root) / f"{wl.name}-v{GENERATOR_VERSION}"
    manifest = _manifest_ok(folder, wl)
    if manifest is None:
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        manifest = _write_shards(wl, tmp, progress)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    files = sorted(str(folder / s["file"]) for s in manifest["shards"])
    return files, manifest


def file_pattern(files: Sequence[str]) -> str:
    return os.path.join(os.path.dirname(files[0]), "train-*.tfrecord")

