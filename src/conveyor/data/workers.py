"""Worker processes for parallel map: Python code on every core, results through shared memory.

Threads cannot run a Python map function on two cores at once (the GIL). So `map` with
`num_parallel_calls` forks worker processes. The function reaches them by fork — lambdas and
closures work, nothing is pickled. Work goes down a pipe as chunks of elements in the
`elements.pack` form; each result (a list of mapped elements, or a whole stacked batch when map
and batch are fused) is written by the worker into a shared-memory slot, and only a small JSON
note travels back through the pipe. The consumer hands the arrays out as views of that slot — no
copy — and lends the slot back to the worker only when the last of those arrays is garbage
collected: the consumer picks the slot for every task, from the slots it holds no arrays of.

Lifetime rules, so that nothing hangs and nothing is orphaned:
- workers ignore SIGINT (the consumer's process handles Ctrl-C and stops them);
- a worker exits when its pipe closes, or when its parent process is gone (checked every second);
- the pool stops its workers on `close()`, on garbage collection, and at interpreter exit;
- a worker that dies is reported by pid and exit status, never waited for forever.
"""

from __future__ import annotations

import collections
import json
import mmap
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from conveyor.data import elements
from conveyor.data.base import call

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# Tasks in flight per worker: one running, one queued, so a worker never waits for the consumer.
TASKS_PER_WORKER = 2
# How long the consumer waits for any word from a worker before checking the workers' health.
_POLL_SECONDS = 1.0


class WorkerDied(RuntimeError):
    """A map worker process exited without finishing its work (killed, or crashed)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised inside a worker process, chained to the re-raised one."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback in the map worker process:\n{self.tb}"


# ------------------------------------------------------------------------------------------ worker


def _seed_everything(seed_material: list[int]) -> None:
    """Reseed the global RNGs a map function may use, from the chunk's identity.

    Random augmentations then depend only on which chunk an element is in, not on which worker
    ran it or whether the iterator was resumed: the stream is reproducible and resumable.
    """
    ss = np.random.SeedSequence([m & 0xFFFFFFFF for m in seed_material])
    words = ss.generate_state(2)
    np.random.seed(int(words[0]))
    import random

    random.seed(int(words[1]))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(int(words[0]))


class _Slot:
    """One shared-memory result buffer of a worker; replaced by a bigger one when a result outgrows it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.path: str | None = None
        self.mm: mmap.mmap | None = None
        self.size = 0
        self.generation = 0

    def ensure(self, nbytes: int) -> None:
        if self.mm is not None and nbytes <= self.size:
            return
        if self.mm is not None:
            self.mm.close()
        self.size = max(nbytes, 2 * self.size, 1 << 16)
        self.generation += 1
        name = f"conveyor-{os.getppid()}-{os.getpid()}-{self.index}-{self.generation}"
        self.path = os.path.join(_SHM_DIR, name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)

    def reserve(self, nbytes: int) -> memoryview:
        """A writable view of the first `nbytes` of this slot (grown if needed)."""
        self.ensure(nbytes)
        return memoryview(self.mm)[:nbytes]

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _worker_main(fn: Callable, conn: Connection, batch_mode: bool, seed: list[int],
                 inherited: list[Connection]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # run the cleanup below: no files left in /dev/shm
    for other in inherited:  # the consumer's pipe ends: holding them would hide the consumer's exit
        other.close()
    torch = sys.modules.get("torch")
    if torch is not None:  # one thread per worker: the workers already fill the cores
        torch.set_num_threads(1)
    parent = os.getppid()
    slots: dict[int, _Slot] = {}  # the consumer names the slot for each task (one it holds no views of)
    try:
        while True:
            if not conn.poll(_POLL_SECONDS):
                if os.getppid() != parent:
                    return
                continue
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                return
            task_id = int.from_bytes(msg[:8], "little")
            slot_id = int.from_bytes(msg[8:12], "little")
            chunk = elements.unpack(memoryview(msg)[12:], copy=False)
            t0 = time.perf_counter()
            try:
                _seed_everything(seed + [task_id])
                out = [call(fn, x) for x in chunk]
                slot = slots.get(slot_id) or slots.setdefault(slot_id, _Slot(slot_id))
                if batch_mode:  # stacked straight into shared memory: one copy of the batch, not two
                    nbytes = elements.stack_into(out, slot.reserve)
                else:
                    header, bufs = elements.pack(out)
                    nbytes = elements.pack_into(slot.reserve(elements.packed_size(header, bufs)), header, bufs)
            except Exception as exc:  # report every failure of the user's code to the consumer
                note = {"id": task_id, "error": type(exc).__name__, "module": type(exc).__module__,
                        "message": str(exc), "traceback": traceback.format_exc()}
                conn.send_bytes(json.dumps(note).encode())
                continue
            busy = time.perf_counter() - t0
            conn.send_bytes(json.dumps({"id": task_id, "slot": slot_id, "path": slot.path, "nbytes": nbytes,
                                        "busy": busy, "n": len(chunk)}).encode())
    except (BrokenPipeError, EOFError, KeyboardInterrupt):
        return
    finally:
        for slot in slots.values():
            slot.remove()


# ------------------------------------------------------------------------------------------ pool


class WorkerPool:
    """N forked workers applying `fn` to chunks; results come back in submission order or as ready.

    `submit(task_id, chunk)` hands a chunk to the least busy worker (only while `has_room()`);
    `receive(timeout)` returns `(task_id, result, busy_seconds)` for the next finished chunk,
    raising the user's exception (with the worker's traceback) or `WorkerDied`.
    """

    def __init__(self, fn: Callable, num_workers: int, batch_mode: bool, seed: list[int], name: str):
        ctx = mp.get_context("fork")
        self.name = name
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        self._maps: dict[str, mmap.mmap] = {}
        self._in_flight: list[int] = []
        self._turn = 0
        self._slots_made: list[int] = []                  # per worker: slot ids handed out so far
        self._free: list[collections.deque] = []          # per worker: slots that hold no live arrays
        self._task_slot: dict[int, tuple[int, int]] = {}  # task id -> (worker, slot)
        for i in range(num_workers):
            parent_end, child_end = ctx.Pipe(duplex=True)
            inherited = [*self.conns, parent_end]
            proc = ctx.Process(target=_worker_main, args=(fn, child_end, batch_mode, seed, inherited),
                               name=f"conveyor-{name}-{i}", daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
            self._in_flight.append(0)
            self._slots_made.append(0)
            self._free.append(collections.deque())
        self._finalizer = weakref.finalize(self, _shutdown, list(self.procs), list(self.conns))

    @property
    def num_workers(self) -> int:
        return len(self.procs)

    def has_room(self) -> bool:
        return min(self._in_flight) < TASKS_PER_WORKER

    def submit(self, task_id: int, chunk: list) -> None:
        worker = self._in_flight.index(min(self._in_flight))
        if self._in_flight[worker] >= TASKS_PER_WORKER:
            raise RuntimeError("WorkerPool.submit called while every worker is full; check has_room()")
        free = self._free[worker]
        if free:
            slot = free.popleft()
        else:  # every slot of this worker still backs arrays the consumer holds: add one
            slot = self._slots_made[worker]
            self._slots_made[worker] += 1
        header, bufs = elements.pack(chunk)
        buf = bytearray(12 + elements.packed_size(header, bufs))
        buf[:8] = task_id.to_bytes(8, "little")
        buf[8:12] = slot.to_bytes(4, "little")
        elements.pack_into(memoryview(buf)[12:], header, bufs)
        try:
            self.conns[worker].send_bytes(buf)
            self._in_flight[worker] += 1
            self._task_slot[task_id] = (worker, slot)
        except (BrokenPipeError, OSError):
            self._raise_if_dead()
            raise

    def receive(self, timeout: float) -> tuple[int, Any, float] | None:
        """The next finished chunk from any worker, or None when nothing arrived within `timeout`."""
        ready = wait(self.conns, timeout=min(timeout, _POLL_SECONDS))
        if not ready:
            self._raise_if_dead()
            return None
        # Take the ready workers in turn: always reading the first one would starve the others
        # while it keeps finishing tasks (a consumer waiting in order for another worker stalls).
        order = {id(c): (self.conns.index(c) - self._turn) % len(self.conns) for c in ready}
        conn = min(ready, key=lambda c: order[id(c)])
        self._turn = (self.conns.index(conn) + 1) % len(self.conns)
        try:
            note = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._raise_if_dead(wait_seconds=1.0)
            raise WorkerDied(f"a {self.name} worker closed its pipe unexpectedly") from None
        self._in_flight[self.conns.index(conn)] -= 1
        worker, slot = self._task_slot.pop(note["id"])
        free = self._free[worker]
        if "error" in note:
            free.append(slot)
            raise _rebuild_error(note)
        try:
            mm = self._mapping(note["path"])
        except FileNotFoundError:  # the worker was stopped and removed its buffer
            self._raise_if_dead(wait_seconds=2.0)
            raise WorkerDied(f"a {self.name} worker removed its result buffer before it was read") from None
        # Every array of the result is a view of `lease`; when the last one is collected, the
        # slot goes back to the worker's free list.
        lease = np.frombuffer(mm, dtype=np.uint8, count=note["nbytes"])
        result = elements.unpack(lease, copy=False)
        weakref.finalize(lease, free.append, slot)
        return note["id"], result, note["busy"]

    def _mapping(self, path: str) -> mmap.mmap:
        mm = self._maps.get(path)
        if mm is None:
            # A new slot, or a slot the worker grew: map it and unlink the file at once — the
            # mappings stay valid and nothing is left behind in /dev/shm. An older mapping of the
            # same slot is only dropped from the cache: arrays may still view it.
            prefix = path.rsplit("-", 1)[0] + "-"
            for old in [p for p in self._maps if p.startswith(prefix)]:
                del self._maps[old]
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, 0)  # writable: the batches handed out are ordinary writable arrays
            finally:
                os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self._maps[path] = mm
        return mm

    def _raise_if_dead(self, wait_seconds: float = 0.0) -> None:
        deadline = time.monotonic() + wait_seconds
        while True:
            for i, proc in enumerate(self.procs):
                if proc.exitcode is not None:
                    code = proc.exitcode
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                    raise WorkerDied(
                        f"{self.name} worker process {i} (pid {proc.pid}) {how} while work was in flight. "
                        f"If the system ran out of memory, lower num_parallel_calls or the batch size."
                    )
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self._maps.clear()  # mappings close when the last array viewing them is collected
        self._finalizer()


def _shutdown(procs: list, conns: list) -> None:
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=2.0)
    for proc in procs:  # files a killed worker could not remove
        prefix = os.path.join(_SHM_DIR, f"conveyor-{os.getpid()}-{proc.pid}-")
        for name in os.listdir(_SHM_DIR):
            path = os.path.join(_SHM_DIR, name)
            if path.startswith(prefix):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _rebuild_error(note: dict) -> BaseException:
    """Re-raise the user's exception in the consumer: same type where it is a builtin one, with
    the worker's traceback chained (as concurrent.futures does)."""
    import builtins

    cls = getattr(builtins, note["error"], None) if note.get("module") == "builtins" else None
    message = note["message"]
    exc: BaseException
    try:
        exc = cls(message) if isinstance(cls, type) and issubclass(cls, Exception) else None
    except Exception:
        exc = None
    if exc is None:
        exc = RuntimeError(f"{note['module']}.{note['error']}: {message}")
    exc.__cause__ = RemoteTraceback(note["traceback"])
    return exc
