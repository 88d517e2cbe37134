"""`conveyor.Trainer`: the training loop, for scripts that do not want to write their own.

    import conveyor
    from conveyor.data import Dataset

    job = conveyor.init()
    model = Net()
    model, optimizer = job.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = Dataset.from_tensor_slices((x, y)).shard(job.world_size, job.rank).shuffle(1000, seed=0).batch(32)
    trainer = conveyor.Trainer(job, model, optimizer, torch.nn.functional.cross_entropy, train,
                               eval_data=test.shard(job.world_size, job.rank).batch(256),
                               epochs=3, checkpoint_every_steps=100)
    summary = trainer.fit()             # the dict written to <output>/summary.json

`fit()` trains, logs, evaluates, checkpoints, resumes from the latest checkpoint and writes the trace,
plots and `summary.json`, the same way under every strategy. What it does when:
`docs/training.md`, "The training loop".
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor import fault, recovery
from conveyor.comm.process_group import collective_guard
from conveyor.data.redistribute import leftover_iterator
from conveyor.data.torch_adapter import to_torch
from conveyor.train.checkpoint import (
    BackgroundSaves,
    CheckpointManager,
    CheckpointPolicy,
    Item,
    Stateful,
    StepWrite,
    stage_commit,
)
from conveyor.train.drain import Drain
from conveyor.train.evaluation import Evaluator, accuracy, batch_size, evaluate, split_batch
from conveyor.train.nonfinite import NonfiniteGuard, check_policy, params_finite
from conveyor.train.position import DataPosition, TrainerPosition
from conveyor.train.profiler import StepProfiler, StepTimes
from conveyor.train.reporting import Reporter
from conveyor.train.resume import ResumeError, resume
from conveyor.train.summary import summarize
from conveyor.train.throughput import Throughput
from conveyor.train.throughput import check_options as check_throughput_options

__all__ = ["ResumeError", "StepEnd", "TrainConfig", "Trainer", "accuracy"]


@dataclass(frozen=True)
class TrainConfig:
    """How long to train and how often to log, evaluate and checkpoint (validated once, here).

    epochs: passes over `train_data`; None (the default) means 1, or as many as `max_steps` needs.
    max_steps: stop after this many steps in total (counted across restarts), even mid-epoch.
    steps_per_epoch: end an epoch after this many steps (batches) even if `train_data` goes on — what
        makes `epochs` meaningful for a `train_data` that repeats forever (ends in `.repeat()`).
    eval_every_steps: evaluate every N steps (and always at the end when there is eval data).
    checkpoint_every_steps / checkpoint_every_seconds: save every N steps / T seconds (and always
        at the end).
    async_checkpoint: True: a save blocks training only while the state is copied; hashing, writing, fsync
        and rotation run in the background (one save at a time; `conveyor.train.checkpoint.background`).
        False: written before training goes on. None (the default): the job's setting, synchronous unless
        `conveyor run --checkpoint-async` (CONVEYOR_CHECKPOINT_ASYNC=1).
    keep_checkpoints: how many checkpoints to keep (None: all).
    log_every_steps: one metrics record per N steps.
    progress: True (a bar on a terminal, plain lines otherwise), "always" (a bar), False.
    nonfinite: what a NaN or infinite loss does: "stop" (the default; `NonfiniteError` naming the step and
        the worker) or "skip" (that worker's batch is dropped); `conveyor.train.nonfinite`.
    peak_tflops / tokens_per_sample / count_flops: the step log's MFU peak (default: a known GPU's bf16 peak),
        tokens per sample (default: T for integer inputs (B, T)) and whether the first step's FLOPs are
        counted for TFLOPS and MFU; `conveyor.train.throughput`.
    """

    epochs: int | None = None
    max_steps: int | None = None
    steps_per_epoch: int | None = None
    eval_every_steps: int | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None
    keep_checkpoints: int | None = 3
    async_checkpoint: bool | None = None
    log_every_steps: int = 10
    progress: bool | str = True
    nonfinite: str = "stop"
    peak_tflops: float | None = None
    tokens_per_sample: int | None = None
    count_flops: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps", "steps_per_epoch", "eval_every_steps", "checkpoint_every_steps",
                     "keep_checkpoints"):
            _check_positive_int(name, getattr(self, name), allow_none=True)
        _check_positive_int("log_every_steps", self.log_every_steps, allow_none=False)
        s = self.checkpoint_every_seconds
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0):
            raise ValueError(f"checkpoint_every_seconds must be a positive number or None, got {s!r}")
        if self.async_checkpoint not in (None, True, False):
            raise ValueError(f"async_checkpoint must be True, False or None (the job's setting), got "
                             f"{self.async_checkpoint!r}")
        if self.progress not in (True, False, "always"):
            raise ValueError(f"progress must be True, False or 'always', got {self.progress!r}")
        check_policy(self.nonfinite, shares_batches=False)
        check_throughput_options(self.peak_tflops, self.tokens_per_sample, self.count_flops)

    @property
    def total_epochs(self) -> int | None:
        """Epochs to run: None when only `max_steps` bounds training."""
        if self.epochs is None:
            return None if self.max_steps is not None else 1
        return self.epochs


def _config(config: TrainConfig | None, options: Mapping[str, Any]) -> TrainConfig:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"Trainer got unknown option(s) {unknown}; the options are {sorted(known)}")
    return dataclasses.replace(config or TrainConfig(), **options)


def _check_positive_int(name: str, value: Any, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class StepEnd:
    """What a callback receives after each step (after logging, evaluation and checkpointing)."""

    step: int
    epoch: int
    loss: torch.Tensor  # detached; `.item()` synchronises with the device
    inputs: Any
    targets: Any
    times: StepTimes


class Trainer:
    """The training loop (module docstring): `Trainer(job, model, optimizer, loss_fn, train_data, ...).fit()`.

    `model` and `optimizer` are what `job.prepare` returned. Options are `TrainConfig`'s fields as
    keywords (`epochs=3, checkpoint_every_steps=100`) or a `config=TrainConfig(...)`; `metric_fn(outputs,
    targets)` returns a batch mean (accuracy by default, reported as `eval_<its name>`); each of
    `callbacks` is called with a `StepEnd` after every step. `scheduler`, a torch LR scheduler over
    `optimizer`, steps after every training step (not every epoch) and is checkpointed with the run.
    """

    def __init__(self, job, model: torch.nn.Module, optimizer, loss_fn: Callable, train_data, *,
                 eval_data=None, metric_fn: Callable = accuracy, callbacks: Sequence[Callable[[StepEnd], Any]] = (),
                 scheduler: Any = None, config: TrainConfig | None = None, **options: Any):
        self.config = _config(config, options)
        for name, ds in (("train_data", train_data), ("eval_data", eval_data)):
            if ds is not None and not hasattr(ds, "iterator"):
                raise TypeError(f"{name} must be a conveyor.data Dataset (got {type(ds).__name__}); build it with "
                                f"conveyor.data.Dataset.from_tensor_slices(...) or TFRecordDataset(...)")
        _check_epochs_end(train_data, self.config)
        job.strategy.step.check(model, train_data)
        self.job, self.model, self.optimizer, self.loss_fn = job, model, optimizer, loss_fn
        self.train_data, self.eval_data, self.metric_fn = train_data, eval_data, metric_fn
        self.callbacks = list(callbacks)
        self.scheduler = scheduler
        self.module = _unwrap(model)
        check_policy(self.config.nonfinite, job.strategy.step.shares_batches)
        self.checkpoints = CheckpointManager(Path(job.output_dir) / "checkpoints", keep=self.config.keep_checkpoints)
        self.step = 0
        self.epoch = 0
        self._warned_eval_shard = False

    def fit(self) -> dict[str, Any]:
        """Train (resuming from the latest checkpoint if there is one) and return the summary.

        Every rank returns it (global figures are summed over ranks; `step_breakdown` is this rank's);
        the chief also writes it to `<output>/summary.json`.
        """
        run = _Run(self)
        try:
            # A dead or silent peer surfaces as PeerError naming it, also from inside DDP's backward.
            with collective_guard(self.job, "the training loop"), run.checkpointer.saves.until_written_on_sigterm():
                run.start()
                if not run.finished_before:
                    run.train()
                    run.finish()
        finally:
            run.close()
        return run.summary

    def evaluate(self, collective: bool = True) -> dict[str, float]:
        """Loss and metric over `eval_data` (each rank its shard), summed over ranks (`collective=False`:
        this rank's shard alone)."""
        if self.eval_data is None:
            return {}
        data = self.eval_data
        shards, index = self.job.data_shard
        if collective and shards > 1 and not data.is_sharded(shards):
            data = self._shard_eval_data(shards, index)
        return evaluate(self.module, data, self.loss_fn, self.metric_fn, device=self.job.device,
                        job=self.job if collective else None, forward=self.job.strategy.step.eval_forward)

    def _shard_eval_data(self, world: int, index: int):
        """`eval_data` split by batch over the workers, so that every sample is counted once (as tf.distribute's
        auto-sharding does); said once, since the user's own `shard` would also split the reading."""
        if not self._warned_eval_shard:
            self._warned_eval_shard = True
            warnings.warn(f"eval_data is not sharded per worker (no .shard({world}, rank)), so each of the {world} "
                          f"workers would evaluate all of it and every sample would count {world} times; conveyor "
                          f"evaluates every {world}th batch on each worker instead. Shard it yourself "
                          f"(eval_data.shard(*job.data_shard)) to read only each worker's part.",
                          stacklevel=4)
        return self.eval_data.shard(world, index)


class _Run:
    """One `fit()` call: its batches, coordinator, profiler, reporter, evaluator and checkpoints.

    `train` is the loop; every component it calls decides its own cadence.
    """

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.job = trainer.job
        self.cfg = trainer.config
        self.strategy = trainer.job.strategy
        self.device = torch.device(self.job.device)
        self.out = Path(self.job.output_dir)
        self.coord = self.strategy.coordinator(self.job)
        self.coord.start(max_steps=self.cfg.max_steps, total_epochs=self.cfg.total_epochs)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        self.prof = StepProfiler(int(self.job.rank), sync=sync)
        self.batches = _Batches(self)
        self.evaluator = Evaluator(trainer.eval_data, self.cfg.eval_every_steps, self.coord, self._evaluate)
        self.position = TrainerPosition(self.job, self.coord, trainer.optimizer, current=self.batches.position,
                                        run_info=self._run_info, train_data=trainer.train_data)
        self.items: dict[str, Item] = {"trainer": self.position,
                                       **self.strategy.checkpoint_items(trainer.module, trainer.optimizer)}
        if trainer.scheduler is not None:
            self.items["scheduler"] = Stateful(trainer.scheduler)
        self.checkpointer = _Checkpointer(self)
        self.drain = Drain.open(self.job, self.coord)  # an elastic job's chief: stop at a checkpoint when asked
        self.guard = NonfiniteGuard(self.cfg.nonfinite, self.job, trainer.module)
        self.loss_fn = self.guard.wrap(trainer.loss_fn)
        self.meter = Throughput(self.device, peak_tflops=self.cfg.peak_tflops,
                                tokens_per_sample=self.cfg.tokens_per_sample, count_flops=self.cfg.count_flops)
        self.finished_before = False  # resumed from a run that did every step asked: fit() changes nothing
        self.reporter: Reporter | None = None
        self.resumed_from: int | None = None
        self.summary: dict[str, Any] = {}
        self.started = time.perf_counter()

    def start(self) -> None:
        t = self.t
        recovery.mark("fit")
        # A worker restarted alone (ps-async/ssp) continues where the servers applied its predecessor's last step;
        # the others' checkpoint is older, and reading it would take collectives it has no group for.
        rejoined = self.coord.rejoined() if self.coord.replacement else None
        resumed = None if self.coord.replacement else resume(self.job, t.checkpoints, self.items)
        recovery.mark("restored")
        t.step = resumed.step if resumed else 0
        self.resumed_from = self.checkpointer.last_saved = resumed.step if resumed else None
        if self.coord.replacement:
            t.step = self.resumed_from = self._take_over(rejoined)
        self.batches.start(resumed is not None or rejoined is not None, self.position)
        if resumed is not None and self._already_done():
            self._finished_before()
            return
        self.reporter = Reporter.open(self.job, self.out, progress=self.cfg.progress, total=self._known_total(),
                                      initial=t.step, resumed_from=self.resumed_from, throughput=self.meter)
        self.prof.start()
        self.started = time.perf_counter()
        self.reporter.window.reset()

    def train(self) -> None:
        t = self.t
        t.model.train()
        self.checkpointer.start(t.step)
        while self.batches.active and not self.coord.finished(t.step, self.batches.steps_per_epoch):
            if self.drain is not None:
                self.drain.look()  # before the step's agreement, which carries the request to save after it
            self.prof.begin_step()
            batch = self.batches.next()
            if batch is None:
                self.prof.cancel_step()
                break
            self.prof.mark("input_wait")
            self.coord.track(self._tracked)  # sent with this step's commit: where a replacement would continue
            inputs, targets = split_batch(batch)
            step, shadow = self.strategy.step, self.batches.shadow
            comm_before = step.comm_seconds()
            loss_fn = _zero_weight(self.loss_fn) if shadow else self.loss_fn
            loss = self.meter.train(step.train, t.model, t.optimizer, loss_fn, inputs, targets, self.prof.mark)
            t.step += 1
            recovery.mark("first_step")  # the stall after a failure ends here (conveyor.recovery)
            fault.point("after-step", t.step)
            self.guard.after_step(t.step, loss)
            if t.scheduler is not None:
                t.scheduler.step()
            samples = 0 if shadow else step.counted_samples(batch_size(targets))
            times = self.prof.end_step(t.step, samples, step.comm_seconds() - comm_before)
            if shadow:  # no batch of this worker's data: no loss, samples or callbacks (the others' step counts)
                self.reporter.progress.advance()
            else:
                self.reporter.add(loss, samples, times.input_wait, *self.meter.measure(inputs, targets, samples))
            if t.step % self.cfg.log_every_steps == 0:
                self._log()
            if self.evaluator.due(t.step):
                self.evaluator.run(t.step, final=False)
            if self.checkpointer.due(t.step):
                self.checkpointer.save(t.step)
            for callback in () if shadow else t.callbacks:
                callback(StepEnd(t.step, t.epoch, loss, inputs, targets, times))
            if self.drain is not None and self.checkpointer.last_saved == t.step:
                self.drain.park(self.checkpointer.saves)  # asked to stop here: the step's callbacks ran, it is saved

    def finish(self) -> None:
        self._log()
        self.strategy.step.finish(self.t.module, self.job)  # workers running apart: the servers' final state
        self.evaluator.run(self.t.step, final=True)
        self.checkpointer.save(self.t.step, final=True)  # complete on disk when it returns
        self.summary = summarize(self.job, self.prof, wall=time.perf_counter() - self.started, steps=self.t.step,
                                 epochs=self.t.epoch, eval_result=self.evaluator.result,
                                 resumed_from=self.resumed_from, checkpoints=self.t.checkpoints.root,
                                 module=self.t.module, throughput=self.meter,
                                 checkpoint_saves=self.checkpointer.saves.report())

    def _finished_before(self) -> None:
        """The run resumed from did every step asked (every rank sees it alike): nothing is trained, and no
        output (summary, traces, metrics, plots) is rewritten; `fit()` returns the summary.json written then."""
        t = self.t
        self.finished_before = True
        self.summary = {"steps": t.step, "epochs": t.epoch, **read_previous_summary(self.out), "steps_this_run": 0}
        if self.job.is_chief:
            print(f"this job already finished: it trained {t.step} steps over {t.epoch} epoch(s), so there is "
                  f"nothing left to do and its outputs in {self.out} are left as they are. To train again from "
                  f"scratch, run it with --no-resume (CONVEYOR_RESUME=0) or another --output-dir; to train longer, "
                  f"raise epochs / max_steps.", file=sys.stderr, flush=True)

    def _tracked(self) -> dict[str, Any]:
        """Where this worker is once the step in progress is applied: what a replacement of it continues from."""
        data = self.batches.place(shard=[int(v) for v in self.job.data_shard])
        return {"step": self.t.step + 1, "steps_per_epoch": self.batches.steps_per_epoch,
                "data": json.loads(data.to_bytes())}

    def _take_over(self, rejoined: dict[str, Any] | None) -> int:
        """A replacement's step, data position and steps per epoch, from what its predecessor last sent with an
        applied step (:meth:`_tracked`); with nothing sent (it died in its first step) its data starts over."""
        rank = self.job.rank
        if rejoined is None:
            warnings.warn(f"worker {rank} was restarted alone, but its predecessor committed no step with a data "
                          f"position, so where it was is unknown; its data starts over from the first epoch",
                          stacklevel=3)
            return 0
        self.position.data = DataPosition.from_doc(rejoined["data"], f"the parameter servers' position of worker "
                                                                     f"{rank}")
        spe = rejoined.get("steps_per_epoch")
        self.position.steps_per_epoch = int(spe) if spe else None
        print(f"worker {rank} restarted alone: continuing at step {rejoined['step']}, epoch "
              f"{self.position.data.epoch} after {self.position.data.batches} batch(es), as the parameter servers "
              f"applied it", flush=True)
        return int(rejoined["step"])

    def _run_info(self) -> dict[str, Any]:
        """What the checkpoint records of this run besides the workers' positions."""
        return {"epoch": self.t.epoch, "steps_per_epoch": self.batches.steps_per_epoch}

    def _already_done(self) -> bool:
        """Whether the run resumed from holds every step this one asks for (lockstep bounds; workers running
        apart find out from their shared count on the first step)."""
        return not self.batches.active or (self.cfg.max_steps is not None and self.t.step >= self.cfg.max_steps)

    def _known_total(self) -> int | None:
        """This worker's total steps, where it is known before the first epoch ends."""
        cfg, per_epoch = self.cfg, self.batches.steps_per_epoch
        if per_epoch is None or cfg.total_epochs is None:
            return cfg.max_steps
        return min(per_epoch * cfg.total_epochs, cfg.max_steps or per_epoch * cfg.total_epochs)

    def close(self) -> None:
        self.checkpointer.saves.close()  # an exception or Ctrl-C on its way: the save in flight completes first
        self.batches.close()
        if self.reporter is not None:
            self.reporter.close()

    def _log(self) -> None:
        if self.reporter.log(self.t.step, self.t.epoch, _lr(self.t.optimizer), self.coord.log_world,
                             self.coord.shared_progress()) is None:
            return
        if self.batches.it is not None:
            self.prof.sample_pipeline(self.batches.it.stats(), key=self.t.epoch)

    def _evaluate(self, collective: bool) -> dict[str, float]:
        with self.prof.span("eval", step=self.t.step):
            result = self.t.evaluate(collective=collective)
        record = {"event": "eval", "step": self.t.step, "epoch": self.t.epoch, **result, "time": time.time()}
        shared = self.coord.shared_progress()
        if shared is not None:  # workers running apart: the job's step too, the one the progress shows
            record["global_step"] = shared[0]
        self.reporter.emit(record)
        return result


class _Batches:
    """This worker's training batches, epoch after epoch, as far as the coordinator lets them through.

    Where the strategy's step can take a zero-weight step (`Step.shadows`), a worker whose batches of the
    epoch ran out steps on with the others (`shadow`: its last batch again, its loss times zero) until the
    last worker's are used: no worker's surplus is dropped. Elsewhere the epoch ends when the first runs out.
    """

    def __init__(self, run: _Run):
        self.run, self.t, self.coord = run, run.t, run.coord
        self.root_seed: int = int(self.t.train_data.root_seed)
        self.it = None
        self.in_epoch = 0  # steps taken in the current epoch (zero-weight ones too)
        self.epoch_length = run.cfg.steps_per_epoch  # None: an epoch is one pass over train_data
        self.steps_per_epoch: int | None = self.epoch_length
        self.resumed = False
        self.leftover: dict | None = None  # this worker's share of an epoch begun by another worker count
        self.dropped_epochs = 0  # epochs in which this rank had batches left when another ran out
        self.can_shadow = bool(run.strategy.step.shadows) and int(self.t.job.world_size) > 1
        self.shadow = False  # the batch `next` returned is one to take a zero-weight step with
        self.exhausted = False  # this epoch's iterator ended
        self.last: Any = None  # the batch zero-weight steps repeat
        self.looked = False  # read a batch for them from the shard's start already

    @property
    def active(self) -> bool:
        return self.it is not None

    def start(self, resumed: bool, position: TrainerPosition) -> None:
        """Position the data where the run resumes (or at the start)."""
        t = self.t
        t.epoch = 0
        self.resumed = resumed
        if resumed and position.steps_per_epoch:
            self.steps_per_epoch = position.steps_per_epoch
        state = position.data if resumed else None
        if state is None:  # a fresh start, or a worker whose data starts over
            self.it = self._iterator(0)
            return
        self.root_seed, t.epoch, self.in_epoch = state.root_seed, state.epoch, state.batches
        self.leftover = state.leftover
        if not self._done_epochs():  # (a finished run resumed with more epochs continues with the next one)
            self.it = self._iterator(t.epoch)
            if state.iterator is not None:
                self.it.load_state_dict(state.iterator)

    def next(self) -> Any:
        """This step's batch (see `shadow`); None when this worker's training data is over."""
        while True:
            batch = self._take()
            can_shadow = batch is None and self.can_shadow and self._shadow_batch() is not None
            if self.coord.agree(batch is not None, can_shadow) or self.coord.holding:
                self.in_epoch += 1
                self.shadow = batch is None
                if self.shadow:
                    return self.last
                if self.can_shadow:
                    self.last = batch
                return batch
            if batch is not None:  # another rank's shard ended first and it cannot step on: all end the epoch
                self._warn_dropped()
            if not self._next_epoch():  # (closes this epoch's iterator, surplus batches and all)
                return None

    def position(self) -> DataPosition:
        return DataPosition.now(epoch=self.t.epoch, batches=self.in_epoch, root_seed=self.root_seed,
                                iterator=None if self.it is None else self.it.state_dict(), leftover=self.leftover)

    def place(self, shard: list[int]) -> DataPosition:
        """:meth:`position` without the RNG states (the pipeline's randomness is its seed's), read every step."""
        return DataPosition(self.t.epoch, self.in_epoch, self.root_seed,
                            None if self.it is None else self.it.state_dict(), None, self.leftover, shard)

    def close(self) -> None:
        if self.it is not None:
            self.it.close()

    def _take(self) -> Any:
        if self.exhausted or (self.epoch_length is not None and self.in_epoch >= self.epoch_length):
            return None
        try:
            return next(self.it)
        except StopIteration:
            self.exhausted = True
            return None

    def _shadow_batch(self) -> Any:
        """The batch zero-weight steps repeat: this worker's last, else (once) the first of its shard's epoch,
        e.g. for a worker dealt no batch of a redistributed epoch; None where its shard has none."""
        if self.last is None and not self.looked:
            self.looked = True
            it = self._iterator(self.t.epoch, plain=True)
            try:
                self.last = next(it, None)
            finally:
                it.close()
        return self.last

    def _next_epoch(self) -> bool:
        t = self.t
        with self.run.prof.span("epoch_end", epoch=t.epoch):
            self.it.close()
            self.exhausted = False
            if self.in_epoch and self.steps_per_epoch is None and not self.resumed:
                self.steps_per_epoch = self.in_epoch
                total_epochs, max_steps = self.run.cfg.total_epochs, self.run.cfg.max_steps
                if total_epochs is not None:
                    total = self.steps_per_epoch * total_epochs
                    self.run.reporter.progress.set_total(min(total, max_steps or total))
            t.epoch += 1
            self.in_epoch = 0
            self.leftover = None  # later epochs run the pipeline, sharded over this world
            if self._done_epochs():
                self.it = None
                return False
            self.it = self._iterator(t.epoch)
            return True

    def _done_epochs(self) -> bool:
        limit = self.coord.epoch_limit()
        return limit is not None and self.t.epoch >= limit

    def _iterator(self, epoch: int, plain: bool = False):
        """The epoch's batches: this worker's leftover where it has one (unless `plain`), else its shard's."""
        device = torch.device(self.run.device)  # pinned host batches: the copy to a GPU overlaps the step
        data = self.t.train_data
        source = (data.iterator(self.root_seed, iteration=epoch) if self.leftover is None or plain
                  else leftover_iterator(data, self.leftover, self.root_seed, epoch))
        return to_torch(source, device=device, pin_memory=device.type == "cuda")

    def _warn_dropped(self) -> None:
        self.dropped_epochs += 1
        if self.dropped_epochs == 1:
            warnings.warn(
                f"worker {self.t.job.rank}: another worker's shard of train_data ran out first in epoch "
                f"{self.t.epoch} and it cannot take zero-weight steps (its shard has no batch, or the strategy "
                f"cannot); this worker skips the rest of its shard so that all workers end the epoch together. "
                f"Give every worker the same number of batches (shard evenly, "
                f"batch(..., drop_remainder=True)) to train on all of them.", stacklevel=4)


class _Checkpointer:
    """When the run checkpoints (the policy's cadence, agreed by the coordinator); each of the run's items
    says what it adds. The items' part (collectives included) and the copy of the state block the loop; the
    write runs in the background unless the run saves synchronously (`BackgroundSaves`)."""

    def __init__(self, run: _Run):
        self.run, self.t, self.job, self.coord = run, run.t, run.job, run.coord
        self.policy = CheckpointPolicy(run.cfg.checkpoint_every_steps, run.cfg.checkpoint_every_seconds)
        self.last_saved: int | None = None
        # A background write may wait the job's timeout for other tasks' parts, then write: bounded by both.
        self.saves = BackgroundSaves(enabled=_async_checkpoint(run.cfg, run.job),
                                     timeout=float(self.job.timeout) + _WRITE_SECONDS)

    def start(self, step: int) -> None:
        self.policy.should_save(step)  # starts its seconds clock now (and never re-saves the step resumed from)

    def due(self, step: int) -> bool:
        return self.coord.should_save(step, self.policy)

    def save(self, step: int, final: bool = False) -> None:
        """Checkpoint ``step``: every rank's items add to it, the chief writes it; the final save is complete on
        disk when this returns (a background write's error raised)."""
        if self.last_saved == step and not self.coord.meets_for(final):
            if final:
                self.saves.finish()
            return
        with self.run.prof.span("checkpoint", step=step):
            # A meeting at the end writes a step saved already again: workers running apart committed since
            # (the servers' state, every worker's position), and the last checkpoint must hold the run's end.
            self.saves.save(step, lambda: self._stage(step, final))
            if final:
                self.saves.finish()
        self.last_saved = step

    def _stage(self, step: int, final: bool) -> Callable[[], Any]:
        """The blocking part of a save: every item adds to the step (collectives, ps shards), the state is copied;
        returns the write."""
        out = StepWrite(step, is_chief=bool(self.job.is_chief), root=self.t.checkpoints.root, final=final)
        for name, item in self.run.items.items():
            item.save(name, out)
        if out.is_chief:  # rotation never deletes the newest finite step (conveyor.train.nonfinite)
            out.extra["finite"] = params_finite(self.t.module)
        # A synchronous save writes at once: nothing changes the state meanwhile, so nothing is copied.
        return stage_commit(self.t.checkpoints, out, timeout=float(self.job.timeout), copy=self.saves.enabled,
                            buffers=self.saves.buffers)


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _check_epochs_end(train_data: Any, cfg: TrainConfig) -> None:
    """An endless `train_data` never ends an epoch: refuse a configuration that waits for one."""
    if cfg.steps_per_epoch is not None or not train_data.is_endless():
        return
    if cfg.epochs is not None or cfg.max_steps is None:
        asked = f"epochs={cfg.epochs}" if cfg.epochs is not None else "the default of one epoch"
        raise ValueError(f"train_data repeats forever (it ends in .repeat() without a count), so an epoch never ends "
                         f"and {asked} would train forever: pass steps_per_epoch=N (batches per epoch) or "
                         f"max_steps=N, or drop the .repeat() (the Trainer runs the epochs itself)")


def _zero_weight(loss_fn: Callable) -> Callable:
    """`loss_fn` times zero: a step whose forward, backward and collectives are a real one's, every gradient zero."""
    return lambda outputs, targets: loss_fn(outputs, targets) * 0.0


def read_previous_summary(out: Path) -> dict[str, Any]:
    """`<out>/summary.json` as the finished run wrote it ({} when it is missing or unreadable)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


_WRITE_SECONDS = 600.0  # what a background write may take besides waiting for other tasks' parts


def _async_checkpoint(cfg: TrainConfig, job: Any) -> bool:
    """Whether saves write in the background: the Trainer's option, else the job's (--checkpoint-async)."""
    if cfg.async_checkpoint is not None:
        return cfg.async_checkpoint
    return bool(getattr(getattr(job, "settings", None), "checkpoint_async", False))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP / DataParallel wrapper: checkpoints hold its keys, without "module."."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _lr(optimizer) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    try:
        return float(groups[0]["lr"])
    except (TypeError, IndexError, KeyError, ValueError):
        return None
