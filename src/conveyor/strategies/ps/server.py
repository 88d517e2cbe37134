"""The parameter-server task: holds its pieces of the model, runs the optimizer on them, answers workers.

    server = ParameterServer("127.0.0.1:2222", secret, index=0, num_workers=2, mode="sync")
    server.serve()              # returns when every worker has sent "done" (conveyor.init() then exits)

One ``ParameterServer`` runs in each ps task, on a transport :class:`~conveyor.comm.transport.Server`
bound to the task's TF_CONFIG address. The transport drops (and counts) anything unauthenticated,
malformed, replayed or addressed to another task before the handler here sees it, so garbage on the
port cannot change the parameters. Requests (all from workers, all signed):

``init``   ``{"fingerprint", "rank", "spec"?, "keys"?}`` + the initial values of this server's pieces.
           The first init that carries values (worker 0's) wins; a later one with the same placement
           fingerprint is acknowledged, one with another fingerprint is refused (an ``error`` reply).
           A worker that asks before any init arrived is told ``wait`` and asks again.
``push``   ``{"rank", "step", "read", "keys"}`` + one gradient per key. ``sync``: kept until the step
           is complete; ``async``/``ssp``: applied at once (one optimizer step over those pieces).
``commit`` ``{"rank", "step", "read", "hyper"?, "plan"?}``: the worker has pushed everything of step
           ``step``. ``sync``: when all workers committed a step, each piece's gradients are averaged
           with :func:`~conveyor.strategies.ps.optim.mean_of_gradients` in rank order (a worker that
           sent none for a piece counts as zeros, like DDP's unused parameters) and applied once.
           The reply carries ``total`` (steps committed by all workers together) and ``plan`` (the
           largest total any worker announced it will stop at): the shared step count that workers
           running apart (``async``/``ssp``) stop on, as TensorFlow's global step.
``pull``   ``{"rank", "step"}``: the parameters the worker needs to compute step ``step``; answered
           ``wait`` while the update rule does not allow it (the worker asks again; its wait time is
           measured): ``sync`` until the version (steps applied) reaches ``step``; ``ssp:K`` while
           ``step - min(clock) > K``, where a worker's clock is the number of steps it committed;
           ``async`` never waits.
``stats``  counters: version, clocks, staleness histogram, pushes, bytes in and out, drops.
``state`` / ``load_state``: the pieces and optimizer state (safetensors-style tensors + JSON meta),
           so a worker's checkpoint can carry the servers' optimizer state.
``save``   ``{"step", "root"}``: write this server's shard (pieces + optimizer state) as ``ps-<i>.safetensors`` and
           ``ps-<i>.json`` into checkpoint step ``step`` (as a part the chief collects); reply: the names.
``restore`` ``{"step", "root"}``: load this server's shard back from the complete checkpoint step ``step``.
``position`` ``{"rank"}`` + one uint8 tensor: that worker's newest data position (JSON). Workers that
           run apart (``async``/``ssp``) leave it with ps:0 every checkpoint interval; ps:0 keeps the
           newest of each, in memory (a restarted job starts with fresh ps tasks and no positions).
``positions`` ``{"rank"}``: every worker's newest position (reply ``ranks``: which workers left one,
           one uint8 tensor each), for the chief's checkpoint.
``done``   ``{"rank"}``: that worker has finished; when all have, :meth:`serve` returns.
``ping``   ``{}``: a worker's heartbeat (:class:`~conveyor.strategies.ps.client.PSClient` sends one every
           quarter of the job's timeout from a thread of its own), so a worker busy elsewhere — a long
           evaluation, a checkpoint, a slow first batch — still counts as alive.

**Lifetime.** Besides "every worker is done", a ps task stops when it has heard nothing authenticated
for the job's timeout (twice that before the first worker shows up: the workers may spend up to one
timeout rendezvousing among themselves): :meth:`serve` raises :class:`IdleTimeout`, and the task exits
non-zero. A ps started by hand or by a scheduler whose workers died therefore cannot be orphaned.

**Untrusted bytes.** Before a connection authenticates, ZeroMQ buffers whatever frame size the peer
claims; the server caps frames at :func:`max_frame_bytes` (8 MiB for the default 4 MiB pieces) and
drops connections that have not authenticated within ``handshake_timeout`` (10 s), so an unauthenticated
peer holds at most 8 MiB per connection, for at most 10 s.

**Staleness.** Every push and commit says which version ``read`` (the server's ``min(clock)`` when the
worker pulled the parameters it computed on) and ``step`` it is; the server records ``step - read``:
how many steps the slowest worker's updates lagged behind the gradient's own step. ``sync`` records
only zeros, ``ssp:K`` never more than K (the pull rule guarantees it), ``async`` whatever happens.

**Checkpoints.** A ps task writes its own shard into the checkpoint folder it shares with the
workers. ``save``/``restore`` name the checkpoint root; ``shards``, which ``conveyor.init()`` hands
the server, opens it as the job's checkpoint manager after checking it lies in the task's output
folder. So the shard lands in the step folder in the same atomic rename as the chief's files, and
is checked against the step's manifest when read back. A ps task that dies loses nothing written:
the launcher restarts the job, and the restarted ps tasks are restored from the last step.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from conveyor.comm.framing import MAX_HEADER_BYTES, MAX_TRAILER_BYTES, Message
from conveyor.comm.transport import Server
from conveyor.strategies.ps.optim import OptimizerSpec, ServerOptimizer, mean_of_gradients
from conveyor.strategies.ps.sharding import DEFAULT_CHUNK_BYTES

__all__ = ["MODES", "IdleTimeout", "ParameterServer", "ShardStore", "max_frame_bytes", "parse_mode"]

log = logging.getLogger(__name__)

MODES = ("sync", "async", "ssp")


def parse_mode(strategy: str) -> tuple[str, int]:
    """``"ps-sync"`` -> ``("sync", 0)``, ``"ps-async"`` -> ``("async", 0)``, ``"ps-ssp:3"`` -> ``("ssp", 3)``."""
    key = strategy.strip().lower()
    if key == "ps-sync":
        return "sync", 0
    if key == "ps-async":
        return "async", 0
    if key.startswith("ps-ssp:"):
        k = key.partition(":")[2]
        if k.isascii() and k.isdigit():
            return "ssp", int(k)
    raise ValueError(f"{strategy!r} is not a parameter-server strategy; expected ps-sync, ps-async or ps-ssp:K "
                     f"(K a whole number, e.g. ps-ssp:2)")


def max_frame_bytes(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The frame size a ps task refuses beyond: twice the largest frame its job's messages can carry.

    A ps message's frames are its header (at most ``MAX_HEADER_BYTES``), one frame per tensor, and the
    trailer (at most ``MAX_TRAILER_BYTES``). Every tensor is one placement piece (a gradient, a value,
    or an optimizer state of the same size), and pieces are at most ``chunk_bytes`` (or one element).
    The factor 2 is headroom for what this bound does not foresee: a frame over the limit costs its
    connection (the request times out), so erring high is the safe side.
    """
    return 2 * max(chunk_bytes, MAX_HEADER_BYTES, MAX_TRAILER_BYTES, 64)


class IdleTimeout(RuntimeError):
    """A ps task heard from no worker for longer than the job's timeout: its job is gone."""


class ShardStore(Protocol):
    """A checkpoint root a ps task writes its shards to: the job's ``conveyor.train.checkpoint`` manager."""

    def save_part(self, step: int, name: str, data: bytes) -> Any: ...

    def read_part(self, step: int, name: str) -> bytes: ...


SHARD_FORMAT = "conveyor.ps.shard"


def _torch(array: np.ndarray) -> torch.Tensor:
    # A copy: the received frame is ZeroMQ's buffer (maybe read-only) and may be kept across messages.
    return torch.from_numpy(np.array(array, copy=True)).reshape(-1)


class ParameterServer:
    """One ps task's state and request handler (see the module docstring)."""

    def __init__(self, address: str, secret: bytes, *, index: int, num_workers: int, mode: str,
                 staleness: int = 0, max_skew: float = 300.0,
                 shards: Callable[[str], ShardStore] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 handshake_timeout: float = 10.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode = {mode!r}; expected one of {MODES}")
        self.index = index
        self.name = f"ps:{index}"
        self.num_workers = num_workers
        self.mode = mode
        self.staleness_bound = staleness
        self.fingerprint: str | None = None
        self.keys: list[str] = []
        self.opt: ServerOptimizer | None = None
        self.clock = [0] * num_workers  # steps committed, per worker
        self.version = 0  # sync: steps applied; async/ssp: min(clock)
        self.staleness: Counter[int] = Counter()
        self.counters: Counter[str] = Counter()
        self.done: set[int] = set()
        self.plan: int | None = None  # the global step count the workers stop at, once one announced it
        self.positions: dict[int, bytes] = {}  # each worker's newest data position (workers running apart)
        self.shards = shards
        self._grads: dict[int, dict[str, dict[int, torch.Tensor]]] = {}  # sync: step -> key -> rank -> grad
        self._commits: dict[int, set[int]] = {}
        self._finished = threading.Event()
        self.server = Server(address, secret, self.handle, name=self.name, max_skew=max_skew,
                             max_frame_bytes=max_frame_bytes(chunk_bytes), handshake_timeout=handshake_timeout)

    # -- lifetime ---------------------------------------------------------------------------------

    def serve(self, timeout: float | None = None, *, idle_timeout: float | None = None) -> bool:
        """Serve in this thread until every worker sent ``done`` (True) or ``timeout`` seconds pass (False).

        ``idle_timeout`` (the job's timeout): raise :class:`IdleTimeout` after that many seconds without an
        authenticated message (twice that before the first one).
        """
        stop = threading.Event()
        if timeout is not None:
            timer = threading.Timer(timeout, stop.set)
            timer.daemon = True
            timer.start()
        try:
            stopped = self.server.serve_forever(stop, idle_timeout=idle_timeout,
                                                first_contact_timeout=idle_timeout and 2 * idle_timeout)
        finally:
            self.server.close()
        if not stopped:
            raise IdleTimeout(self._idle_message(idle_timeout))
        return self._finished.is_set()

    def _idle_message(self, idle_timeout: float | None) -> str:
        heard = self.server.last_heard
        if heard is None:
            what = f"no worker contacted it within {2 * idle_timeout:g} s (twice the job's timeout) of starting"
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(heard[0]))
            what = (f"it last heard from a worker ({heard[1]}) at {when}, over the job's timeout of "
                    f"{idle_timeout:g} s ago")
        return (f"{self.name} is stopping: {what}, so its job is gone (the launcher or the workers died). "
                f"Live workers ping their ps tasks at least every quarter of the timeout; if this job's workers "
                f"really are alive but unreachable for that long, raise the timeout (`conveyor run --timeout S` "
                f"or CONVEYOR_TIMEOUT=S)")

    def start(self) -> ParameterServer:
        """Serve in a background thread (tests)."""
        self.server.start()
        return self

    def close(self) -> None:
        self.server.close()

    # -- requests ---------------------------------------------------------------------------------

    def handle(self, message: Message) -> tuple[str, dict[str, Any], list[Any]]:
        self.counters["requests"] += 1
        self.counters["bytes_in"] += sum(a.nbytes for a in message.tensors)
        handler = getattr(self, f"_on_{message.kind}", None)
        if handler is None:
            raise ValueError(f"unknown request kind {message.kind!r}")
        if message.kind not in ("init", "stats", "done", "ping") and self.opt is None:
            return "wait", {}, []
        kind, header, tensors = handler(message.header, message.tensors)
        self.counters["bytes_out"] += sum(int(t.numel() * t.element_size()) for t in tensors
                                          if isinstance(t, torch.Tensor))
        return kind, header, tensors

    def _on_init(self, header: dict[str, Any], arrays: list[np.ndarray]):
        fingerprint = header.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise ValueError("init without a placement fingerprint")
        if self.opt is not None:
            if fingerprint != self.fingerprint:
                raise ValueError(f"{self.name} serves parameter placement {self.fingerprint}, the worker sent "
                                 f"{fingerprint}: every worker must build the same model with the same number of "
                                 f"ps tasks")
            return "ok", {"version": self.version}, []
        if "spec" not in header:
            return "wait", {}, []  # worker 0's init (with the values) has not arrived yet
        keys = [str(k) for k in header["keys"]]
        if len(keys) != len(arrays):
            raise ValueError(f"init lists {len(keys)} pieces but carries {len(arrays)} tensors")
        spec = OptimizerSpec.from_json(header["spec"])
        self.opt = ServerOptimizer(spec, {k: _torch(a) for k, a in zip(keys, arrays, strict=True)})
        self.keys, self.fingerprint = keys, fingerprint
        log.info("%s: serving %d pieces (%s, mode %s%s) for %d workers", self.name, len(keys), spec.name, self.mode,
                 f":{self.staleness_bound}" if self.mode == "ssp" else "", self.num_workers)
        return "ok", {"version": self.version}, []

    def _rank(self, header: dict[str, Any]) -> int:
        rank = header.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_workers:
            raise ValueError(f"rank {rank!r} outside 0..{self.num_workers - 1}")
        return rank

    def _on_push(self, header: dict[str, Any], arrays: list[np.ndarray]):
        rank, step = self._rank(header), int(header["step"])
        keys = [str(k) for k in header["keys"]]
        if len(keys) != len(arrays):
            raise ValueError(f"push lists {len(keys)} pieces but carries {len(arrays)} tensors")
        grads = {k: _torch(a) for k, a in zip(keys, arrays, strict=True)}
        self.counters["pushes"] += 1
        if self.mode == "sync":
            if step < self.version:
                raise ValueError(f"push for step {step}, which was already applied (version {self.version})")
            slot = self._grads.setdefault(step, {})
            for key, grad in grads.items():
                slot.setdefault(key, {})[rank] = grad  # a second push of a piece (accumulation) replaces the first
        else:
            self._record(step - int(header.get("read", step)))
            self.opt.apply(grads)
            self.counters["updates"] += 1
        return "ok", {}, []

    def _on_commit(self, header: dict[str, Any], arrays: list[np.ndarray]):
        rank, step = self._rank(header), int(header["step"])
        if header.get("hyper") is not None:
            self.opt.update_hyperparameters(header["hyper"])
        plan = header.get("plan")
        if isinstance(plan, int) and not isinstance(plan, bool) and plan >= 0:
            self.plan = max(self.plan or 0, plan)
        self.clock[rank] = max(self.clock[rank], step + 1)
        if self.mode != "sync":
            self.version = min(self.clock)
        else:
            self._record(step - int(header.get("read", step)))
            commits = self._commits.setdefault(step, set())
            commits.add(rank)
            if len(commits) == self.num_workers and step == self.version:
                self._apply_step(step)
        return "ok", {"version": self.version, "total": sum(self.clock), "plan": self.plan}, []

    def _apply_step(self, step: int) -> None:
        slot = self._grads.pop(step, {})
        self._commits.pop(step, None)
        averaged = {}
        for key in self.keys:  # a fixed order, whatever the arrival order
            by_rank = slot.get(key)
            if not by_rank:
                continue
            like = next(iter(by_rank.values()))
            averaged[key] = mean_of_gradients([by_rank.get(r, torch.zeros_like(like)) for r in range(self.num_workers)])
        self.opt.apply(averaged)
        self.version = step + 1
        self.counters["updates"] += 1

    def _record(self, staleness: int) -> None:
        self.staleness[max(0, staleness)] += 1

    def _ready(self, step: int) -> bool:
        if self.mode == "sync":
            return self.version >= step
        if self.mode == "ssp":
            return step - min(self.clock) <= self.staleness_bound
        return True

    def _on_pull(self, header: dict[str, Any], arrays: list[np.ndarray]):
        self._rank(header)
        step = int(header["step"])
        if not self._ready(step):
            self.counters["pull_waits"] += 1
            return "wait", {"version": self.version}, []
        self.counters["pulls"] += 1
        read = self.version if self.mode == "sync" else min(self.clock)
        return "params", {"version": read, "keys": self.keys}, [self.opt.params[k] for k in self.keys]

    def _on_stats(self, header: dict[str, Any], arrays: list[np.ndarray]):
        transport = self.server.stats
        return "stats", {"name": self.name, "mode": self.mode, "version": self.version, "clock": list(self.clock),
                         "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
                         "counters": dict(self.counters), "dropped": transport["dropped"],
                         "dropped_by_reason": transport["dropped_by_reason"], "pieces": len(self.keys)}, []

    def _on_state(self, header: dict[str, Any], arrays: list[np.ndarray]):
        tensors, meta = self.opt.state_dict()
        names = list(tensors)
        return "state", {"meta": meta, "names": names}, [tensors[n] for n in names]

    def _on_load_state(self, header: dict[str, Any], arrays: list[np.ndarray]):
        names = [str(n) for n in header["names"]]
        tensors = {n: torch.from_numpy(np.array(a, copy=True)) for n, a in zip(names, arrays, strict=True)}
        self.opt.load_state_dict(tensors, header["meta"])
        return "ok", {}, []

    def _shard_store(self, header: dict[str, Any]) -> tuple[ShardStore, str, str]:
        if self.shards is None:
            raise ValueError(f"{self.name} has no checkpoint folder to write its shard to (it was started without "
                             f"one); save the optimizer's state_dict() from a worker instead")
        return self.shards(str(header["root"])), f"ps-{self.index}.safetensors", f"ps-{self.index}.json"

    def _on_save(self, header: dict[str, Any], arrays: list[np.ndarray]):
        step = int(header["step"])
        store, tensors_name, meta_name = self._shard_store(header)
        tensors, meta = self.opt.state_dict()
        shard = {"format": SHARD_FORMAT, "version": 1, "ps": self.index, "fingerprint": self.fingerprint,
                 "keys": self.keys, "optimizer": meta}
        store.save_part(step, tensors_name, save_safetensors({k: v.contiguous() for k, v in tensors.items()}))
        store.save_part(step, meta_name, json.dumps(shard, sort_keys=True).encode())
        self.counters["checkpoints"] += 1
        return "ok", {"parts": [tensors_name, meta_name]}, []

    def _on_restore(self, header: dict[str, Any], arrays: list[np.ndarray]):
        step = int(header["step"])
        store, tensors_name, meta_name = self._shard_store(header)
        shard = json.loads(store.read_part(step, meta_name))
        if shard.get("format") != SHARD_FORMAT or shard.get("ps") != self.index:
            raise ValueError(f"{meta_name} of checkpoint step {step} is not {self.name}'s shard")
        if shard.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint step {step} holds a shard of another model or ps layout (placement "
                             f"{shard.get('fingerprint')}, this job {self.fingerprint}): resume with the same model "
                             f"and number of ps tasks, or start over with --no-resume")
        tensors = load_safetensors(store.read_part(step, tensors_name))
        self.opt.load_state_dict(tensors, shard["optimizer"])
        log.info("%s: restored its shard from checkpoint step %d", self.name, step)
        return "ok", {}, []

    def _on_ping(self, header: dict[str, Any], arrays: list[np.ndarray]):
        return "ok", {}, []

    def _on_position(self, header: dict[str, Any], arrays: list[np.ndarray]):
        rank = self._rank(header)
        if len(arrays) != 1 or arrays[0].dtype != np.uint8 or arrays[0].ndim != 1:
            raise ValueError("a position request carries exactly one 1-d uint8 tensor")
        self.positions[rank] = arrays[0].tobytes()
        return "ok", {}, []

    def _on_positions(self, header: dict[str, Any], arrays: list[np.ndarray]):
        self._rank(header)
        ranks = sorted(self.positions)
        return "positions", {"ranks": ranks}, [torch.from_numpy(np.frombuffer(self.positions[r], np.uint8).copy())
                                                for r in ranks]

    def _on_done(self, header: dict[str, Any], arrays: list[np.ndarray]):
        self.done.add(self._rank(header))
        if len(self.done) == self.num_workers:
            log.info("%s: every worker is done; stopping", self.name)
            self._finished.set()
            self.server.stop()
        return "ok", {}, []


def serve_task(address: str, secret: bytes, *, index: int, num_workers: int, strategy: str,
               shards: Callable[[str], ShardStore] | None = None, idle_timeout: float | None = None) -> bool:
    """Run ps task ``index`` for ``strategy`` until the workers are done (what ``conveyor.init()`` does on a ps);
    :class:`IdleTimeout` when no worker was heard from for ``idle_timeout`` seconds (the job's timeout)."""
    mode, staleness = parse_mode(strategy)
    server = ParameterServer(address, secret, index=index, num_workers=num_workers, mode=mode, staleness=staleness,
                             shards=shards)
    started = time.monotonic()
    try:
        return server.serve(idle_timeout=idle_timeout)
    finally:
        log.info("%s: served for %.1f s", server.name, time.monotonic() - started)
