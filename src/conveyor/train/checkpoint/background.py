"""Checkpoint writes beside training: a save blocks the training loop only while its state is copied.

    saves = BackgroundSaves(enabled=True, timeout=900)
    saves.save(step, lambda: stage_commit(checkpoints, out, timeout=60))  # stage here; the write: a thread
    saves.finish()        # the end of training: the last save is complete on disk (its error raised)
    saves.report()        # summary.json's "checkpoint_saves": blocked and total seconds per save

The contract. `save` first waits for the save before it (at most one is in flight: the host holds one
copy of the state at a time; the wait counts as blocked time) and raises that save's error, then calls
`stage()` in the caller's thread — the collective part of a save and the copy of the state
(`staging`) — and runs the write it returns (hashing, safetensors, fsync, seal, rename, `latest`,
rotation) in a thread of its own. An error of a background write is never lost: the next `save`
raises it, or `finish` at the end of training. `close` (an exception or Ctrl-C on its way) and SIGTERM
wait for the write; `close` warns of its error instead of hiding the first. Every wait is bounded by `timeout`. A
crash during a background write loses that checkpoint only: a step folder appears by one rename or
not at all (`store`), and the job resumes from the save before. `enabled=False` writes in the
caller's thread, as before (blocked = total).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from conveyor.train.checkpoint.read import CheckpointError
from conveyor.train.checkpoint.staging import HostBuffers

__all__ = ["BackgroundSaves"]


class BackgroundSaves:
    """Checkpoint saves whose writes run in a background thread, one at a time (module docstring)."""

    def __init__(self, enabled: bool = True, timeout: float = 900.0):
        self.enabled = bool(enabled)
        self.timeout = float(timeout)
        self.records: list[dict[str, Any]] = []  # per save: step, blocked_seconds, total_seconds
        self._thread: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None
        self.end_wait_seconds = 0.0
        self.buffers = HostBuffers()  # reused by one save after another: never two writes at once

    @property
    def in_flight(self) -> bool:
        """Whether a background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, stage: Callable[[], Callable[[], Any]]) -> None:
        """Wait for the save before (raising its error), call `stage()` here, run the write it returns (in the
        background unless disabled)."""
        started = time.perf_counter()
        self.wait()
        write = stage()
        record: dict[str, Any] = {"step": int(step), "blocked_seconds": None, "total_seconds": None}
        self.records.append(record)
        if not self.enabled:
            write()
            record["blocked_seconds"] = record["total_seconds"] = time.perf_counter() - started
            return
        record["blocked_seconds"] = time.perf_counter() - started
        self._thread = threading.Thread(target=self._write, args=(write, record, started), daemon=True,
                                        name=f"conveyor-checkpoint-{step}")
        self._thread.start()

    def _write(self, write: Callable[[], Any], record: dict[str, Any], started: float) -> None:
        try:
            write()
        except BaseException as e:  # kept for the training loop, which raises it (a thread's error is lost)
            self._failed = (record["step"], e)
        finally:
            record["total_seconds"] = time.perf_counter() - started

    def wait(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` s (default: the one given) for the write in flight; raise `CheckpointError` if it
        failed or is still running then."""
        thread, limit = self._thread, self.timeout if timeout is None else float(timeout)
        if thread is not None:
            thread.join(limit)
            if thread.is_alive():
                raise CheckpointError(
                    f"the checkpoint write {thread.name} is still running after {limit:g}s: the disk may be slow or "
                    f"full, or a task that contributes a part may be stuck (the step stays unpublished, and the job "
                    f"resumes from the save before). Check the disk and the other tasks' logs, or save synchronously "
                    f"(--checkpoint-sync) to see where it blocks")
            self._thread = None
        if self._failed is not None:
            step, error = self._failed
            self._failed = None
            raise CheckpointError(f"the checkpoint of step {step}, written in the background, failed: {error} (the "
                                  f"step was not published; the job resumes from the save before)") from error

    def finish(self) -> None:
        """The end of training: `wait`, the time waited counted in `report` (the last save's write blocks the end)."""
        started = time.perf_counter()
        try:
            self.wait()
        finally:
            self.end_wait_seconds += time.perf_counter() - started

    def close(self) -> None:
        """On the way out with another error (or Ctrl-C): wait for the write in flight, warning of its failure."""
        try:
            self.wait()
        except CheckpointError as e:
            warnings.warn(str(e), stacklevel=2)

    @contextlib.contextmanager
    def until_written_on_sigterm(self) -> Iterator[None]:
        """Within it, SIGTERM (a launcher stopping the job) first lets the write in flight finish (up to `timeout`,
        or until the sender's SIGKILL), then ends the process by SIGTERM as before. Only where SIGTERM has its
        default action, in the main thread: a handler of the program's own is left alone."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            yield
            return

        def on_term(signum: int, frame: Any) -> None:
            self.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def report(self) -> dict[str, Any]:
        """summary.json's `checkpoint_saves`: whether saves ran in the background, each save's blocked and total
        seconds (None: not finished), their medians and totals, and the time the end of training waited for the last."""
        out: dict[str, Any] = {"async": self.enabled, "saves": [dict(r) for r in self.records],
                               "end_wait_seconds": self.end_wait_seconds}
        for key in ("blocked_seconds", "total_seconds"):
            values = [r[key] for r in self.records if r[key] is not None]
            out[key] = {"median": statistics.median(values) if values else None, "total": sum(values)}
        return out
