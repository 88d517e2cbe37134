"""Resuming a training run: which checkpoint, whether this job may continue it, and this worker's data state.

    resumed = resume(job, checkpoints, coordinator, module, optimizer)   # None: a fresh start
    ... resumed.step, resumed.data (this worker's data state, or None), resumed.steps_per_epoch

The chief picks the step (every rank loads the same one). A checkpoint written by another number of
workers is refused: its data positions describe other shards, so resuming would lose or repeat
samples. Every worker's data state (`data_state`) records its epoch, the batches it took in that
epoch, the pipeline's root seed, the iterator's position and the RNG states, in a versioned format.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from conveyor.train.checkpoint import Checkpoint, CheckpointError, CheckpointManager
from conveyor.train.state_io import rng_from_json, rng_state, rng_to_json, set_rng_state, state_from_bytes

__all__ = ["DATA_STATE_FORMAT", "DATA_STATE_VERSION", "ResumeError", "Resumed", "data_state", "describe",
           "optimizer_name", "resume"]

DATA_STATE_FORMAT = "conveyor.trainer.data"
DATA_STATE_VERSION = 1


class ResumeError(CheckpointError):
    """The checkpoint found cannot be resumed by this job; the message names the fix."""

    usage_error = True  # a restart meets it again: `conveyor run` does not retry it


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run starts: the step, this worker's data state (None: its data starts over)."""

    step: int
    data: dict[str, Any] | None
    steps_per_epoch: int | None


def data_state(*, epoch: int, batches: int, root_seed: int, iterator: Any) -> dict[str, Any]:
    """This worker's data position for a checkpoint (JSON), with the RNG states as they are now."""
    return {"format": DATA_STATE_FORMAT, "version": DATA_STATE_VERSION, "epoch": epoch, "batches": batches,
            "root_seed": root_seed, "iterator": iterator, "rng": rng_to_json(rng_state())}


def resume(job: Any, checkpoints: CheckpointManager, coordinator: Any, module: Any, optimizer: Any) -> Resumed | None:
    """Load the latest checkpoint into ``module``, ``optimizer`` and the RNGs (None: nothing to resume)."""
    if not job.resume:
        return None
    step = _chiefs_latest_step(job, checkpoints)
    if step is None:
        return None
    ckpt = checkpoints.load(step)
    if job.is_chief:
        print(f"resumed from {describe(ckpt)}", file=sys.stderr, flush=True)
    world, rank = int(job.world_size), int(job.rank)
    _check_world_size(ckpt, world, checkpoints)
    state = _worker_state(ckpt, rank, world, coordinator, checkpoints)
    if not _restored_by_strategy(job, module, optimizer, ckpt, checkpoints):
        _check_model(module, ckpt, checkpoints)
        module.load_state_dict(ckpt.model_state)
        if ckpt.optimizer_state is not None:
            _restore_optimizer(job, optimizer, ckpt, checkpoints)
    coordinator.resumed(ckpt.extra)
    rng = rng_from_json(state["rng"]) if state is not None and state.get("rng") else ckpt.rng
    if rng is not None:
        set_rng_state(rng)
    spe = ckpt.extra.get("steps_per_epoch")
    return Resumed(ckpt.step, state, int(spe) if spe else None)


def describe(ckpt: Checkpoint) -> str:
    """"step N (<folder>), written <when> by a job of W worker(s), strategy S, in epoch E"."""
    extra = ckpt.extra
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ckpt.time)) if ckpt.time else "at an unknown time"
    return (f"step {ckpt.step} ({ckpt.path}), written {when} by a job of {extra.get('world_size', '?')} "
            f"worker(s), strategy {extra.get('strategy', '?')}, in epoch {extra.get('epoch', '?')}")


def optimizer_name(optimizer: Any) -> str:
    """The class of the user's optimizer (wrappers such as the parameter servers' proxy hold it as `.optimizer`)."""
    return type(getattr(optimizer, "optimizer", optimizer)).__name__


def _start_over(checkpoints: CheckpointManager) -> str:
    return (f"start over with --no-resume (CONVEYOR_RESUME=0), or give this job another output folder than "
            f"{checkpoints.root.parent} (--output-dir)")


def _check_model(module: Any, ckpt: Checkpoint, checkpoints: CheckpointManager) -> None:
    """Refuse a checkpoint of another model, naming what differs, before torch's own error would."""
    mine = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    saved = {k: tuple(getattr(v, "shape", ())) for k, v in (ckpt.model_state or {}).items()}
    missing, unexpected = sorted(mine.keys() - saved.keys()), sorted(saved.keys() - mine.keys())
    reshaped = [f"{k} {saved[k]} in the checkpoint, {mine[k]} here" for k in sorted(mine.keys() & saved.keys())
                if mine[k] != saved[k]]
    if not (missing or unexpected or reshaped):
        return
    what = [f"{label}: {_some(names)}" for label, names in (
        ("not in the checkpoint", missing), ("not in this model", unexpected), ("other shapes", reshaped)) if names]
    raise ResumeError(f"checkpoint {ckpt.path} holds another model than this job's ({'; '.join(what)}). To keep "
                      f"training it, run the model that wrote it; to train this one, " + _start_over(checkpoints))


def _some(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _restored_by_strategy(job: Any, module: Any, optimizer: Any, ckpt: Checkpoint,
                          checkpoints: CheckpointManager) -> bool:
    """Whether the strategy restored model and optimizer from parts it wrote (pipeline stages do)."""
    def read(name: str) -> Any:
        return state_from_bytes(checkpoints.read_part(ckpt.step, f"{name}.safetensors"),
                                checkpoints.read_part(ckpt.step, f"{name}.json"))

    _check_optimizer_name(optimizer, ckpt, checkpoints)
    try:
        return bool(job.strategy.restore_checkpoint(module, optimizer, ckpt.optimizer_state, read))
    except (KeyError, TypeError, ValueError) as e:
        raise ResumeError(f"checkpoint {ckpt.path} cannot be resumed by this job: {e}. Or "
                          + _start_over(checkpoints)) from e


def _check_optimizer_name(optimizer: Any, ckpt: Checkpoint, checkpoints: CheckpointManager) -> None:
    saved, mine = ckpt.extra.get("optimizer"), optimizer_name(optimizer)
    if saved is not None and saved != mine:  # torch would load it and fail on the first step, or worse, not at all
        raise ResumeError(f"checkpoint {ckpt.path} holds the state of optimizer {saved}; this job trains with "
                          f"{mine}. Resume with {saved}, or " + _start_over(checkpoints))


def _restore_optimizer(job: Any, optimizer: Any, ckpt: Checkpoint, checkpoints: CheckpointManager) -> None:
    try:
        job.strategy.restore_optimizer(optimizer, ckpt.optimizer_state, checkpoints, ckpt.step)
    except (KeyError, TypeError, ValueError) as e:  # torch's own complaints about a state of another shape
        raise ResumeError(f"the optimizer state in {ckpt.path} (written by strategy "
                          f"{ckpt.extra.get('strategy', '?')}) does not fit this job's optimizer (strategy "
                          f"{job.strategy.name}): {e}. Resume with the optimizer and strategy that wrote it, or "
                          + _start_over(checkpoints)) from e


def _chiefs_latest_step(job: Any, checkpoints: CheckpointManager) -> int | None:
    mine = None
    if job.is_chief:
        try:  # skips damaged steps with a warning each; refuses when every step is damaged
            mine = {"step": checkpoints.resume_step()}
        except CheckpointError as e:
            mine = {"error": str(e)}
    data = json.loads(bytes(job.broadcast_bytes(json.dumps(mine).encode() if job.is_chief else None, src=0)))
    if "error" in data:  # every rank refuses, not only the chief
        raise CheckpointError(data["error"])
    return data["step"]


def _fix(world: Any, checkpoints: CheckpointManager) -> str:
    return (f"run with the same number of workers as the job that wrote it (conveyor run -n {world}), or start "
            f"over with --no-resume (CONVEYOR_RESUME=0) or another output folder than {checkpoints.root.parent}")


def _check_world_size(ckpt: Checkpoint, world: int, checkpoints: CheckpointManager) -> None:
    saved = ckpt.extra.get("world_size")
    if saved != world:
        raise ResumeError(f"checkpoint {ckpt.path} was written by a job of {saved} worker(s); this job has {world}. "
                          f"Its data positions describe {saved} shards, so resuming would lose or repeat samples: "
                          + _fix(saved, checkpoints))


def _worker_state(ckpt: Checkpoint, rank: int, world: int, coordinator: Any,
                  checkpoints: CheckpointManager) -> dict[str, Any] | None:
    """This worker's data state from ``ckpt``, checked (None: the coordinator lets it start its data over)."""
    missing = [f"worker-{r}" for r in range(world) if f"worker-{r}" not in ckpt.data_states]
    if missing and not coordinator.tolerates_missing_positions(ckpt.data_states):
        # checked for every rank on every rank, so all ranks refuse together
        raise ResumeError(f"checkpoint {ckpt.path} has no data-iterator state for {missing} (it has "
                          f"{sorted(ckpt.data_states)}), so those workers cannot continue where they were: "
                          + _fix(ckpt.extra.get("world_size"), checkpoints))
    state = ckpt.data_states.get(f"worker-{rank}")
    if state is None:
        warnings.warn(f"worker {rank}: checkpoint {ckpt.path} has no data position for this worker (it had "
                      f"published none yet); its data starts over from the first epoch", stacklevel=3)
        return None
    if not isinstance(state, dict) or state.get("format") != DATA_STATE_FORMAT:
        raise ResumeError(f"{ckpt.path}/data/worker-{rank}.json is not a conveyor Trainer data state; it was "
                          f"written by another program: start over with --no-resume (CONVEYOR_RESUME=0)")
    if state.get("version") != DATA_STATE_VERSION:
        raise ResumeError(f"{ckpt.path}: Trainer data state version {state.get('version')}, this conveyor reads "
                          f"{DATA_STATE_VERSION}; resume with the conveyor version that wrote it")
    return state
