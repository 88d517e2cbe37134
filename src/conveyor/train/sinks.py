"""Where the trainer's log records go: `metrics.jsonl` and TensorBoard (the progress bar is in progress.py).

A record is a flat dict. Training records carry `event="train"`, `step`, `epoch`, `loss`,
`samples_per_second`, `input_wait_fraction`, `lr` and `time` (Unix seconds); evaluation records
carry `event="eval"`, `step`, `epoch`, `eval_loss`, `eval_<metric>` and `time`. Every sink takes the
same records:

    sinks = [JsonlSink(out / "metrics.jsonl"), TensorBoardSink(out / "tensorboard")]
    for s in sinks:
        s.write({"event": "train", "step": 10, "loss": 0.7, ...})
    for s in sinks:
        s.close()

Only the chief writes them (one file per job, not per worker).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from conveyor.extras import optional_import

__all__ = ["JsonlSink", "MetricsSink", "TensorBoardSink"]


class MetricsSink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed after every record, so `tail -f` and a crash both see whole lines.

    `append=True` continues an existing file (a resumed run); otherwise the file is started over.
    Non-finite floats are written as null: strict JSON readers reject NaN.
    """

    def __init__(self, path: str | os.PathLike[str], append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def write(self, record: Mapping[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._f.write(json.dumps(clean, allow_nan=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class TensorBoardSink:
    """Scalars for TensorBoard under `logdir`: `train/<field>` and `eval/<field>` at each record's step.

    `purge_step`: on a resumed run, the step resumed from; TensorBoard then drops what the crashed
    run logged after it, so the curves show one history instead of two overlapping ones.
    Without the `tensorboard` extra the sink writes nothing and says so once.
    """

    _SKIP = {"event", "step", "epoch", "time"}

    def __init__(self, logdir: str | os.PathLike[str], purge_step: int | None = None):
        # Imported here: tensorboard is only for the chief, and optional (metrics.jsonl has the same numbers).
        tb = optional_import("torch.utils.tensorboard", package="tensorboard",
                             skipped="the TensorBoard scalars (tensorboard/)", extra="tensorboard")
        self.logdir = Path(logdir)
        self._writer = None if tb is None else tb.SummaryWriter(str(self.logdir), purge_step=purge_step)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        step = int(record.get("step", 0))
        group = "eval" if record.get("event") == "eval" else "train"
        wall = record.get("time")
        for key, value in record.items():
            if key in self._SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = key[len("eval_"):] if group == "eval" and key.startswith("eval_") else key
            self._writer.add_scalar(f"{group}/{name}", value, step, walltime=wall)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
