"""`conveyor.Trainer`: the training loop, for scripts that do not want to write their own.

    import conveyor
    from conveyor.data import Dataset

    job = conveyor.init()
    model, optimizer = job.prepare(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    train = Dataset.from_tensor_slices((x, y)).shard(job.world_size, job.rank).shuffle(1000, seed=0).batch(32)
    trainer = conveyor.Trainer(job, model, optimizer, torch.nn.functional.cross_entropy, train,
                               eval_data=test.shard(job.world_size, job.rank).batch(256),
                               epochs=3, checkpoint_every_steps=100)
    summary = trainer.fit()             # the dict written to <output>/summary.json

Run it with `python train.py` (one local worker) or `conveyor run -n 4 train.py`. A plain PyTorch
loop over `to_torch(ds)` keeps working without any of this.

What `fit()` does, on every worker:

- iterates `train_data` (a conveyor Dataset of `(inputs, targets)` numpy batches, already sharded
  for this rank) through `to_torch(..., device=job.device)`; one pass is one epoch. Epoch `e` is
  `train_data.iterator(root_seed, iteration=e)`, so a reshuffling pipeline draws the same order
  for epoch `e` in a resumed job as in an uninterrupted one;
- runs the steps (`zero_grad`, forward, `loss_fn(outputs, targets)` — a batch mean — `backward`,
  `step`), timing each phase with `StepProfiler`;
- every `log_every_steps` steps: one record (loss and throughput over all ranks) to
  `metrics.jsonl`, TensorBoard and the progress display (chief only);
- every `eval_every_steps` steps and at the end: evaluation of `eval_data` (this rank's shard)
  with `loss_fn` and `metric_fn` (accuracy by default), summed over ranks;
- checkpoints every `checkpoint_every_steps` steps / `checkpoint_every_seconds` seconds and at
  the end: model, optimizer, step, epoch, every worker's data-iterator position and RNG states;
- at the end: `trace/worker-<rank>.json` (every worker), and on the chief `plots/` and
  `summary.json`.

Resuming. When `job.resume` (the default; `conveyor run --no-resume` / `CONVEYOR_RESUME=0` turns it
off) and `<output>/checkpoints` holds a checkpoint, `fit()` continues from it: weights and optimizer
state into the unwrapped model, RNG states, step and epoch, and this worker's iterator position,
so the run sees exactly the samples an uninterrupted run would have seen after that step, in the
same order. A checkpoint written by a different number of workers is refused (its data positions
describe other shards).

Collectives. With more than one worker every step starts with one small all-reduce: it checks that
every rank still has a batch (an epoch ends for all ranks together; a rank whose shard is longer
drops its surplus batches with a warning, instead of DDP hanging) and carries the chief's
"checkpoint now" decision when `checkpoint_every_seconds` is set (the chief's clock decides, and
every rank saves at the end of the following step, so all ranks save the same step).

Workers apart. Strategies that are not `lockstep` (`ps-async`, `ps-ssp:K`) exist so that a fast
worker does not wait for a slow one, so there the loop has no per-step collective: each worker
runs through its own shard at its own pace (into further epochs of it if need be), and all stop
when the steps committed by all workers together reach the job's total — epochs × steps per epoch
× workers, or `max_steps` × workers — as TensorFlow's global step. Log records are then the
chief's own figures; every worker publishes its data position every checkpoint interval and the
chief's checkpoint holds the newest of each, so a resumed job may repeat or skip up to that many
steps of another worker's data (asynchronous updates promise no exact replay anyway). Evaluation
every `eval_every_steps` is the chief's alone, on its shard; only the end (the last evaluation and
checkpoint, the summary) brings the workers together.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor.comm.process_group import collective_guard
from conveyor.data.torch_adapter import to_torch
from conveyor.train.checkpoint import CheckpointError, CheckpointManager, CheckpointPolicy
from conveyor.train.profiler import StepProfiler, StepTimes, plot_step_breakdown, plot_timeline
from conveyor.train.progress import Progress
from conveyor.train.sinks import JsonlSink, TensorBoardSink
from conveyor.train.state_io import rng_state, set_rng_state

__all__ = ["ResumeError", "StepEnd", "TrainConfig", "Trainer", "accuracy"]

DATA_STATE_FORMAT = "conveyor.trainer.data"
DATA_STATE_VERSION = 1


class ResumeError(CheckpointError):
    """The checkpoint found cannot be resumed by this job; the message names the fix."""


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default `metric_fn`: the share of correct predictions in a batch.

    Several outputs per sample: the argmax is the prediction (logits or probabilities). One output
    per sample: a binary classifier's logit, positive meaning class 1.
    """
    if outputs.ndim >= 2 and outputs.shape[-1] > 1:
        predicted = outputs.argmax(dim=-1)
    else:
        predicted = (outputs.reshape(targets.shape) > 0).to(targets.dtype)
    return (predicted == targets).float().mean()


@dataclass(frozen=True)
class TrainConfig:
    """How long to train and how often to log, evaluate and checkpoint (validated once, here).

    epochs: passes over `train_data`; None (the default) means 1, or as many as `max_steps` needs.
    max_steps: stop after this many steps in total (counted across restarts), even mid-epoch.
    eval_every_steps: evaluate every N steps (and always at the end when there is eval data).
    checkpoint_every_steps / checkpoint_every_seconds: save every N steps / T seconds (and always
        at the end).
    keep_checkpoints: how many checkpoints to keep (None: all).
    log_every_steps: one metrics record per N steps.
    progress: True (a bar on a terminal, plain lines otherwise), "always" (a bar), False.
    """

    epochs: int | None = None
    max_steps: int | None = None
    eval_every_steps: int | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None
    keep_checkpoints: int | None = 3
    log_every_steps: int = 10
    progress: bool | str = True

    def __post_init__(self) -> None:
        for name in ("epochs", "max_steps", "eval_every_steps", "checkpoint_every_steps", "keep_checkpoints"):
            _check_positive_int(name, getattr(self, name), allow_none=True)
        _check_positive_int("log_every_steps", self.log_every_steps, allow_none=False)
        s = self.checkpoint_every_seconds
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0):
            raise ValueError(f"checkpoint_every_seconds must be a positive number or None, got {s!r}")
        if self.progress not in (True, False, "always"):
            raise ValueError(f"progress must be True, False or 'always', got {self.progress!r}")

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
    `callbacks` is called with a `StepEnd` after every step.
    """

    def __init__(self, job, model: torch.nn.Module, optimizer, loss_fn: Callable, train_data, *,
                 eval_data=None, metric_fn: Callable = accuracy, callbacks: Sequence[Callable[[StepEnd], Any]] = (),
                 config: TrainConfig | None = None, **options: Any):
        self.config = _config(config, options)
        for name, ds in (("train_data", train_data), ("eval_data", eval_data)):
            if ds is not None and not hasattr(ds, "iterator"):
                raise TypeError(f"{name} must be a conveyor.data Dataset (got {type(ds).__name__}); build it with "
                                f"conveyor.data.Dataset.from_tensor_slices(...) or TFRecordDataset(...)")
        self.job, self.model, self.optimizer, self.loss_fn = job, model, optimizer, loss_fn
        self.train_data, self.eval_data, self.metric_fn = train_data, eval_data, metric_fn
        self.callbacks = list(callbacks)
        self.module = _unwrap(model)
        _check_prepared(job, model)
        self.checkpoints = CheckpointManager(Path(job.output_dir) / "checkpoints", keep=self.config.keep_checkpoints)
        self.step = 0
        self.epoch = 0

    # ------------------------------------------------------------------------------------------------------------
    # the loop

    def fit(self) -> dict[str, Any]:
        """Train (resuming from the latest checkpoint if there is one) and return the summary.

        Every rank returns it (global figures are summed over ranks; `step_breakdown` is this rank's);
        the chief also writes it to `<output>/summary.json`.
        """
        run = _Run(self)
        try:
            # A dead or silent peer surfaces as PeerError naming it, also from inside DDP's backward.
            with collective_guard(self.job, "the training loop"):
                run.restore()
                run.open_outputs()
                run.loop()
                run.finish()
        finally:
            run.close()
        return run.summary

    def evaluate(self, collective: bool = True) -> dict[str, float]:
        """Loss and metric over `eval_data` (each rank its shard), summed over ranks (`collective=False`:
        this rank's shard alone)."""
        if self.eval_data is None:
            return {}
        device = self.job.device
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss * n, metric * n, n
        was_training = self.module.training
        self.module.eval()  # the unwrapped module: no DDP collectives, so shards may differ in length
        it = to_torch(self.eval_data.iterator(iteration=0), device=device)
        try:
            with torch.no_grad():
                for batch in it:
                    inputs, targets = _split(batch)
                    outputs = self.module(inputs)
                    n = _batch_size(targets)
                    sums[0] += self.loss_fn(outputs, targets).detach().double() * n
                    sums[1] += torch.as_tensor(self.metric_fn(outputs, targets), device=device).double() * n
                    sums[2] += n
        finally:
            it.close()
            self.module.train(was_training)
        if collective:
            self.job.all_reduce(sums)
        loss_sum, metric_sum, n = sums.tolist()
        name = getattr(self.metric_fn, "__name__", "metric")
        if n == 0:
            return {"eval_loss": math.nan, f"eval_{name}": math.nan, "eval_samples": 0}
        return {"eval_loss": loss_sum / n, f"eval_{name}": metric_sum / n, "eval_samples": int(n)}


class _Run:
    """The state of one `fit()` call: iterator, profiler, sinks, windows. Kept apart from `Trainer` so
    the trainer's own attributes are its configuration, and each phase of `fit` is one method here."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.job = trainer.job
        self.cfg = trainer.config
        self.world = int(self.job.world_size)
        self.rank = int(self.job.rank)
        self.chief = bool(self.job.is_chief)
        self.device = torch.device(self.job.device)
        self.out = Path(self.job.output_dir)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else None
        self.prof = StepProfiler(self.rank, sync=sync)
        self.policy = CheckpointPolicy(self.cfg.checkpoint_every_steps, self.cfg.checkpoint_every_seconds)
        self.it = None
        self.root_seed: int = int(trainer.train_data.root_seed)
        self.batches_in_epoch = 0
        self.steps_per_epoch: int | None = None
        self.resumed_from: int | None = None
        self.last_saved: int | None = None
        self.last_eval: int | None = None
        self.save_request = False  # the chief's time-based decision, sent with the next step's sync
        self.sinks: list = []
        self.progress: Progress | None = None
        self.eval_result: dict[str, float] = {}
        self.summary: dict[str, Any] = {}
        self.dropped_epochs = 0  # epochs in which this rank had batches left when another ran out
        self.started = time.perf_counter()
        self.win = _Window(self.device)
        strategy = getattr(self.job, "strategy", None)
        #: workers run apart (see the module docstring): no per-step collective
        self.apart = self.world > 1 and not getattr(strategy, "lockstep", True)
        self.global_offset = 0  # apart: steps all workers committed before this run (from the checkpoint)
        self.planned: int | None = None  # apart: the total of all workers' steps the job stops at

    # ---- resume

    def restore(self) -> None:
        t, job = self.t, self.job
        state = None
        if self.apart and self.chief:
            # Positions of the run before a restart may be ahead of the checkpoint it resumes from;
            # cleared before the first collective, so no worker has published one of this run yet.
            t.checkpoints.clear_positions()
        if getattr(job, "resume", True):
            chosen = self.checkpoints_latest()
            if chosen is not None:
                state = self._load(chosen)
                if self.chief:
                    print(f"resumed from step {chosen} ({t.checkpoints.step_dir(chosen)})", file=sys.stderr, flush=True)
        if state is None:  # a fresh start, also for a second fit() of the same trainer with resume off
            t.step, t.epoch = 0, 0
            self.it = self._iterator(0)
            return
        if state.get("fresh"):  # apart: this worker had published no position yet
            t.epoch = 0
            self.it = self._iterator(0)
            return
        self.root_seed = int(state["root_seed"])
        t.epoch = int(state["epoch"])
        self.batches_in_epoch = int(state["batches"])
        if not self._done_epochs():  # (a finished run resumed with more epochs continues with the next one)
            self.it = self._iterator(t.epoch)
            if state["iterator"] is not None:
                self.it.load_state_dict(state["iterator"])

    def checkpoints_latest(self) -> int | None:
        """The step to resume from, as the chief sees it (so every rank loads the same one, or all refuse)."""
        mine = None
        if self.chief:
            try:  # skips damaged steps with a warning each; refuses when every step is damaged
                mine = {"step": self.t.checkpoints.resume_step()}
            except CheckpointError as e:
                mine = {"error": str(e)}
        data = json.loads(bytes(self.job.broadcast_bytes(json.dumps(mine).encode() if self.chief else None, src=0)))
        if "error" in data:
            raise CheckpointError(data["error"])
        return data["step"]

    def _load(self, step: int) -> dict[str, Any]:
        t = self.t
        ckpt = t.checkpoints.load(step)
        root = t.checkpoints.root
        fix = lambda n: (f"run with the same number of workers as the job that wrote it (conveyor run -n {n}), or "
                         f"start over with --no-resume (CONVEYOR_RESUME=0) or another output folder than {root.parent}")
        saved_world = ckpt.extra.get("world_size")
        if saved_world != self.world:
            raise ResumeError(
                f"checkpoint {ckpt.path} was written by a job of {saved_world} worker(s); this job has {self.world}. "
                f"Its data positions describe {saved_world} shards, so resuming would lose or repeat samples: "
                + fix(saved_world)
            )
        missing = [f"worker-{r}" for r in range(self.world) if f"worker-{r}" not in ckpt.data_states]
        if missing and self.apart and "worker-0" in ckpt.data_states:
            if f"worker-{self.rank}" in missing:
                warnings.warn(f"worker {self.rank}: checkpoint {ckpt.path} has no data position for this worker (it "
                              f"had published none yet); its data starts over from the first epoch", stacklevel=2)
        elif missing:  # checked for every rank on every rank, so all ranks refuse together
            raise ResumeError(
                f"checkpoint {ckpt.path} has no data-iterator state for {missing} (it has "
                f"{sorted(ckpt.data_states)}), so those workers cannot continue where they were: "
                + fix(saved_world)
            )
        state = ckpt.data_states.get(f"worker-{self.rank}", {"format": DATA_STATE_FORMAT, "fresh": True,
                                                                 "version": DATA_STATE_VERSION})
        if not isinstance(state, dict) or state.get("format") != DATA_STATE_FORMAT:
            raise ResumeError(f"{ckpt.path}/data/worker-{self.rank}.json is not a conveyor Trainer data state; "
                              f"it was written by another program: start over with --no-resume (CONVEYOR_RESUME=0)")
        if state.get("version") != DATA_STATE_VERSION:
            raise ResumeError(f"{ckpt.path}: Trainer data state version {state.get('version')}, this conveyor reads "
                              f"{DATA_STATE_VERSION}; resume with the conveyor version that wrote it")
        t.module.load_state_dict(ckpt.model_state)
        if ckpt.optimizer_state is not None:
            _strategy_call(self.job, "restore_optimizer", t.optimizer, ckpt.optimizer_state, t.checkpoints, ckpt.step,
                           default=lambda: t.optimizer.load_state_dict(ckpt.optimizer_state))
        self.global_offset = int(ckpt.extra.get("global_steps") or 0)
        if ckpt.extra.get("steps_per_epoch"):
            self.steps_per_epoch = int(ckpt.extra["steps_per_epoch"])
        rng = _rng_from_json(state["rng"]) if state.get("rng") else ckpt.rng
        if rng is not None:
            set_rng_state(rng)
        t.step = ckpt.step
        self.resumed_from = self.last_saved = ckpt.step
        return state

    # ---- outputs

    def open_outputs(self) -> None:
        cfg = self.cfg
        total = cfg.max_steps
        self.progress = Progress(self.chief, cfg.progress, total=total, initial=self.t.step)
        if self.chief:
            resumed = self.resumed_from is not None
            self.sinks = [JsonlSink(self.out / "metrics.jsonl", append=resumed),
                          TensorBoardSink(self.out / "tensorboard", purge_step=self.resumed_from)]
        self.prof.start()
        self.started = time.perf_counter()
        self.win.reset()

    # ---- steps

    def loop(self) -> None:
        t = self.t
        t.model.train()
        self.policy.should_save(t.step)  # starts its seconds clock now (and never re-saves the step resumed from)
        if self.apart:
            self._plan()
        while self.it is not None and not self._reached_end():
            self.prof.begin_step()
            batch, save_flag = self._next_batch()
            if batch is None:
                self.prof.cancel_step()
                break
            self.prof.mark("input_wait")
            inputs, targets = _split(batch)
            comm0 = _comm_seconds(self.job)
            t.optimizer.zero_grad(set_to_none=True)
            loss = t.loss_fn(t.model(inputs), targets)
            loss.backward()
            self.prof.mark("forward_backward")
            t.optimizer.step()
            self.prof.mark("optimizer")
            t.step += 1
            self.batches_in_epoch += 1
            n = _batch_size(targets)
            times = self.prof.end_step(t.step, n, _comm_seconds(self.job) - comm0)
            self.win.add(loss.detach(), n, times.input_wait)
            self.progress.advance()
            self._after_step(save_flag)
            if t.callbacks:
                event = StepEnd(t.step, t.epoch, loss.detach(), inputs, targets, times)
                for callback in t.callbacks:
                    callback(event)

    def _reached_end(self) -> bool:
        if self.apart:
            done, _ = self.job.strategy.global_progress()
            return self.planned is not None and self.global_offset + done >= self.planned
        return self.cfg.max_steps is not None and self.t.step >= self.cfg.max_steps

    def _plan(self) -> None:
        """Apart: the total of all workers' steps to stop at, once this worker can tell it; announced to all."""
        cfg, totals = self.cfg, []
        if cfg.max_steps is not None:
            totals.append(cfg.max_steps * self.world)
        if cfg.total_epochs is not None and self.steps_per_epoch:
            totals.append(cfg.total_epochs * self.steps_per_epoch * self.world)
        if totals and self.planned is None:
            self.planned = min(totals)
            self.job.strategy.announce_total(max(0, self.planned - self.global_offset))
        if self.planned is None:  # another worker may have announced it
            _, announced = self.job.strategy.global_progress()
            if announced is not None:
                self.planned = self.global_offset + int(announced)

    def _after_step(self, save_flag: bool) -> None:
        t, cfg = self.t, self.cfg
        if self.apart and self.planned is None:
            self._plan()
        if t.step % cfg.log_every_steps == 0:
            self._log()
        if t.eval_data is not None and cfg.eval_every_steps and t.step % cfg.eval_every_steps == 0:
            self._evaluate(final=False)
        if self._should_save(save_flag):
            self._save()

    def _next_batch(self) -> tuple[Any, bool]:
        """This step's batch (None: training data exhausted) and whether to checkpoint after it."""
        while True:
            try:
                batch = next(self.it)
            except StopIteration:
                batch = None
            have, save_flag = self._sync(batch is not None)
            if have:
                return batch, save_flag
            if batch is not None:  # another rank's shard ended first: every rank ends the epoch together
                self.dropped_epochs += 1
                if self.dropped_epochs == 1:
                    warnings.warn(
                        f"worker {self.rank}: another worker's shard of train_data ran out first in epoch "
                        f"{self.t.epoch}; this worker skips the rest of its shard so that all workers end the epoch "
                        f"together. Give every worker the same number of batches (shard evenly, "
                        f"batch(..., drop_remainder=True)) to train on all of them.", stacklevel=2)
            if not self._next_epoch():  # (closes this epoch's iterator, surplus batches and all)
                return None, False

    def _sync(self, have_batch: bool) -> tuple[bool, bool]:
        """One all-reduce per step when there are several workers: does every rank have a batch, and
        has the chief asked for a checkpoint (time-based)?"""
        if self.world == 1 or self.apart:
            return have_batch, False
        flags = torch.tensor([1.0 if have_batch else 0.0, 1.0 if (self.chief and self.save_request) else 0.0],
                             device=self.device)
        self.job.all_reduce(flags)
        everyone, save = flags.tolist()
        return everyone >= self.world, save > 0

    def _next_epoch(self) -> bool:
        t = self.t
        with self.prof.span("epoch_end", epoch=t.epoch):
            self.it.close()
            if self.batches_in_epoch and self.steps_per_epoch is None and self.resumed_from is None:
                self.steps_per_epoch = self.batches_in_epoch
                if self.cfg.total_epochs is not None:
                    total = self.steps_per_epoch * self.cfg.total_epochs
                    self.progress.set_total(min(total, self.cfg.max_steps or total))
            t.epoch += 1
            self.batches_in_epoch = 0
            if self._done_epochs():
                self.it = None
                return False
            self.it = self._iterator(t.epoch)
            return True

    def _done_epochs(self) -> bool:
        total = self.cfg.total_epochs
        if self.apart and total is not None:
            # Apart, a worker goes on into further epochs of its shard until the shared total is reached;
            # it stops by itself only if it alone did every worker's share (the others are gone).
            return self.t.epoch >= total * self.world
        return total is not None and self.t.epoch >= total

    def _iterator(self, epoch: int):
        return to_torch(self.t.train_data.iterator(self.root_seed, iteration=epoch), device=self.device)

    # ---- logging and evaluation

    def _log(self) -> None:
        if self.win.steps == 0:
            return
        world = 1 if self.apart else self.world  # apart: no collective, the chief's own figures
        record = {"event": "train", "step": self.t.step, "epoch": self.t.epoch, **self.win.record(self.job, world),
                  "lr": _lr(self.t.optimizer), "time": time.time()}
        self.win.reset()
        if self.it is not None:
            self.prof.sample_pipeline(self.it.stats(), key=self.t.epoch)
        self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.chief:
            for sink in self.sinks:
                sink.write(record)
            self.progress.write(record)

    def _evaluate(self, final: bool = True) -> None:
        """Evaluate over all ranks; workers apart (before the end) meet in no collective: the chief
        evaluates its own shard and the others skip."""
        alone = self.apart and not final
        if (self.last_eval == self.t.step and not self.apart) or (alone and not self.chief):
            return
        self.last_eval = self.t.step
        with self.prof.span("eval", step=self.t.step):
            self.eval_result = self.t.evaluate(collective=not alone)
        self._emit({"event": "eval", "step": self.t.step, "epoch": self.t.epoch, **self.eval_result,
                    "time": time.time()})

    # ---- checkpoints

    def _should_save(self, save_flag: bool) -> bool:
        step = self.t.step
        if self.world == 1 or self.apart:
            return self.policy.should_save(step)
        every = self.cfg.checkpoint_every_steps
        save = save_flag or bool(every and step % every == 0)
        if self.chief:
            due = self.policy.should_save(step)  # also restarts the policy's clock on step-based saves
            self.save_request = due and not save  # a time-based save: every rank saves after the next step
            if save:
                self.save_request = False
        return save

    def _save(self, final: bool = False) -> None:
        """Checkpoint this step: collectively, or (workers apart, before the end) from published positions."""
        t = self.t
        if self.last_saved == t.step and not (self.apart and final):  # apart, the last one is a collective
            return
        with self.prof.span("checkpoint", step=t.step):
            mine = json.dumps(self._data_state(), separators=(",", ":")).encode()
            if self.apart and not final:
                if not self.chief:
                    t.checkpoints.publish_position(f"worker-{self.rank}", mine)
                gathered = [mine] + [t.checkpoints.latest_position(f"worker-{r}") for r in range(1, self.world)]
            else:
                gathered = self.job.all_gather_bytes(mine)
            if self.chief and self.last_saved != t.step:  # (apart, the last collective may find it written)
                data_states = {f"worker-{r}": json.loads(bytes(b).decode())
                               for r, b in enumerate(gathered) if b is not None}
                extra = {"epoch": t.epoch, "world_size": self.world, "strategy": _strategy_name(self.job),
                         "restarts": int(getattr(self.job, "restart_count", 0)),
                         "steps_per_epoch": self.steps_per_epoch}
                if self.apart:
                    extra["global_steps"] = self.global_offset + self.job.strategy.global_progress()[0]
                optimizer_state, parts = _strategy_call(
                    self.job, "save_optimizer", t.optimizer, t.checkpoints, t.step,
                    default=lambda: (t.optimizer.state_dict(), []))
                t.checkpoints.save(t.step, t.module.state_dict(), optimizer_state, extra=extra,
                                   data_states=data_states, rng=rng_state(), parts=parts,
                                   parts_timeout=float(getattr(self.job, "timeout", 60.0)))
        self.last_saved = t.step

    def _data_state(self) -> dict[str, Any]:
        return {"format": DATA_STATE_FORMAT, "version": DATA_STATE_VERSION, "epoch": self.t.epoch,
                "batches": self.batches_in_epoch, "root_seed": self.root_seed,
                "iterator": None if self.it is None else self.it.state_dict(), "rng": _rng_to_json(rng_state())}

    # ---- the end

    def finish(self) -> None:
        t = self.t
        self._log()
        if t.eval_data is not None:
            self._evaluate()
        self._save(final=True)
        wall = time.perf_counter() - self.started
        prof = self.prof.summary()
        totals = torch.tensor([prof["samples"], prof["input_wait_seconds"] / max(wall, 1e-9),
                               prof["accelerator_idle_fraction"]], dtype=torch.float64, device=self.device)
        self.job.all_reduce(totals)
        samples, wait_fraction_sum, idle_sum = totals.tolist()
        self.prof.write_trace(self.out / "trace" / f"worker-{self.rank}.json")
        plots = [self.out / "plots" / "timeline.png", self.out / "plots" / "step_breakdown.png"]
        if self.chief and self.prof.steps:  # a run that had nothing left to do keeps the plots of the run before
            plot_timeline(self.prof.trace(), plots[0])
            plot_step_breakdown(self.prof.steps, plots[1])
        outputs = {
            "metrics": str(self.out / "metrics.jsonl"),
            "tensorboard": str(self.out / "tensorboard"),
            "trace": str(self.out / "trace"),
            "plots": [str(p) for p in plots if p.exists()],
            "summary": str(self.out / "summary.json"),
        }
        self.summary = {
            "strategy": _strategy_name(self.job),
            "world_size": self.world,
            "steps": t.step,
            "epochs": t.epoch,
            "samples": int(samples),
            "samples_per_second": samples / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
            **{k: _finite(v) for k, v in self.eval_result.items() if k != "eval_samples"},
            "input_wait_fraction": wait_fraction_sum / self.world,
            "accelerator_idle_fraction": idle_sum / self.world,
            "step_breakdown": prof["step_breakdown"],
            "restarts": int(getattr(self.job, "restart_count", 0)),
            "resumed_from_step": self.resumed_from,
            "steps_this_run": prof["steps"],
            "checkpoints": str(t.checkpoints.root),
            "outputs": outputs,
        }
        if self.chief:
            # Strategies with more to say (parameter servers: push / pull / wait-for-servers
            # seconds, bytes and staleness per server) add it to the summary.
            strategy_stats = getattr(self.job.strategy, "stats", None)
            details = strategy_stats() if callable(strategy_stats) else None
            if details:
                self.summary["communication"] = details
            _write_json_atomic(self.out / "summary.json", self.summary)

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
        for sink in self.sinks:
            sink.close()
        if self.progress is not None:
            self.progress.close()


class _Window:
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

    def record(self, job, world: int) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rest = torch.tensor([self.steps, self.samples, self.wait, elapsed], dtype=torch.float64, device=self.device)
        vec = torch.cat([self.loss.reshape(1), rest])
        if world > 1:
            job.all_reduce(vec)
        loss, steps, samples, wait, elapsed_sum = vec.tolist()
        return {"loss": loss / max(steps, 1), "samples_per_second": samples / (elapsed_sum / world),
                "input_wait_fraction": wait / elapsed_sum}


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP / DataParallel wrapper: checkpoints hold its keys, without "module."."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def _check_prepared(job, model) -> None:
    if (int(job.world_size) > 1 and _strategy_name(job) == "allreduce"
            and not isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        raise ValueError(
            "the model is not wrapped for the allreduce strategy, so workers would train apart without "
            "averaging gradients: pass the model and optimizer that `job.prepare(model, optimizer)` returned"
        )


def _strategy_name(job) -> str:
    strategy = getattr(job, "strategy", None)
    return str(getattr(strategy, "name", None) or strategy or "local")


def _strategy_call(job, method: str, *args: Any, default: Callable[[], Any]) -> Any:
    """``job.strategy.<method>(*args)``, or ``default()`` for a job without a strategy (a stand-in job)."""
    fn = getattr(getattr(job, "strategy", None), method, None)
    return fn(*args) if fn is not None else default()


def _comm_seconds(job) -> float:
    fn = getattr(getattr(job, "strategy", None), "comm_seconds", None)
    return float(fn()) if fn is not None else 0.0


def _split(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"the Trainer needs (inputs, targets) batches, got a {type(batch).__name__}"
        f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; map the dataset to a pair first, "
        f"e.g. ds.map(lambda d: (d['image'], d['label']))"
    )


def _batch_size(targets: Any) -> int:
    if isinstance(targets, torch.Tensor):
        return int(targets.shape[0]) if targets.ndim else 1
    if isinstance(targets, Mapping):
        return _batch_size(next(iter(targets.values())))
    if isinstance(targets, (tuple, list)):
        return _batch_size(targets[0]) if targets and isinstance(targets[0], torch.Tensor) else len(targets)
    return 1


def _lr(optimizer) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    try:
        return float(groups[0]["lr"])
    except (TypeError, IndexError, KeyError, ValueError):
        return None


def _rng_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """`rng_state()` as JSON (for a worker's data state): torch's byte blobs in base64."""
    out = {k: v for k, v in state.items() if k in ("python", "numpy")}
    b64 = lambda t: base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")
    out["torch"] = b64(state["torch"])
    if "cuda" in state:
        out["cuda"] = [b64(s) for s in state["cuda"]]
    return out


def _rng_from_json(state: Mapping[str, Any]) -> dict[str, Any]:
    blob = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    out = {k: v for k, v in state.items() if k in ("python", "numpy")}
    out["torch"] = blob(state["torch"])
    if "cuda" in state:
        out["cuda"] = [blob(s) for s in state["cuda"]]
    return out


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(x: Any) -> Any:
    raise TypeError(f"summary value of type {type(x).__name__} is not JSON")
