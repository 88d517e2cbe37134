"""A data worker: builds the named pipeline, registers with the dispatcher, and serves elements to trainers.

    worker = DataWorker("10.0.0.5:5050", "myjob.input:train_pipeline", secret, bind="0.0.0.0:6000",
                        advertise="10.0.0.7:6000").start()    # `conveyor data worker --dispatcher ...`

Registration sends the pipeline's fingerprint and file list; the dispatcher refuses a mismatch (the
worker raises :class:`PipelineMismatchError` and stops). A job's task starts when a trainer first asks for
its elements: a thread runs the pipeline (``parallel_epochs``: all of it; ``distributed_epoch``: over the
files the dispatcher hands out one at a time) into a queue of at most ``buffer`` elements, so a slow
trainer stops the producer instead of growing memory. ``get_elements`` takes up to ``max`` elements; when
none is ready it is answered within ``wait`` seconds (``none``: ask again), so no request outlives its
timeout. ``end`` says the task produced everything (or failed: its header then carries the error).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
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
)
from conveyor.data.service.splits import split_files

log = logging.getLogger(__name__)
_END = object()


class _Task:
    """One job's producer: the pipeline's elements into a bounded queue, from a daemon thread."""

    def __init__(self, dataset: Dataset, buffer: int) -> None:
        self.dataset = dataset
        self.queue: queue.Queue = queue.Queue(maxsize=buffer)
        self.produced = 0
        self.error: str | None = None
        self.finished = False  # the queue's last item is _END
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-data-task", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self.dataset.iterator() as it:
                for element in it:
                    if not self._put(element):
                        return
                    self.produced += 1
        except Exception as e:  # the trainer gets it with the end of the stream
            log.exception("data worker task failed")
            self.error = f"{type(e).__name__}: {e}"
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

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
        self._stop.set()
        self._thread.join(timeout=5.0)


class DataWorker:
    """The data-worker role. ``advertise`` is the address trainers connect to (default: ``bind``)."""

    def __init__(self, dispatcher: str, pipeline: str, secret: bytes, *, bind: str, advertise: str | None = None,
                 buffer: int = 16, wait: float = 1.0, timeout: float = 30.0, heartbeat: float = 1.0) -> None:
        self.dispatcher, self.pipeline, self.secret = dispatcher, pipeline, secret
        self.address = advertise or bind
        self.buffer, self.wait, self.timeout, self.heartbeat = buffer, wait, timeout, heartbeat
        self.dataset = load_pipeline(pipeline)
        self.files = split_files(self.dataset._node)
        self.tasks: dict[int, _Task] = {}
        self._pending: list[tuple[Deferred, _Task, int, float]] = []
        self._stop = threading.Event()
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
            while not self._stop.wait(self.heartbeat):
                try:
                    _ask(client, "heartbeat", {"worker_id": self.worker_id})
                except DataServiceError as e:
                    log.warning("data worker %s: heartbeat failed: %s", self.address, e)

    def _task(self, job_id: int, mode: str) -> _Task:
        task = self.tasks.get(job_id)
        if task is None:
            ds = self.dataset
            if check_mode(mode) == "distributed_epoch":
                ds = with_split_source(ds, self._split_source(job_id))
            task = self.tasks[job_id] = _Task(ds, self.buffer)
        return task

    def _split_source(self, job_id: int) -> Callable[[], str | None]:
        clients: list[Client] = []  # made in the task's thread, which owns it

        def next_split() -> str | None:
            if not clients:
                clients.append(self._dispatcher())
            return _ask(clients[0], "get_split", {"worker_id": self.worker_id, "job_id": job_id})["split"]

        return next_split

    def _handle(self, message: Message) -> Any:
        h = message.header
        if message.kind == "stats":
            return "ok", {str(j): {"produced": t.produced, "queued": t.queue.qsize(), "buffer": self.buffer}
                          for j, t in self.tasks.items()}, []
        if message.kind != "get_elements":
            raise DataServiceError(f"a data worker does not know the request {message.kind!r}")
        task, most = self._task(int(h["job_id"]), str(h["mode"])), max(1, int(h.get("max", 1)))
        reply = _reply(task, most, final=False)
        if reply is not None:
            return reply
        deferred = Deferred()
        self._pending.append((deferred, task, most, time.monotonic() + self.wait))
        return deferred

    def _tick(self) -> None:
        now, waiting = time.monotonic(), []
        for deferred, task, most, deadline in self._pending:
            if deferred.identity is None:  # the handler has not returned it yet
                waiting.append((deferred, task, most, deadline))
                continue
            reply = _reply(task, most, final=now >= deadline)
            if reply is None:
                waiting.append((deferred, task, most, deadline))
            else:
                self.server.reply(deferred, reply)
        self._pending = waiting

    def close(self) -> None:
        self._stop.set()
        for task in self.tasks.values():
            task.stop()
        self.server.close()


def _reply(task: _Task, most: int, *, final: bool) -> tuple[str, dict, list] | None:
    elements = task.take(most)
    if elements:
        return "elements", {}, element_frames(elements)
    if task.finished:
        return "end", {"error": task.error}, []
    return ("none", {}, []) if final else None


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
