"""The chief's progress display: a tqdm bar on a terminal, plain lines in a log.

`mode`: True shows a tqdm bar when stderr is a terminal (or when `conveyor run`, whose own
output is a terminal, says so with CONVEYOR_TTY=1: it redraws the bar in place) and otherwise
prints one line per log record (what a log file under `conveyor run` wants: a bar redrawn with carriage returns is
unreadable there); "always" forces the bar; False shows nothing. Only the chief shows progress.

    progress = Progress(enabled=job.is_chief, mode=True, total=1000, initial=resumed_step)
    progress.advance()                                  # every step: cheap
    progress.write({"step": 10, "loss": 0.7, ...})      # every log record: refreshes the postfix
                                                        # (with tokens/s, TFLOPS, MFU, peak memory where known)
    progress.close()
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from conveyor.cluster.variables import TTY_VAR

__all__ = ["Progress"]


class Progress:
    def __init__(self, enabled: bool, mode: bool | str = True, total: int | None = None, initial: int = 0,
                 stream: TextIO | None = None):
        if mode not in (True, False, "always"):
            raise ValueError(f"progress must be True, False or 'always', got {mode!r}")
        self._stream = stream if stream is not None else sys.stderr
        self._on = bool(enabled and mode)
        self._bar = None
        self._total = total
        launcher_tty = os.environ.get(TTY_VAR) == "1"
        if self._on and (mode == "always" or _isatty(self._stream) or launcher_tty):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=self._stream,
                             desc="train")

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    def set_total(self, total: int | None) -> None:
        """Set the number of steps once it is known (after the first epoch, when only `epochs` was given)."""
        self._total = total
        if self._bar is not None and total is not None and self._bar.total != total:
            self._bar.total = total
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, record: Mapping[str, Any]) -> None:
        """Show a log record: the bar's postfix on a terminal, one line otherwise."""
        if not self._on:
            return
        if record.get("event") == "eval":
            metrics = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in record.items() if k.startswith("eval_") and _num(v))
            self._line(f"eval at step {record.get('global_step', record.get('step'))}: {metrics}")
            return
        loss, sps, wait = record.get("loss"), record.get("samples_per_second"), record.get("input_wait_fraction")
        step = record.get("global_step", record.get("step"))  # workers running apart: the job's step
        if self._bar is not None:
            if "global_step" in record:
                self._bar.n = int(record["global_step"])
            extra = "".join(f" {label}={value}" for label, value in _extras(record))
            self._bar.set_postfix_str(
                f"loss={_fmt(loss, '.4f')} samples/s={_fmt(sps, '.0f')} input-wait={_fmt(wait, '.1%')}{extra}",
                refresh=False
            )
            return
        total = f"/{self._total}" if self._total else ""
        extra = "".join(f"  {label} {value}" if label in ("MFU", "mem") else f"  {value} {label}"
                        for label, value in _extras(record))
        self._line(
            f"step {step}{total}  epoch {record.get('epoch')}  loss {_fmt(loss, '.4f')}  "
            f"{_fmt(sps, '.0f')} samples/s  input wait {_fmt(wait, '.1%')}{extra}"
        )

    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _extras(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The throughput figures a record has (``conveyor.train.throughput``), as (label, value) in torchtitan's order."""
    tflops = record.get("tflops")
    known = [("tokens/s", "tokens_per_second", ".0f"),
             ("TFLOPS", "tflops", ".1f" if _num(tflops) and tflops >= 10 else ".3g"),  # small models: 3 digits
             ("MFU", "mfu", ".1%"), ("mem", "peak_memory_gib", ".2f")]
    return [(label, format(record[key], spec) + ("GiB" if label == "mem" else ""))
            for label, key, spec in known if _num(record.get(key))]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if _num(v) else "-"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
