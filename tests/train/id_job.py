"""A tiny training job whose records carry unique ids, for tests/train/test_redistribute_job.py.

    conveyor run -n 2 [--strategy fsdp] --output-dir OUT tests/train/id_job.py DATA [CRASH_AT]

DATA holds TFRecord files whose records are ids ("17"); every worker appends the ids of each of its steps
to OUT/ids-<rank>.jsonl (with the run's label from ID_JOB_RUN), and with CRASH_AT every task exits after
that step, as a crash would (the steps after the last checkpoint are then undone).
"""

import json
import os
import sys

import numpy as np
import torch

import conveyor
from conveyor.data import Dataset, TFRecordDataset


def parse(record: bytes):
    i = int(record)
    return np.array([i], dtype=np.float32), np.int64(i % 2)


def main() -> None:
    folder, crash_at = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None
    job = conveyor.init()
    files = Dataset.list_files(os.path.join(folder, "*.tfrecord"), shuffle=False).shard(*job.data_shard)
    data = files.interleave(TFRecordDataset, cycle_length=2).shuffle(8, seed=0).map(parse).batch(4)
    torch.manual_seed(0)
    # repeated blocks (same-typed layers in a Sequential): what the fsdp strategy shards block by block
    module = torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, opt = job.prepare(module, torch.optim.SGD(module.parameters(), lr=0.01))
    log = open(os.path.join(job.output_dir, f"ids-{job.rank}.jsonl"), "a")

    def record(event) -> None:
        ids = [int(v) for v in event.inputs[:, 0]]
        log.write(json.dumps({"run": os.environ.get("ID_JOB_RUN"), "step": event.step, "ids": ids}) + "\n")
        log.flush()
        if event.step == crash_at:
            os._exit(3)

    # synchronous saves: the crash after CRASH_AT must find the last checkpoint sealed (a background write cut
    # short by the crash loses that checkpoint, which would make the resume start over)
    conveyor.Trainer(job, model, opt, torch.nn.functional.cross_entropy, data, epochs=1, checkpoint_every_steps=3,
                     callbacks=[record], progress=False, async_checkpoint=False).fit()


if __name__ == "__main__":
    main()
