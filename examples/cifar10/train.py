"""CIFAR-10 with a ResNet-20: the CIFAR-10 case study, under every strategy conveyor has.

    curl -LO https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz        # once (or cifar-10-python.tar.gz)
    conveyor data convert cifar-10-binary.tar.gz data/cifar10 --shards 8
    conveyor run -n 2 --data-dir data --output-dir runs/cifar10 examples/cifar10/train.py --epochs 30
    conveyor run -n 2 --ps 1 --strategy ps-sync --data-dir data examples/cifar10/train.py   # or ps-async, ps-ssp:4
    conveyor run -n 2 --strategy pipeline --stages 2 --data-dir data examples/cifar10/train.py
    python examples/cifar10/train.py --synthetic --max-steps 20             # no data needed: a smoke test

The script runs under whatever strategy the job has (`conveyor run --strategy allreduce|ps-sync|
ps-async|ps-ssp:K|pipeline`). The model is an `nn.Sequential` of a stem, 3n residual blocks and a
head, so `--strategy pipeline --stages S` needs nothing more (the stages are balanced by parameter
bytes; `--split 4,8` cuts before those blocks); the stages call the blocks directly, so the model's
bfloat16 autocast does not reach them and pipelined runs train in float32. Each worker reads its own
shards of `<data-dir>/cifar10/train-*.tfrecord`, decodes (PNG, or the raw 3,072-byte planes of
`--image-format raw` and of TensorFlow's own generator), pads by 4 and crops back to 32×32 at
random, flips half the images, and normalises, in forked worker processes (their RNGs are reseeded
per batch from `--seed`, through `conveyor.data.set_seed`, so a resumed job, and another run with the
same seed, sees the same crops). On a GPU the forward pass runs in bfloat16
autocast (`--no-amp` turns it off). Checkpoints, metrics, traces and plots go to the job's output
folder. Shards of CIFAR-100 train too: the number of classes is read from the `classes.txt` the
converter writes.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

import conveyor
from conveyor.data import AUTOTUNE, Dataset, FixedLenFeature, TFRecordDataset, parse_single_example, set_seed

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
FEATURES = {"image": FixedLenFeature([], "string"), "label": FixedLenFeature([], "int64")}
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32) * 255
STD = np.array([0.2470, 0.2435, 0.2616], np.float32) * 255
PNG = b"\x89PNG\r\n\x1a\n"
PAD = 4


# ------------------------------------------------------------------------------ data


def decode(image: bytes) -> np.ndarray:
    """A 32×32×3 uint8 image from a PNG or from the 3,072 bytes of R, G, B planes (TensorFlow's layout)."""
    if image.startswith(PNG):
        return np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
    if len(image) == 3 * 32 * 32:
        return np.frombuffer(image, np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)
    raise ValueError(f"an image of {len(image)} bytes is neither a PNG nor the 3,072 raw bytes of a CIFAR image")


def augment(image: np.ndarray) -> np.ndarray:
    """Pad-crop and flip, with numpy's global RNG: the map's worker processes reseed it per batch."""
    padded = np.pad(image, ((PAD, PAD), (PAD, PAD), (0, 0)))
    y, x = np.random.randint(0, 2 * PAD + 1, size=2)
    image = padded[y:y + 32, x:x + 32]
    return image[:, ::-1] if np.random.rand() < 0.5 else image


def normalise(image: np.ndarray) -> np.ndarray:
    return ((image.astype(np.float32) - MEAN) / STD).transpose(2, 0, 1).copy()  # HWC → CHW, as torch wants


def example(training: bool):
    def parse(record: bytes):
        ex = parse_single_example(record, FEATURES)
        image = decode(ex["image"])
        return normalise(augment(image) if training else image), ex["label"]
    return parse


def tfrecord_pipeline(pattern: str, job, batch_size: int, training: bool) -> Dataset:
    files = sorted(glob.glob(pattern))
    if len(files) >= job.world_size:  # each worker reads its own files
        records = Dataset.list_files(pattern, shuffle=False).shard(*job.data_shard).interleave(
            lambda f: TFRecordDataset(f), cycle_length=4, num_parallel_calls=None)
    else:  # fewer files than workers: every worker reads them all and keeps its share of the records
        records = TFRecordDataset(files).shard(*job.data_shard)
    if training:
        records = records.shuffle(10_000)  # seeded by set_seed(--seed)
    return records.map(example(training), num_parallel_calls=AUTOTUNE).batch(
        batch_size, drop_remainder=training).prefetch(AUTOTUNE)


def synthetic_pipeline(job, size: int, batch_size: int, training: bool, num_classes: int) -> Dataset:
    """CIFAR-shaped uint8 images whose colour depends on the label (so there is something to learn)."""
    rng = np.random.default_rng(1 if training else 2)
    labels = rng.integers(0, num_classes, size)
    colours = np.random.default_rng(0).integers(0, 256, (num_classes, 1, 1, 3))
    noise = rng.integers(-64, 64, (size, 32, 32, 3))
    images = np.clip(colours[labels] + noise, 0, 255).astype(np.uint8)
    ds = Dataset.from_tensor_slices((images, labels.astype(np.int64))).shard(*job.data_shard)
    if training:
        ds = ds.shuffle(size)  # seeded by set_seed(--seed)
    fn = (lambda im, lab: (normalise(augment(im)), lab)) if training else (lambda im, lab: (normalise(im), lab))
    return ds.map(fn, num_parallel_calls=AUTOTUNE).batch(batch_size, drop_remainder=training).prefetch(AUTOTUNE)


def missing_data(folder: Path, pattern: str) -> str:
    return (f"no CIFAR-10 TFRecord files match {pattern}. To make them (about 170 MB to download, once):\n"
            f"  curl -LO {URL}\n"
            f"  conveyor data convert cifar-10-binary.tar.gz {folder} --shards 8\n"
            f"(cifar-10-python.tar.gz, torchvision's download, converts the same way), then run this again with the "
            f"same --data-dir. Or pass --synthetic to train on generated CIFAR-shaped data (a smoke test).")


# ------------------------------------------------------------------------------ model


class BasicBlock(nn.Module):
    """Two 3×3 convolutions and a shortcut (a 1×1 projection where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Sequential):
    """He et al.'s CIFAR ResNet-(6n+2): a stem, three stages of n blocks (16, 32, 64 channels), a head.

    An nn.Sequential, so that a pipeline split can cut it between blocks; `amp_dtype` runs the
    forward pass in autocast (the logits come back in float32 for the loss).
    """

    def __init__(self, n: int = 3, num_classes: int = 10, amp_dtype: torch.dtype | None = None):
        blocks: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                                 nn.ReLU(inplace=True))]
        cin = 16
        for stage, cout in enumerate((16, 32, 64)):
            for i in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if stage and not i else 1))
                cin = cout
        blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)))
        super().__init__(*blocks)
        self.amp_dtype = amp_dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            return super().forward(x).float()


def amp_dtype(requested: bool | None, device: torch.device) -> torch.dtype | None:
    if device.type != "cuda":
        if requested:
            print("--amp: mixed precision is used on GPUs only; this job runs on the CPU in float32", flush=True)
        return None
    if requested is False:
        return None
    if not torch.cuda.is_bf16_supported():  # float16 would need a gradient scaler the Trainer does not have
        print("this GPU has no bfloat16: training in float32", flush=True)
        return None
    return torch.bfloat16


# ------------------------------------------------------------------------------ main


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=int, default=128, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--depth", type=int, default=20, help="6n+2: 20, 32, 44, 56, 110")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (default: on GPUs)")
    p.add_argument("--train-files", default=None, metavar="GLOB",
                   help="default <data-dir>/cifar10/train-*.tfrecord (e.g. 'data/train.tfrecords' for TensorFlow's "
                   "own generator's output)")
    p.add_argument("--test-files", default=None, metavar="GLOB", help="default <data-dir>/cifar10/test-*.tfrecord")
    p.add_argument("--synthetic", action="store_true", help="generated CIFAR-shaped data instead of the files")
    p.add_argument("--synthetic-size", type=int, default=2048, help="training images with --synthetic")
    p.add_argument("--checkpoint-every", type=int, default=500, metavar="STEPS")
    p.add_argument("--log-every", type=int, default=20, metavar="STEPS")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.depth < 8 or (args.depth - 2) % 6:
        p.error(f"--depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110), got {args.depth}")
    return args


def data(args: argparse.Namespace, job) -> tuple[Dataset, Dataset, int]:
    """Training and test pipelines for this worker, and the number of classes."""
    if args.synthetic:
        return (synthetic_pipeline(job, args.synthetic_size, args.batch_size, True, 10),
                synthetic_pipeline(job, max(256, args.synthetic_size // 8), 256, False, 10), 10)
    folder = Path(job.data_dir) / "cifar10"
    train = args.train_files or str(folder / "train-*.tfrecord")
    test = args.test_files or str(folder / "test-*.tfrecord")
    for pattern in (train, test):
        if not glob.glob(pattern):
            raise SystemExit(missing_data(folder, pattern))
    classes = Path(os.path.dirname(train)) / "classes.txt"
    num_classes = len([n for n in classes.read_text().splitlines() if n.strip()]) if classes.is_file() else 10
    return (tfrecord_pipeline(train, job, args.batch_size, True),
            tfrecord_pipeline(test, job, 256, False), num_classes)


def main() -> None:
    args = arguments()
    job = conveyor.init()
    # Before the pipelines are built: their shuffles and the map workers' RNGs (the crops and flips) derive
    # their seeds from it, so two runs with one --seed see the same batches.
    set_seed(args.seed)
    train, test, num_classes = data(args, job)

    torch.manual_seed(args.seed)
    model = ResNet((args.depth - 2) // 6, num_classes, amp_dtype(args.amp, torch.device(job.device)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.weight_decay)
    model, optimizer = job.prepare(model, optimizer)

    trainer = conveyor.Trainer(
        job, model, optimizer, nn.functional.cross_entropy, train, eval_data=test, epochs=args.epochs,
        max_steps=args.max_steps, checkpoint_every_steps=args.checkpoint_every, log_every_steps=args.log_every,
    )
    summary = trainer.fit()
    if job.is_chief:
        out = job.output_dir
        print(f"test accuracy {summary['eval_accuracy']:.4f}, {summary['samples_per_second']:.0f} samples/s "
              f"over {summary['world_size']} worker(s) ({summary['strategy']}), input wait "
              f"{summary['input_wait_fraction']:.1%}")
        print(f"checkpoints: {out / 'checkpoints'}\nmetrics:     {out / 'metrics.jsonl'}\n"
              f"trace:       {out / 'trace'}\nplots:       {out / 'plots'}\nsummary:     {out / 'summary.json'}")
    job.shutdown()


if __name__ == "__main__":
    main()
