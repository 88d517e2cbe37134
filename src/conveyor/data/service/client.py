"""The trainer's side: `dataset.distribute(service, processing_mode, job_name)` → elements from data workers.

    ds = pipeline().distribute("10.0.0.5:5050", processing_mode="distributed_epoch", job_name="train")
    for batch in ds: ...                           # or to_torch(ds, device="cuda")

The local pipeline is never run: only its fingerprint and file list go to the dispatcher, which refuses
a job whose pipeline differs from its workers'. Iterating creates (or joins, by ``job_name``) the job,
then one fetcher thread per worker keeps at most ``max_outstanding`` ``get_elements`` requests of at most
``per_request`` elements in flight (the credit that bounds what a worker sends ahead) and puts the
elements into one queue of ``buffer`` elements. New workers are picked up every ``refresh`` seconds. The
iterator ends when every worker has said ``end`` and no new worker came. Every wait is bounded by
``timeout``; no worker after ``timeout`` seconds is a :class:`DataServiceError` naming the fix.
distributed_epoch is exactly once: elements come tagged ``(split, index)``; one whose index is not the
next expected for its split (the split was given again after its worker died) is dropped, and a split is
acknowledged to the dispatcher once all of it was returned. ``state_dict`` holds exactly that position.
With each look for workers, and at the end, the iterator reports its input wait to the dispatcher (report.py).
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from typing import Any

from conveyor.comm.transport import Client, RemoteError, ServerUnavailable
from conveyor.data.base import Context, Iter, Node, StateField
from conveyor.data.service.protocol import (
    DISPATCHER,
    WORKER,
    DataServiceError,
    PipelineMismatchError,
    Service,
    check_mode,
    elements_from_frames,
    put_until_stopped,
    resolve_service,
)

_END, _ELEMENT, _SPLIT_END = object(), object(), object()  # kinds of the fetchers' queue items


class ServiceNode(Node):
    """The recipe of a distributed dataset: where the service is, the job, and the local pipeline's identity."""

    name = "distribute"

    def __init__(self, pipeline: Node, files: list[str] | None, service: Service | str, processing_mode: str,
                 job_name: str | None = None, *, max_outstanding: int = 2, per_request: int = 8,
                 buffer: int = 32, timeout: float = 60.0, refresh: float = 1.0, worker_timeout: float = 10.0) -> None:
        super().__init__()
        self.service = resolve_service(service)
        self.mode = check_mode(processing_mode)
        self.job_name = job_name
        self.pipeline_fingerprint = pipeline.fingerprint()
        self.files = files
        if min(max_outstanding, per_request, buffer) < 1 or min(timeout, worker_timeout) <= 0:
            raise DataServiceError("distribute: max_outstanding, per_request, buffer, timeout and worker_timeout "
                                   "must be positive")
        self.max_outstanding, self.per_request, self.buffer = max_outstanding, per_request, buffer
        self.timeout, self.refresh, self.worker_timeout = timeout, refresh, worker_timeout

    def params(self) -> dict[str, Any]:
        # Not the address: a job resumed from a checkpoint may find its dispatcher elsewhere.
        return {"processing_mode": self.mode, "job_name": self.job_name, "pipeline": self.pipeline_fingerprint}

    def iterator(self, ctx: Context) -> Iter:
        return ServiceIter(self, ctx)


class ServiceIter(Iter):
    """Elements from the job's workers, in arrival order."""

    def __init__(self, node: ServiceNode, ctx: Context) -> None:
        super().__init__(node.name, ctx)
        self.node = node
        self._iteration = ctx.iteration  # the n-th iter() of the dataset: trainers share the job of their n-th
        self._seed = ctx.root_seed  # seeds the workers' per-split pipelines: a state loaded later restores it
        self._queue: queue.Queue = queue.Queue(maxsize=node.buffer)
        self._stop = threading.Event()
        self._fetchers: dict[int, threading.Thread] = {}
        self._ended: dict[int, str] = {}  # worker id -> "end" (it produced everything) or "lost" (it died)
        self._received: dict[int, int] = {}  # split -> elements of it returned (the next index expected)
        self._acknowledged: set[int] = set()
        self._resume: dict[str, Any] | None = None  # a loaded state's position, sent with the job request (jobs.py)
        self._trainers = 1  # how many trainers share the job, as the dispatcher last said (saved with the state)
        self._last_live = self._last_item = time.monotonic()
        self._dispatcher: Client | None = None
        self._job_id: int | None = None
        self._last_refresh = 0.0
        # the figures it reports to the dispatcher (data/service/report.py): elements and bytes returned, seconds
        # blocked waiting for the next element (input wait), from the first request on
        self._token = secrets.token_hex(4)
        self._consumed = self._bytes = 0
        self._wait = 0.0
        self._first: float | None = None

    def _ask(self, kind: str, header: dict[str, Any]) -> dict[str, Any]:
        if self._dispatcher is None:
            self._dispatcher = Client(self.node.service.address, self.node.service.secret, name=DISPATCHER,
                                      timeout=self.node.timeout, sender="data-trainer")
        try:
            return self._dispatcher.request(kind, header).header
        except RemoteError as e:
            cls = PipelineMismatchError if "PipelineMismatchError" in str(e) else DataServiceError
            raise cls(f"the data service refused {kind}: {e}") from None
        except ServerUnavailable as e:
            raise DataServiceError(f"data service: {e} (is `conveyor data serve` running there, with the same "
                                   f"secret file as this trainer?)") from None

    def _refresh(self) -> None:
        if self._job_id is None:
            self._job_id = self._ask("get_or_create_job", {
                "job_name": self.node.job_name, "iteration": self._iteration, "mode": self.node.mode,
                "fingerprint": self.node.pipeline_fingerprint, "files": self.node.files,
                "resume": self._resume})["job_id"]
            self._last_live = self._last_item = time.monotonic()
        self._last_refresh = time.monotonic()
        answer = self._ask("get_workers", {"job_id": self._job_id, "trainer": self._figures()})
        self._trainers = max(self._trainers, int(answer.get("trainers", 1)))
        for worker_id, address in answer["workers"]:
            if worker_id not in self._fetchers:
                thread = threading.Thread(target=self._fetch, args=(worker_id, address), daemon=True,
                                          name=f"conveyor-data-fetch-{worker_id}")
                self._fetchers[worker_id] = thread
                thread.start()

    def _figures(self) -> dict[str, Any]:
        elapsed = 0.0 if self._first is None else time.monotonic() - self._first
        return {"token": self._token, "consumed": self._consumed, "bytes": self._bytes, "wait_s": round(self._wait, 4),
                "elapsed_s": round(elapsed, 4)}

    def _next(self) -> Any:
        """The next element, timed: the time spent here is the trainer's input wait."""
        t0 = time.monotonic()
        if self._first is None:
            self._first = t0
        try:
            element = self._take()
        except StopIteration:
            self._wait += time.monotonic() - t0
            with contextlib.suppress(DataServiceError):  # the epoch's last figures; the figures are no reason to fail
                self._ask("get_workers", {"job_id": self._job_id, "trainer": self._figures()})
            raise
        self._wait += time.monotonic() - t0
        self._consumed += 1
        return element

    def _take(self) -> Any:
        while True:
            if self._job_id is None or time.monotonic() - self._last_refresh >= self.node.refresh:
                self._refresh()
            if len(self._ended) == len(self._fetchers) and self._queue.empty() and self._finished():
                raise StopIteration
            try:
                item = self._queue.get(timeout=min(0.2, self.node.refresh))
            except queue.Empty:
                self._check_progress()
                continue
            self._last_item = time.monotonic()
            if item[0] is _ELEMENT:
                split, k, element = item[1:4]
                if split is None:
                    self._bytes += item[4]
                    return element
                expected = self._received.get(split, 0)
                if k == expected:  # k < expected: a split given again, and this element was returned already
                    self._received[split] = k + 1
                    self._bytes += item[4]
                    return element
                if k > expected:  # an element skipped: returning this one would lose that one
                    raise DataServiceError(f"element {k} of split {split} arrived before element {expected}: the "
                                           f"data workers run another conveyor version than this trainer?")
            elif item[0] is _SPLIT_END:
                self._acknowledge(item[1], item[2])
            else:
                self._ended[item[1]] = item[3]
                if item[2] is not None:
                    raise DataServiceError(item[2])

    def _check_progress(self) -> None:
        """Live workers that send nothing for ``timeout`` seconds: say so rather than wait forever."""
        if self._fetchers and len(self._ended) < len(self._fetchers) and \
                time.monotonic() - self._last_item > self.node.timeout:
            raise DataServiceError(
                f"the data workers of job {self.node.job_name or self._job_id} sent nothing for {self.node.timeout:g} "
                f"s though they answer: their pipeline is that slow (raise distribute's timeout), or a trainer "
                f"sharing this job left mid-epoch holding splits it never acknowledged, or one that shared the "
                f"checkpoint this trainer resumed from has not resumed (every trainer of the job resumes, or use a "
                f"new job_name)")

    def _finished(self) -> bool:
        """Every fetcher has stopped: the end when one worker said so; else, after a look for new workers,
        wait for one (a dead worker's splits are given to the next) until ``timeout``."""
        if "end" in self._ended.values():
            return True
        self._refresh()
        if len(self._ended) < len(self._fetchers):
            self._last_live = time.monotonic()
            return False
        if time.monotonic() - self._last_live > self.node.timeout:
            what = "every data worker of the job died" if self._fetchers else "no data worker registered"
            raise DataServiceError(
                f"{what} and none joined the dispatcher at {self.node.service.address} within {self.node.timeout:g} "
                f"s: start `conveyor data worker --dispatcher {self.node.service.address} --pipeline "
                f"MODULE:FUNCTION`")
        return False

    def _acknowledge(self, split: int, count: int) -> None:
        """Tell the dispatcher that every element of ``split`` was returned, so it is never given again."""
        if self._received.get(split, 0) == count and split not in self._acknowledged:
            self._ask("split_done", {"job_id": self._job_id, "split": split})
            self._acknowledged.add(split)

    def _fetch(self, worker_id: int, address: str) -> None:
        """One worker's stream: keep the credit's requests in flight, queue what comes back."""
        outcome, error = "end", None
        client = Client(address, self.node.service.secret, name=WORKER, timeout=self.node.worker_timeout,
                        sender="data-trainer")
        header = {"job_id": self._job_id, "mode": self.node.mode, "max": self.node.per_request, "seed": self._seed,
                  "trainer": self._token}
        try:
            in_flight = [client.send("get_elements", header) for _ in range(self.node.max_outstanding)]
            while in_flight and not self._stop.is_set():
                reply = client.receive(in_flight.pop(0))
                if reply.kind == "end":
                    error = reply.header.get("error") and f"data worker at {address} failed: {reply.header['error']}"
                    break
                in_flight.append(client.send("get_elements", header))
                if not self._queue_reply(reply):
                    return
        except (ServerUnavailable, RemoteError) as e:
            outcome = "lost"
            if self.node.mode != "distributed_epoch":  # its splits go to another worker; here its epoch is lost
                error = f"data worker at {address}: {e}"
        finally:
            client.close()
        self._put((_END, worker_id, error, outcome))

    def _queue_reply(self, reply: Any) -> bool:
        tags = reply.header.get("tags", [])
        counts = reply.header.get("frames", [])
        for (split, k), (element, nbytes) in zip(tags, elements_from_frames(reply.tensors, counts), strict=True):
            if not self._put((_ELEMENT, split, k, element, nbytes)):
                return False
        return all(self._put((_SPLIT_END, split, n)) for split, n in reply.header.get("ends", []))

    def _put(self, item: Any) -> bool:
        return put_until_stopped(self._queue, item, self._stop)

    def get_state(self) -> dict[str, Any]:
        """distributed_epoch only: the splits acknowledged and how many elements of each other split were
        returned, this trainer's token and how many trainers share the job. Loading it starts a new job (which
        the other trainers' states join) that skips those splits, gives the begun ones back to this trainer
        alone, and drops the elements returned before."""
        if self.node.mode != "distributed_epoch":
            raise DataServiceError("a parallel_epochs dataset's position cannot be saved (each worker runs its own "
                                   "epoch); use processing_mode='distributed_epoch' to checkpoint the position")
        if self._job_id is not None:  # count the trainers afresh: one that joined since the last look counts
            with contextlib.suppress(DataServiceError):  # unreachable now: the last count, not a failed checkpoint
                self._refresh()
        return {"acknowledged": sorted(self._acknowledged),
                "received": [[split, k] for split, k in sorted(self._received.items()) if split not in
                             self._acknowledged], "token": self._token, "trainers": self._trainers}

    def set_state(self, state: StateField) -> None:
        if self.node.mode != "distributed_epoch":
            raise state.error("a parallel_epochs dataset's position cannot be restored")
        count = len(self.node.files or ())
        fields = state.fields(("acknowledged", "received"), optional=("token", "trainers"))
        self._acknowledged = {f.as_int(0, count - 1) for f in fields["acknowledged"].as_list(max_len=count)}
        for pair in fields["received"].as_list(max_len=count):
            split, k = pair.as_list(length=2)
            self._received[split.as_int(0, count - 1)] = k.as_int(0)
        if fields.get("token") is not None:  # the same trainer: the splits it had begun are its own
            self._token = fields["token"].as_str()
        if fields.get("trainers") is not None:
            self._trainers = fields["trainers"].as_int(1)
        self._resume = {"token": self._token, "trainers": self._trainers, "acknowledged": sorted(self._acknowledged),
                        "begun": sorted(set(self._received) - self._acknowledged)}

    def close(self) -> None:
        self._stop.set()
        for thread in self._fetchers.values():
            thread.join(timeout=5.0)
        if self._dispatcher is not None:
            self._dispatcher.close()
            self._dispatcher = None
