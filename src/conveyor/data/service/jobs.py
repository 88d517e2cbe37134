"""A job's split bookkeeping in the dispatcher: who produces each split and which trainer consumes it.

    job = Job(1, "train", "distributed_epoch", files)
    job.take(worker_id, trainer)   # {"split", "file"}, {"split": None, "wait": True} or {"split": None}
    job.acknowledge(split); job.give_back({worker_id})

A split belongs to the first trainer whose task takes it (``owner``): the trainer checks each split's
element indices, so one split's elements must all reach one trainer. A split given back (its worker died
or stopped the task) waits in its owner's line (``returned``) and goes only to that trainer's tasks; the
owner drops the elements it already returned. A trainer's task ends (``split: None``) once no fresh split
is left and every split it owns is acknowledged, so a trainer that ends holds nothing another would need.
Resume: each trainer's checkpoint holds its token, the splits it acknowledged, the splits it had begun and
how many trainers shared the job; the resuming trainers join one new job (``join``), which hands out no
split until that many have joined, so no fresh split can be one a later joiner already consumed.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from conveyor.data.service.protocol import DataServiceError

log = logging.getLogger(__name__)


@dataclass
class Job:
    job_id: int
    name: str
    mode: str
    files: list[str] | None
    pending: deque[int] = field(default_factory=deque)  # fresh splits (indices into files), not handed out yet
    handed: dict[int, int] = field(default_factory=dict)  # split -> the worker producing it
    owner: dict[int, str] = field(default_factory=dict)  # split -> the token of the trainer consuming it
    returned: dict[str, deque[int]] = field(default_factory=dict)  # trainer -> its splits given back, first in line
    done: set[int] = field(default_factory=set)  # splits their trainer acknowledged, every element received
    trainers: dict[str, dict[str, Any]] = field(default_factory=dict)  # per trainer iterator: its input figures
    resumed: bool = False
    expected: int = 1  # resumed: the trainers that shared the job when they saved; no split before all joined
    joined: set[str] = field(default_factory=set)  # resumed: the trainers that joined

    def __post_init__(self) -> None:
        self.pending.extend(range(len(self.files or ())))

    def take(self, worker_id: int, trainer: str) -> dict[str, Any]:
        """The next split for ``trainer``'s task on ``worker_id``: one given back of its own first, then a fresh
        one; ``wait`` while it owns an unacknowledged split (whose worker may die); None once it has nothing."""
        if self.files is None:
            raise DataServiceError(f"job {self.name} ({self.mode}) has no splits to hand out")
        if len(self.joined) < self.expected and self.resumed:
            return {"split": None, "wait": True}
        mine = self.returned.get(trainer)
        if mine:
            split = mine.popleft()
        elif self.pending:
            split = self.pending.popleft()
            self.owner[split] = trainer
        elif any(o == trainer and s not in self.done for s, o in self.owner.items()):
            return {"split": None, "wait": True}
        else:
            return {"split": None}
        self.handed[split] = worker_id
        return {"split": split, "file": self.files[split]}

    def acknowledge(self, split: int) -> None:
        self.done.add(split)
        self.handed.pop(split, None)

    def give_back(self, workers: set[int], trainer: str | None = None) -> dict[int, list[int]]:
        """The unacknowledged splits ``workers`` produce (for ``trainer`` only, if named) go back to the front
        of their owner's line; which, by worker."""
        lost = sorted(s for s, w in self.handed.items()
                      if w in workers and s not in self.done and trainer in (None, self.owner.get(s)))
        by_worker: dict[int, list[int]] = {}
        for split in lost:
            by_worker.setdefault(self.handed[split], []).append(split)
        for split in reversed(lost):
            del self.handed[split]
            self.returned.setdefault(self.owner[split], deque()).appendleft(split)
        if lost:
            log.warning("job %s: splits %s of worker(s) %s go to other workers", self.name, lost, sorted(workers))
        return by_worker

    def join(self, resume: Any) -> None:
        """A trainer resuming from its checkpoint joins this (resumed) job: its acknowledged splits are done, the
        ones it had begun are its own again (it drops the elements it returned before the checkpoint)."""
        count = len(self.files or ())
        if not isinstance(resume, dict) or self.mode != "distributed_epoch" or not all(
                isinstance(resume.get(k), list) and all(isinstance(x, int) and 0 <= x < count for x in resume[k])
                for k in ("acknowledged", "begun")):
            raise DataServiceError(f"cannot resume job {self.name}: the saved position ({str(resume)[:100]}) does "
                                   f"not fit its {count} files in distributed_epoch; resume with the pipeline it "
                                   f"was saved from")
        trainer = str(resume.get("token"))
        self.resumed = True
        self.expected = max(self.expected, int(resume.get("trainers") or 1))
        self.joined.add(trainer)
        self.done |= set(resume["acknowledged"])
        begun = [s for s in resume["begun"] if s not in self.done and s not in self.owner]
        for split in begun:
            self.owner[split] = trainer
        self.returned.setdefault(trainer, deque()).extend(begun)
        self.pending = deque(s for s in self.pending if s not in self.done and s not in self.owner)

    def accepts(self, resume: Any) -> bool:
        """A resumed job another trainer of the same checkpoint may still join."""
        token = resume.get("token") if isinstance(resume, dict) else None
        return self.resumed and len(self.joined) < self.expected and token not in self.joined and not self.handed

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, "splits": len(self.files or ()), "done": len(self.done),
                "in_progress": len(self.handed), "waiting": len(self.pending) + sum(map(len, self.returned.values()))}

    def trainer_count(self) -> int:
        """The trainers sharing the job: those that reported or own a split (saved with each one's position)."""
        return max(1, len({*self.owner.values(), *self.trainers}))
