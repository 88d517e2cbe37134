"""A tiny training job for tests/train/test_export.py, run under `conveyor run` with each strategy.

    conveyor run -n 2 [--strategy S ...] --output-dir OUT tests/train/export_job.py

A Sequential (so that the pipeline can cut it) whose first weight is over the parameter servers' 4 MiB
piece size (the ps tasks split it between them) and with a BatchNorm (buffers the servers do not hold),
trained with the Trainer for 2 epochs on fixed random data. At the end the chief writes `probe.json`:
the summary's eval figures (every strategy computes them, the pipeline's last stage included) and, where
the chief holds the whole model, its outputs on `probe()` in eval mode (ps-async too: the trainer's end of
run pulls the servers' final state, `Step.finish`). Run again on the same output
folder, it resumes from the last step, trains nothing, and writes what the restored model computes.
"""

from __future__ import annotations

import json

import torch
from torch import nn

import conveyor
from conveyor.data import Dataset

FEATURES = 1024  # x 1040 float32 = 4.26 MB: over the ps piece size (4 MiB), so it is split over the ps tasks


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 1040), nn.Tanh(), nn.BatchNorm1d(1040), nn.Linear(1040, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, FEATURES, generator=g)
    return x, (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 0).long()


def probe() -> torch.Tensor:
    return torch.randn(5, FEATURES, generator=torch.Generator().manual_seed(11))


def outsum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A metric that moves with every output: the eval figures compare models, not accuracies."""
    return outputs.double().sum()


def main() -> None:
    job = conveyor.init()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = job.prepare(model, optimizer)
    x, y = data()
    train = Dataset.from_tensor_slices((x, y)).shard(*job.data_shard).batch(8, drop_remainder=True)
    evaluation = Dataset.from_tensor_slices((x[:16], y[:16])).shard(*job.data_shard).batch(8)
    trainer = conveyor.Trainer(job, model, optimizer, nn.functional.cross_entropy, train, eval_data=evaluation,
                               metric_fn=outsum, epochs=2, checkpoint_every_steps=3, log_every_steps=100)
    summary = trainer.fit()
    if job.is_chief:
        found = {"eval_loss": summary.get("eval_loss"), "eval_outsum": summary.get("eval_outsum")}
        if job.strategy.name != "pipeline":
            module = trainer.module
            module.eval()
            with torch.no_grad():
                found["outputs"] = module(probe()).tolist()
        (job.output_dir / "probe.json").write_text(json.dumps(found))
    job.shutdown()


if __name__ == "__main__":
    main()
