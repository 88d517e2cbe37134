"""Handwritten digits, data-parallel: the conveyor demo.

    conveyor run -n 2 examples/digits/train.py --epochs 20     # two workers, all-reduce
    python examples/digits/train.py                            # one local worker
    make demo                                                  # sets up, then the first command
    conveyor run -n 2 --strategy pipeline --stages 2 examples/digits/train.py   # features | head, one per process

The data is scikit-learn's bundled copy of the UCI handwritten digits (1,797 8×8 images, no
download). On first use the script writes it as sharded TFRecord files of tf.train.Example into
the job's data folder (`--data-dir`, default ./data/digits); later runs read those files. Each
worker reads its own shards; checkpoints, metrics, traces and plots go to the job's output folder.
"""

from __future__ import annotations

import argparse
import glob
import os
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

import conveyor
from conveyor.data import AUTOTUNE, Dataset, FixedLenFeature, TFRecordDataset, parse_single_example

SHARDS = 8
FEATURES = {"image": FixedLenFeature([64], "float32"), "label": FixedLenFeature([], "int64")}


def write_tfrecords(folder: str) -> None:
    """scikit-learn's digits as train/test TFRecord shards (80/20, fixed seed)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # the data itself: nothing to skip, so stop with the fix
        raise SystemExit(f"the digits example reads scikit-learn's bundled digits, and scikit-learn is not "
                         f"installed ({e}); pip install 'conveyor[examples]' brings it") from e

    from conveyor.data.convert import convert_arrays

    digits = load_digits()
    arrays = {"image": (digits.images.reshape(-1, 64) / 16.0).astype(np.float32),
              "label": digits.target.astype(np.int64)}
    convert_arrays(arrays, folder, SHARDS, splits={"train": 0.8, "test": 0.2}, seed=0,
                   source="sklearn.datasets.load_digits", overwrite=True)


def parse(record: bytes):
    ex = parse_single_example(record, FEATURES)
    return ex["image"].reshape(1, 8, 8), ex["label"]


def pipeline(folder: str, split: str, job, batch_size: int, training: bool) -> Dataset:
    files = Dataset.list_files(os.path.join(folder, f"{split}-*.tfrecord"), shuffle=False)
    files = files.shard(*job.data_shard)  # each worker (each pipeline replica) reads its own files
    records = files.interleave(lambda f: TFRecordDataset(f), cycle_length=2, num_parallel_calls=None)
    if training:
        records = records.shuffle(1024, seed=0)
    return records.map(parse).batch(batch_size, drop_remainder=training).prefetch(AUTOTUNE)


class Net(nn.Sequential):
    """features, then head: a Sequential, so `--strategy pipeline` can cut it (between them, or inside
    either with `--split features.2,head`)."""

    def __init__(self):
        super().__init__(OrderedDict(
            features=nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8×8 → 4×4
            ),
            head=nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(64 * 16, 128), nn.ReLU(),
                               nn.Linear(128, 10)),
        ))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="STEPS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    job = conveyor.init()
    folder = str(job.data_dir / "digits")
    if job.is_chief and not glob.glob(os.path.join(folder, "train-*.tfrecord")):
        print(f"writing the digits as TFRecord shards to {folder}", flush=True)
        write_tfrecords(folder)
    job.barrier()  # the other workers wait for the files

    torch.manual_seed(args.seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)

    trainer = conveyor.Trainer(
        job, model, optimizer, nn.functional.cross_entropy,
        pipeline(folder, "train", job, args.batch_size, training=True),
        eval_data=pipeline(folder, "test", job, 256, training=False),
        epochs=args.epochs, checkpoint_every_steps=args.checkpoint_every, log_every_steps=5,
    )
    summary = trainer.fit()
    if job.is_chief:
        out = job.output_dir
        print(f"test accuracy {summary['eval_accuracy']:.4f}, {summary['samples_per_second']:.0f} samples/s "
              f"over {summary['world_size']} worker(s), input wait {summary['input_wait_fraction']:.1%}")
        print(f"checkpoints: {out / 'checkpoints'}\nmetrics:     {out / 'metrics.jsonl'} (TensorBoard: "
              f"{out / 'tensorboard'})\ntrace:       {out / 'trace'}\nplots:       {out / 'plots'}\n"
              f"summary:     {out / 'summary.json'}")
    job.shutdown()


if __name__ == "__main__":
    main()
