"""A tiny Trainer job for tests/strategies/test_pipeline_sharded.py's kill -9 test, under `conveyor run`.

    conveyor run -n 4 --strategy pipeline --stages 2 --shard-stages --output-dir OUT sharded_pipeline_job.py

That test file's model (widths 15 and 16: FSDP2's uneven chunks on 2 shards), Adam and data, the rows dealt to
the 2 replicas (the 2 stages of a replica read the same shard), batches of 8 in 4 microbatches, 2 epochs of 6
steps, a checkpoint every 4 steps (and the final one at step 12). The test compares the final checkpoint of an
uninterrupted run with one whose task was killed by ``CONVEYOR_FAULT`` and restarted from its checkpoint.
"""

from __future__ import annotations

from test_pipeline_sharded import BATCH, make_data, make_model, make_optimizer  # this folder: the script's own
from torch import nn

import conveyor
from conveyor.data import Dataset

EPOCHS, CHECKPOINT_EVERY = 2, 4


def main() -> None:
    job = conveyor.init()
    model = make_model()
    model, optimizer = job.prepare(model, make_optimizer(model))
    x, y = make_data()
    train = Dataset.from_tensor_slices((x, y)).shard(*job.data_shard).batch(BATCH, drop_remainder=True)
    trainer = conveyor.Trainer(job, model, optimizer, nn.functional.mse_loss, train, epochs=EPOCHS,
                               checkpoint_every_steps=CHECKPOINT_EVERY, log_every_steps=100)
    trainer.fit()
    job.shutdown()


if __name__ == "__main__":
    main()
