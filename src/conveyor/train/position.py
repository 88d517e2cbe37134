"""Where a training run is, as the checkpoint item `trainer`: its epoch, every worker's data position, the RNGs.

    position = TrainerPosition(job, coordinator, optimizer, current=lambda: DataPosition.now(...))
    items = {"trainer": position, **job.strategy.checkpoint_items(module, optimizer)}
    ... after `resume`: position.data (this worker's DataPosition, None: its data starts over), position.steps_per_epoch

`DataPosition` is one worker's place in its training data: the epoch, the batches taken in it, the
pipeline's root seed, the iterator's state and the RNG states, as versioned JSON
(`data/worker-<rank>.json` of a step). A checkpoint written by another number of workers is resumed by
redistributing the rest of the interrupted epoch over this job's workers (`conveyor.data.redistribute`:
every record exactly once; `leftover` is this worker's share until the epoch ends), or refused naming the
op that holds the data back and the way out.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

from conveyor.data.errors import StateError
from conveyor.data.redistribute import Saved, plan
from conveyor.train.checkpoint import Checkpoint, Item, ResumeError, StepWrite
from conveyor.train.state_io import rng_from_json, rng_state, rng_to_json, set_rng_state

__all__ = ["DataPosition", "TrainerPosition", "optimizer_name"]


@dataclass(frozen=True)
class DataPosition:
    """One worker's place in its training data (module docstring); `rng` is `rng_to_json(rng_state())` or None;
    `leftover` this worker's share of an epoch begun by another number of workers (None: the pipeline's own);
    `shard` the [shards, shard] it read (`job.data_shard`: pipeline stages of a replica share one; None: a
    checkpoint from before positions named it, read as [world, rank])."""

    FORMAT: ClassVar[str] = "conveyor.trainer.data"
    VERSION: ClassVar[int] = 1

    epoch: int
    batches: int
    root_seed: int
    iterator: Any
    rng: dict[str, Any] | None = None
    leftover: dict[str, Any] | None = None
    shard: list[int] | None = None

    @classmethod
    def now(cls, *, epoch: int, batches: int, root_seed: int, iterator: Any,
            leftover: dict[str, Any] | None = None) -> DataPosition:
        """This worker's position, with the RNG states as they are now."""
        return cls(epoch, batches, root_seed, iterator, rng_to_json(rng_state()), leftover)

    def to_bytes(self) -> bytes:
        """What a worker sends the chief (the coordinator gathers it) and the chief writes."""
        return json.dumps({"format": self.FORMAT, "version": self.VERSION, **asdict(self)},
                          separators=(",", ":")).encode()

    @classmethod
    def docs(cls, gathered: list[bytes | None]) -> dict[str, Any]:
        """The gathered positions as the step's documents `data/worker-<rank>` (workers without one left out)."""
        return {f"data/worker-{r}": json.loads(bytes(b).decode()) for r, b in enumerate(gathered) if b is not None}

    @classmethod
    def from_doc(cls, doc: Any, where: str) -> DataPosition:
        """Read back what `to_bytes` wrote, refusing another program's file or another version."""
        if not isinstance(doc, dict) or doc.get("format") != cls.FORMAT:
            raise ResumeError(f"{where} is not a conveyor Trainer data state; it was written by another program: "
                              f"start over with --no-resume (CONVEYOR_RESUME=0)")
        if doc.get("version") != cls.VERSION:
            raise ResumeError(f"{where}: Trainer data state version {doc.get('version')}, this conveyor reads "
                              f"{cls.VERSION}; resume with the conveyor version that wrote it")
        shard = doc.get("shard")
        return cls(int(doc["epoch"]), int(doc["batches"]), int(doc["root_seed"]), doc["iterator"], doc.get("rng"),
                   doc.get("leftover"), [int(v) for v in shard] if isinstance(shard, list) else None)

    @classmethod
    def for_rank(cls, ckpt: Checkpoint, rank: int, world: int, tolerates_missing: Callable[[Any], bool],
                 train_data: Any = None, shard: tuple[int, int] | None = None) -> DataPosition | None:
        """Worker `rank`'s position in `ckpt`, after checking that `ckpt` holds one for each of `world` workers
        (None: `tolerates_missing` let this worker start its data over). A checkpoint of another number of
        workers is redistributed when `train_data` (this worker's pipeline, reading `shard`: (world, rank) if
        None) is given, else refused."""
        saved = ckpt.extra.get("world_size")
        if saved != world and train_data is not None and isinstance(saved, int) and saved >= 1:
            return cls.redistributed(ckpt, rank, world, saved, train_data, shard or (world, rank))
        if saved != world:
            raise ResumeError(f"checkpoint {ckpt.path} was written by a job of {saved} worker(s); this job has "
                              f"{world}. Its data positions describe {saved} shards, so resuming would lose or repeat "
                              f"samples: " + _fix(saved, ckpt))
        docs = ckpt.group("data")
        missing = [f"worker-{r}" for r in range(world) if f"worker-{r}" not in docs]
        if missing and not tolerates_missing(docs):  # checked for every rank on every rank: all refuse together
            raise ResumeError(f"checkpoint {ckpt.path} has no data-iterator state for {missing} (it has "
                              f"{sorted(docs)}), so those workers cannot continue where they were: "
                              + _fix(saved, ckpt))
        doc = docs.get(f"worker-{rank}")
        if doc is None:
            warnings.warn(f"worker {rank}: checkpoint {ckpt.path} has no data position for this worker (it had "
                          f"published none yet); its data starts over from the first epoch", stacklevel=3)
            return None
        return cls.from_doc(doc, f"{ckpt.path}/data/worker-{rank}.json")

    @classmethod
    def redistributed(cls, ckpt: Checkpoint, rank: int, world: int, saved: int, train_data: Any,
                      shard: tuple[int, int]) -> DataPosition:
        """Worker `rank`'s share (that of its `shard`: (shards, index)) of what the `saved` workers that wrote
        `ckpt` left of their epoch, dealt by shard: the processes that read one shard (a pipeline replica's
        stages) count once, and those that share a new one get the same share. Every rank computes the same
        deal from the same documents."""
        docs = ckpt.group("data")
        missing = [f"worker-{r}" for r in range(saved) if f"worker-{r}" not in docs]
        if missing:
            raise ResumeError(f"checkpoint {ckpt.path} has no data position for {missing}, so what they had read "
                              f"cannot be told and the rest of the epoch cannot be dealt over {world} workers: "
                              + _fix(saved, ckpt))
        old = [cls.from_doc(docs[f"worker-{r}"], f"{ckpt.path}/data/worker-{r}.json") for r in range(saved)]
        if len({p.epoch for p in old}) > 1:
            raise ResumeError(f"checkpoint {ckpt.path}: its {saved} workers were in different epochs "
                              f"({sorted({p.epoch for p in old})}), so their data cannot be dealt over {world} "
                              f"workers: " + _fix(saved, ckpt))
        per_shard = _one_per_shard(old, ckpt, saved, shared=tuple(shard) != (world, rank))
        try:
            shares = plan(train_data, [Saved(p.iterator, p.leftover) for p in per_shard], int(shard[0]))
        except (StateError, OSError) as e:
            raise ResumeError(f"checkpoint {ckpt.path} was written by a job of {saved} worker(s); this job has "
                              f"{world}, and the rest of its epoch cannot be redistributed over them: {e}. "
                              + _fix(saved, ckpt)) from e
        return cls(old[0].epoch, max(p.batches for p in old), old[0].root_seed, None,
                   old[rank].rng if rank < saved else None, shares[int(shard[1])], [int(v) for v in shard])


def _one_per_shard(old: list[DataPosition], ckpt: Checkpoint, saved: int, shared: bool) -> list[DataPosition]:
    """The old positions by shard, in shard order: of the processes that read one shard (a pipeline replica's
    stages, in step: the same batches), the lowest rank's. Positions that do not name their shard were each
    a worker's own, unless this job's processes `shared` shards: then which ones shared cannot be told."""
    if all(p.shard is None for p in old) and not shared:
        return old
    readers: dict[int, list[DataPosition]] = {}
    for p in old:
        if p.shard is not None:
            readers.setdefault(p.shard[1], []).append(p)
    shards = {p.shard[0] for p in old if p.shard is not None}
    if any(p.shard is None for p in old) or len(shards) != 1 or sorted(readers) != list(range(shards.pop())):
        raise ResumeError(f"checkpoint {ckpt.path}: its data positions do not say which of its {saved} processes "
                          f"read which shard of the data ({[p.shard for p in old]}), so the rest of its epoch "
                          f"cannot be dealt over this job's shards: " + _fix(saved, ckpt))
    for index, ps in readers.items():
        if len({p.batches for p in ps}) > 1:
            raise ResumeError(f"checkpoint {ckpt.path}: the processes that read shard {index} of the data were at "
                              f"different batches ({sorted(p.batches for p in ps)}), so what they had read cannot "
                              f"be told: " + _fix(saved, ckpt))
    return [readers[index][0] for index in sorted(readers)]


def _fix(world: Any, ckpt: Checkpoint) -> str:
    return (f"run with the same number of workers as the job that wrote it (conveyor run -n {world}), or start "
            f"over with --no-resume (CONVEYOR_RESUME=0) or another output folder than {ckpt.root.parent}")


def optimizer_name(optimizer: Any) -> str:
    """The class of the user's optimizer (wrappers such as the parameter servers' proxy hold it as `.optimizer`)."""
    return type(getattr(optimizer, "optimizer", optimizer)).__name__


class TrainerPosition(Item):
    """The item `trainer`: the run's epoch and counts (state.json's `extra`), every worker's `DataPosition`
    (gathered by the coordinator) and the chief's RNG states (tree `rng`); on resume it checks that this
    job may continue the run and restores this worker's position and RNGs."""

    def __init__(self, job: Any, coordinator: Any, optimizer: Any, current: Callable[[], DataPosition],
                 run_info: Callable[[], dict[str, Any]], train_data: Any = None):
        self.job, self.coord, self.optimizer = job, coordinator, optimizer
        self.current, self.run_info = current, run_info
        self.train_data = train_data  # what a checkpoint of another worker count is redistributed over
        self.data: DataPosition | None = None  # this worker's, once restored
        self.steps_per_epoch: int | None = None

    def save(self, name: str, out: StepWrite) -> None:
        gathered = self.coord.positions(self._current().to_bytes(), out.final)
        if out.is_chief:
            out.extra.update({"world_size": int(self.job.world_size), "strategy": self.job.strategy.name,
                              "restarts": int(self.job.restart_count), "optimizer": optimizer_name(self.optimizer),
                              **self.run_info(), **self.coord.checkpoint_extra()})
            out.docs.update(DataPosition.docs(gathered))
            out.tree("rng", rng_state())

    def _current(self) -> DataPosition:
        """This worker's position, naming the shard it reads (so that a change of world deals by shard)."""
        return replace(self.current(), shard=[int(v) for v in self.job.data_shard])

    def restore(self, name: str, ckpt: Checkpoint) -> None:
        rank, world = int(self.job.rank), int(self.job.world_size)
        # Redistribution deals by shard: the processes that share one (a pipeline replica's stages) get one share.
        shard = (int(self.job.data_shard[0]), int(self.job.data_shard[1]))
        self.data = DataPosition.for_rank(ckpt, rank, world, self.coord.tolerates_missing_positions,
                                          self.train_data, shard)
        saved_world = ckpt.extra.get("world_size")
        saved, mine = ckpt.extra.get("optimizer"), optimizer_name(self.optimizer)
        if saved is not None and saved != mine:  # torch would load it and fail on the first step, or not at all
            raise ResumeError(f"checkpoint {ckpt.path} holds the state of optimizer {saved}; this job trains with "
                              f"{mine}. Resume with {saved}, or " + ckpt.start_over())
        self.coord.resumed(ckpt.extra)
        rng = rng_from_json(self.data.rng) if self.data is not None and self.data.rng else ckpt.trees.get("rng")
        if rng is not None:
            set_rng_state(rng)
        spe = ckpt.extra.get("steps_per_epoch")
        self.steps_per_epoch = int(spe) if spe and saved_world == world else None  # another world: other epochs
        if saved_world != world and isinstance(saved_world, int):
            ckpt.reworld.append(("workers", saved_world, world, "data", ""))
