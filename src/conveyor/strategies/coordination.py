"""How the workers of one training run keep together; each strategy supplies one (`Strategy.coordinator`).

    coord = job.strategy.coordinator(job)
    coord.start(max_steps=..., total_epochs=...)
    while not coord.finished(step, steps_per_epoch):
        have_all = coord.agree(have_batch, can_shadow)   # False: some worker's shard ran out
        ...one step (a zero-weight one without a batch while coord.holding > 0)...
        if coord.should_save(step, policy): ...positions = coord.positions(mine, final=False) ...

The training loop asks these questions and never branches on the strategy. Two answers exist:

- :class:`LockstepCoordinator` (all-reduce, ``ps-sync``, fsdp, one process): every step starts with one
  small all-reduce that counts the ranks that still have a batch and carries the chief's time-based
  "checkpoint now", so all ranks save the same step. An epoch ends for all ranks together: when the
  last rank's batches are used where every rank without one can take a zero-weight step, else when
  the first rank runs out.
- :class:`IndependentCoordinator` (``ps-async``, ``ps-ssp:K``): no per-step collective. Each worker
  runs at its own pace, into further epochs of its shard if need be, and all stop when the steps
  committed by all workers together reach the job's total (TensorFlow's global step). The count, the
  planned total and every worker's newest data position live on a :class:`ProgressBoard` that the
  strategy provides (ps:0 for the parameter-server strategies), not on a shared file system. Each step
  leaves its position with the servers (``track``): a worker that dies is replaced alone (``rejoined``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

__all__ = ["MAX_TRACKED_BYTES", "Coordinator", "IndependentCoordinator", "LockstepCoordinator", "ProgressBoard"]

_REJOIN_FORMAT = "conveyor.trainer.rejoin"
MAX_TRACKED_BYTES = 1 << 20  # what the parameter servers keep per worker (protocol.MAX_POSITION_BYTES)


class _Policy(Protocol):
    every_steps: int | None

    def should_save(self, step: int) -> bool: ...


class Coordinator:
    """The questions a training loop asks about the other workers. Subclasses answer them."""

    #: how many workers' figures a log record averages over (1: this worker's own)
    log_world: int = 1
    #: how many workers had a batch at the last ``agree`` that did not end the epoch (lockstep: workers
    #: without one then take a zero-weight step); 0: the epoch ends (workers running apart end their own)
    holding: int = 0

    def __init__(self, job: Any) -> None:
        self.job = job
        self.world = int(job.world_size)
        self.rank = int(job.rank)
        self.chief = bool(job.is_chief)
        self.max_steps: int | None = None
        self.total_epochs: int | None = None

    def start(self, *, max_steps: int | None, total_epochs: int | None) -> None:
        """The run's bounds, once per ``fit()`` before its first step."""
        self.max_steps, self.total_epochs = max_steps, total_epochs

    def resumed(self, extra: Mapping[str, Any]) -> None:
        """The ``extra`` of the checkpoint the run resumes from (counts kept across restarts)."""

    def tolerates_missing_positions(self, data_states: Mapping[str, Any]) -> bool:
        """Whether a checkpoint lacking some workers' data positions may still be resumed."""
        return False

    def finished(self, step: int, steps_per_epoch: int | None) -> bool:
        """Whether training is over before the next step (``max_steps`` reached)."""
        return self.max_steps is not None and step >= self.max_steps

    def epoch_limit(self) -> int | None:
        """How many epochs of its shard this worker runs at most (None: no bound from epochs)."""
        return self.total_epochs

    def agree(self, have_batch: bool, can_shadow: bool = False) -> bool:
        """Whether every worker has a batch for this step (given whether this one has, and whether it can take
        a zero-weight step without one); sets :attr:`holding`."""
        return have_batch

    def should_save(self, step: int, policy: _Policy) -> bool:
        """Whether to checkpoint after ``step``; every worker gets the same answer when they save together."""
        return policy.should_save(step)

    def request_save(self) -> bool:
        """The chief asks every worker to save after the next step (an elastic job re-forming: train/drain.py);
        False where the workers cannot be asked (they run apart)."""
        return False

    def evaluation(self, final: bool) -> str | None:
        """How to evaluate now: ``"all"`` (a collective over every worker), ``"alone"`` (this worker's
        shard, no collective) or None (this worker skips)."""
        return "all"

    def meets_for(self, final: bool) -> bool:
        """Whether this save is made even when this worker saved the step already: a meeting of all workers
        that writes the step again (workers running apart changed the state since)."""
        return False

    def positions(self, mine: bytes, final: bool) -> list[bytes | None]:
        """Every worker's data position for the checkpoint (the chief's result counts; index = rank)."""
        return self.job.all_gather_bytes(mine)

    def checkpoint_extra(self) -> dict[str, Any]:
        """What the checkpoint records for :meth:`resumed`."""
        return {}

    def shared_progress(self) -> tuple[int, int | None] | None:
        """(the job's step, its total) when it is not this worker's own step count (None: it is)."""
        return None

    #: this worker replaces one that died, restarted alone: it continues from :meth:`rejoined`, not a checkpoint
    replacement: bool = False

    def track(self, position: Callable[[], dict[str, Any]]) -> None:
        """Before each step's update: leave where this worker will be after the step (``position()``, JSON-able)
        where a replacement of it would find it. Lockstep workers do not (a death restarts every worker)."""

    def rejoined(self) -> dict[str, Any] | None:
        """A replacement's starting point: what :meth:`track` left last for its predecessor (None: nothing)."""
        return None


class LockstepCoordinator(Coordinator):
    """Workers that move one step at a time together (see the module docstring)."""

    def __init__(self, job: Any) -> None:
        super().__init__(job)
        self.log_world = self.world
        self._save_request = False  # the chief's time-based decision, sent with the next step's agreement
        self._save_flag = False  # what the last agreement carried
        self._asked = False  # request_save() since the last save (a world of one: no agreement carries it)

    def agree(self, have_batch: bool, can_shadow: bool = False) -> bool:
        if self.world == 1:
            self.holding = int(have_batch)
            return have_batch
        want = self.chief and self._save_request
        stuck = not have_batch and not can_shadow  # one such rank ends the epoch for all (the surplus is dropped)
        flags = torch.tensor([float(have_batch), float(want), float(stuck)], device=self.job.device)
        self.job.all_reduce(flags)
        everyone, save, stuck_ranks = flags.tolist()
        self._save_flag = save > 0
        self.holding = 0 if stuck_ranks > 0 else round(everyone)
        return everyone >= self.world

    def request_save(self) -> bool:
        self._save_request = self._save_request or self.chief
        self._asked = True  # (one worker alone saves at its next step: nobody to tell)
        return True

    def should_save(self, step: int, policy: _Policy) -> bool:
        if self.world == 1:
            asked, self._asked = self._asked, False
            return policy.should_save(step) or asked
        every = policy.every_steps
        save = self._save_flag or bool(every and step % every == 0)
        if self.chief:
            due = policy.should_save(step)  # also restarts the policy's clock on step-based saves
            self._save_request = due and not save  # time-based: every rank saves after the next step
        return save


class ProgressBoard(Protocol):
    """Where workers that run apart count their shared steps and leave their data positions."""

    def global_progress(self) -> tuple[int, int | None]:
        """(steps all workers committed so far, the total one of them announced, or None)."""

    def announce_total(self, total: int) -> None:
        """Tell every worker the total number of steps (over all of them) this run stops at."""

    def publish_position(self, data: bytes) -> None:
        """Replace this worker's newest data position."""

    def positions(self) -> list[bytes | None]:
        """Every worker's newest published position (index = rank; None: nothing published yet)."""

    # Optional (boards of workers that can be restarted alone): ``replacement`` (this worker is one),
    # ``track(data)`` (the position to send with this step's commit), ``rejoined()`` (the predecessor's, or None).


class IndependentCoordinator(Coordinator):
    """Workers that run apart and stop on a shared step count (see the module docstring)."""

    def __init__(self, job: Any, board: ProgressBoard) -> None:
        super().__init__(job)
        self.board = board
        self.replacement = bool(getattr(board, "replacement", False))
        self._too_large = False
        self.offset = 0  # steps all workers committed before this run (from the checkpoint)
        self.planned: int | None = None  # the total of all workers' steps the job stops at
        self.done = False  # this worker stopped: the job's count ends on `planned` once the others commit

    def resumed(self, extra: Mapping[str, Any]) -> None:
        self.offset = int(extra.get("global_steps") or 0)

    def tolerates_missing_positions(self, data_states: Mapping[str, Any]) -> bool:
        # A worker that had published no position yet when the chief saved starts its data over.
        return "worker-0" in data_states

    def finished(self, step: int, steps_per_epoch: int | None) -> bool:
        if self.planned is None:
            self._plan(steps_per_epoch)
        done, _ = self.board.global_progress()
        # ``done`` is the count this worker's own last commit was answered with, so the others may each be in
        # a step it does not see: stopping at ``planned`` would let every worker take one more (221/220).
        # Stopping once the count is within world - 1 of it lands on it exactly: each worker commits at most
        # once after the count passes that mark, and each stops on a different count at or above it.
        self.done = self.planned is not None and self.offset + done >= self.planned - (self.world - 1)
        return self.done

    def _plan(self, steps_per_epoch: int | None) -> None:
        """The total to stop at, once this worker can tell it (announced to all), or as another announced it."""
        totals = []
        if self.max_steps is not None:
            totals.append(self.max_steps * self.world)
        if self.total_epochs is not None and steps_per_epoch:
            totals.append(self.total_epochs * steps_per_epoch * self.world)
        if totals:
            self.planned = min(totals)
            self.board.announce_total(max(0, self.planned - self.offset))
            return
        _, announced = self.board.global_progress()
        if announced is not None:
            self.planned = self.offset + int(announced)

    def epoch_limit(self) -> int | None:
        # A worker goes on into further epochs of its shard until the shared total is reached; it stops
        # by itself only if it alone did every worker's share (the others are gone).
        return None if self.total_epochs is None else self.total_epochs * self.world

    def evaluation(self, final: bool) -> str | None:
        if final:
            return "all"
        return "alone" if self.chief else None

    def meets_for(self, final: bool) -> bool:
        return final

    def positions(self, mine: bytes, final: bool) -> list[bytes | None]:
        if final:
            return self.job.all_gather_bytes(mine)
        if not self.chief:
            self.board.publish_position(mine)
            return []
        return [mine, *self.board.positions()[1:]]

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"global_steps": self.shared_progress()[0]}  # the final save meets every worker: all committed

    def track(self, position: Callable[[], dict[str, Any]]) -> None:
        if self._too_large:
            return
        data = json.dumps({"format": _REJOIN_FORMAT, "offset": self.offset, **position()}, separators=(",", ":"))
        size = len(data)
        if size > MAX_TRACKED_BYTES:  # the servers would refuse the commit: this worker cannot be replaced
            self._too_large = True
            data = json.dumps({"format": _REJOIN_FORMAT, "too_large": size})
            warnings.warn(f"worker {self.rank}: its data position is {size} bytes, over the "
                          f"{MAX_TRACKED_BYTES} the parameter servers keep per worker, so a replacement of it could "
                          f"not continue where it was: if it dies, its replacement stops with an error. A smaller "
                          f"shuffle buffer (or interleave cycle) makes the position smaller", stacklevel=3)
        self.board.track(data.encode())

    def rejoined(self) -> dict[str, Any] | None:
        data = self.board.rejoined()
        if data is None:
            return None
        doc = json.loads(bytes(data).decode())
        if not isinstance(doc, dict) or doc.get("format") != _REJOIN_FORMAT:
            raise ValueError(f"worker {self.rank} was restarted alone, but the position the parameter servers hold "
                             f"for it is not a Trainer's (another program trained with them): restart the whole job")
        if "too_large" in doc:
            raise ValueError(f"worker {self.rank} was restarted alone, but its predecessor's data position "
                             f"({doc['too_large']} bytes) was too large for the parameter servers to keep, so where "
                             f"it was is unknown: make the position smaller (a smaller shuffle buffer) and run the "
                             f"job again")
        self.offset = int(doc["offset"])
        return doc

    def shared_progress(self) -> tuple[int, int | None] | None:
        if self.done:  # what the job ends on (finished() says why), not this worker's last, older, answer
            return self.planned, self.planned
        return self.offset + self.board.global_progress()[0], self.planned

