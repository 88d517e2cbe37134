"""A data worker: builds the named pipeline, registers with the dispatcher, and serves elements to trainers.

    worker = DataWorker("10.0.0.5:5050", "myjob.input:train_pipeline", secret, bind="0.0.0.0:6000",
                        advertise="10.0.0.7:6000").start()    # `conveyor data worker --dispatcher ...`

Registration sends the pipeline's fingerprint and file list; the dispatcher refuses a mismatch (the
worker raises :class:`PipelineMismatchError` and stops). A task starts when a trainer first asks for a job's
elements (in distributed_epoch one per job and trainer, naming it in ``get_split``, so that each split's
elements go to the trainer that owns it): a thread runs the pipeline into a queue of at most ``buffer``
elements, so a slow trainer stops the producer instead of growing memory. ``parallel_epochs``: the whole
pipeline. ``distributed_epoch``: the pipeline once per file the dispatcher hands out, seeded by the trainer
and the file, so that a file given again yields the same elements; each element is tagged ``(split, index)``
and a split's end is sent as such. ``get_elements`` takes up to ``max``; with none ready it is answered
within ``wait`` seconds (``none``: ask again). ``end`` says the task is done (or failed: its header then
carries the error). A task no trainer has asked anything for ``idle_timeout`` seconds is stopped and its
unacknowledged splits released. Each heartbeat carries every task's figures (produced, bytes sent, queue
depth, seconds run and blocked).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from conveyor.comm.framing import Message
from conveyor.comm.transport import Client, Deferred, RemoteError, Server, ServerUnavailable
from conveyor.data.pipeline import Dataset
from conveyor.data.service.pipelines import fingerprint, load_pipeline, with_split_source
from conveyor.data.service.protocol import (
    DISPATCHER,
    WORKER,
    DataServiceError,
    PipelineMismatchError,
    check_mode,
    element_frames,
    put_until_stopped,
)
from conveyor.data.service.splits import split_files

log = logging.getLogger(__name__)
_END = object()
SPLIT_END = object()  # closes a split in a task's queue


class _Task:
    """One job's producer: tagged elements ``(split, index, element)`` into a bounded queue, from a daemon thread.

    ``items`` yields them (``split`` is None in parallel_epochs); ``(split, count, SPLIT_END)`` closes a split.
    """

    def __init__(self, items: Iterator[tuple[Any, int, Any]], buffer: int, stop: threading.Event) -> None:
        self.items = items
        self.queue: queue.Queue = queue.Queue(maxsize=buffer)
        self.produced = 0
        self.sent_bytes = 0  # element bytes sent to trainers
        self.blocked = 0.0  # seconds the producer waited on a full queue (the trainer took slower) or for a split
        self.started = self.last_request = time.monotonic()
        self.ended: float | None = None  # when the producer stopped: its rates are over the time it ran
        self.error: str | None = None
        self.finished = False  # the queue's last item is _END
        self.stop_event = stop
        self._thread = threading.Thread(target=self._run, name="conveyor-data-task", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self.items:
                if not self._put(item):
                    return
                self.produced += item[2] is not SPLIT_END
        except Exception as e:  # the trainer gets it with the end of the stream
            log.exception("data worker task failed")
            self.error = f"{type(e).__name__}: {e}"
        self._put(_END)
        self.ended = time.monotonic()  # after the last put, so that its blocked time is inside the run

    def _put(self, item: Any) -> bool:
        t0 = time.monotonic()
        try:
            return put_until_stopped(self.queue, item, self.stop_event)
        finally:
            self.blocked += time.monotonic() - t0

    def figures(self, buffer: int) -> dict[str, Any]:
        """What the heartbeat tells the dispatcher (data/service/report.py reads it)."""
        return {"produced": self.produced, "bytes": self.sent_bytes, "queued": self.queue.qsize(), "buffer": buffer,
                "run_s": round((self.ended or time.monotonic()) - self.started, 3), "blocked_s": round(self.blocked, 3)}

    def take(self, most: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < most and not self.finished:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is _END:
                self.finished = True
            else:
                out.append(item)
        return out

    def stop(self) -> None:
        self.stop_event.set()
        self._thread.join(timeout=5.0)


def _whole(dataset: Dataset) -> Iterator[tuple[Any, int, Any]]:
    with dataset.iterator() as it:
        for k, element in enumerate(it):
            yield None, k, element


def _by_split(dataset: Dataset, splits: Iterator[tuple[int, str]], seed: int) -> Iterator[tuple[Any, int, Any]]:
    """The pipeline once per split, over that one file, with a seed fixed by the trainer's root seed and the
    split: a split given again (its first worker died, or the trainer resumed) yields the same elements in
    the same order, so the trainer can drop the ones it already has."""
    for split, name in splits:
        files = iter([name])
        one = with_split_source(dataset, lambda files=files: next(files, None))
        count = 0
        with one.iterator(root_seed=(seed * 1_000_003 + split) % (1 << 63), iteration=0) as it:
            for count, element in enumerate(it, 1):
                yield split, count - 1, element
        yield split, count, SPLIT_END


class DataWorker:
    """The data-worker role. ``advertise`` is the address trainers connect to (default: ``bind``)."""

    def __init__(self, dispatcher: str, pipeline: str, secret: bytes, *, bind: str, advertise: str | None = None,
                 buffer: int = 16, wait: float = 1.0, timeout: float = 30.0, heartbeat: float = 1.0,
                 idle_timeout: float = 300.0) -> None:
        self.dispatcher, self.pipeline, self.secret = dispatcher, pipeline, secret
        self.address = advertise or bind
        self.buffer, self.wait, self.timeout, self.heartbeat = buffer, wait, timeout, heartbeat
        self.idle_timeout = idle_timeout
        self.dataset = load_pipeline(pipeline)
        self.files = split_files(self.dataset._node)
        self.tasks: dict[tuple[int, str | None], _Task] = {}  # (job, trainer token in distributed_epoch) -> task
        self._pending: list[tuple[Deferred, _Task, int, float]] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # a heartbeat now: a task has sent its last element (final figures)
        self.worker_id: int | None = None
        self.server = Server(bind, secret, self._handle, name=WORKER, tick=self._tick, max_frame_bytes=1 << 20)

    def _dispatcher(self) -> Client:
        return Client(self.dispatcher, self.secret, name=DISPATCHER, timeout=self.timeout,
                      sender=f"data-worker@{self.address}")

    def start(self) -> DataWorker:
        """Register (raising the dispatcher's refusal) and start serving and heartbeating."""
        with self._dispatcher() as client:
            header = {"address": self.address, "pipeline": self.pipeline,
                      "fingerprint": fingerprint(self.dataset), "files": self.files}
            self.worker_id = _ask(client, "register_worker", header)["worker_id"]
        self.server.start()
        threading.Thread(target=self._beat, name="conveyor-data-heartbeat", daemon=True).start()
        return self

    def _beat(self) -> None:
        with self._dispatcher() as client:
            while not self._stop.is_set():
                self._wake.wait(self.heartbeat)
                self._wake.clear()
                tasks = _figures(self.tasks.copy(), self.buffer)
                try:
                    _ask(client, "heartbeat", {"worker_id": self.worker_id, "tasks": tasks})
                except DataServiceError as e:
                    log.warning("data worker %s: heartbeat failed: %s", self.address, e)

    def _task(self, job_id: int, mode: str, seed: int, trainer: str | None) -> _Task:
        distributed = check_mode(mode) == "distributed_epoch"
        key = (job_id, trainer if distributed else None)
        task = self.tasks.get(key)
        if task is None:
            stop = threading.Event()
            if distributed:
                items = _by_split(self.dataset, self._splits(key, stop), seed)
            else:
                items = _whole(self.dataset)
            task = _Task(items, self.buffer, stop)
            self.tasks[key] = task
        return task

    def _splits(self, key: tuple[int, str | None], stop: threading.Event) -> Iterator[tuple[int, str]]:
        """The splits of the job's trainer as the dispatcher hands them out (runs in the task's thread, which
        owns the client)."""
        request = {"worker_id": self.worker_id, "job_id": key[0], "trainer": key[1]}
        with self._dispatcher() as client:
            try:
                while not stop.is_set():
                    answer = _ask(client, "get_split", request)
                    if answer.get("wait"):  # every split is out, some not yet acknowledged: it may come back
                        t0 = time.monotonic()
                        stop.wait(0.2)
                        task = self.tasks.get(key)  # idle, not slow: its capacity leaves this time out
                        if task is not None:
                            task.blocked += time.monotonic() - t0
                    elif answer["split"] is None:
                        return
                    else:
                        yield int(answer["split"]), str(answer["file"])
            finally:
                if stop.is_set():  # stopped, not finished: what this task held goes to other workers
                    _release(client, request)

    def _handle(self, message: Message) -> Any:
        h = message.header
        if message.kind == "stats":
            return "ok", _figures(self.tasks, self.buffer), []
        if message.kind != "get_elements":
            raise DataServiceError(f"a data worker does not know the request {message.kind!r}")
        trainer = None if h.get("trainer") is None else str(h["trainer"])
        task = self._task(int(h["job_id"]), str(h["mode"]), int(h.get("seed", 0)), trainer)
        most = max(1, int(h.get("max", 1)))
        task.last_request = time.monotonic()
        # Requests are answered in the order they came, so a split's elements reach the trainer in order.
        reply = None if any(t is task for _, t, _, _ in self._pending) else _reply(task, most, final=False)
        if reply is not None:
            self._ended(reply)
            return reply
        deferred = Deferred()
        self._pending.append((deferred, task, most, time.monotonic() + self.wait))
        return deferred

    def _tick(self) -> None:
        now, waiting = time.monotonic(), []
        for key, task in list(self.tasks.items()):
            if now - task.last_request > self.idle_timeout:  # no trainer asks any more: stop, release its splits
                log.info("data worker %s: job %s idle for %g s, stopping its task", self.address, key,
                         self.idle_timeout)
                task.stop_event.set()
                del self.tasks[key]
        blocked: set[int] = set()  # tasks with an earlier request still waiting: later ones wait behind it
        for deferred, task, most, deadline in self._pending:
            reply = None
            if deferred.identity is not None and id(task) not in blocked:  # None: its handler has not returned
                reply = _reply(task, most, final=now >= deadline)
            if reply is None:
                waiting.append((deferred, task, most, deadline))
                blocked.add(id(task))
            else:
                self._ended(reply)
                self.server.reply(deferred, reply)
        self._pending = waiting

    def _ended(self, reply: tuple[str, dict, list]) -> None:
        if reply[0] == "end":
            self._wake.set()

    def close(self) -> None:
        self._stop.set()
        for task in self.tasks.values():
            task.stop()
        self.server.close()


def _figures(tasks: dict[tuple[int, str | None], _Task], buffer: int) -> dict[str, Any]:
    """Each task's figures under ``job`` or ``job/trainer``."""
    return {"/".join(str(k) for k in key if k is not None): t.figures(buffer) for key, t in tasks.items()}


def _reply(task: _Task, most: int, *, final: bool) -> tuple[str, dict, list] | None:
    items = task.take(most)
    if items:
        elements = [(split, k) for split, k, e in items if e is not SPLIT_END]
        ends = [(split, n) for split, n, e in items if e is SPLIT_END]
        frames, counts = element_frames([e for _, _, e in items if e is not SPLIT_END])
        task.sent_bytes += sum(f.nbytes for f in frames)
        return "elements", {"tags": elements, "ends": ends, "frames": counts}, frames
    if task.finished:
        return "end", {"error": task.error}, []
    return ("none", {}, []) if final else None


def _release(client: Client, request: dict[str, Any]) -> None:
    try:
        _ask(client, "release_splits", request)
    except DataServiceError as e:  # the dispatcher gives them back anyway once this worker falls silent
        log.warning("could not give job %s's splits back: %s", request["job_id"], e)


def _ask(client: Client, kind: str, header: dict[str, Any]) -> dict[str, Any]:
    """A request to the dispatcher; its refusals and silence become :class:`DataServiceError`."""
    try:
        return client.request(kind, header).header
    except RemoteError as e:
        text = str(e)
        cls = PipelineMismatchError if "PipelineMismatchError" in text else DataServiceError
        raise cls(f"the data service dispatcher at {client.address} refused {kind}: {text}") from None
    except ServerUnavailable as e:
        raise DataServiceError(f"data service dispatcher: {e} (start it with `conveyor data serve`, and give every "
                               f"role the same secret file)") from None
