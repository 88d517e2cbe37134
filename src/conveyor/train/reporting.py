"""What a training run tells people while it runs: log records to metrics.jsonl, TensorBoard and the progress display.

    reporter = Reporter.open(job, output_dir, progress=True, total=None, initial=0, resumed_from=None,
                             throughput=meter)           # a conveyor.train.throughput.Throughput, or None
    reporter.add(loss, samples, input_wait, tokens, flops)   # every step: summed on the device, no sync
    record = reporter.log(step, epoch, lr, world=coord.log_world)   # every N steps: averaged over ranks
    reporter.emit({"event": "eval", ...})
    reporter.close()

Only the chief writes; every rank takes part in the all-reduce that averages a log record over
``world`` ranks (1: this rank's own figures, no collective). A record has loss, samples/s and input wait, the
samples it sums (exact) and over how many workers (``workers``: ``world``), and where known tokens/s (summed
over ranks), TFLOPS per device, MFU and the chief's peak memory in GiB.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from conveyor.train.progress import Progress
from conveyor.train.sinks import JsonlSink, TensorBoardSink
from conveyor.train.throughput import Throughput, peak_memory_bytes

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
        self.tokens: float | None = None  # None: unknown (conveyor.train.throughput)
        self.flops: float | None = None
        self.t0 = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int, wait: float, tokens: int | None = None,
            flops: float | None = None) -> None:
        self.loss += loss.double()
        self.steps += 1
        self.samples += samples
        self.wait += wait
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens
        if flops is not None:
            self.flops = (self.flops or 0.0) + flops

    def record(self, job: Any, world: int, meter: Throughput | None = None) -> dict[str, Any] | None:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        known = [self.tokens is not None, self.flops is not None]
        rest = torch.tensor([self.steps, self.samples, self.wait, elapsed, self.tokens or 0, self.flops or 0, *known],
                            dtype=torch.float64, device=self.device)
        vec = torch.cat([self.loss.reshape(1), rest])
        if world > 1:
            job.all_reduce(vec)
        loss, steps, samples, wait, elapsed_sum, tokens, flops, tokens_known, flops_known = vec.tolist()
        if steps == 0:
            return None  # no worker took a step with a batch since the last record
        seconds = elapsed_sum / world  # the ranks' mean window
        # samples (exact) and the workers summed: what goodput is counted from (benchmarks/elastic_goodput.py)
        record = {"loss": loss / max(steps, 1), "samples_per_second": samples / seconds,
                  "input_wait_fraction": wait / elapsed_sum, "samples": int(samples), "workers": world}
        if meter is not None:
            record.update(meter.figures(flops / world if flops_known else None, tokens if tokens_known else None,
                                        seconds))
            record["peak_memory_gib"] = peak_memory_bytes(self.device) / 2**30
        return record


class Reporter:
    """The run's log window and, on the chief, its sinks and progress display."""

    def __init__(self, job: Any, progress: Progress, sinks: list[Any], throughput: Throughput | None = None):
        self.job = job
        self.progress = progress
        self.sinks = sinks
        self.throughput = throughput
        self.window = LogWindow(torch.device(job.device))

    @classmethod
    def open(cls, job: Any, output_dir: Path, *, progress: bool | str, total: int | None, initial: int,
             resumed_from: int | None, throughput: Throughput | None = None) -> Reporter:
        """Sinks append to a resumed run's records (TensorBoard drops those after the step resumed from)."""
        chief = bool(job.is_chief)
        sinks = []
        if chief:
            sinks = [JsonlSink(output_dir / "metrics.jsonl", append=resumed_from is not None),
                     TensorBoardSink(output_dir / "tensorboard", purge_step=resumed_from)]
        return cls(job, Progress(chief, progress, total=total, initial=initial), sinks, throughput)

    def add(self, loss: torch.Tensor, samples: int, input_wait: float, tokens: int | None = None,
            flops: float | None = None) -> None:
        self.window.add(loss, samples, input_wait, tokens, flops)
        self.progress.advance()

    def log(self, step: int, epoch: int, lr: float | None, world: int,
            shared: tuple[int, int | None] | None = None) -> dict[str, Any] | None:
        """Write one train record for the steps since the last (None: there were none).

        ``shared``: the job's (step, total) where workers run apart and this worker's steps are a part of it.
        """
        if self.window.steps == 0 and world <= 1:
            return None
        # Over several workers the record is a collective: a worker whose window holds zero-weight steps only
        # (its shard ran out first) must take part too, or the others' next collective meets its step's (a gloo
        # abort, "16 vs 4").
        figures = self.window.record(self.job, world, self.throughput)
        if figures is None:
            self.window.reset()
            return None
        record = {"event": "train", "step": step, "epoch": epoch, **figures, "lr": lr, "time": time.time()}
        if shared is not None:
            record["global_step"] = shared[0]
            if shared[1] is not None:
                self.progress.set_total(shared[1])
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
