"""A Trainer job whose model counts every update applied, for test_ps_rejoin_run.py, under `conveyor run`.

    conveyor run -n 2 --ps 2 --strategy ps-async --output-dir OUT ps_rejoin_job.py --delays 0.25,0.1

The records are the ids 0..IDS-1, dealt to the workers by `shard` and shuffled. The model is one parameter `w`
of shape (EPOCHS * 2, IDS); a batch of ids in the worker's epoch e (the Trainer's count of passes over its
shard: workers running apart go up to EPOCHS * workers) has the loss sum(w[e, ids]), and SGD at lr 1 subtracts 1
from w[e, id] each time that record's update is applied. So after the run -w[e, id] counts how often record id
was applied in epoch e. The chief writes -w to applied.json; every worker appends {rank, pid, step, epoch,
time} per step to steps-<rank>.jsonl and sleeps its delay (`--delays` per rank), so worker 0 goes slower.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import conveyor
from conveyor.data import Dataset

IDS, EPOCHS, BATCH = 160, 3, 2


class AppliedCounts(nn.Module):
    """w[e, id] loses 1 per application of record id's update in epoch e (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(EPOCHS * 2, IDS))
        self.epoch_of = lambda: 0  # the Trainer's epoch, once it exists

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[min(self.epoch_of(), len(self.w) - 1), ids.long()]  # (evaluation: after the last epoch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--delays", default="0.25,0.1", help="seconds each rank sleeps after a step")
    args = p.parse_args()
    job = conveyor.init()
    delay = float(args.delays.split(",")[job.rank])
    module = AppliedCounts()
    model, optimizer = job.prepare(module, torch.optim.SGD(module.parameters(), lr=1.0))
    ids = torch.arange(IDS)
    train = Dataset.from_tensor_slices((ids, torch.zeros(IDS))).shard(*job.data_shard).shuffle(64, seed=1).batch(BATCH)
    evals = Dataset.from_tensor_slices((ids[:8], torch.zeros(8))).shard(*job.data_shard).batch(4)
    steps = open(os.path.join(job.output_dir, f"steps-{job.rank}.jsonl"), "a")

    def record(event) -> None:
        steps.write(json.dumps({"rank": job.rank, "pid": os.getpid(), "step": event.step, "epoch": event.epoch,
                                "time": time.time()}) + "\n")
        steps.flush()
        time.sleep(delay)

    trainer = conveyor.Trainer(job, model, optimizer, lambda out, target: out.sum(), train, eval_data=evals,
                               metric_fn=lambda out, target: (out * 0.0).mean(), epochs=EPOCHS,
                               checkpoint_every_steps=20, callbacks=[record], progress=False, log_every_steps=20)
    module.epoch_of = lambda: trainer.epoch
    summary = trainer.fit()
    steps.close()
    if job.is_chief:
        applied = (-module.w.detach()).tolist()
        with open(os.path.join(job.output_dir, "applied.json"), "w") as f:
            json.dump({"applied": applied, "steps": summary.get("steps")}, f)
    job.shutdown()


if __name__ == "__main__":
    main()
