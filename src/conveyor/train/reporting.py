"""What a training run tells people while it runs: log records to metrics.jsonl, TensorBoard and the progress display.

    reporter = Reporter.open(job, output_dir, progress=True, total=None, initial=0, resumed_from=None)
    reporter.add(loss, samples, input_wait)              # every step: summed on the device, no sync
    record = reporter.log(step, epoch, lr, world=coord.log_world)   # every N steps: averaged over ranks
    reporter.emit({"event": "eval", ...})
    reporter.close()

Only the chief writes; every rank takes part in the all-reduce that averages a log record over
``world`` ranks (1: this rank's own figures, no collective).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from conveyor.train.progress import Progress
from conveyor.train.sinks import JsonlSink, TensorBoardSink

__all__ = ["LogWindow", "Reporter"]


class LogWindow:
    """Loss, samples and input wait since the last log record, averaged over ranks when it is written."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device: no sync per step
        self.steps = 0
        self.samples = 0
        self.wait = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int, wait: float) -> None:
        self.loss += loss.double()
        self.steps += 1
        self.samples += samples
        self.wait += wait

    def record(self, job: Any, world: int) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rest = torch.tensor([self.steps, self.samples, self.wait, elapsed], dtype=torch.float64, device=self.device)
        vec = torch.cat([self.loss.reshape(1), rest])
        if world > 1:
            job.all_reduce(vec)
        loss, steps, samples, wait, elapsed_sum = vec.tolist()
        return {"loss": loss / max(steps, 1), "samples_per_second": samples / (elapsed_sum / world),
                "input_wait_fraction": wait / elapsed_sum}


class Reporter:
    """The run's log window and, on the chief, its sinks and progress display."""

    def __init__(self, job: Any, progress: Progress, sinks: list[Any]):
        self.job = job
        self.progress = progress
        self.sinks = sinks
        self.window = LogWindow(torch.device(job.device))

    @classmethod
    def open(cls, job: Any, output_dir: Path, *, progress: bool | str, total: int | None, initial: int,
             resumed_from: int | None) -> Reporter:
        """Sinks append to a resumed run's records (TensorBoard drops those after the step resumed from)."""
        chief = bool(job.is_chief)
        sinks = []
        if chief:
            sinks = [JsonlSink(output_dir / "metrics.jsonl", append=resumed_from is not None),
                     TensorBoardSink(output_dir / "tensorboard", purge_step=resumed_from)]
        return cls(job, Progress(chief, progress, total=total, initial=initial), sinks)

    def add(self, loss: torch.Tensor, samples: int, input_wait: float) -> None:
        self.window.add(loss, samples, input_wait)
        self.progress.advance()

    def log(self, step: int, epoch: int, lr: float | None, world: int) -> dict[str, Any] | None:
        """Write one train record for the steps since the last (None: there were none)."""
        if self.window.steps == 0:
            return None
        record = {"event": "train", "step": step, "epoch": epoch, **self.window.record(self.job, world),
                  "lr": lr, "time": time.time()}
        self.window.reset()
        self.emit(record)
        return record

    def emit(self, record: dict[str, Any]) -> None:
        if self.job.is_chief:
            for sink in self.sinks:
                sink.write(record)
            self.progress.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.progress.close()
