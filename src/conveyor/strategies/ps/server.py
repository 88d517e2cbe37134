"""The parameter-server task: holds its pieces of the model, runs the optimizer on them, answers workers.

    server = ParameterServer("127.0.0.1:2222", secret, index=0, num_workers=2, mode="sync")
    server.serve()              # returns when every worker has sent "done" (conveyor.init() then exits)

One ``ParameterServer`` runs in each ps task, on a transport :class:`~conveyor.comm.transport.Server`
bound to the task's TF_CONFIG address; each handler ``_on_<kind>`` takes one typed request of
:mod:`.protocol` and returns a typed reply. :class:`ShardFiles` writes and reads its checkpoint shard.

Promises: only authenticated, well-formed requests addressed to this task reach the handlers, so
garbage on the port cannot change the parameters; an unauthenticated peer holds at most
:func:`max_frame_bytes` per connection, for at most ``handshake_timeout`` seconds (all together at most
the transport's ``MAX_UNAUTHENTICATED_BYTES``); a push or commit for a step outside the worker's window,
or naming pieces this task does not hold (or more than it holds), is refused with a counted ``error``
reply and nothing kept, and held pulls are bounded per connection and in all (docs/ps.md); the update rules
(``sync``, ``async``, ``ssp:K``) are :mod:`.rules`' (the handlers only delegate to one), applied as
docs/ps.md, "The parameter-server protocol", describes; and :meth:`ParameterServer.serve` raises
:class:`IdleTimeout` after the job's timeout without hearing from a worker (twice that before the
first), so a ps task cannot outlive its job.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from conveyor.cluster.strategy_name import PS_MODES, parse_strategy
from conveyor.comm.framing import MAX_HEADER_BYTES, MAX_TRAILER_BYTES, Message
from conveyor.comm.transport import MAX_ASSEMBLY_BYTES, Deferred, Server
from conveyor.errors import ConveyorError
from conveyor.strategies.ps import protocol as wire
from conveyor.strategies.ps.applied import AppliedLog
from conveyor.strategies.ps.held import HeldPulls
from conveyor.strategies.ps.optim import OptimizerSpec, ServerOptimizer
from conveyor.strategies.ps.packing import PACK_BYTES
from conveyor.strategies.ps.rules import Clocks, UpdateRule, make_rule
from conveyor.strategies.ps.sharding import DEFAULT_CHUNK_BYTES

__all__ = ["MODES", "IdleTimeout", "ParameterServer", "ShardStore", "max_frame_bytes"]

log = logging.getLogger(__name__)

MODES = PS_MODES
MAX_HOLD_MS = 2000  # the longest a server keeps a pull that asked to be held (the worker asks again after)
MAX_HELD_PER_PEER = 4  # held pulls per connection (a worker holds one); the server: this x 2 x workers


def max_frame_bytes(chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """The frame size a ps task refuses beyond: twice the largest frame its job's messages can carry.

    A ps message's frames are its header (at most ``MAX_HEADER_BYTES``), one frame per tensor, and the
    trailer (at most ``MAX_TRAILER_BYTES``). Every tensor is one placement piece (a gradient, a value,
    or an optimizer state of the same size), at most ``chunk_bytes`` (or one element), or pieces packed
    into at most ``PACK_BYTES``. The factor 2 is headroom for what this bound does not foresee: a frame
    over the limit costs its connection (the request times out), so erring high is the safe side.
    """
    return 2 * max(chunk_bytes, PACK_BYTES, MAX_HEADER_BYTES, MAX_TRAILER_BYTES, 64)


class IdleTimeout(ConveyorError, RuntimeError):
    """A ps task heard from no worker for longer than the job's timeout: its job is gone."""


class ShardStore(Protocol):
    """A checkpoint root a ps task writes its shards to: the job's ``conveyor.train.checkpoint`` manager."""

    def save_part(self, step: int, name: str, data: bytes) -> Any: ...

    def read_part(self, step: int, name: str) -> bytes: ...


SHARD_FORMAT = "conveyor.ps.shard"


def _own(tensor: torch.Tensor) -> torch.Tensor:
    # A copy: the received tensor views ZeroMQ's frame, and the server keeps it across messages.
    return tensor.reshape(-1).clone()


class ShardFiles:
    """A ps task's checkpoint shard: its pieces and optimizer state as ``ps-<i>.safetensors`` + ``ps-<i>.json``.

    ``shards`` opens a checkpoint root as a :class:`ShardStore` (None: the task has no checkpoint folder,
    and every save or restore is refused with what to do instead).
    """

    def __init__(self, index: int, shards: Callable[[str], ShardStore] | None) -> None:
        self.index = index
        self.name = f"ps:{index}"
        self.shards = shards
        self.tensors_name, self.meta_name = f"ps-{index}.safetensors", f"ps-{index}.json"

    def _store(self, root: str) -> ShardStore:
        if self.shards is None:
            raise ValueError(f"{self.name} has no checkpoint folder to write its shard to (it was started without "
                             f"one); save the optimizer's state_dict() from a worker instead")
        return self.shards(root)

    def save(self, root: str, step: int, tensors: dict[str, torch.Tensor], fields: dict[str, Any]) -> list[str]:
        """Write the shard (``fields``: its fingerprint, keys and optimizer meta) into step ``step``; the names."""
        store = self._store(root)
        shard = {"format": SHARD_FORMAT, "version": 1, "ps": self.index, **fields}
        store.save_part(step, self.tensors_name, save_safetensors({k: v.contiguous() for k, v in tensors.items()}))
        store.save_part(step, self.meta_name, json.dumps(shard, sort_keys=True).encode())
        return [self.tensors_name, self.meta_name]

    def restore(self, root: str, step: int, fingerprint: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors and JSON half (``optimizer``, ``applied``, ...) of this task's shard in step ``step``,
        refused if another placement's."""
        store = self._store(root)
        shard = self._read_meta(store, step)
        if shard.get("fingerprint") != fingerprint:
            raise ValueError(f"checkpoint step {step} holds a shard of another model or ps layout (placement "
                             f"{shard.get('fingerprint')}, this job {fingerprint}): resume with the same model "
                             f"and number of ps tasks, or start over with --no-resume")
        return load_safetensors(store.read_part(step, self.tensors_name)), shard

    def read(self, store: ShardStore, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors and optimizer meta of this task's shard in step ``step`` of ``store``, whatever its placement
        (a worker re-splitting the shards over another number of ps tasks reads them all: ``.reshard``)."""
        shard = self._read_meta(store, step)
        return load_safetensors(store.read_part(step, self.tensors_name)), shard["optimizer"]

    def _read_meta(self, store: ShardStore, step: int) -> dict[str, Any]:
        """The JSON half of this server's shard in checkpoint step ``step``, checked to be this server's."""
        meta_name = self.meta_name
        try:
            shard = json.loads(store.read_part(step, meta_name))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{meta_name} of checkpoint step {step} is not JSON ({exc}); the step is damaged: "
                             f"resume from an earlier step or start over with --no-resume") from None
        if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT or shard.get("ps") != self.index \
                or not isinstance(shard.get("optimizer"), dict):
            raise ValueError(f"{meta_name} of checkpoint step {step} is not {self.name}'s shard (a JSON object of "
                             f"format {SHARD_FORMAT!r} with its optimizer state); the step is damaged: resume from an "
                             f"earlier step or start over with --no-resume")
        return shard


def _refuse(name: str, counters: Counter[str], message: Message,
            refused: wire.Refused) -> tuple[str, dict[str, Any], list[Any]]:
    """The ``error`` reply to a request a server will not keep, counted as ``refused_<reason>`` and logged
    (the first of each reason, then every 1000th: a peer cannot flood the log)."""
    counter = f"refused_{refused.reason}"
    counters[counter] += 1
    if counters[counter] == 1 or counters[counter] % 1000 == 0:
        log.warning("%s: refused a %r request from %s (%s); %d refused for this reason so far", name,
                    message.kind, message.sender, refused, counters[counter])
    return "error", {"error": f"{type(refused).__name__}: {refused}"[:4000], "request_kind": message.kind}, []


def _check_push(name: str, params: Mapping[str, torch.Tensor], clocks: Clocks, push: wire.Push) -> None:
    """Refuse a push naming a piece the server does not hold (or one twice), or for a step outside the
    worker's window: the sync rule would keep its gradients and never apply them."""
    if len(set(push.keys)) != len(push.keys):
        raise wire.Refused("'push'", "keys", "lists a piece twice", reason="unknown_pieces")
    unknown = [k for k in push.keys if k not in params]
    if unknown:
        raise wire.Refused("'push'", "keys", f"names {len(unknown)} pieces {name} does not hold (e.g. "
                                             f"{unknown[0][:80]!r}); every worker must build the same model with "
                                             f"the same number of ps tasks", reason="unknown_pieces")
    _check_step(clocks, "'push'", push.rank, push.step)


def _check_step(clocks: Clocks, label: str, rank: int, step: int) -> None:
    problem = clocks.out_of_window(rank, step)
    if problem is not None:
        raise wire.Refused(label, "step", problem, reason="step_out_of_window")


class ParameterServer:
    """One ps task's state and request handler (docs/ps.md, "The parameter-server protocol").

    Long because it is the protocol's one handler: a method per request kind (sixteen), each a few lines
    delegating to the update rule, the optimizer, the shard files or the applied log."""

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
        self.rule: UpdateRule = make_rule(mode, num_workers, staleness)  # every decision of the update rule
        self.fingerprint: str | None = None
        self.keys: list[str] = []
        self.opt: ServerOptimizer | None = None
        self.counters: Counter[str] = Counter()
        self.positions: dict[int, bytes] = {}  # each worker's newest data position (workers running apart)
        self.applied = AppliedLog()  # async/ssp: what was applied from whom, for a worker restarted alone
        self.meetings: dict[int, dict[int, bytes]] = {}  # ps:0: the workers' collectives by key (``meet``)
        self.shard_files = ShardFiles(index, shards)
        self._held = HeldPulls(per_peer=MAX_HELD_PER_PEER, total=MAX_HELD_PER_PEER * 2 * num_workers)  # till ready
        #: a pull from a peer with more reply bytes than this still unsent is answered 'wait' (set at init:
        #: one reply of this server's pieces; a worker reads each reply before it pulls again)
        self.max_unsent_bytes = 0
        self._finished = threading.Event()
        self.server = Server(address, secret, self.handle, name=self.name, max_skew=max_skew,
                             max_frame_bytes=max_frame_bytes(chunk_bytes), handshake_timeout=handshake_timeout,
                             tick=self._answer_held)

    @property
    def clock(self) -> list[int]:
        """Steps committed, per worker."""
        return self.rule.clocks.clock

    @property
    def version(self) -> int:
        """What a pull reads now: sync, steps applied; async and ssp, the slowest worker's clock."""
        return self.rule.version

    @property
    def staleness(self) -> Counter[int]:
        """(step - read) -> count: per push under async and ssp, per commit under sync."""
        return self.rule.staleness

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

    def handle(self, message: Message) -> tuple[str, dict[str, Any], list[Any]] | Deferred:
        self.counters["requests"] += 1
        self.counters["bytes_in"] += sum(a.nbytes for a in message.tensors)
        try:
            request = wire.read_request(message.kind, message.header, message.torch_tensors(),
                                        num_workers=self.num_workers, max_pieces=len(self.keys) if self.opt else None)
            if self.opt is None and not isinstance(request, (wire.Init, wire.Stats, wire.Done, wire.Ping)):
                return wire.WaitReply().encode()
            reply = getattr(self, f"_on_{request.KIND}")(request)
        except wire.Refused as refused:
            return _refuse(self.name, self.counters, message, refused)
        if isinstance(reply, Deferred):
            return reply
        if isinstance(request, wire.Commit):
            self._answer_held()  # the commit may have made held pulls ready
        return self._encoded(reply)

    def _encoded(self, reply: Any) -> tuple[str, dict[str, Any], list[Any]]:
        kind, header, tensors = reply.encode()
        self.counters["bytes_out"] += sum(int(t.numel() * t.element_size()) for t in tensors
                                          if isinstance(t, torch.Tensor))
        return kind, header, tensors

    def _on_init(self, init: wire.Init) -> wire.InitReply | wire.WaitReply:
        if self.opt is not None:
            if init.fingerprint != self.fingerprint:
                raise ValueError(f"{self.name} serves parameter placement {self.fingerprint}, the worker sent "
                                 f"{init.fingerprint}: every worker must build the same model with the same number "
                                 f"of ps tasks")
            return wire.InitReply(self.version)
        if init.spec is None:
            return wire.WaitReply()  # worker 0's init (with the values) has not arrived yet
        spec = OptimizerSpec.from_json(init.spec)
        self.opt = ServerOptimizer(spec, {k: _own(v) for k, v in zip(init.keys, init.values, strict=True)})
        self.keys, self.fingerprint = list(init.keys), init.fingerprint
        self.max_unsent_bytes = sum(p.numel() * p.element_size() for p in self.opt.params.values())
        self.server.assembly.max_bytes = max(MAX_ASSEMBLY_BYTES, 8 * self.max_unsent_bytes)  # a few load_states
        # the task said "serving" when it started (ps/task.py); this is worker 0's parameters arriving
        log.info("%s: holds %d pieces from worker 0 (server-side optimizer %s)", self.name, len(self.keys),
                 spec.name)
        return wire.InitReply(self.version)

    def _on_push(self, push: wire.Push) -> wire.OkReply:
        if self.applied.redone(push.rank, push.step, self.rule.clocks.clock[push.rank], self.counters):
            return wire.OkReply()
        _check_push(self.name, self.opt.params, self.rule.clocks, push)
        grads = {k: _own(g) for k, g in zip(push.keys, push.grads, strict=True)}
        self.counters["pushes"] += 1
        now = self.rule.push(push.rank, push.step, push.read, grads)
        self._apply(self.applied.applying(push.rank, push.step, now, self.counters))
        return wire.OkReply()

    def _on_commit(self, commit: wire.Commit) -> wire.CommitReply:
        clocks = self.rule.clocks
        if self.applied.redone(commit.rank, commit.step, clocks.clock[commit.rank], self.counters):
            return wire.CommitReply(self.version, clocks.total, clocks.plan)
        _check_step(clocks, "'commit'", commit.rank, commit.step)
        if commit.hyper is not None:
            self.opt.update_hyperparameters(commit.hyper)
        if commit.plan is not None:
            clocks.announce(commit.rank, commit.plan)
        self._apply(self.rule.commit(commit.rank, commit.step, commit.read, self.keys))
        self.applied.committed(commit.rank, commit.step, commit.position)
        return wire.CommitReply(self.version, clocks.total, clocks.plan)

    def _on_rejoin(self, rejoin: wire.Rejoin) -> wire.RejoinReply:
        clock = self.rule.clocks.clock[rejoin.rank]
        position = self.applied.rejoin(rejoin.rank, clock, self.mode, self.counters)
        log.info("%s: worker %d rejoins after %d of its steps applied here", self.name, rejoin.rank, clock)
        return wire.RejoinReply(clock, position)

    def _apply(self, grads: Mapping[str, torch.Tensor] | None) -> None:
        """One optimizer update with what the rule let through (None: it held everything back)."""
        if grads is not None:
            self._writable(grads)
            self.opt.apply(grads)
            self.counters["updates"] += 1

    def _writable(self, keys: Iterable[str] | None = None) -> None:
        """Before the pieces ``keys`` (None: all) change: those a pull reply still lends to ZeroMQ (a worker
        reading slowly, or stopped) get new memory, so the server never waits for a peer to read."""
        if self.server.lending:
            self.opt.unshare(keys)
            self.counters["copies_on_write"] += 1

    def _on_pull(self, pull: wire.Pull) -> wire.ParamsReply | wire.WaitReply | Deferred:
        if self.server.unsent_bytes() > self.max_unsent_bytes:
            return self._backlogged()
        if self.rule.ready(pull.step):
            return self._params()
        if pull.hold:
            # Kept until a commit makes it ready (answered at once then) or its hold runs out (then 'wait'):
            # no polling round trips, and the worker's own timeout still bounds the wait.
            deferred, now = Deferred(), time.monotonic()
            if self._held.add(self.server.peer, pull.step, deferred, since=now,
                              deadline=now + min(pull.hold, MAX_HOLD_MS) / 1000):
                return deferred
            self.counters["pull_hold_refused"] += 1  # over the bound: answered 'wait' now, it asks again
        self.counters["pull_waits"] += 1
        return wire.WaitReply(self.version)

    def _backlogged(self) -> wire.WaitReply:
        """The answer to a pull from a peer that has not read earlier replies: 'wait' (it asks again when it
        reads), so a peer that stopped reading pins at most about two replies of this server's pieces."""
        self.counters["pull_backlogged"] += 1
        return wire.WaitReply(self.version)

    def _params(self, held: float = 0.0) -> wire.ParamsReply:
        self.counters["pulls"] += 1
        return wire.ParamsReply(self.version, list(self.keys), [self.opt.params[k] for k in self.keys],
                                held=int(held * 1e6))

    def _answer_held(self) -> None:
        """Answer the held pulls that became ready (their parameters, or 'wait' to a peer that has not read
        earlier replies) or ran out of time ('wait'); touches only those (:class:`.held.HeldPulls`)."""
        now = time.monotonic()
        for _, deferred, since in self._held.take_ready(self.rule.ready):
            backlogged = self.server.unsent_bytes(deferred) > self.max_unsent_bytes  # answered 'wait', as below
            reply = self._backlogged() if backlogged else self._params(held=now - since)
            self.server.reply(deferred, self._encoded(reply))
        for _, deferred, _ in self._held.take_expired(now):
            self.counters["pull_waits"] += 1
            self.server.reply(deferred, self._encoded(wire.WaitReply(self.version)))

    def _on_stats(self, stats: wire.Stats) -> wire.StatsReply:
        transport = self.server.stats
        return wire.StatsReply(name=self.name, mode=self.mode, version=self.version, clock=list(self.clock),
                          staleness={str(k): v for k, v in sorted(self.staleness.items())},
                          counters=dict(self.counters), dropped=transport["dropped"],
                          dropped_by_reason=transport["dropped_by_reason"], pieces=len(self.keys))

    def _on_state(self, state: wire.State) -> wire.StateReply:
        tensors, meta = self.opt.state_dict()
        return wire.StateReply(meta, tensors)

    def _on_load_state(self, load: wire.LoadState) -> wire.OkReply:
        self._writable()
        self.opt.load_state_dict({n: t.clone() for n, t in load.named.items()}, load.meta)
        return wire.OkReply()

    def _on_save(self, save: wire.Save) -> wire.SaveReply:
        tensors, meta = self.opt.state_dict()
        parts = self.shard_files.save(save.root, save.step, tensors, {"fingerprint": self.fingerprint,
                                                                      "keys": self.keys, "optimizer": meta,
                                                                      "applied": self.applied.to_json()})
        self.counters["checkpoints"] += 1
        return wire.SaveReply(parts)

    def _on_restore(self, restore: wire.Restore) -> wire.OkReply:
        tensors, shard = self.shard_files.restore(restore.root, restore.step, self.fingerprint)
        self._writable()
        self.opt.load_state_dict(tensors, shard["optimizer"])
        self.applied.load_json(shard.get("applied"), self.num_workers)
        log.info("%s: restored its shard from checkpoint step %d", self.name, restore.step)
        return wire.OkReply()

    def _on_ping(self, ping: wire.Ping) -> wire.OkReply:
        return wire.OkReply()

    def _on_position(self, position: wire.Position) -> wire.OkReply:
        self.positions[position.rank] = position.data
        return wire.OkReply()

    def _on_positions(self, positions: wire.Positions) -> wire.PositionsReply:
        return wire.PositionsReply(dict(self.positions))

    def _on_meet(self, meet: wire.Meet) -> wire.PositionsReply | wire.WaitReply:
        """The workers' collective ``key`` (on ps:0): every worker's data once all are in (asked again until
        then). Once one is complete every worker is past the others, which are dropped (workers number their
        meetings from 0 again at each training loop's end)."""
        held = self.meetings.setdefault(meet.key, {})
        held[meet.rank] = meet.data
        if len(held) < self.num_workers:
            return wire.WaitReply()
        self.meetings = {meet.key: held}
        return wire.PositionsReply(dict(held))

    def _on_done(self, done: wire.Done) -> wire.OkReply:
        finished = self.rule.clocks.done
        finished.add(done.rank)
        self._answer_held()  # a worker that is done bounds no ssp pull any more
        if len(finished) == self.num_workers:
            log.debug("%s: every worker is done; stopping", self.name)  # the task says it as it exits
            self._finished.set()
            self.server.stop()
        return wire.OkReply()


def serve_task(address: str, secret: bytes, *, index: int, num_workers: int, strategy: str,
               shards: Callable[[str], ShardStore] | None = None, idle_timeout: float | None = None) -> bool:
    """Run ps task ``index`` for ``strategy`` until the workers are done (what ``conveyor.init()`` does on a ps);
    :class:`IdleTimeout` when no worker was heard from for ``idle_timeout`` seconds (the job's timeout)."""
    parsed = parse_strategy(strategy)
    if not parsed.uses_ps:
        raise ValueError(f"{strategy!r} is not a parameter-server strategy; expected ps-sync, ps-async or ps-ssp:K "
                         f"(K a whole number, e.g. ps-ssp:2)")
    server = ParameterServer(address, secret, index=index, num_workers=num_workers, mode=parsed.mode,
                             staleness=parsed.staleness, shards=shards)
    started = time.monotonic()
    try:
        return server.serve(idle_timeout=idle_timeout)
    finally:
        log.info("%s: served for %.1f s", server.name, time.monotonic() - started)
