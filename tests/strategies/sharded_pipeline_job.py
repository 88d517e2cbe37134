"""A tiny Trainer job for tests/strategies/test_pipeline_sharded.py's kill -9 and resume-on-another-n tests.

    conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages --output-dir OUT sharded_pipeline_job.py \
        [--run LABEL] [--stop-at STEP]

That test file's model (widths 15 and 16: FSDP2's uneven chunks), Adam and data, the rows dealt to the replicas
(the 2 stages of a replica read the same shard), batches of 8, 2 epochs, a checkpoint every 4 steps (and the
final one). Each target row carries its record's id as a second column, which the loss drops: every process
appends the ids of each step it applied ({run, epoch, step, ids}) to OUT/ids-<rank>.jsonl (zero-weight steps
call no callback). With --stop-at every process exits after that step, as a crash would (saves are then
synchronous, so the last checkpoint before it is sealed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from test_pipeline_sharded import BATCH, make_data, make_model, make_optimizer  # this folder: the script's own
from torch import nn

import conveyor
from conveyor.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from elastic_ids_job import id_logger  # noqa: E402  (the elastic benchmark's id log, shared)

EPOCHS, CHECKPOINT_EVERY = 2, 4


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets[:, :1])  # column 1 is the record's id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default="run", help="this run's label in the id logs")
    p.add_argument("--stop-at", type=int, default=None, help="every process exits after this step")
    args = p.parse_args()
    job = conveyor.init()
    model = make_model()
    model, optimizer = job.prepare(model, make_optimizer(model))
    x, y = make_data()
    ids = torch.arange(len(x), dtype=x.dtype).unsqueeze(1)
    train = Dataset.from_tensor_slices((x, torch.cat([y, ids], dim=1))).shard(*job.data_shard).batch(BATCH)
    record = id_logger(job, args.run, args.stop_at, lambda event: event.targets[:, 1])
    trainer = conveyor.Trainer(job, model, optimizer, loss_fn, train, epochs=EPOCHS, callbacks=[record],
                               checkpoint_every_steps=CHECKPOINT_EVERY, log_every_steps=100,
                               async_checkpoint=args.stop_at is None)
    trainer.fit()
    job.shutdown()


if __name__ == "__main__":
    main()
