"""The digits demo's model trained on records that carry their id: the job of elastic_exactly_once.py.

    conveyor run -n W --output-dir OUT benchmarks/elastic_ids_job.py DATA --run LABEL [--stop-at STEP] [--epochs E]

DATA holds train-*.tfrecord and test-*.tfrecord of tf.train.Example {image[64], label, id}
(elastic_exactly_once.write_data). The id rides as a 65th input column that the model drops, so each
worker appends the ids of every step it applied ({run, epoch, step, ids}) to OUT/ids-<rank>.jsonl; zero-weight
steps call no callback, so they log nothing. With --stop-at every task exits after that step, as a crash would
(the steps after the last checkpoint are undone; saves are synchronous, so that checkpoint is sealed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import conveyor
from conveyor.data import Dataset, FixedLenFeature, TFRecordDataset, parse_single_example

FEATURES = {"image": FixedLenFeature([64], "float32"), "label": FixedLenFeature([], "int64"),
            "id": FixedLenFeature([], "int64")}
DIGITS = Path(__file__).resolve().parents[1] / "examples" / "digits" / "train.py"


def digits_net() -> nn.Module:
    """The digits example's `Net`, loaded from its file (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("conveyor_example_digits", DIGITS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


class WithoutId(nn.Module):
    """The digits net over inputs of 64 pixels and the record's id: the id is logged, never learned from."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, :64].reshape(-1, 1, 8, 8))


def parse(record: bytes):
    ex = parse_single_example(record, FEATURES)
    return np.append(ex["image"], np.float32(ex["id"])).astype(np.float32), ex["label"]


def pipeline(folder: str, split: str, job, batch_size: int, seed: int, training: bool) -> Dataset:
    files = Dataset.list_files(os.path.join(folder, f"{split}-*.tfrecord"), shuffle=False).shard(*job.data_shard)
    records = files.interleave(TFRecordDataset, cycle_length=2)
    if training:  # no drop_remainder: every record of the epoch is trained on, the uneven shares too
        records = records.shuffle(256, seed=seed)
    return records.map(parse).batch(batch_size).prefetch(2)


def id_logger(job, run: str, stop_at: int | None, ids_of) -> Any:
    """A Trainer callback appending the ids ``ids_of(event)`` of every step this task applied ({run, epoch, step,
    ids}) to OUT/ids-<rank>.jsonl, flushed each time; at step ``stop_at`` (if given) the task exits with status 3,
    as a crash would. Also the id log of tests/strategies/sharded_pipeline_job.py."""
    log = open(os.path.join(job.output_dir, f"ids-{job.rank}.jsonl"), "a")  # closed by the process's exit

    def record(event) -> None:
        ids = [int(v) for v in ids_of(event)]
        log.write(json.dumps({"run": run, "epoch": event.epoch, "step": event.step, "ids": ids}) + "\n")
        log.flush()
        if event.step == stop_at:
            os._exit(3)

    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data")
    p.add_argument("--run", required=True, help="this run's label in the id logs")
    p.add_argument("--stop-at", type=int, default=None, help="every task exits after this step")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    job = conveyor.init()
    torch.manual_seed(args.seed)
    module = WithoutId(digits_net())
    model, optimizer = job.prepare(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    record = id_logger(job, args.run, args.stop_at, lambda event: event.inputs[:, 64])
    conveyor.Trainer(job, model, optimizer, nn.functional.cross_entropy,
                     pipeline(args.data, "train", job, args.batch_size, args.seed, training=True),
                     eval_data=pipeline(args.data, "test", job, 256, args.seed, training=False),
                     epochs=args.epochs, checkpoint_every_steps=args.checkpoint_every, callbacks=[record],
                     progress=False, async_checkpoint=False).fit()
    job.shutdown()


if __name__ == "__main__":
    main()
