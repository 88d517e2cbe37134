"""The data service's dispatcher: registers workers, checks their pipelines, and hands out jobs and splits.

    dispatcher = Dispatcher("0.0.0.0:5050", secret).start()     # `conveyor data serve --port 5050 ...`
    ...
    dispatcher.close()

State lives in the serving thread only (the transport runs one handler at a time), so nothing is locked.
The first pipeline to arrive (a worker's, or a trainer's job) is the reference: a later worker or job
whose fingerprint or file list differs is refused with the first differing op and argument. A job is
created by the first trainer that names it (``get_or_create_job``); later trainers naming it share it
(one job per iteration of the dataset: each `iter()` is an epoch of its own); trainers resuming from a
checkpoint (``resume``) get a new job, which the other trainers of that checkpoint join. For
``distributed_epoch`` the job's file list is handed out one file per ``get_split``, to whichever worker asks
for a trainer's task, and the file belongs to that trainer (jobs.py): each file of an epoch is read by one
worker and consumed by one trainer. A worker silent for ``worker_timeout`` seconds is left out of
``get_workers``, and the splits it held that were not acknowledged (``split_done``) go back to the front of
their trainer's line; a trainer's epoch ends when no file is left and each of its own is acknowledged.
Heartbeats carry each worker's figures and ``get_workers`` each trainer's; :meth:`Dispatcher.report`
(report.py) sums them up, and with ``report_path`` it is written there every 2 s and at close.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.comm.framing import Message
from conveyor.comm.transport import Server
from conveyor.data.service.jobs import Job
from conveyor.data.service.pipelines import first_difference
from conveyor.data.service.protocol import DISPATCHER, DataServiceError, PipelineMismatchError, check_mode
from conveyor.data.service.report import service_report, trainer_figures, worker_figures
from conveyor.fileio import atomic_write

log = logging.getLogger(__name__)
REPORT_EVERY = 2.0  # seconds between writes of the report file (`conveyor data serve --report`)


@dataclass
class _Worker:
    worker_id: int
    address: str
    pipeline: str
    last_seen: float
    tasks: dict[str, Any] = field(default_factory=dict)  # per job: its heartbeat's figures (report.py)


class Dispatcher:
    """The dispatcher role: a transport :class:`Server` whose handler keeps the workers and jobs."""

    def __init__(self, bind_address: str, secret: bytes, *, worker_timeout: float = 10.0,
                 report_path: str | None = None) -> None:
        self.worker_timeout = worker_timeout
        self.report_path = report_path  # where report() is written every REPORT_EVERY seconds and at close
        self.lost: list[dict[str, Any]] = []  # the workers found dead, and the splits given to others
        self._next_report = 0.0
        self.workers: dict[int, _Worker] = {}
        self.jobs: dict[int, Job] = {}
        self._by_name: dict[tuple[str, int], int] = {}  # (job name, iteration of the dataset) -> job id
        self._ids = itertools.count(1)
        self._reference: tuple[str, Any, list[str] | None] | None = None  # (who, fingerprint, files)
        self._handlers = {"register_worker": self._register, "heartbeat": self._heartbeat,
                          "get_split": self._get_split, "split_done": self._split_done, "release_splits": self._release,
                          "get_or_create_job": self._job, "get_workers": self._list, "stats": self._stats}
        self.server = Server(bind_address, secret, self._handle, name=DISPATCHER, max_frame_bytes=16 << 20,
                             tick=self._tick)

    def start(self) -> Dispatcher:
        self.server.start()
        return self

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        self.server.close()
        self._write_report()  # the serving thread has stopped: the state is this thread's now

    def report(self) -> dict[str, Any]:
        """Per worker throughput and queues, each trainer's input wait, the lost workers, and the advice."""
        now = time.monotonic()
        workers = [worker_figures(w.worker_id, w.address, now - w.last_seen < self.worker_timeout, w.tasks)
                   for w in self.workers.values()]
        trainers = [trainer_figures(job.name, t) for job in self.jobs.values() for t in job.trainers.values()]
        return service_report(workers, trainers, self.lost)

    def _tick(self) -> None:
        if self.report_path is not None and time.monotonic() >= self._next_report:
            self._next_report = time.monotonic() + REPORT_EVERY
            self._write_report()

    def _write_report(self) -> None:
        if self.report_path is None:
            return
        try:
            Path(self.report_path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(self.report_path), json.dumps(self.report(), indent=1).encode())
        except OSError as e:
            log.warning("cannot write the data service report %s: %s", self.report_path, e)

    def _handle(self, message: Message) -> Any:
        handler = self._handlers.get(message.kind)
        if handler is None:
            raise DataServiceError(f"the dispatcher does not know the request {message.kind!r}")
        return "ok", handler(message.header), []

    def _check_pipeline(self, who: str, fp: Any, files: list[str] | None) -> None:
        if self._reference is None:
            self._reference = (who, fp, files)
            return
        ref_who, ref_fp, ref_files = self._reference
        if fp != ref_fp:
            raise PipelineMismatchError(
                f"{who} built a different pipeline from {ref_who}: {first_difference(fp, ref_fp)} "
                f"('here' is {who}, 'there' is {ref_who}); every worker and trainer must build the same pipeline "
                f"(the same --pipeline function and code version)")
        if files is not None and ref_files is not None and files != ref_files:
            only = sorted(set(files) ^ set(ref_files))[:3]
            raise PipelineMismatchError(f"{who} lists other files than {ref_who} (e.g. {only}); give every worker "
                                        f"the same data (the same paths, mounted alike)")

    def _register(self, h: dict[str, Any]) -> dict[str, Any]:
        who = f"data worker at {h['address']} (pipeline {h['pipeline']})"
        self._check_pipeline(who, h["fingerprint"], h.get("files"))
        worker = _Worker(next(self._ids), str(h["address"]), str(h["pipeline"]), time.monotonic())
        now = time.monotonic()
        for old in self.workers.values():  # a worker restarted where one was: that one is dead, not just silent
            if old.address == worker.address and now - old.last_seen < self.worker_timeout:
                log.warning("worker %d at %s registered again as %d: the old one is dead", old.worker_id, old.address,
                            worker.worker_id)
                old.last_seen = now - self.worker_timeout
        self.workers[worker.worker_id] = worker
        self._reap()
        log.info("%s registered as worker %d", who, worker.worker_id)
        return {"worker_id": worker.worker_id}

    def _worker(self, h: dict[str, Any]) -> _Worker:
        worker = self.workers.get(h.get("worker_id"))
        if worker is None:
            raise DataServiceError(f"worker id {h.get('worker_id')!r} is not registered (the dispatcher restarted?): "
                                   f"restart the data worker so that it registers again")
        worker.last_seen = time.monotonic()
        return worker

    def _heartbeat(self, h: dict[str, Any]) -> dict[str, Any]:
        worker = self._worker(h)
        if isinstance(h.get("tasks"), dict):
            worker.tasks = h["tasks"]
        return {}

    def _job_of(self, h: dict[str, Any]) -> Job:
        job = self.jobs.get(h.get("job_id"))
        if job is None:
            raise DataServiceError(f"job id {h.get('job_id')!r} is unknown to the dispatcher (it restarted?): "
                                   f"restart the trainer's iterator so that it creates the job again")
        return job

    def _get_split(self, h: dict[str, Any]) -> dict[str, Any]:
        """The next file of the epoch for the trainer's task (jobs.py: ``wait`` while that trainer has a file
        out unacknowledged, whose worker may die; ``split: None`` once it has none and no fresh one is left)."""
        worker, job = self._worker(h), self._job_of(h)
        if job.mode != "distributed_epoch":
            raise DataServiceError(f"job {job.name} ({job.mode}) has no splits to hand out")
        self._reap()
        return job.take(worker.worker_id, str(h.get("trainer")))

    def _split_done(self, h: dict[str, Any]) -> dict[str, Any]:
        self._job_of(h).acknowledge(int(h["split"]))
        return {}

    def _release(self, h: dict[str, Any]) -> dict[str, Any]:
        """A worker stopped a trainer's task: that task's unacknowledged splits go back, first in its line."""
        worker, job = self._worker(h), self._job_of(h)
        job.give_back({worker.worker_id}, None if h.get("trainer") is None else str(h["trainer"]))
        return {}

    def _reap(self) -> None:
        """Give the unacknowledged splits of workers silent for ``worker_timeout`` back, first in line."""
        now = time.monotonic()
        dead = {w.worker_id for w in self.workers.values() if now - w.last_seen >= self.worker_timeout}
        noted = {e["id"] for e in self.lost}
        for worker_id in sorted(dead - noted):
            w = self.workers[worker_id]
            self.lost.append({"id": worker_id, "address": w.address, "silent_s": round(now - w.last_seen, 1),
                              "splits_given_to_others": []})
        for job in self.jobs.values():
            for worker_id, splits in job.give_back(dead).items():
                next(e for e in self.lost if e["id"] == worker_id)["splits_given_to_others"] += splits

    def _job(self, h: dict[str, Any]) -> dict[str, Any]:
        mode, name, resume = check_mode(h["mode"]), h.get("job_name"), h.get("resume")
        self._check_pipeline(f"the trainer's job {name or '(unnamed)'}", h["fingerprint"], h.get("files"))
        key = (str(name), int(h.get("iteration", 0)))
        job = self.jobs.get(self._by_name.get(key, -1)) if name is not None else None
        if job is not None and (resume is None or job.accepts(resume)):
            if job.mode != mode:
                raise DataServiceError(f"job {name} exists with processing_mode={job.mode!r}, not {mode!r}: use "
                                       f"the same mode in every trainer, or another job_name")
            if resume is not None:
                job.join(resume)
            return {"job_id": job.job_id}
        if mode == "distributed_epoch" and h.get("files") is None:
            raise DataServiceError("processing_mode='distributed_epoch' splits the pipeline's file list, and this "
                                   "pipeline has not exactly one (list_files or TFRecordDataset of a list); use "
                                   "processing_mode='parallel_epochs'")
        job = Job(next(self._ids), name or f"job-{len(self.jobs)}", mode, h.get("files"))
        if resume is not None:  # a new job, which the other trainers resuming from the same checkpoint join
            job.join(resume)
        self.jobs[job.job_id] = job
        if name is not None:
            self._by_name[key] = job.job_id
        return {"job_id": job.job_id}

    def _stats(self, h: dict[str, Any]) -> dict[str, Any]:
        """What `conveyor data status` shows: each worker and when it was last heard, each job's splits."""
        now = time.monotonic()
        return {"workers": [{"id": w.worker_id, "address": w.address, "pipeline": w.pipeline,
                             "silent_s": round(now - w.last_seen, 1), "alive": now - w.last_seen < self.worker_timeout}
                            for w in self.workers.values()],
                "jobs": {str(j.job_id): j.stats() for j in self.jobs.values()}, "report": self.report()}

    def _list(self, h: dict[str, Any]) -> dict[str, Any]:
        job = self._job_of(h)
        trainer = h.get("trainer")
        if isinstance(trainer, dict):
            job.trainers[str(trainer.get("token"))] = trainer
        now = time.monotonic()
        live = [w for w in self.workers.values() if now - w.last_seen < self.worker_timeout]
        return {"workers": [[w.worker_id, w.address] for w in live], "trainers": job.trainer_count()}

